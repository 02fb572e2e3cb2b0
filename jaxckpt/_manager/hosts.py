"""Host groups: which processes share a manager directory, and how processes whose
directories differ agree on the steps and on a restore.

A shared directory (or an object store) is one group; a local directory per host gives
one group per host. The first process of each group acts for its directory (lease,
commits, deletes). With per-host directories each host discovers what its own disk
holds: the listing at start is what every host holds (``agreed_steps``), and a restore
agrees on a step every host can read (``restore_agreed``), copying a step to the hosts
that lack it first (``hostcopy``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NoReturn

from .. import _commit, _distributed
from .._errors import CheckpointError, CheckpointNotFoundError
from .._manifest import Manifest
from .._storage.location import Location
from . import hostcopy as _hostcopy
from . import steplist as _steplist

_log = logging.getLogger("jaxckpt")

_FALL_BACK = object()  # a local read that some process could not do


@dataclasses.dataclass(frozen=True)
class HostGroups:
    """The processes sharing each directory: one group when the directory is shared, one
    per host when each host has a local directory of its own (see ``find_groups``)."""

    groups: tuple[tuple[int, ...], ...]

    @classmethod
    def everyone(cls) -> HostGroups:
        return cls((tuple(range(_distributed.process_count())),))

    @property
    def mine(self) -> tuple[int, ...]:
        """The group of this process."""
        return next(g for g in self.groups if _distributed.process_index() in g)

    @property
    def leads(self) -> bool:
        """Whether this process acts for its directory (lease, commits, deletes)."""
        return self.mine[0] == _distributed.process_index()

    @property
    def per_host(self) -> bool:
        return len(self.groups) > 1


def others() -> list[int]:
    """Every process of the job but this one."""
    me = _distributed.process_index()
    return [p for p in range(_distributed.process_count()) if p != me]


def share_verdict(op: _distributed.Operation, key: str, error: BaseException | None) -> BaseException | None:
    """Post this process's verdict (``None``: fine) and hear every other's: the first
    error this process knows of, the same failure or success in every process."""
    op.post(key, error if error is not None else b"")
    try:
        op.wait_for(key, others())
    except CheckpointError as e:
        error = error or e
    return error


def find_groups(op: _distributed.Operation, directory: Location) -> HostGroups:
    """Which processes share this directory. Each process drops a probe file in its
    directory; each then looks for every process's probe. A shared directory (or an
    object store) is one group; a local directory per host gives one group per host.
    """
    n = _distributed.process_count()
    if n == 1 or directory.local is None:
        return HostGroups((tuple(range(n)),))
    token = op.broadcast("probe", _commit.new_token().encode() if _distributed.process_index() == 0 else None)
    probe = os.path.join(directory.local, f".jaxckpt-probe-{token.decode()}-")
    me = _distributed.process_index()
    try:
        os.makedirs(directory.local, exist_ok=True)
        with open(probe + str(me), "wb"):
            pass
        op.post("probed")
        op.wait_for("probed", others())
        mine = tuple(p for p in range(n) if os.path.exists(probe + str(p)))
        op.post("group", json.dumps(mine).encode())
        seen = {p: tuple(json.loads(d)) for p, d in op.wait_for("group", others()).items()}
    finally:
        with contextlib.suppress(OSError):
            os.remove(probe + str(me))
    seen[me] = mine
    groups = tuple(sorted(set(seen.values())))
    if any(p not in seen[p] or any(seen[q] != seen[p] for q in seen[p]) for p in seen):
        raise CheckpointError(f"The processes of this job see the manager directory '{directory}' "
                              f"inconsistently (process -> processes sharing it: {seen})")
    return HostGroups(groups)


def save_of(man: Manifest) -> str:
    """Which save a copy of a step belongs to: a digest of its manifest's info. Every
    host's manifest of one save carries process 0's info of it (its creation time
    included), and so does its persistent copy (which adds where it was copied from);
    another save of the same step number (deleted and saved again) has another."""
    info = {k: v for k, v in man.info.items() if k != "copied_from"}
    return hashlib.sha256(json.dumps(info, sort_keys=True, default=str).encode()).hexdigest()[:32]


def saves_of(found: Mapping[int, Manifest]) -> dict[str, str]:
    """``save_of`` of each step, as posted (JSON keys)."""
    return {str(s): save_of(m) for s, m in found.items()}


def mixed_steps(views: Mapping[int, Mapping[str, str]]) -> set[int]:
    """The steps that the hosts hold from different saves (``views``: each process's
    ``saves_of``): a step deleted and saved again while one host kept its old copy.
    Such a step is never read from the hosts' directories: that would mix two saves."""
    seen: dict[str, set[str]] = {}
    for view in views.values():
        for s, key in view.items():
            seen.setdefault(s, set()).add(key)
    return {int(s) for s, keys in seen.items() if len(keys) > 1}


def durable_agreeing(durable: Mapping[str, str], views: Iterable[Mapping[str, str]]) -> set[int]:
    """The persistent tier's steps (``durable``: its ``saves_of``) that may be read for
    their step: those no host holds and those the hosts hold from the same save. A
    persistent copy of another save of a step the hosts hold (it was deleted and saved
    again since) is never read for it; for a step the hosts hold from several saves,
    the persistent copy is one whole save."""
    held: dict[str, set[str]] = {}
    for view in views:
        for s, key in view.items():
            held.setdefault(s, set()).add(key)
    return {int(s) for s, key in durable.items() if len(held.get(s, set())) != 1 or held[s] == {key}}


def agreed_steps(op: _distributed.Operation, directory: Location, groups: HostGroups,
                 partial: PartialSteps) -> dict[int, Manifest]:
    """The committed steps: with per-host directories, those every host holds, of one save.

    A step that some host lacks (a replaced node, a disk mounted late) is left out of
    the listing (and kept in ``partial``) but never deleted here: with replicated state
    another host's copy is complete, and a restore can still get it (``hostcopy``). It is
    deleted once a newer step is committed everywhere or the persistent tier holds it
    (``PartialSteps.drop``). So is a step the hosts hold from different saves
    (``mixed_steps``).
    """
    if not groups.per_host:  # the manifests read when needed (_steplist)
        return _steplist.discover(directory)
    found = dict(_commit.discover_steps(directory))
    mine = saves_of(found)
    op.post("steps", json.dumps(mine).encode())
    views = {p: json.loads(d) for p, d in op.wait_for("steps", others()).items()}
    views[_distributed.process_index()] = mine
    mixed = mixed_steps(views)
    every = set.intersection(*({int(s) for s in v} for v in views.values())) - mixed
    if mixed:
        _log.warning("jaxckpt: the hosts hold steps %s in '%s' from different saves (deleted and saved again "
                     "while a host kept its old copy); not listed, never restored from the hosts' directories",
                     sorted(mixed), directory)
    held_here = {s: m for s, m in found.items() if s not in every}
    lacking = {s: [p for p, v in sorted(views.items()) if str(s) not in v] for s in held_here if s not in mixed}
    if lacking:
        _log.warning("jaxckpt: steps %s in '%s' are not held by every host (lacking: %s); not listed, "
                     "kept until a newer step is committed everywhere or the persistent tier holds them",
                     sorted(lacking), directory,
                     "; ".join(f"step {s}: process(es) {ps}" for s, ps in sorted(lacking.items())))
    partial.reset(held_here)
    return {s: m for s, m in found.items() if s in every}


class PartialSteps:
    """Per-host directories: the steps committed in this host's directory that some host
    lacks (not listed, not deleted at start; see ``agreed_steps``)."""

    def __init__(self, directory: Location):
        self._dir = directory
        self._lock = threading.Lock()
        self._steps: dict[int, Manifest] = {}

    def reset(self, steps: Mapping[int, Manifest]) -> None:
        with self._lock:
            self._steps = dict(steps)

    def adopt(self, step: int) -> None:
        """``step`` is now held everywhere (copied to the hosts that lacked it)."""
        with self._lock:
            self._steps.pop(step, None)

    def forget(self, step: int) -> None:
        """``step`` was deleted (``delete``): what some host kept of it is no step any more."""
        with self._lock:
            self._steps.pop(step, None)

    def drop(self, committed: int, durable: set[int], deleter: Any) -> None:
        """After ``committed`` is committed everywhere: delete the partial steps it
        supersedes (older ones) and those the persistent tier holds (the same decision in
        every process of a group; its first process passes the ``deleter``)."""
        with self._lock:
            doomed = sorted(s for s in self._steps if s != committed and (s < committed or s in durable))
            self._steps.pop(committed, None)  # replaced by this commit
            for s in doomed:
                del self._steps[s]
        if doomed and deleter is not None:
            _log.info("jaxckpt: deleting steps %s in '%s' that some host lacked (step %d is committed "
                      "everywhere)", doomed, self._dir, committed)
            deleter.submit(doomed)


@dataclasses.dataclass(frozen=True)
class Sources:
    """What a per-host restore reads from and updates: the manager's directory, its host
    groups and whether it only reads, its listing of both tiers (``tiers.Listing``), its
    partial steps and its pins (``marks.StepPins``)."""

    directory: Location
    groups: HostGroups
    timeout_s: float | None
    read_only: bool
    listing: Any
    partial: PartialSteps
    pins: Any


def restore_agreed(sources: Sources, step: int | None, read: Callable[[Location], Any]) -> Any:
    """Per-host directories: the newest step (or ``step``) that every host holds
    locally or the persistent tier holds. Read locally only when every process read
    its part there; otherwise every process reads the persistent copy. A step that
    some hosts lack and the persistent tier does not hold is first copied to them
    from a host that holds all of it (``hostcopy``); when none does, it is skipped (the
    latest) or named with the hosts that lack it (a step asked for). ``read(where)``
    reads one copy, its step pinned meanwhile."""
    me = _distributed.process_index()
    with _distributed.Operation(f"restore{_distributed.next_id()}", str(sources.directory), sources.timeout_s,
                                lane="restore") as op:
        found = _commit.discover_steps(sources.directory)
        durable_dir = sources.listing.persistent and sources.listing.persistent.dir
        view = [sorted(found), saves_of(sources.listing.durable()) if me == 0 else {}, socket.gethostname(),
                saves_of(found)]
        op.post("held", json.dumps(view).encode())
        views = {p: json.loads(d) for p, d in op.wait_for("held", others()).items()}
        views[me] = json.loads(json.dumps(view))
        mixed = mixed_steps({p: v[3] for p, v in views.items()})  # never read from the hosts' directories
        everywhere = set.intersection(*(set(v[0]) for v in views.values())) - mixed
        # process 0's view of the persistent tier decides; a copy of another save of a step is not that step
        durable = durable_agreeing(views[0][1], [v[3] for v in views.values()])
        other = sorted({int(s) for s in views[0][1]} - durable)
        if other:
            _log.warning("jaxckpt: the persistent tier's steps %s are other saves than the hosts' steps of those "
                         "numbers (deleted and saved again since); they are not read for them", other)
        known = set().union(*(set(v[0]) for v in views.values())) | durable
        lacked: list[str] = []
        for s in [step] if step is not None else sorted(known, reverse=True):
            lacks = s not in everywhere and s not in durable and s in known and s not in mixed
            if lacks and _copy_to_lacking(op, sources, s, views):
                everywhere.add(s)
            if s in everywhere:
                result = _read_local_agreed(op, sources, s, read, s in durable)
                if result is not _FALL_BACK:
                    return result
            if s in durable:
                with sources.pins.hold(s):
                    return read(durable_dir.child(_commit.step_name(s)))
            if s in known:
                lacked.append(_mixed(s, views) if s in mixed else _lacking(s, views))
                if step is None:
                    _log.warning("jaxckpt: %s; restoring an older step", lacked[-1])
    _refuse(sources.directory, step, lacked, known)


def _refuse(directory: Location, step: int | None, lacked: list[str], known: set[int]) -> NoReturn:
    """No step (or not ``step``) can be restored: say why."""
    where = f" ({'; '.join(lacked)})" if lacked else ""
    if step is None:
        raise CheckpointNotFoundError(f"No committed step in '{directory}' held by every host{where}")
    if lacked:
        raise CheckpointError(f"Cannot restore step {step} from '{directory}': {lacked[0]}")
    raise CheckpointNotFoundError(
        f"No committed step {step} held by every host in '{directory}' (committed: {sorted(known)})")


def _lacking(step: int, views: dict[int, list[Any]]) -> str:
    who = [f"process {p} on host {v[2]!r}" for p, v in sorted(views.items()) if step not in v[0]]
    tier = "holds only another save of it" if str(step) in views[0][1] else "does not hold it"
    return f"step {step} is missing on {', '.join(who)}, no host holds all of it and the persistent tier {tier}"


def _mixed(step: int, views: dict[int, list[Any]]) -> str:
    by_save: dict[str, list[str]] = {}
    for p, v in sorted(views.items()):
        if str(step) in v[3]:
            by_save.setdefault(v[3][str(step)], []).append(f"process {p} on host {v[2]!r}")
    held = "; ".join(", ".join(who) for who in by_save.values())
    return (f"the hosts hold step {step} from {len(by_save)} different saves ({held}; deleted and saved again "
            "while a host kept its old copy?) and the persistent tier does not hold it")


def _copy_to_lacking(op: _distributed.Operation, sources: Sources, step: int, views: dict[int, list[Any]]) -> bool:
    """Copy ``step`` to the hosts that lack it from one that holds all of it; the same
    answer in every process. The step is then listed like any other."""
    holds = step in views[_distributed.process_index()][0]
    leads = sources.groups.leads
    man = _hostcopy.copy_from_holders(op, step, sources.directory, holds, leads, leads and not holds,
                                      sources.read_only)
    if man is None:
        return False
    sources.listing.add(step, man)
    sources.partial.adopt(step)
    return True


def _read_local_agreed(op: _distributed.Operation, sources: Sources, step: int, read: Callable[[Location], Any],
                       durable: bool) -> Any:
    """Read ``step`` from this host's directory; ``_FALL_BACK`` when some process
    could not (a host lost part of its copy) and the persistent tier has the step."""
    error: BaseException | None = None
    try:
        with sources.pins.hold(step):
            result = read(sources.directory.child(_commit.step_name(step)))
    except CheckpointError as e:
        result, error = None, e
    op.post(f"local{step}", b"0" if error is not None else b"1")
    failed = sorted(p for p, ok in op.wait_for(f"local{step}", others()).items() if ok != b"1")
    failed = sorted(failed + ([_distributed.process_index()] if error is not None else []))
    if not failed:
        return result
    del result
    if durable:
        _log.warning("jaxckpt: process(es) %s could not read step %d from their local directory "
                     "(%s); every process reads the persistent tier", failed, step, error or "see there")
        return _FALL_BACK
    if error is not None:
        raise error
    raise CheckpointError(f"Step {step} could not be read from the local directory of process(es) "
                          f"{failed} and the persistent tier does not hold it")
