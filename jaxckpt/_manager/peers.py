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
manifest, committed manifest last, with ``peer.json`` recording the listing it copied
and the identity of the step it copies: every host's manifest checksum of that step
(``identity``). A restore uses a copy only when those are the identities of the step
the hosts hold (``peerrepair``), so a copy of a deleted or re-saved step is never used.

When the bytes move. A save's peer copy runs where the manager settles that save: at
the ``save``/``wait_until_finished``/``restore``/``close`` call that waits for it (with
``async_save=False``, inside ``save``). That call is the same in every process
(``manager._Saves``), on the thread the training loop calls from, so the copy's
collectives never run beside the loop's own (two threads issuing collectives in
different orders across processes can deadlock; NCCL warns against it). A step is
listed, counted for retention and sent to the persistent tier once its copy has run.

A copy that fails in any process (a partner's disk full, a read or write error) fails
in every process alike, but not the save: the step is committed, so it stays listed,
goes to the persistent tier as usual and counts for retention, with a warning naming the
cause, and is marked as lacking its peer copies (``PeerCopies.missing``, shown by
``step_tiers()`` as ``"peer-copies-missing"``). The next save sends them again: once
the new step is listed (and retention has run), every step still listed in every
process that lacks copies is copied whole again, oldest first (a copy replaces any
earlier one of that step). A step whose copy never ran (the job died in between), or
whose copies a host lost with its disk, is found by ``peerrepair.repair`` when the next
manager starts, and copied at its first save the same way. ``delete(step)`` drops the
step's copies on every host once every host deleted it; retention's deletes drop them
after each save (``prune``).

How the bytes move: over JAX's collectives, one device per process (as read-once does):
a jitted ``ppermute`` from each sending process to its receiver, in waves of at most
``BLOCK_BYTES`` per process (every byte crosses the network once; nothing goes through
the bucket). The first process of each group sends its directory's part and receives its
partner's. Before any collective every process posts what it will send and whether it
can receive (the receiver checks its free space first: a full RAM disk fails the copy
before a byte moves); during the waves a process whose read or write failed goes on
joining them with zeros, and reports afterwards, so no process is left alone in a
collective. Restoring a lost part from its copy: ``peerrepair``.
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
from .._manifest import CHECKSUM_FIELD, MANIFEST
from .._storage.location import Location
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


def identity(manifest: bytes) -> str:
    """The identity of a committed part: its manifest's checksum (the sha256 a manifest
    carries of itself; of its bytes for one written before manifests had checksums).
    Another save of the same step has another manifest, hence another identity."""
    try:
        value = json.loads(manifest).get(CHECKSUM_FIELD)
    except (ValueError, AttributeError, RecursionError):
        value = None
    return value if isinstance(value, str) else "sha256:" + hashlib.sha256(manifest).hexdigest()


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


def copy_dirs(directory: Location) -> list[str]:
    """The names of the per-source folders of peer copies under ``directory`` (``p<k>``)."""
    top = os.path.join(directory.local, PEERS_DIR)
    names = sorted(os.listdir(top)) if os.path.isdir(top) else []
    return [n for n in names if n.startswith("p") and n[1:].isdigit()]


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
        # listed steps lacking some peer copy: the same set in every process (it changes on
        # shared verdicts and on what every process posted); replaced, never changed in place
        self.missing: frozenset[int] | set[int] = frozenset()

    def copy(self, step: int) -> bool:
        """Every process, at the same call, once ``step`` is committed in every host's
        directory: each host's part to its partners. A copy that fails in any process
        (the same verdict in every process) is logged and the step kept, marked as
        lacking its peer copies (``missing``) until ``copy_missing`` sends them. Whether
        every copy was made."""
        final = self.dir.child(_commit.step_name(step))
        with _distributed.Operation(f"peer{_distributed.next_id()}", str(final), self.timeout_s) as op:
            try:
                error = self._send(op, step, final)
            except Exception as e:  # noqa: BLE001 - every process hears of it
                error = e
            error = _hosts.share_verdict(op, "copied", error)
        if error is None:
            self.missing = self.missing - {step}
            return True
        self.missing = self.missing | {step}
        cause = error if isinstance(error, CheckpointError) else f"process {self.me}: {type(error).__name__}: {error}"
        _log.warning("jaxckpt: the peer copy of step %d in '%s' failed: %s; the step is kept without its peer "
                     "copies (sent again at the next save)", step, self.dir, cause)
        return False

    def copy_missing(self, listed: Iterable[int], saved: int) -> None:
        """After the save of ``saved`` is listed (the thread that settles saves, every
        process): send the peer copies of the other listed steps that lack theirs
        (``missing``: a copy that failed at an earlier save, or found missing by
        ``repair``). The steps are those every process lists; a step no process lists
        any more is forgotten. A failure is logged (``copy``)."""
        if not self.missing - {saved}:  # the same in every process: it changes on shared verdicts and posts
            return
        mine = sorted(self.missing & set(listed) - {saved})
        try:
            with _distributed.Operation(f"peerretry{_distributed.next_id()}", str(self.dir), self.timeout_s) as op:
                op.post("listed", json.dumps(mine).encode())
                views = [set(json.loads(d)) for d in op.wait_for("listed", _hosts.others()).values()]
        except CheckpointError as e:
            _log.warning("jaxckpt: sending the missing peer copies of steps %s in '%s' failed: %s", mine, self.dir, e)
            return
        views.append(set(mine))
        self.missing = {s for s in self.missing if s == saved or s in set.union(*views)}
        for step in sorted(set.intersection(*views)):
            self.copy(step)

    def drop(self, step: int) -> None:
        """``delete(step)`` (every process, once every host deleted it): the first process
        of each group drops its peer copies of ``step``, so that no later restore or start
        brings the step back from them."""
        self.missing = self.missing - {step}
        if self.me not in self.leads:
            return
        for name in copy_dirs(self.dir):
            root = self.dir.child(PEERS_DIR).child(name)
            if step in _commit.discover_steps(root):
                try:
                    _commit.delete_step(root, step, _commit.new_token())
                except (OSError, CheckpointError) as e:
                    _log.warning("jaxckpt: dropping the peer copy of step %d in '%s' failed: %s", step, root, e)

    def _send(self, op: _distributed.Operation, step: int, final: Location) -> None:
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
        # the identity of the step copied: the checksum of every host's manifest of it
        ids = {str(lead): identity(mans[lead]) for lead in self.leads}
        for source, (where, staging, token) in staged.items():
            with open(os.path.join(staging.local, RECORD), "w") as f:
                json.dump({"source": source, "step": step, "digest": parts[source]["digest"], "parts": ids}, f)
            _commit.commit(where, staging, mans[source], token)

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
