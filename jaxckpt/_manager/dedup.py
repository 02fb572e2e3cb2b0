"""Deduplicated saves (``CheckpointManager(dedup=True)``, format 4): a run of a leaf whose
bytes a retained step already holds is not written again; the new manifest refers to
that step's stream instead (docs/format.md, "Format 4").

Where the bytes are. Every save of such a manager writes its data objects into the
manager directory's *pool*, ``<directory>/.jaxckpt-data/<token>/data/p<k>.<n>`` (the
attempt's token), never into the step's own directory, which holds the manifest only. A
step can then be deleted (its manifest goes) while later steps still read its bytes, and
the step saved again later writes a pool entry of its own.

What "equal" means. A run is referred to only if the leaf has the same dtype, shape,
chunk shape and codec as at the step referred to, the run covers the same chunks, and
either the leaf is the very same ``jax.Array`` object as at that save, off CPU (immutable:
its bytes cannot have changed; on CPU an array may share a numpy buffer changed in place,
``_immutable``) or the run's content hash (blake3, 128 bits, over its
entries' payloads in chunk order) equals the hash recorded for it. The hashes are
computed on the save's background threads (``HASH_THREADS``), before its writes. A leaf
whose hash changed since the last save is not hashed for the next 1, 2, 4 ... 32 saves
(each time it changed again: dense training changes every byte each step, so the hash then
costs a few percent of its time at most).

Deleting. A pool entry is removed only when no manifest on disk names it (its own or in
its ``refs``) and no save in flight uses it: a mark and sweep (``Dedup.sweep``) run by
the writing manager after its deletes, holding the dedup lock so that no save picks a
ref to an entry being removed. A crash at any point leaves at worst an entry nothing
names, removed by a later sweep. Manifests first, then the pool: a listed step never
refers to bytes that are gone. Only the writer holding the lease sweeps (checked first,
and before each removal); a step compared with that is no longer listed (deleted, or
dropped by retention) is forgotten at the next save by every process (``start``), so no
process refers to an entry another one swept.

One process or several (each decides for its own runs, process 0 merges their tables:
``table``, ``merge``); peer copies, a persistent tier, per-host directories, compression,
quantized leaves and a staging budget are refused with dedup for now (``make``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from .. import _commit, _distributed, _layout, _manifest, _storage, _streams, _tasks, _tree, _untrusted
from .._errors import CheckpointError
from .._manifest import LeafRecord, Manifest
from .._snapshot import Snapshot, cell_of
from .._storage import kvstore as _kvstore
from .._storage.location import Location
from .._writer import entry_payload, split_rows
from . import lease as _lease
from . import steplist as _steplist

_log = logging.getLogger("jaxckpt")

MAX_BACKOFF = 32  # saves a leaf that keeps changing goes unhashed, at most
HASH_THREADS = 4  # leaves hashed at once (blake3 releases the GIL)
HASH_BYTES = 16


def make(dedup: bool, manager: Any, *, peer_copies: int, persistent: Any, codecs: Any, read_only: bool,
         staging: Any, max_pending: int) -> Dedup | None:
    """A manager's ``Dedup`` (``None`` without ``dedup``); an option it does not support
    yet is refused before anything starts."""
    if dedup is False:
        return None
    if not isinstance(dedup, bool):
        raise ValueError(f"dedup must be True or False, got {dedup!r}")
    if _distributed.process_count() > 1 and max_pending > 1:  # another process's refs are not known here
        raise CheckpointError("dedup=True in a job of several processes saves one step at a time: max_pending=1")
    for name, used in (("peer_copies", peer_copies), ("persistent_directory", persistent is not None),
                       ("compression", getattr(codecs, "compression", None) is not None),
                       ("quantize", getattr(codecs, "quantize", None) is not None), ("read_only", read_only),
                       ("max_staging_bytes", staging is not None)):
        if used:
            raise CheckpointError(f"dedup=True with {name} is not supported yet: pass one or the other")
    return Dedup(manager._dir, weakref.ref(manager))


def content_hash(rec: LeafRecord, chunks: list[tuple[int, Any]]) -> str:
    """blake3 (128 bits, hex) of ``chunks`` (``(flat index, host data)``) as their
    entries' payloads, in chunk order."""
    import blake3  # imported on first use: only dedup saves hash

    h = blake3.blake3()
    for _, data in sorted(chunks, key=lambda c: c[0]):
        h.update(entry_payload(rec, data).reshape(-1).view(np.uint8))
    return h.hexdigest(HASH_BYTES)


class _Held(NamedTuple):
    """One run of a leaf at the step the next save compares with: where its bytes are."""

    ref: _streams.Ref  # the stream that holds them (a pool entry's)
    offset: int
    hash: str | None


class _Leaf(NamedTuple):
    key: tuple[Any, ...]  # what must match: dtype, shape, chunk shape, codec, entry bytes, kind
    runs: dict[tuple[int, int], _Held]  # (first, count) -> where


def _immutable(x: jax.Array) -> bool:
    """Whether ``x``'s bytes are its own: on CPU a ``jax.Array`` may share a numpy buffer
    (``jax.device_put`` and ``from_dlpack`` of aligned host memory are zero-copy) that its
    owner changes in place, so identity proves nothing there: such leaves are hashed."""
    try:
        return all(d.platform != "cpu" for d in x.sharding.device_set)
    except Exception:  # noqa: BLE001 - a deleted or odd array: hashed
        return False


def _leaf_key(rec: LeafRecord) -> tuple[Any, ...]:
    return (rec.kind, rec.dtype, rec.storage_dtype, tuple(rec.shape), tuple(rec.chunk_shape), rec.codec,
            rec.entry_bytes, rec.impl, rec.key_ndim)


def _dedupable(rec: LeafRecord) -> bool:
    return rec.store == _manifest.STREAM and rec.codec == _streams.CODEC_RAW and rec.codec_config is None


def index_of(step: int, man: Manifest) -> dict[str, _Leaf]:
    """Where each run of ``man``'s leaves is (format 4 only: a format-3 step's data is in
    its own directory, which its deletion removes)."""
    if man.format_version != _manifest.DEDUP_VERSION:
        return {}
    out = {}
    pc = man.process_count
    for rec in man.leaves:
        if not _dedupable(rec):
            continue
        runs = {}
        for i, (stream, first, count, offset) in enumerate(rec.runs):
            ref = (_streams.Ref(step, man.pool, stream, man.segment_bytes, man.streams[stream])
                   if stream < pc else man.refs[stream - pc])
            runs[(first, count)] = _Held(ref, offset, rec.hashes[i] if rec.hashes else None)
        out[rec.path] = _Leaf(_leaf_key(rec), runs)
    return out


def pools_of(man: Manifest) -> set[str]:
    """The pool entries a manifest names."""
    if man.format_version != _manifest.DEDUP_VERSION:
        return set()
    return {man.pool, *(r.pool for r in man.refs)}


@dataclasses.dataclass
class _Habit:
    """How a leaf changed at recent saves: hashing a leaf that changes every time is waste."""

    streak: int = 0  # saves in a row its hash changed
    skip: int = 0  # saves left without hashing it
    backoff: int = 1


class Dedup:
    """A writing manager's dedup state: the runs of the last committed step, the arrays
    saved then, the pool entries saves in flight use, and which leaves keep changing."""

    def __init__(self, directory: Location, manager: Callable[[], Any] = lambda: None):
        self.dir = directory
        self._manager = manager  # (a weak reference) its writer lease and the manifests it has read
        self.lock = threading.Lock()
        self.exclusive = threading.Lock()  # a sweep, or a delete (a step renamed aside may be put back)
        self._step: int | None = None  # the step the index describes
        self._index: dict[str, _Leaf] = {}
        self._arrays: tuple[int | None, dict[str, Any]] = (None, {})  # (step, path -> weakref) of the last save
        self._live: dict[str, int] = {}  # pool entry -> saves in flight using it
        self._habits: dict[str, _Habit] = {}
        self._pools: dict[int, set[str]] = {}  # step -> the pool entries its manifest names (read once)
        self._committed = False
        self._gen = 0  # bumped when the index changes (a commit, a sweep that removed entries)
        self._suspect: dict[int, set[str]] = {}  # a step whose manifest fails -> the entries it may name

    # --- a save ------------------------------------------------------------------------

    def start(self, step: int, state: Any, listing: Any, groups: Any = None) -> _Save:
        """The blocking part of ``save(step, state)``: which leaves are the very arrays the
        last save had (cheap: an identity test a leaf). ``listing``: the manager's
        (``tiers.Listing``): its newest step is what the first save compares with."""
        if groups is not None and groups.per_host:
            raise CheckpointError("dedup=True with a directory per host is not supported yet")
        with self.lock:  # the step compared with, unlisted since (deleted, dropped by retention): its
            if self._step not in (None, -1) and self._step not in self.known():  # pools may be gone, in every process
                self._gen += 1
                self._step, self._index, self._arrays = None, {}, (None, {})
        latest = listing.newest_local() if self._step is None else None
        flat, _ = _tree.flatten(state)
        arrays = {p: x for p, x in flat if isinstance(x, jax.Array) and _immutable(x)}
        with self.lock:
            if self._step is None and latest is not None:
                self._step, self._index = latest[0], index_of(*latest)
                self._pools[latest[0]] = pools_of(latest[1])
            last_step, last = self._arrays
            same = {p for p, x in arrays.items() if (r := last.get(p)) is not None and r() is x}
            self._arrays = (step, {p: weakref.ref(x) for p, x in arrays.items()})
        return _Save(self, step, same if last_step is not None else set(), last_step)

    def known(self) -> dict[int, Manifest]:
        """The manifests the manager has read (``steplist.Steps.known``: it wrote or listed them)."""
        mgr = self._manager()
        return mgr._steps.local.known() if mgr is not None and hasattr(mgr, "_steps") else {}

    @property
    def lease(self) -> Any:
        mgr = self._manager()
        return getattr(mgr, "_lease", None)

    def committed(self, step: int, man: Manifest, save: _Save | None) -> bool:
        """``step`` committed (its manifest names what it uses): the next save compares
        with it. Whether it is this manager's first commit."""
        with self.lock:
            self._gen += 1
            self._step, self._index = step, index_of(step, man)
            self._pools[step] = pools_of(man)
            if save is not None:
                save.release_locked()
            first, self._committed = not self._committed, True
            return first

    def distrust(self) -> None:
        """A step failed its read back (``verify_before_delete``): it may have referred to
        damaged bytes, so the next save compares with nothing and writes every leaf."""
        with self.lock:
            self._gen += 1
            self._step, self._index, self._arrays = -1, {}, (None, {})

    def forget(self, step: int) -> None:
        """``step`` deleted: its manifest no longer protects what it names."""
        with self.lock:
            self._pools.pop(step, None)

    # --- mark and sweep ----------------------------------------------------------------

    def sweep(self) -> list[str]:
        """Remove the pool entries no manifest on disk names and no save in flight uses;
        returns their names. A step whose manifest does not validate (damaged, or of a newer
        format) may name any entry that existed when this manager first saw it so: those are
        kept while it stays so (logged once); entries made later are not its. A store that
        fails raises, nothing removed."""
        pool = self.dir.child(_manifest.POOL_DIR)
        with self.exclusive, self.lock:
            entries = [n for n in _kvstore.list_children(pool) if _streams.pool_name_ok(n)]
            if not entries:
                return []
            self._check_lease()  # a writer replaced (stopped, then resumed) must remove nothing
            steps, _ = _commit.listed_steps(self.dir)
            known = self.known()  # the manifests the manager has read (it wrote or listed them)
            for step in steps:
                if step not in self._pools and step in known:
                    self._pools[step] = pools_of(known[step])
            found, bad = _steplist.read(self.dir, [s for s in steps if s not in self._pools])  # a failure raises
            for step in sorted(set(bad) - set(self._suspect)):
                _log.warning("jaxckpt: the manifest of step %d in '%s' does not validate (%s): the %d pool entries "
                             "there now are kept, as it may name them", step, self.dir, bad[step], len(entries))
                self._suspect[step] = set(entries)
            self._suspect = {s: e for s, e in self._suspect.items() if s in bad}
            self._pools.update({s: pools_of(m) for s, m in found.items() if m is not None})
            marked = set(self._live).union(*(self._pools[s] for s in steps if s in self._pools),
                                           *self._suspect.values())
            doomed = sorted(set(entries) - marked)
            for name in doomed:
                _storage.fault("sweep:delete", name)
                if self.lease is not None and self.lease.lost:
                    raise CheckpointError(f"removing unreferenced data in '{self.dir}': {self.lease.lost}")
                _kvstore.delete_tree(pool.child(name))
            if doomed:
                self._gen += 1
                gone = set(doomed)
                self._index = {p: leaf for p, leaf in self._index.items()
                               if not any(h.ref.pool in gone for h in leaf.runs.values())}
            return doomed

    def _check_lease(self) -> None:
        """The writer lease is still this manager's: its holder says so, and the file too
        (a writer stopped past its lease period and resumed learns it here)."""
        lease = self.lease
        if lease is None:
            raise CheckpointError(f"removing unreferenced data in '{self.dir}' needs the writer lease")
        if lease.lost is None:
            holder = _untrusted.load_record(_kvstore.read_blob(lease.directory, _lease.LEASE_FILE))
            if not holder or holder.get("token") != lease.owner["token"]:
                raise CheckpointError(f"removing unreferenced data in '{self.dir}': the writer lease is "
                                      "another writer's now")
        if lease.lost is not None:
            raise CheckpointError(f"removing unreferenced data in '{self.dir}': {lease.lost}")

    def sweep_logged(self) -> None:
        try:
            removed = self.sweep()
        except Exception as e:  # noqa: BLE001 - logged: the entries stay, a later sweep removes them
            _log.warning("jaxckpt: removing unreferenced data in '%s' failed: %s", self.dir, e)
            return
        if removed:
            _log.info("jaxckpt: removed %d pool entries no step refers to in '%s'", len(removed), self.dir)


class _Save:
    """One save's part in dedup: ``_checkpoint.save_snapshot``'s ``dedup``."""

    def __init__(self, owner: Dedup, step: int, same: set[str], same_step: int | None):
        self.owner, self.step, self.same, self.same_step = owner, step, same, same_step
        self.refs: list[_streams.Ref] = []
        self.held: list[str] = []  # pool entries marked live for this save
        self.written = self.referred = self.length = 0  # entry bytes written, referred; own stream's length
        self.runs: dict[int, list[tuple[int, int, int, int]]] = {}  # slot -> this process's runs, decided
        self.hashes: dict[int, dict[tuple[int, int], str]] = {}  # slot -> (first, count) -> hash

    def location(self, final: Location, token: str) -> Location:
        """Where this save's data objects go: its pool entry."""
        loc = _manifest.pool_location(final.parent(), token)
        with self.owner.lock:
            self._hold_locked([token])
        if loc.local is not None:
            os.makedirs(loc.local, exist_ok=True)
        return loc

    def _hold_locked(self, pools: list[str]) -> None:
        for p in pools:
            self.owner._live[p] = self.owner._live.get(p, 0) + 1
            self.held.append(p)

    def release_locked(self) -> None:
        live = self.owner._live
        for p in self.held:
            live[p] -= 1
            if not live[p]:
                del live[p]
        self.held = []

    def release(self) -> None:
        with self.owner.lock:
            self.release_locked()

    def apply(self, snap: Snapshot, token: str) -> Snapshot:
        """The snapshot with each run whose bytes a retained step holds referring to them,
        the others laid out again in this process's stream, and each run's hash."""
        if snap.streams is None or snap.waves is not None:
            raise CheckpointError("dedup=True needs format 3 and no max_staging_bytes (not supported yet)")
        owner = self.owner
        with owner.lock:
            index, index_step, gen = dict(owner._index), owner._step, owner._gen
            identical = self.same if self.same_step == index_step else set()
        records = list(snap.records)
        shards = dict(snap.file_shards)
        chosen: dict[int, list[tuple[_Held, ...]] | None] = {}
        hashes: dict[int, tuple[str, ...]] = {}

        def decide(slot: int, rec: LeafRecord) -> None:
            held, own = self._decide(rec, index.get(rec.path), rec.path in identical, shards[slot])
            if held is not None:
                chosen[slot] = held
            if own:
                hashes[slot] = own

        _tasks.run_tasks([functools.partial(decide, slot, rec) for slot, rec in enumerate(records)
                          if rec is not None and _dedupable(rec) and slot in shards], HASH_THREADS)
        paths = {rec.path for rec in records if rec is not None}
        with owner.lock:  # a leaf no longer saved: its habit goes (bounded by the state's leaves)
            owner._habits = {p: h for p, h in owner._habits.items() if p in paths}
        with owner.lock:
            if owner._gen != gen:  # a commit or a sweep moved the index: keep only what still holds
                alive = {h.ref.pool for leaf in owner._index.values() for h in leaf.runs.values()}
                chosen = {s: hs for s, hs in chosen.items() if all(h.ref.pool in alive for h in hs)}
            self._hold_locked(sorted({h.ref.pool for hs in chosen.values() for h in hs}))
        return self._lay_out(snap, records, shards, chosen, hashes)

    def _decide(self, rec: LeafRecord, prev: _Leaf | None, identical: bool,
                pieces: list[tuple[_layout.Index, Any]]) -> tuple[tuple[_Held, ...] | None, tuple[str, ...]]:
        """For one leaf: where its runs' bytes already are (``None``: to write), and the
        hashes to record for it (empty: none)."""
        me = _distributed.process_index()
        habit = self.owner._habits.setdefault(rec.path, _Habit())
        matches = prev is not None and prev.key == _leaf_key(rec) and all(
            (first, count) in prev.runs for p, first, count, _ in rec.runs if p == me)
        mine = [(first, count) for p, first, count, _ in rec.runs if p == me]
        if matches and identical:
            held = tuple(prev.runs[fc] for fc in mine)
            habit.streak = 0
            return held, tuple(h.hash for h in held) if all(h.hash for h in held) else ()
        if habit.skip > 0:
            habit.skip -= 1
            return None, ()
        grid = _layout.chunk_grid_shape(rec.shape, rec.chunk_shape)
        by_flat = {_layout.chunk_flat_index(cell_of(region, rec.chunk_shape), grid): data
                   for region, data in split_rows(rec, pieces)}
        got = tuple(content_hash(rec, [(f, by_flat[f]) for f in range(first, first + count)])
                    for first, count in mine)
        if matches and all(prev.runs[fc].hash == h for fc, h in zip(mine, got)):
            habit.streak, habit.backoff = 0, 1
            return tuple(prev.runs[fc] for fc in mine), got
        if matches and all(prev.runs[fc].hash for fc in mine):  # compared, and changed: trained
            habit.streak += 1
            habit.skip, habit.backoff = habit.backoff, min(2 * habit.backoff, MAX_BACKOFF)
        return None, got

    def _lay_out(self, snap: Snapshot, records: list[Any], shards: dict[int, Any],
                 chosen: dict[int, Any], hashes: dict[int, tuple[str, ...]]) -> Snapshot:
        """Referred leaves' runs point at their streams (one ref a stream, ids from
        ``process_count``), the others are packed again one after the other in this
        process's stream; what this process decided is kept for process 0 (``table``)."""
        me, pc = _distributed.process_index(), _distributed.process_count()
        ids: dict[tuple[str, int], int] = {}
        at = 0
        for slot, rec in enumerate(records):
            if rec is None or rec.kind == "value" or rec.store != _manifest.STREAM:
                continue
            held, stride = chosen.get(slot), _streams.stride_for(rec.entry_bytes)
            mine = [r for r in rec.runs if r[0] == me]
            runs = [r for r in rec.runs if r[0] != me]
            own = []
            for k, (_, first, count, _) in enumerate(mine):
                span = (count - 1) * stride + rec.entry_bytes
                if held is not None:
                    h = held[k]
                    if (key := (h.ref.pool, h.ref.process)) not in ids:
                        ids[key] = pc + len(self.refs)
                        self.refs.append(h.ref)
                    own.append((ids[key], first, count, h.offset))
                    self.referred += count * rec.entry_bytes
                else:
                    at = _streams.stride_for(at)
                    own.append((me, first, count, at))
                    at += span
                    self.written += count * rec.entry_bytes
            self.runs[slot] = own
            if slot in hashes:
                self.hashes[slot] = {(first, count): h for (_, first, count, _), h in zip(mine, hashes[slot])}
            records[slot] = dataclasses.replace(rec, runs=tuple(sorted(runs + own, key=lambda r: r[1])))
            if held is not None:
                shards.pop(slot, None)
        self.length = at
        streams = {p: n for p, n in snap.streams.items() if p != me}
        if at:
            streams[me] = at
        return dataclasses.replace(snap, records=records, file_shards=shards, streams=streams)

    def table(self) -> bytes:
        """What this process decided, for process 0's manifest (``merge``)."""
        return json.dumps({"runs": {str(s): r for s, r in self.runs.items()},
                           "hashes": {str(s): [[f, c, h] for (f, c), h in m.items()] for s, m in self.hashes.items()},
                           "refs": [r._asdict() for r in self.refs], "length": self.length,
                           "written": self.written, "referred": self.referred}).encode()

    def merge(self, snap: Snapshot, tables: dict[int, bytes]) -> Snapshot:
        """Process 0, once every process wrote: each one's runs (its refs renumbered into
        one list), stream lengths and hashes in the snapshot it writes the manifest of."""
        pc = _distributed.process_count()
        records, streams = list(snap.records), dict(snap.streams or {})
        ids = {(r.pool, r.process): pc + i for i, r in enumerate(self.refs)}
        hashes = {s: dict(m) for s, m in self.hashes.items()}
        for p, raw in sorted(tables.items()):
            if p == _distributed.process_index() or not raw:
                continue
            part = json.loads(raw)
            local = []
            for r in part["refs"]:
                ref = _streams.Ref(**r)
                if (key := (ref.pool, ref.process)) not in ids:
                    ids[key] = pc + len(self.refs)
                    self.refs.append(ref)
                local.append(ids[key])
            for slot, own in part["runs"].items():
                rec = records[int(slot)]
                new = [(s if s < pc else local[s - pc], f, c, o) for s, f, c, o in own]
                records[int(slot)] = dataclasses.replace(
                    rec, runs=tuple(sorted([r for r in rec.runs if r[0] != p] + new, key=lambda r: r[1])))
            for slot, rows in part["hashes"].items():
                hashes.setdefault(int(slot), {}).update({(f, c): h for f, c, h in rows})
            streams.pop(p, None)
            if part["length"]:
                streams[p] = part["length"]
            self.written += part["written"]
            self.referred += part["referred"]
        for slot, m in hashes.items():  # a leaf's hashes: one per run, or none
            rec = records[slot]
            if all((f, c) in m for _, f, c, _ in rec.runs):
                records[slot] = dataclasses.replace(rec, hashes=tuple(m[f, c] for _, f, c, _ in rec.runs))
        return dataclasses.replace(snap, records=records, streams=streams)

    def finish(self, man: Manifest, token: str) -> Manifest:
        """The manifest as format 4: its data in pool entry ``token``, its refs."""
        info = {**man.info, "dedup": {"written_bytes": self.written, "referred_bytes": self.referred,
                                      "referred_steps": sorted({r.step for r in self.refs})}}
        return dataclasses.replace(man, format_version=_manifest.DEDUP_VERSION, data="", pool=token,
                                   refs=tuple(self.refs), info=info)

    def abort(self, final: Location, staging: Location, token: str) -> None:
        """A failed save: what ``_commit.abort`` removes, and its pool entry unless the
        manifest at ``final`` names it (a commit that reported an error may have landed)."""
        try:
            _commit.abort(final, staging, token)
            man = _commit.manifest_if_any(final)
            if man is None or man.pool != token:
                _kvstore.delete_tree(_manifest.pool_location(final.parent(), token))
        except Exception as e:  # noqa: BLE001 - best effort: the save's own error is what matters
            _log.warning("jaxckpt: removing the pool entry of a failed save to '%s' failed: %s", final, e)
        finally:
            self.release()
