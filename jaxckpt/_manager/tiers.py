"""Two tiers: every step commits to a fast local directory; every K-th one is also copied,
in the background, to a durable persistent directory (a bucket), with its own
manifest-last commit and its own retention.

The copy moves the committed local files byte for byte (each chunk file keeps its
crc32c; device memory is never snapshotted again; host memory stays near one file per
copy thread). In a multi-process job every process takes part, on a thread of its own
and in an agreement lane of its own (``"persist"``):

1. process 0 prepares the persistent attempt and broadcasts its token;
2. the first process of each group that shares a local directory (one group when the
   directory is shared, one per host when each host has its own) lists the step's
   files there; every process learns every listing;
3. each file goes to one process among those whose directory holds it (largest first,
   to the least loaded: ``_layout.assign_writers``), which copies it;
4. process 0 checks that the listings together hold every file the manifest needs (a
   host that lost its copy and held the only one makes the copy fail, loudly), waits
   for every copier, then writes the manifest, last, naming the attempt's data.

A copy killed midway leaves no persistent step: its manifest is written last.

Format 3 (issue 22) copies data objects the same way, streamed from the file (a block at
a time to a local tier, ``uploads.upload_file``'s parallel parts to an object store),
never whole in memory. With a directory per host, process 0's manifest locates every
chunk at one host's copy (``_hoststreams``) and is the persistent one: it names the
objects and their sizes, posted to every process, and a host's object is copied only
up to that size (the entries after it are its copies of chunks another host's
objects hold).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from .. import _claims, _commit, _distributed, _layout, _manifest, _storage, _tasks, _verify
from .._errors import CheckpointError, CheckpointNotFoundError
from .._formats import orbaxrun as _orbaxrun
from .._manifest import Manifest
from .._storage import kvstore as _kvstore
from .._storage import location as _location
from .._storage import uploads as _uploads
from .._storage.location import Location
from . import retention as _retention
from . import steplist as _steplist

_log = logging.getLogger("jaxckpt")

COPY_THREADS = 8
COPY_BLOCK_BYTES = 16 << 20  # a data object copied to a local tier goes a block at a time


def list_files(root: Location) -> dict[str, int]:
    """The data files of the committed local checkpoint ``root`` (its manifest excluded),
    relative path -> size. Empty when it is not there (a host that lost its disk)."""
    if root.local is None:
        raise CheckpointError(f"'{root}': the local tier must be a local directory")
    return _verify.list_files(root.local)


def assign_copies(listings: dict[int, dict[str, int]], groups: Sequence[Sequence[int]]) -> dict[int, list[str]]:
    """Which process copies which file: each file to one process of a group that listed
    it (the first process of each group posted its group's listing). The same answer in
    every process."""
    group_of = {g[0]: tuple(g) for g in groups}
    holders: dict[str, list[int]] = {}
    sizes: dict[str, int] = {}
    for lister, files in sorted(listings.items()):
        for path, size in files.items():
            holders.setdefault(path, []).extend(group_of.get(lister, (lister,)))
            sizes[path] = size
    paths = sorted(holders)
    writers = _layout.assign_writers([(sizes[p], tuple(sorted(set(holders[p])))) for p in paths])
    out: dict[int, list[str]] = {}
    for path, w in zip(paths, writers):
        out.setdefault(w, []).append(path)
    return out


def object_sizes(man: Manifest) -> dict[str, int]:
    """Format 3: the data objects a copy of ``man`` takes, with their sizes (from its
    streams); empty for the other formats."""
    if not man.streams:
        return {}
    return {path: size for path, (size, _) in _verify.expected_files(man).items()}


def _copy_files(src: Location, dest: Location, paths: list[str], sizes: Mapping[str, int] | None = None) -> None:
    """Copy ``paths`` of the committed ``src`` under ``dest``, byte for byte; a data
    object in ``sizes`` (format 3) only up to its size, streamed."""
    def copy(path: str) -> None:
        _storage.fault("copy", path)
        if sizes and path in sizes:
            copy_object(os.path.join(src.local, path), dest, path, sizes[path],
                        os.path.dirname(os.path.normpath(src.local)))
            return
        with open(os.path.join(src.local, path), "rb") as f:
            data = f.read()
        _storage.count(bytes_written=len(data), writes=1)
        if dest.local is not None:
            os.makedirs(os.path.dirname(os.path.join(dest.local, path)), exist_ok=True)
        _kvstore.write_blob(dest, path, data)

    _tasks.run_tasks([lambda p=p: copy(p) for p in paths], COPY_THREADS)


def copy_object(src: str, dest: Location, path: str, size: int, scratch: str) -> None:
    """The first ``size`` bytes of the local file ``src`` as ``dest/path``: to a local
    tier a block at a time (fsynced), to an object store by ``uploads.upload_file``
    (a longer file through a temporary copy of its first ``size`` bytes, made in the
    local directory ``scratch``: the manager's, beside its steps)."""
    _storage.count(bytes_written=size, writes=1)
    if dest.local is not None:
        target = os.path.join(dest.local, path)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(src, "rb") as f, open(target, "wb") as out:
            _copy_bytes(f, out, size, path)
            out.flush()
            os.fsync(out.fileno())
        return
    folder, name = os.path.split(path)
    root = dest.child(folder) if folder else dest
    if os.stat(src).st_size == size:
        _uploads.upload_file(root, name, src)
        return
    fd, tmp = tempfile.mkstemp(prefix=_claims.scratch_prefix(), dir=scratch)  # says who made it
    try:
        with open(src, "rb") as f, os.fdopen(fd, "wb") as out:
            _copy_bytes(f, out, size, path)
        _uploads.upload_file(root, name, tmp)
    finally:
        os.remove(tmp)


def _copy_bytes(f: Any, out: Any, size: int, path: str) -> None:
    left = size
    while left:
        block = f.read(min(COPY_BLOCK_BYTES, left))
        if not block:
            raise CheckpointError(f"'{path}' ended {left} bytes before the {size} its manifest implies")
        out.write(block)
        left -= len(block)


class _Copy:
    """One step's copy to the persistent tier, by every process of the job."""

    def __init__(self, step: int, local: Location, dest: Location, man: Manifest,
                 groups: Sequence[Sequence[int]], timeout_s: float | None,
                 check_lease: Callable[[], None] = lambda: None):
        self.step, self.local, self.dest, self.man = step, local, dest, man
        self.check_lease = check_lease
        self.groups, self.timeout_s = groups, timeout_s
        me = _distributed.process_index()
        self.me = me
        self.lists = any(g[0] == me for g in groups)  # the first of its group lists its directory

    def run(self) -> Manifest:
        name = f"persist{self.step}-{self.man.info.get('created_unix', 0)}"
        with _distributed.Operation(name, str(self.dest), self.timeout_s, lane="persist") as op:
            if self.me == 0:
                return self._coordinate(op)
            token = op.broadcast("staged", None).decode()
            self._copy_mine(op, token)
            return _manifest.parse(op.wait_for_outcome(str(self.dest)), str(self.dest))

    def _copy_mine(self, op: _distributed.Operation, token: str) -> dict[int, dict[str, int]]:
        try:
            mine = list_files(self.local) if self.lists else {}
            op.post("listed", json.dumps(mine).encode())
            others = [p for p in range(_distributed.process_count()) if p != self.me]
            listings = {p: json.loads(d) for p, d in op.wait_for("listed", others).items()}
            listings[self.me] = mine
            listings = {p: v for p, v in listings.items() if any(g[0] == p for g in self.groups)}
            sizes = self._object_sizes(op, others)
            if sizes:  # format 3: only the objects process 0's manifest names, each long enough
                listings = {p: {f: sizes[f] for f, n in v.items() if f in sizes and n >= sizes[f]}
                            for p, v in listings.items()}
            todo = assign_copies(listings, self.groups).get(self.me, [])
            _copy_files(self.local, _commit.data_location(self.dest, token), todo, sizes)
        except BaseException as e:
            op.post("copied", e)
            raise
        op.post("copied")
        return listings

    def _object_sizes(self, op: _distributed.Operation, others: list[int]) -> dict[str, int]:
        """Format 3: process 0's ``object_sizes`` (its manifest is the persistent one;
        with a directory per host, the others' differ), the same in every process."""
        if not self.man.streams:
            return {}
        if self.me == 0:
            sizes = object_sizes(self.man)
            if others:
                op.post("objects", json.dumps(sizes).encode())
            return sizes
        return json.loads(op.wait_for("objects", [0])[0])

    def _coordinate(self, op: _distributed.Operation) -> Manifest:
        def stage() -> tuple[str, Location]:
            self.check_lease()
            token = _commit.new_token(self.dest)
            return token, _commit.prepare(self.dest, token, overwrite=True)

        def work(token: str) -> tuple[bytes, Manifest]:
            listings = self._copy_mine(op, token)
            held = set().union(*listings.values()) if listings else set()
            missing = sorted(set(_verify.expected_files(self.man)) - held)
            if missing:
                raise CheckpointError(
                    f"step {self.step}: no process's local directory holds {len(missing)} of its files "
                    f"(e.g. '{missing[0]}'); a host lost its copy")
            op.wait_for("copied", list(range(1, _distributed.process_count())))
            new = self._persistent_manifest(token)
            data = new.to_bytes()
            self.check_lease()
            return data, new

        return op.lead_commit(f"copy of step {self.step} to '{self.dest}'", stage, work,
                              lambda staging, data, token: _commit.commit(self.dest, staging, data, token),
                              lambda staging, token: _commit.abort(self.dest, staging, token))

    def _persistent_manifest(self, token: str) -> Manifest:
        key = _commit.data_key(self.dest, token)
        info = {k: v for k, v in self.man.info.items() if k != "format"}
        info["copied_from"] = str(self.local)
        version = _manifest.DATA_PREFIX_VERSION if key else _manifest.FORMAT_VERSION
        if self.man.streams:
            version = _manifest.STREAMS_VERSION  # the data prefix (object stores) is the data's root
        return dataclasses.replace(self.man, data=key, format_version=version, info=info)


class PersistentTier:
    """The durable tier of a manager: its committed steps, a copy thread, retention."""

    def __init__(self, directory: Location, interval_steps: int, max_to_keep: int | None,
                 timeout_s: float | None = None):
        self.dir, self.interval, self.max_to_keep = directory, interval_steps, max_to_keep
        self.timeout_s = timeout_s
        self.steps: dict[int, Manifest] = dict(_commit.discover_steps(directory))
        # Process 0 of a writing manager holds the tier's writer lease (the manager takes
        # it): a cleaner or a second job sees the copy in progress as a live writer's.
        self.lease: Any = None
        self._lock = threading.Lock()
        self._worker = _tasks.Worker("jaxckpt-persist", self._run)
        self.errors: list[tuple[int, BaseException]] = []

    def wants(self, step: int) -> bool:
        return step % self.interval == 0

    def submit(self, step: int, local: Location, man: Manifest, groups: Sequence[Sequence[int]],
               done: Callable[[], None]) -> None:
        """Copy committed local ``step`` in the background (every process of the job
        submits it); ``done()`` runs after it."""
        self._worker.submit((step, local, man, groups, done))

    def _run(self, item: tuple[Any, ...]) -> None:
        step, local, man, groups, done = item
        try:
            copied = _Copy(step, local, self.dir.child(_commit.step_name(step)), man, groups, self.timeout_s,
                           self._check_lease).run()
            with self._lock:
                self.steps[step] = copied
            self._apply_retention()
        except Exception as e:  # noqa: BLE001 - raised by the manager's next wait
            _log.warning("jaxckpt: copying step %d to '%s' failed: %s", step, self.dir, e)
            with self._lock:
                self.errors.append((step, e))
        finally:
            done()

    def _check_lease(self) -> None:
        """Process 0, before it commits or deletes in the tier: refuse once another writer
        took the directory over."""
        if self.lease is not None and self.lease.lost:
            raise CheckpointError(f"the persistent tier '{self.dir}' cannot be written: {self.lease.lost}")

    def _apply_retention(self) -> None:
        """The same decision in every process; process 0 deletes (the tier is shared)."""
        if self.max_to_keep is None:
            return
        with self._lock:
            infos = [_retention.StepInfo(s, float(m.info.get("commit_time", 0.0)), m.info.get("metrics"))
                     for s, m in self.steps.items()]
        policy = _retention.RetentionPolicy.make(max_to_keep=self.max_to_keep)
        for s in _retention.steps_to_delete(infos, policy):
            with self._lock:
                self.steps.pop(s, None)
            if _distributed.process_index() == 0:
                self._check_lease()
                _commit.delete_step(self.dir, s, _commit.new_token())

    def settled_steps(self) -> set[int]:
        """The tier's steps once every copy submitted so far has run (``delete``: the same
        in every process; a copy of the step cannot land after it is deleted)."""
        self._worker.wait()
        with self._lock:
            return set(self.steps)

    def delete(self, step: int) -> None:
        """Process 0: delete ``step`` from the tier (``manager.delete``)."""
        self._check_lease()
        _commit.delete_step(self.dir, step, _commit.new_token())

    def forget(self, step: int) -> None:
        with self._lock:
            self.steps.pop(step, None)

    def wait(self) -> list[tuple[int, BaseException]]:
        """Until every submitted copy ran; returns (and forgets) the failures."""
        self._worker.wait()
        with self._lock:
            errors, self.errors = self.errors, []
        return errors

    def first_failure(self) -> CheckpointError | None:
        """Until every submitted copy ran: the first that failed, as the manager raises it."""
        first = None
        for step, error in self.wait():
            first = first or CheckpointError(f"Copying step {step} to the persistent tier '{self.dir}' failed: {error}")
        return first


def make_persistent(directory: Any, interval: int | None, max_to_keep: int | None, timeout_s: float | None,
                    read_only: bool) -> PersistentTier | None:
    """The manager's persistent tier from its ``persistent_*`` options (``None``: none)."""
    if directory is None:
        if interval is not None or max_to_keep is not None:
            raise CheckpointError("persistent_interval_steps/persistent_max_to_keep need persistent_directory")
        return None
    if interval is None and read_only:
        interval = 1  # a reader only lists and restores
    if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
        raise CheckpointError(f"persistent_interval_steps must be a positive int, got {interval!r}")
    return PersistentTier(_location.resolve(directory), interval, max_to_keep, timeout_s)


# --- routing: which tier a step is read from -------------------------------------------

PEERS_MISSING = "peer-copies-missing"  # a local step that lacks some of its peer copies


def step_tiers(local: Iterable[int], durable: Iterable[int], bare: Iterable[int] = ()) -> dict[int, tuple[str, ...]]:
    """Which tiers hold each step: ``("local",)``, ``("persistent",)`` or both; a local
    step in ``bare`` (its peer copies missing) also says ``PEERS_MISSING``, last."""
    local, durable, bare = set(local), set(durable), set(bare)
    marks = (("local", local), ("persistent", durable), (PEERS_MISSING, local & bare))
    return {s: tuple(t for t, steps in marks if s in steps) for s in sorted(local | durable)}


def locate(step: int | None, local: Mapping[int, Any], durable: Mapping[int, Any], local_dir: Location,
           durable_dir: Location | None) -> tuple[Location, int]:
    """Where to read ``step`` (default: the newest of either tier): the local copy when
    there is one."""
    if step is None:  # no step but the newest read (``Steps.newest``)
        newest = local.newest() if isinstance(local, _steplist.Steps) else max(local, default=None)
        step = max((s for s in (newest, max(durable, default=None)) if s is not None), default=None)
        if step is None:
            raise CheckpointNotFoundError(f"No committed step in '{local_dir}'")
    elif step not in local and step not in durable:
        known = sorted(set(local) | set(durable))
        raise CheckpointNotFoundError(f"No committed step {step} in '{local_dir}' (committed: {known})")
    return (local_dir if step in local else durable_dir).child(_commit.step_name(step)), step


class Listing:
    """The committed steps a manager lists, by tier: ``local`` (its directory's; with
    per-host directories, those every host held at start) and the persistent tier's.
    Shares the manager's lock: a step is looked up and pinned under one lock."""

    def __init__(self, lock: Any, directory: Location, local: dict[int, Manifest],
                 persistent: PersistentTier | None):
        self._lock, self.dir, self.persistent = lock, directory, persistent
        self.local = local if isinstance(local, _steplist.Steps) else _steplist.Steps(None, read=local)
        self._scanning: set[int] | None = None  # steps committed while reload() scans

    def durable(self) -> dict[int, Manifest]:
        return dict(self.persistent.steps) if self.persistent is not None else {}

    def validate(self) -> None:
        """Read the manifests of the listed steps not read yet (``Steps``), outside the
        lock: a save committing meanwhile is not held up by a directory of many steps."""
        with self._lock:
            local = self.local
            todo = local.unread()
        if todo:
            found: tuple[dict[int, Manifest | None], dict[int, str]] = ({}, {})
            try:
                _steplist.read(local.directory, todo, found)
            finally:  # a store that failed: the steps read before it are kept, the others stay unread
                with self._lock:
                    local.adopt(found)

    def all(self) -> list[int]:
        self.validate()
        with self._lock:
            return sorted(set(self.local) | set(self.durable()))

    def latest(self) -> int | None:
        """The newest listed step: the newest local one that validates, or a newer
        persistent one; no other manifest read or checked."""
        with self._lock:
            return max((s for s in (self.local.newest(), max(self.durable(), default=None)) if s is not None),
                       default=None)

    def newest_local(self) -> tuple[int, Manifest] | None:
        """The newest local step that validates, with its manifest."""
        with self._lock:
            step = self.local.newest()
            return None if step is None else (step, self.local[step])

    def tiers(self, bare: Iterable[int] = ()) -> dict[int, tuple[str, ...]]:
        """``step_tiers`` of the listed steps (``bare``: those lacking peer copies)."""
        self.validate()
        with self._lock:
            return step_tiers(self.local, self.durable(), bare)

    def manifest(self, step: int) -> Manifest:
        with self._lock:
            man = self.local.get(step) or self.durable().get(step)
        if man is None:
            raise CheckpointNotFoundError(f"No committed step {step} in '{self.dir}'")
        return man

    def locate(self, step: int | None) -> tuple[Location, int]:
        """Where to read ``step`` (see ``locate``); call it under the lock."""
        where, step = locate(step, self.local, self.durable(), self.dir, self.persistent and self.persistent.dir)
        name = _orbaxrun.step_dir(self.local.get(step))  # a step of an orbax run: its own directory name
        return (where if name is None else self.dir.child(name)), step

    def foreign(self, step: int) -> bool:
        """Whether ``step`` is listed from an orbax run (read as orbax wrote it)."""
        with self._lock:
            return _orbaxrun.step_dir(self.local.get(step)) is not None

    def infos(self) -> dict[int, dict[str, Any]]:
        """The manifest info of each listed local step."""
        self.validate()
        with self._lock:
            return {s: m.info for s, m in self.local.items()}

    def add(self, step: int, man: Manifest) -> None:
        """List ``step``, committed by this manager (a ``reload`` scanning now keeps it)."""
        with self._lock:
            self.local[step] = man
            if self._scanning is not None:
                self._scanning.add(step)

    def relist(self, step: int, error: BaseException) -> None:
        """List ``step`` again, unlisted by a ``delete`` that was refused: from its manifest
        on disk; ``error`` (the refusal) is raised instead when it is gone here."""
        try:
            man = _commit.read_manifest(self.dir.child(_commit.step_name(step)))
        except CheckpointError:  # deleted here, refused for another host's directory
            raise error from None
        with self._lock:
            self.local[step] = man

    def reload(self) -> None:
        """Rescan both tiers."""
        with self._lock:
            self._scanning = set()
        try:
            found = _steplist.listed(self.dir)  # jaxckpt's steps, or an orbax run's
        finally:
            with self._lock:
                ours, self._scanning = self._scanning, None
        if self.persistent is not None:
            durable = _commit.discover_steps(self.persistent.dir)
            with self._lock:
                self.persistent.steps = dict(durable)
        with self._lock:
            # a step this manager committed while the scan ran may be missing from it
            for s in ours or ():
                if s in self.local and s not in found:
                    found[s] = self.local[s]
            self.local.clear()
            self.local.update(found)
