"""Peer copies: with a local directory per host, each host's part of a committed step is
also kept on ``peer_copies`` partner hosts, so that losing a host (its disk with it)
does not send the whole job to the persistent tier.

Partners form a ring over the host groups (sorted; a group is the processes sharing a
directory, ``hosts.HostGroups``): the part of group ``i`` goes to groups ``i + 1``,
..., ``i + peer_copies`` (mod the number of groups). Losing any ``peer_copies`` hosts
therefore leaves a copy of every part; losing two partners of a ring of single copies
does not, and the job reads the persistent tier. A copy lives in the partner's own
directory, apart from its steps: ``<directory>/.jaxckpt-peers/p<lead>/<step>/`` (``lead``:
the first process of the source group), the source's files byte for byte and its
manifest, committed manifest last, with ``peer.json`` recording the listing it copied.

When the bytes move. A save's peer copy runs where the manager settles that save: at
the ``save``/``wait_until_finished``/``restore``/``close`` call that waits for it (with
``async_save=False``, inside ``save``). That call is the same in every process
(``manager._Saves``), on the thread the training loop calls from, so the copy's
collectives never run beside the loop's own (two threads issuing collectives in
different orders across processes can deadlock; NCCL warns against it). A step is
listed, counted for retention and sent to the persistent tier only once every host's
part has its peer copies; a copy that fails in any process fails that save in every
process (the step is deleted, the previous one is untouched). A step committed on disk
whose copy never ran (the job died in between) is listed after a restart like any other
step every host holds; only its peer copies are missing.

How the bytes move: over JAX's collectives, one device per process (as read-once does):
a jitted ``ppermute`` from each sending process to its receiver, in waves of at most
``BLOCK_BYTES`` per process (every byte crosses the network once; nothing goes through
the bucket). The first process of each group sends its directory's part and receives its
partner's. Before any collective every process posts what it will send and whether it
can receive (the receiver checks its free space first: a full RAM disk fails the save
before a byte moves); during the waves a process whose read or write failed goes on
joining them with zeros, and reports afterwards, so no process is left alone in a
collective.

Restoring (``repair``, before the per-host restore agrees on its source): every group's
first process posts the steps its directory holds, with a digest of each one's listing,
and the peer copies it holds. Every process computes the same choice from those posts:
the newest step (or the one asked for) whose every part is held intact somewhere, in its
own directory (its listing's digest is the one recorded when it was copied) or as a peer
copy; a newer step that only the persistent tier holds wins. The parts some host lacks
are sent back to it from a peer copy, committed into its directory, and the restore reads
every part locally. When some part exists nowhere local, nothing is sent and the restore
goes to the persistent tier as before; a repair that fails falls to the persistent tier
when it holds the step, and fails in every process otherwise, never silently older.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np

from .. import _commit, _distributed, _storage, _verify
from .._errors import CheckpointError
from .._manifest import MANIFEST
from .._storage.location import Location
from . import cleanup as _cleanup
from . import hosts as _hosts

_log = logging.getLogger("jaxckpt")

PEERS_DIR = ".jaxckpt-peers"
RECORD = "peer.json"  # in a peer copy: the listing digest of the part it copied
BLOCK_BYTES = 64 << 20  # bytes each sender moves per collective (its row)


def check_option(copies: Any) -> int:
    """``peer_copies`` as an int >= 0."""
    if isinstance(copies, bool) or not isinstance(copies, int) or copies < 0:
        raise CheckpointError(f"peer_copies must be a non-negative int, got {copies!r}")
    return copies


def check_groups(copies: int, groups: _hosts.HostGroups, directory: Location) -> None:
    """Peer copies need a directory per host and more hosts than copies (the same facts,
    the same answer, in every process)."""
    if not groups.per_host:
        raise CheckpointError(
            f"peer_copies={copies} needs a local directory per host, but '{directory}' is shared by every "
            f"process of this job ({_distributed.process_count()} process(es), one group)")
    if copies >= len(groups.groups):
        raise CheckpointError(
            f"peer_copies={copies} needs more hosts than copies: '{directory}' is held by "
            f"{len(groups.groups)} hosts (groups {[list(g) for g in groups.groups]})")


def start(copies: Any, groups: _hosts.HostGroups, lease: Any, persistent: Any,
          sources: _hosts.Sources) -> PeerCopies | None:
    """A writing manager's peer copies (``None`` for ``peer_copies=0`` or a read-only
    manager), after checking the option against the host groups (its leases are
    released when it is refused). A step whose part some host lost is sent back to it
    at once, so that ``latest_step()`` lists it (``repair``)."""
    try:
        copies = check_option(copies)
        if copies and not sources.read_only:
            check_groups(copies, groups, sources.directory)
    except CheckpointError:
        _cleanup.release_leases(lease, persistent)
        raise
    if not copies or sources.read_only:
        return None
    peers = PeerCopies(sources.directory, groups, copies, sources.timeout_s)
    try:
        repair(peers, None, sources)
    except CheckpointError as e:  # the same in every process; a restore tries again and raises
        _log.warning("jaxckpt: %s", e)
    return peers


def ring(leads: list[int], distance: int) -> list[tuple[int, int]]:
    """(sender, receiver) pairs of the first processes of the groups, each group's part
    to the group ``distance`` further around the ring."""
    n = len(leads)
    return [(leads[i], leads[(i + distance) % n]) for i in range(n)]


def partners(leads: list[int], copies: int) -> dict[int, list[int]]:
    """The leads holding each lead's peer copies, nearest first."""
    return {leads[i]: [leads[(i + d) % len(leads)] for d in range(1, copies + 1)] for i in range(len(leads))}


def digest(files: Iterable[tuple[str, int]], manifest: bytes) -> str:
    """What identifies a committed part: its files with their sizes, and its manifest."""
    h = hashlib.sha256(json.dumps(sorted(files)).encode())
    h.update(manifest)
    return h.hexdigest()[:32]


def part_of(root: str) -> tuple[list[tuple[str, int]], bytes, str]:
    """A committed part on disk: its data files (sorted, with sizes), its manifest's
    bytes, its digest. Raises ``OSError`` when the manifest is missing."""
    files = sorted(_verify.list_files(root).items())
    with open(os.path.join(root, MANIFEST), "rb") as f:
        man = f.read()
    return files, man, digest(files, man)


def peer_root(directory: Location, source: int) -> Location:
    """Where this host keeps the peer copies of the group whose first process is ``source``."""
    return directory.child(PEERS_DIR).child(f"p{source}")


# --- the transfer: one ppermute per wave --------------------------------------------------

def waves(sizes: dict[int, int], block: int = BLOCK_BYTES) -> tuple[int, int]:
    """(number of waves, row width) for senders moving ``sizes`` bytes each."""
    most = max(sizes.values(), default=0)
    if most == 0:
        return 0, 0
    count = -(-most // block)
    width = -(-most // count)  # even waves: 128 MiB and a manifest's few KiB are two, not three
    width = -(-width // 4096) * 4096  # few distinct shapes to compile
    return -(-most // width), width


def _one_device_per_process() -> list[Any]:
    first: dict[int, Any] = {}
    for d in sorted(jax.devices(), key=lambda d: d.id):
        first.setdefault(d.process_index, d)
    return [first[p] for p in sorted(first)]


@functools.lru_cache(maxsize=16)
def _permute(pairs: tuple[tuple[int, int], ...], width: int) -> Any:
    devices = _one_device_per_process()
    mesh = jax.sharding.Mesh(np.array(devices), ("p",))
    spec = jax.sharding.PartitionSpec("p")
    fn = jax.shard_map(lambda x: jax.lax.ppermute(x, "p", list(pairs)), mesh=mesh, in_specs=spec, out_specs=spec)
    return jax.jit(fn), jax.sharding.NamedSharding(mesh, spec), devices


def permute(row: np.ndarray, pairs: tuple[tuple[int, int], ...]) -> np.ndarray:
    """Each sender's ``row`` (uint8, the same width everywhere) at its receiver (zeros
    where a process receives nothing): one collective over one device per process."""
    fn, sharding, devices = _permute(pairs, row.shape[0])
    local = jax.device_put(row.reshape(1, -1), devices[_distributed.process_index()])
    arr = jax.make_array_from_single_device_arrays((len(devices), row.shape[0]), sharding, [local])
    return np.asarray(fn(arr).addressable_data(0)).reshape(-1)


def move(pairs: list[tuple[int, int]], files: dict[int, list[tuple[str, int]]], read_root: str | None,
         write_root: str | None, spent: dict[str, float] | None = None) -> BaseException | None:
    """Send each sender's ``files`` (read under ``read_root``) to its receiver (written
    under ``write_root``, each fsynced). Every process calls it with the same ``pairs``
    and ``files`` (senders and receivers each unique). A read or write that fails stops
    this process's I/O but not its part in the waves; its error is returned. ``spent``
    adds up the seconds reading, in the collectives and writing."""
    spent = {} if spent is None else spent
    me = _distributed.process_index()
    count, width = waves({s: sum(n for _, n in files.get(s, [])) for s, _ in pairs})
    sender = next((s for s, r in pairs if s == me), None)
    source = next((s for s, r in pairs if r == me), None)
    error: BaseException | None = None
    stream = _Files(read_root, files[me]) if sender is not None else None
    sink = _Files(write_root, files[source]) if source is not None else None
    row = np.zeros(width, np.uint8)  # one buffer for every wave: fresh memory is slow to touch
    for _ in range(count):
        t0 = time.perf_counter()
        if stream is not None and error is None:
            try:
                stream.read_into(row)
            except Exception as e:  # noqa: BLE001 - reported after the waves
                error = e
                row[:] = 0
        t1 = time.perf_counter()
        got = permute(row, tuple(pairs))
        t2 = time.perf_counter()
        if sink is not None and error is None:
            try:
                _storage.fault("peer", write_root)
                sink.write_from(got)
            except Exception as e:  # noqa: BLE001 - reported after the waves
                error = e
        for key, dt in (("read", t1 - t0), ("collective", t2 - t1), ("write", time.perf_counter() - t2)):
            spent[key] = spent.get(key, 0.0) + dt
    for files_ in (stream, sink):
        try:
            if files_ is not None:
                files_.close(check=files_ is sink and error is None)
        except Exception as e:  # noqa: BLE001
            error = error or e
    return error


class _Files:
    """Files under ``root`` back to back as one stream of bytes: read into each wave's
    row (the rest of it zeros), or written from each wave's row (each file fsynced)."""

    def __init__(self, root: str, files: list[tuple[str, int]]):
        self.root, self.files, self.i, self.done, self.f = root, list(files), 0, 0, None

    def _open(self, mode: str) -> Any:
        if self.f is None:
            path = os.path.join(self.root, self.files[self.i][0])
            if mode == "wb":
                os.makedirs(os.path.dirname(path), exist_ok=True)
            self.f = open(path, mode)  # noqa: SIM115 - closed when its last byte passed
        return self.f

    def _next_file(self, fsync: bool) -> None:
        if self.f is not None:
            if fsync:
                self.f.flush()
                os.fsync(self.f.fileno())
            self.f.close()
        self.f, self.i, self.done = None, self.i + 1, 0

    def read_into(self, row: np.ndarray) -> None:
        view, at = memoryview(row), 0
        while at < len(view) and self.i < len(self.files):
            size = self.files[self.i][1]
            if self.done == size:
                self._next_file(False)
                continue
            n = self._open("rb").readinto(view[at:at + min(len(view) - at, size - self.done)])
            if not n:
                raise CheckpointError(f"'{self.files[self.i][0]}' in '{self.root}' is shorter than its {size} bytes")
            at, self.done = at + n, self.done + n
        row[at:] = 0

    def write_from(self, row: np.ndarray) -> None:
        view, at = memoryview(row), 0
        while self.i < len(self.files):
            size = self.files[self.i][1]
            take = min(size - self.done, len(view) - at)
            if take:
                self._open("wb").write(view[at:at + take])
                at, self.done = at + take, self.done + take
            if self.done < size:
                return  # this row is used up; the file goes on in the next
            self._open("wb")  # an empty file is created too
            self._next_file(True)

    def close(self, check: bool) -> None:
        if self.f is not None:
            self.f.close()
            self.f = None
        if check and self.i < len(self.files):
            self.write_from(np.zeros(0, np.uint8))  # empty files at the end
            if self.i < len(self.files):
                raise CheckpointError(f"short copy into '{self.root}': {len(self.files) - self.i} file(s) incomplete")


def free_bytes(path: str) -> int:
    """Bytes free to this process in the file system holding ``path`` (or its parent)."""
    while not os.path.exists(path):
        path = os.path.dirname(path)
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


# --- a save's peer copies -------------------------------------------------------------------

class PeerCopies:
    """A manager's peer copies: sent after each save (``copy``), pruned to the listed
    steps (``prune``), sent back to a host that lost its part (``repair``)."""

    def __init__(self, directory: Location, groups: _hosts.HostGroups, copies: int, timeout_s: float | None):
        self.dir, self.groups, self.copies, self.timeout_s = directory, groups, copies, timeout_s
        self.leads = [g[0] for g in groups.groups]
        self.me = _distributed.process_index()

    def copy(self, step: int) -> None:
        """Every process, at the same call, once ``step`` is committed in every host's
        directory: each host's part to its partners. Raises ``CheckpointError`` in every
        process when any of them failed; the step is then deleted everywhere."""
        final = self.dir.child(_commit.step_name(step))
        with _distributed.Operation(f"peer{_distributed.next_id()}", str(final), self.timeout_s) as op:
            committed: list[Location] = []
            try:
                error = self._send(op, step, final, committed)
            except Exception as e:  # noqa: BLE001 - every process hears of it
                error = e
            error = _hosts.share_verdict(op, "copied", error)
        if error is None:
            return
        _log.error("jaxckpt: the peer copy of step %d in '%s' failed: %s; deleting the step", step, self.dir, error)
        if self.me in self.leads:
            for root in committed:
                _commit.delete_step(root, step, _commit.new_token())
            _commit.delete_step(self.dir, step, _commit.new_token())
        cause = error if isinstance(error, CheckpointError) else f"process {self.me}: {type(error).__name__}: {error}"
        raise CheckpointError(f"the peer copy failed (the step is deleted on every host): {cause}") from error

    def _send(self, op: _distributed.Operation, step: int, final: Location, committed: list[Location]) -> None:
        mine: dict[str, Any] = {}
        man = b""
        if self.me in self.leads:
            try:
                files, man, dg = part_of(final.local)
            except Exception as e:
                op.post("part", e)
                raise
            mine = {"files": files, "digest": dg}
        op.post("part", json.dumps(mine).encode())
        op.post("manifest", man)
        others = _hosts.others()
        parts = {p: json.loads(d) for p, d in op.wait_for("part", others).items()}
        parts[self.me] = mine
        mans = op.wait_for("manifest", others)
        mans[self.me] = man
        files = {p: [tuple(f) for f in parts[p]["files"]] for p in self.leads}
        rounds = [ring(self.leads, d) for d in range(1, self.copies + 1)]
        incoming = [(s, r) for pairs in rounds for s, r in pairs if r == self.me]
        staged = _ready(op, lambda: self._stage(step, incoming, files))
        spent: dict[str, float] = {}
        for pairs in rounds:
            source = next((s for s, r in pairs if r == self.me), None)
            error = move(pairs, files, final.local, staged[source][1].local if source is not None else None, spent)
            if error is not None:
                raise error
        _log.debug("jaxckpt: peer copy of step %d: %d bytes out; %s", step, sum(n for _, n in files.get(self.me, [])),
                   ", ".join(f"{k} {v:.3f} s" for k, v in spent.items()))
        for source, (where, staging, token) in staged.items():
            with open(os.path.join(staging.local, RECORD), "w") as f:
                json.dump({"source": source, "step": step, "digest": parts[source]["digest"]}, f)
            _commit.commit(where, staging, mans[source], token)
            committed.append(peer_root(self.dir, source))

    def _stage(self, step: int, incoming: list[tuple[int, int]],
               files: dict[int, list[tuple[str, int]]]) -> dict[int, tuple[Location, Location, str]]:
        """This receiver's staging attempts, after checking that the parts fit (an earlier
        copy that failed first gives back its room)."""
        for source, _ in incoming:
            drop_attempts(peer_root(self.dir, source).local)
        need = sum(n for s, _ in incoming for _, n in files[s])
        if incoming:
            free = free_bytes(self.dir.local)
            if need > free:
                raise CheckpointError(
                    f"no room for the peer copies of step {step} in '{self.dir}' (process {self.me}): they take "
                    f"{need} bytes, {free} are free; on a RAM disk (/dev/shm) each host holds max_to_keep steps "
                    f"of its own and of its {self.copies} partner(s), plus the step being saved")
        out = {}
        for source, _ in incoming:
            where = peer_root(self.dir, source).child(_commit.step_name(step))
            os.makedirs(os.path.dirname(where.local), exist_ok=True)
            token = _commit.new_token()
            out[source] = (where, _commit.make_staging(where, token), token)
        return out

    # --- retention ----------------------------------------------------------------------

    def prune(self, keep: Iterable[int]) -> None:
        """The first process of each group: drop the peer copies (and their dead attempts)
        of steps not in ``keep`` (the listed local steps, the same in every process)."""
        if self.me not in self.leads:
            return
        keep = set(keep)
        top = os.path.join(self.dir.local, PEERS_DIR)
        for name in sorted(os.listdir(top)) if os.path.isdir(top) else []:
            drop_attempts(os.path.join(top, name))
            for step in _commit.discover_steps(self.dir.child(PEERS_DIR).child(name)):
                if step not in keep:
                    try:
                        _commit.delete_step(self.dir.child(PEERS_DIR).child(name), step, _commit.new_token())
                    except OSError as e:
                        _log.warning("jaxckpt: dropping the peer copy of step %d in '%s' failed: %s", step, top, e)


def drop_attempts(root: str) -> None:
    """Remove the hidden attempts (and their claims) under a peer copies' directory:
    copies that failed or were killed. Only the thread that settles saves copies, so none
    is in progress when this runs."""
    for entry in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        if not entry.startswith("."):
            continue
        path = os.path.join(root, entry)
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.remove(path)
        except OSError as e:
            _log.warning("jaxckpt: removing '%s' failed: %s", path, e)


def _ready(op: _distributed.Operation, prepare: Any) -> Any:
    """``prepare()`` here, then two rounds before any collective: every process posts
    whether it is ready, then "go" once it saw every process ready. A process that gave
    up on a late peer never posts "go", so no process enters the waves alone."""
    error: BaseException | None = None
    result = None
    try:
        result = prepare()
    except Exception as e:  # noqa: BLE001 - every process hears of it
        error = e
    op.post("ready", error if error is not None else b"")
    if error is not None:  # its own cause first; the others hear of it at "ready"
        op.post("go", error)
        raise error
    try:
        op.wait_for("ready", _hosts.others())
    except CheckpointError as e:
        op.post("go", e)
        raise
    op.post("go")
    op.wait_for("go", _hosts.others())
    return result


# --- restoring a lost part from its peer copy ------------------------------------------------

def plan_repair(held: dict[int, dict[int, str]], copies: dict[int, dict[int, dict[int, list[str]]]],
                durable: set[int], step: int | None) -> tuple[int | None, dict[int, int]]:
    """The step to restore and, for each group (by its first process) whose part of it is
    lost, the group whose peer copy sends it back: ``(step, {lacking: holder})``, or
    ``(step, {})`` when nothing needs sending (every part intact, or only the persistent
    tier has the step), or ``(None, {})``.

    ``held[g]``: the steps in group ``g``'s directory, each with its listing's digest;
    ``copies[h][g][s]``: group ``h``'s peer copy of ``g``'s part of step ``s``, as its
    current and its recorded digest (a copy whose two differ is damaged and not used).
    A part held in its own directory is intact unless a valid copy recorded another
    digest (files lost since the commit). Pure: every process decides the same."""
    valid: dict[tuple[int, int], dict[int, str]] = {}  # (group, step) -> {holder: recorded digest}
    for holder, by_source in copies.items():
        for source, steps in by_source.items():
            for s, (now, recorded) in steps.items():
                if now == recorded:
                    valid.setdefault((source, s), {})[holder] = recorded

    def intact(g: int, s: int) -> bool:
        recorded = set(valid.get((g, s), {}).values())
        return s in held[g] and (not recorded or held[g][s] in recorded)

    known = set(durable).union(*(set(v) for v in held.values()), {s for _, s in valid})
    for s in [step] if step is not None else sorted(known, reverse=True):
        if all(intact(g, s) for g in held):
            return s, {}
        if all(intact(g, s) or (g, s) in valid for g in held):
            return s, {g: min(valid[(g, s)]) for g in held if not intact(g, s)}
        if s in durable:
            return s, {}
    return None, {}


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


def _held_parts(directory: Location) -> dict[int, str]:
    out = {}
    for step in sorted(_commit.discover_steps(directory)):
        try:
            out[step] = part_of(directory.child(_commit.step_name(step)).local)[2]
        except OSError:
            continue  # deleted meanwhile
    return out


def _held_copies(directory: Location) -> dict[int, dict[int, list[str]]]:
    """This directory's committed peer copies: source -> step -> [digest now, recorded]."""
    top = os.path.join(directory.local, PEERS_DIR)
    out: dict[int, dict[int, list[str]]] = {}
    for name in sorted(os.listdir(top)) if os.path.isdir(top) else []:
        if not (name.startswith("p") and name[1:].isdigit()):
            continue
        for step in _commit.discover_steps(directory.child(PEERS_DIR).child(name)):
            root = os.path.join(top, name, _commit.step_name(step))
            try:
                with open(os.path.join(root, RECORD)) as f:
                    recorded = str(json.load(f)["digest"])
                out.setdefault(int(name[1:]), {})[step] = [part_of(root)[2], recorded]
            except (OSError, ValueError, KeyError, TypeError):
                continue  # no usable record: not a copy to rely on
    return out


def repair(peers: PeerCopies, step: int | None, sources: _hosts.Sources) -> None:
    """Before a per-host restore: send the parts of the chosen step that some host lost
    back from their peer copies (see ``plan_repair``), committed into those hosts'
    directories, so that the restore reads every part locally. Every process calls it
    at the same point. A failure falls to the persistent tier when it holds the step
    (a warning) and is raised in every process otherwise."""
    me = peers.me
    with _distributed.Operation(f"peerfix{_distributed.next_id()}", str(peers.dir), peers.timeout_s,
                                lane="restore") as op:
        facts: dict[str, Any] = {}
        if me in peers.leads:
            facts = {"held": _held_parts(peers.dir), "copies": _held_copies(peers.dir)}
        if me == 0:
            facts["durable"] = sorted(sources.listing.durable())
        op.post("facts", json.dumps(facts).encode())
        posts = {p: json.loads(d) for p, d in op.wait_for("facts", _hosts.others()).items()}
        posts[me] = json.loads(json.dumps(facts))
        held = {g: {int(s): d for s, d in posts[g]["held"].items()} for g in peers.leads}
        copies = {h: {int(g): {int(s): v for s, v in steps.items()} for g, steps in posts[h]["copies"].items()}
                  for h in peers.leads}
        durable = set(posts[0].get("durable", []))
        chosen, fixes = plan_repair(held, copies, durable, step)
        if not fixes or sources.read_only:
            return
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
        return
    if chosen in durable:
        _log.warning("jaxckpt: sending step %d back from its peer copies failed (%s); every process reads the "
                     "persistent tier", chosen, error)
        return
    raise CheckpointError(f"Cannot restore step {chosen} from '{peers.dir}': sending the lost part(s) back from "
                          f"their peer copies failed: {error}") from error


def _send_back(op: _distributed.Operation, peers: PeerCopies, step: int, fixes: dict[int, int],
               damaged: bool) -> None:
    """Move the peer copies of ``fixes`` to their hosts, round by round; each receiver
    commits its part, manifest last, into its own directory."""
    me = peers.me
    final = peers.dir.child(_commit.step_name(step))
    mine = {}
    for lacking, holder in fixes.items():
        if holder == me:
            root = peer_root(peers.dir, lacking).child(_commit.step_name(step)).local
            files, man, _ = part_of(root)
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
        need, free = sum(n for _, n in part[me]["files"]), free_bytes(peers.dir.local)
        if need > free:
            raise CheckpointError(f"no room for step {step}'s part in '{peers.dir}': {need} bytes, {free} free")
        token = _commit.new_token()
        return _commit.make_staging(final, token), token

    staged = _ready(op, stage)
    for pairs in rounds_of(fixes):
        files = {h: [tuple(f) for f in part[g]["files"]] for h, g in pairs}
        source = next((g for h, g in pairs if h == me), None)
        read_root = peer_root(peers.dir, source).child(_commit.step_name(step)).local if source is not None else None
        error = move(pairs, files, read_root, staged[0].local if staged and any(g == me for _, g in pairs) else None)
        if error is not None:
            raise error
    if staged is not None:
        _commit.commit(final, staged[0], part[me]["manifest"].encode(), staged[1])
