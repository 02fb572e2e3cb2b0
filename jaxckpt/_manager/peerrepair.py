"""Restoring a lost part from its peer copy (``peer_copies``; the copies: ``peers``).

Before a per-host restore agrees on its source (``hosts.restore_agreed``), and when a
writing manager starts, every group's first process posts the steps its directory holds
(each with its manifest's checksum, the save it belongs to and a digest of its listing)
and the peer copies it holds (each with the digest of its listing now and when it was
made, and the identities recorded with it). Every process computes the same plan from
those posts (``plan_repair``): the newest step (or the one asked for) whose every part
is intact in its own directory or has a usable copy; a newer step that only the
persistent tier holds wins. The parts some host lacks (or that lost files since their
commit) are sent back from a copy, committed into that host's directory, and the
restore reads every part locally. When some part exists nowhere local, nothing is sent
and the restore goes to the persistent tier as before; a repair that fails falls to the
persistent tier when it holds the step, and fails in every process otherwise, never
silently older.

Every copy is checked against the step it would restore. A step is what the hosts that
hold it committed: never one that only copies hold (no host holds a deleted step), and
only of one save (the hosts' manifests carry the same info, ``hosts.save_of``; hosts
holding two saves of one step number make it not intact here, never a mix). A copy is
used only when the identities recorded with it (every host's manifest checksum of the
step it copied, ``peers.identity``) are those the holders' manifests carry: a copy of a
deleted or re-saved step never is, and is removed when found (``stale``). The plan also
names the steps every host holds that lack some copy (``PeerCopies.missing``): the next
save sends them (``PeerCopies.copy_missing``).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, NamedTuple

from .. import _commit, _distributed
from .._errors import CheckpointError
from .._storage.location import Location
from . import cleanup as _cleanup
from . import hosts as _hosts
from . import peers as _peers

_log = logging.getLogger("jaxckpt")


def start(copies: Any, groups: _hosts.HostGroups, lease: Any, persistent: Any,
          sources: _hosts.Sources) -> _peers.PeerCopies | None:
    """A writing manager's peer copies (``None`` for ``peer_copies=0`` or a read-only
    manager), after checking the option against the host groups (its leases are
    released when it is refused). A step whose part some host lost is sent back to it
    at once, so that ``latest_step()`` lists it; the stale copies are removed and the
    steps lacking copies noted (``repair``; a failure is logged, the same in every
    process: a restore tries again and raises)."""
    try:
        copies = _peers.check_option(copies)
        if copies and not sources.read_only:
            _peers.check_groups(copies, groups, sources.directory)
    except CheckpointError:
        _cleanup.release_leases(lease, persistent)
        raise
    if not copies or sources.read_only:
        return None
    peers = _peers.PeerCopies(sources.directory, groups, copies, sources.timeout_s)
    try:  # the newest step first, then the older ones a lost host can get back (newest first)
        for step in repair(peers, None, sources):
            repair(peers, step, sources)
    except CheckpointError as e:
        _log.warning("jaxckpt: %s", e)
    peers.submit_missing(sources.listing.local)  # a replaced host gets back what it held for its partners
    return peers


class Plan(NamedTuple):
    """What ``repair`` does (``plan_repair``): the step to restore (``None``: none), for
    each group lacking its part of it the group whose peer copy sends it back, the peer
    copies each group removes (``(source, step)``: they copy no step any host holds),
    the steps every host holds whose peer copies are not all there, and (no step asked
    for) the older steps some host lacks that copies can rebuild, newest first."""

    step: int | None
    fixes: dict[int, int]
    stale: dict[int, list[tuple[int, int]]]
    missing: set[int]
    older: tuple[int, ...] = ()


Held = dict[int, dict[int, dict[str, str]]]  # group -> step -> its own part's facts
Copies = dict[int, dict[int, dict[int, dict[str, Any]]]]  # holder -> source -> step -> a copy's facts


def plan_repair(held: Held, copies: Copies, durable: set[int], step: int | None, copies_each: int = 1) -> Plan:
    """Which step to restore and how (``Plan``), from every group's facts alone: the same
    plan in every process.

    ``held[g][s]``: group ``g``'s own committed part of step ``s``: its manifest's ``id``
    (``peers.identity``), the ``save`` it belongs to (``hosts.save_of``) and its listing's
    ``digest``. ``copies[h][g][s]``: group ``h``'s peer copy of ``g``'s part of ``s``:
    the ``digest`` of its listing ``now`` and the one ``recorded`` when it was made, its
    manifest's ``id`` and the ``parts`` recorded with it (every group's ``id`` of the
    step it copied; ``None`` when it has no record).

    A step is what the groups holding it committed: it is never brought back from copies
    alone (a step no group holds was deleted), and groups holding parts of different
    saves of it (their manifests' ``save`` differ) make it not intact here, never a mix.
    A copy is used only when it is whole (its digest is the recorded one) and its
    recorded ``parts`` are exactly the holders' identities (``sort_copies``): a copy of a
    deleted or re-saved step never is, and is removed (``stale``). A part held in its
    own directory is intact unless a usable copy recorded another listing (files lost
    since the commit: the copy replaces it). The newest step (or ``step``) whose every
    part is intact or has a usable copy is chosen; a step the persistent tier holds is
    chosen as it is (``fixes`` empty) when its local parts are not all to be had."""
    leads = sorted(held)
    use, stale = sort_copies(held, copies)

    def intact(g: int, s: int) -> bool:
        recorded = {rec["recorded"] for rec in use.get((g, s), {}).values()}
        return s in held[g] and (not recorded or held[g][s]["digest"] in recorded)

    chosen: tuple[int | None, dict[int, int]] = (None, {})
    everywhere = set.intersection(*(set(v) for v in held.values())) if held else set()
    known = set(durable).union(*(set(v) for v in held.values()))
    for s in [step] if step is not None else sorted(known, reverse=True):
        if one_save(held, s):
            if all(intact(g, s) for g in leads):
                chosen = (s, {})
                break
            if all(intact(g, s) or (g, s) in use for g in leads):
                chosen = (s, {g: min(use[(g, s)]) for g in leads if not intact(g, s)})
                everywhere.add(s)
                break
        if s in durable:
            chosen = (s, {})
            break
    ring_of = _peers.partners(leads, copies_each)
    missing = {s for s in everywhere if one_save(held, s)
               and any(p not in use.get((g, s), {}) for g in leads for p in ring_of[g])}
    older = tuple(s for s in sorted(known, reverse=True)
                  if step is None and chosen[0] is not None and s < chosen[0] and one_save(held, s)
                  and not all(intact(g, s) for g in leads) and all(intact(g, s) or (g, s) in use for g in leads))
    return Plan(*chosen, {h: sorted(v) for h, v in stale.items()}, missing, older)


def one_save(held: Held, step: int) -> bool:
    """Whether some group holds ``step`` and every group holding it holds the same save."""
    return len({steps[step]["save"] for steps in held.values() if step in steps}) == 1


def sort_copies(held: Held, copies: Copies) -> tuple[dict[tuple[int, int], dict[int, dict[str, Any]]],
                                                      dict[int, list[tuple[int, int]]]]:
    """The usable copies, ``{(source, step): {holder: copy}}``, and the stale ones,
    ``{holder: [(source, step)]}``. A copy is usable when it is whole and the identities
    recorded with it are those of every group's part of the step it copies, as the
    groups holding that step (of one save) committed it. It is stale when no group holds
    its step or they hold another save of it; when the holders hold different saves,
    which copy is stale is unknown and none is."""
    leads = sorted(held)
    use: dict[tuple[int, int], dict[int, dict[str, Any]]] = {}
    stale: dict[int, list[tuple[int, int]]] = {}
    for h, by_source in copies.items():
        for g, steps in by_source.items():
            for s, rec in steps.items():
                holders = {k: v[s] for k, v in held.items() if s in v}
                parts = rec.get("parts")
                if (one_save(held, s) and rec["now"] == rec["recorded"] and isinstance(parts, dict)
                        and sorted(parts) == leads and rec["id"] == parts[g]
                        and all(parts[k] == v["id"] for k, v in holders.items())):
                    use.setdefault((g, s), {})[h] = rec
                elif not holders or one_save(held, s):
                    stale.setdefault(h, []).append((g, s))
    return use, stale


def rounds_of(fixes: dict[int, int]) -> list[list[tuple[int, int]]]:
    """(holder, lacking) pairs in rounds where each holder sends once."""
    out: list[list[tuple[int, int]]] = []
    for lacking, holder in sorted(fixes.items()):
        for pairs in out:
            if all(h != holder for h, _ in pairs):
                pairs.append((holder, lacking))
                break
        else:
            out.append([(holder, lacking)])
    return out


def _held_parts(directory: Location) -> dict[int, dict[str, str]]:
    """This directory's committed steps: step -> its part's ``id``, ``save``, ``digest``."""
    out = {}
    for step, man in sorted(_commit.discover_steps(directory).items()):
        try:
            _, data, dg = _peers.part_of(directory.child(_commit.step_name(step)).local)
        except OSError:
            continue  # deleted meanwhile
        out[step] = {"id": _peers.identity(data), "save": _hosts.save_of(man), "digest": dg}
    return out


def _held_copies(directory: Location) -> dict[int, dict[int, dict[str, Any]]]:
    """This directory's committed peer copies: source -> step -> the digest of its listing
    ``now``, the one ``recorded`` when it was made, its manifest's ``id`` and the
    ``parts`` recorded (``None``: no usable record)."""
    out: dict[int, dict[int, dict[str, Any]]] = {}
    for name in _peers.copy_dirs(directory):
        for step in _commit.discover_steps(directory.child(_peers.PEERS_DIR).child(name)):
            root = os.path.join(directory.local, _peers.PEERS_DIR, name, _commit.step_name(step))
            try:
                _, data, now = _peers.part_of(root)
            except OSError:
                continue  # deleted meanwhile
            try:
                with open(os.path.join(root, _peers.RECORD)) as f:
                    record = json.load(f)
                recorded, parts = str(record["digest"]), {int(k): str(v) for k, v in record["parts"].items()}
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                recorded, parts = "", None  # no usable record: not a copy to rely on
            out.setdefault(int(name[1:]), {})[step] = {"now": now, "recorded": recorded, "id": _peers.identity(data),
                                                       "parts": parts}
    return out


def _drop_stale(peers: _peers.PeerCopies, stale: list[tuple[int, int]]) -> None:
    """Remove this directory's peer copies that copy no step any host holds (a deleted or
    re-saved step's, or one without a record)."""
    for source, step in stale:
        root = _peers.peer_root(peers.dir, source)
        _log.warning("jaxckpt: removing the peer copy of process %d's part of step %d in '%s': it copies no step "
                     "any host holds (deleted or saved again since)", source, step, peers.dir)
        try:
            _commit.delete_step(root, step, _commit.new_token())
        except (OSError, CheckpointError) as e:
            _log.warning("jaxckpt: removing the peer copy of step %d in '%s' failed: %s", step, root, e)


def repair(peers: _peers.PeerCopies, step: int | None, sources: _hosts.Sources,
           listed: Any = None) -> tuple[int, ...]:
    """Before a per-host restore: send the parts of the chosen step that some host lost
    back from their peer copies (see ``plan_repair``), committed into those hosts'
    directories, so that the restore reads every part locally. Every process calls it
    at the same point. The stale peer copies found are removed, and the steps lacking
    copies noted (``peers.PeerCopies.missing``: sent at the next save). A failure falls to
    the persistent tier when it holds the step (a warning) and is raised in every
    process otherwise. With ``listed`` (a restore's listing), the copies those steps lack
    are sent afterwards, in the background (what a replaced host held for its partners).
    Returns the plan's ``older`` steps (``step`` None: those a lost host can get back)."""
    older = _repair(peers, step, sources)
    if listed is not None:
        peers.submit_missing(listed)
    return older


def _repair(peers: _peers.PeerCopies, step: int | None, sources: _hosts.Sources) -> tuple[int, ...]:
    me = peers.me
    with _distributed.Operation(f"peerfix{_distributed.next_id()}", str(peers.dir), peers.timeout_s,
                                lane="restore") as op:
        facts: dict[str, Any] = {}
        if me in peers.leads:
            facts = {"held": _held_parts(peers.dir), "copies": _held_copies(peers.dir)}
        if me == 0:
            facts["durable"] = _hosts.saves_of(sources.listing.durable())
        op.post("facts", json.dumps(facts).encode())
        posts = {p: json.loads(d) for p, d in op.wait_for("facts", _hosts.others()).items()}
        posts[me] = json.loads(json.dumps(facts))
        held = {g: {int(s): d for s, d in posts[g]["held"].items()} for g in peers.leads}
        copies = {h: {int(g): {int(s): {**v, "parts": None if v["parts"] is None else
                                        {int(k): x for k, x in v["parts"].items()}}
                               for s, v in steps.items()} for g, steps in posts[h]["copies"].items()}
                  for h in peers.leads}
        # the persistent tier's copy of another save of a step the hosts hold is not that step
        durable = _hosts.durable_agreeing(posts[0].get("durable", {}),
                                          [{str(s): d["save"] for s, d in v.items()} for v in held.values()])
        plan = plan_repair(held, copies, durable, step, peers.copies)
        peers.missing = frozenset(plan.missing)
        if me in plan.stale:
            _drop_stale(peers, plan.stale[me])
        chosen, fixes = plan.step, plan.fixes
        if not fixes or sources.read_only:
            return plan.older
        _log.warning("jaxckpt: step %d of '%s': the part(s) of process(es) %s are lost; sending them back from "
                     "their peer copies (on process(es) %s) over the job's collectives", chosen, peers.dir,
                     sorted(fixes), [fixes[g] for g in sorted(fixes)])
        error: BaseException | None = None
        try:
            _send_back(op, peers, chosen, fixes, chosen in held.get(me, {}))
        except Exception as e:  # noqa: BLE001 - every process hears of it
            error = e
        error = _hosts.share_verdict(op, "fixed", error)
    if error is None:
        man = _commit.read_manifest(peers.dir.child(_commit.step_name(chosen)))
        sources.listing.add(chosen, man)
        sources.partial.adopt(chosen)
        return plan.older
    if chosen in durable:
        _log.warning("jaxckpt: sending step %d back from its peer copies failed (%s); every process reads the "
                     "persistent tier", chosen, error)
        return ()
    raise CheckpointError(f"Cannot restore step {chosen} from '{peers.dir}': sending the lost part(s) back from "
                          f"their peer copies failed: {error}") from error


def _send_back(op: _distributed.Operation, peers: _peers.PeerCopies, step: int, fixes: dict[int, int],
               damaged: bool) -> None:
    """Move the peer copies of ``fixes`` to their hosts, round by round; each receiver
    commits its part, manifest last, into its own directory."""
    me = peers.me
    final = peers.dir.child(_commit.step_name(step))
    mine = {}
    for lacking, holder in fixes.items():
        if holder == me:
            root = _peers.peer_root(peers.dir, lacking).child(_commit.step_name(step)).local
            files, man, _ = _peers.part_of(root)
            mine[lacking] = {"files": files, "manifest": man.decode()}
    op.post("send", json.dumps(mine).encode())
    sends = {p: json.loads(d) for p, d in op.wait_for("send", _hosts.others()).items()}
    sends[me] = json.loads(json.dumps(mine))
    part = {g: sends[h][str(g)] for g, h in fixes.items()}

    def stage() -> tuple[Location, str] | None:
        if me not in fixes:
            return None
        if damaged:  # files lost since its commit: the peer copy replaces it
            _commit.delete_step(peers.dir, step, _commit.new_token())
        need, free = sum(n for _, n in part[me]["files"]), _peers.free_bytes(peers.dir.local)
        if need > free:
            raise CheckpointError(f"no room for step {step}'s part in '{peers.dir}': {need} bytes, {free} free")
        token = _commit.new_token()
        return _commit.make_staging(final, token), token

    staged = _peers._ready(op, stage)
    for pairs in rounds_of(fixes):
        files = {h: [tuple(f) for f in part[g]["files"]] for h, g in pairs}
        source = next((g for h, g in pairs if h == me), None)
        read_root = _peers.peer_root(peers.dir, source).child(_commit.step_name(step)).local if source is not None else None
        error = _peers.move(pairs, files, read_root, staged[0].local if staged and any(g == me for _, g in pairs) else None)
        if error is not None:
            raise error
    if staged is not None:
        _commit.commit(final, staged[0], part[me]["manifest"].encode(), staged[1])
