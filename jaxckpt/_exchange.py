"""Read once per job: a slice that several processes need is read from storage by one
of them and handed to the others over the devices' collectives.

A data-parallel restore has every replica of a leaf in a different process. Read
naively, N replicas read the same bytes N times: a bucket serving a thousand hosts
serves each replicated byte a thousand times. Here the slices the target needs are
known in every process from the target shardings alone (``_layout.shards_of``), so
every process computes the same plan without talking:

1. every distinct slice held by several processes, or touching a saved chunk that a
   slice of another process touches (a layout that cuts across the saved chunks), is
   cut at the saved chunk boundaries into *pieces* (a chunk is the unit storage reads
   and checksums);
2. each piece goes to one of the processes that need it, balanced by bytes on top of
   what each process reads for itself (``_layout.assign_with_loads``, as the save
   balances its writers);
3. each process reads its own slices and its pieces, then posts whether that worked
   (``_distributed.Operation``): a failed or dead reader fails the restore in every
   process instead of leaving the others in a collective that never ends;
4. the pieces go to every process in one all-gather per wave (one device per process,
   a jitted reshard from "one row per process" to "replicated"; gloo on CPU, NCCL on
   GPU), and each process assembles the slices it needs from them.

If the collective itself fails (a multi-process CPU job without
``jax_cpu_collectives_implementation``), every process reads what it lacks from
storage instead, and says so in a warning.

When: ``JAXCKPT_READ_ONCE`` (``READ_ONCE``) is ``auto`` by default: on for object
stores, off for local paths, where the processes of one host share its page cache and
reading again is cheaper than the exchange (measured in ``benchmarks/read_once.py``);
``1`` always (a cluster file system many hosts read), ``0`` never.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import time
from typing import Any, NamedTuple

import jax
import numpy as np

from . import _chunkfiles, _distributed, _dtypes, _layout, _tasks
from ._location import Location
from ._manifest import LeafRecord

_log = logging.getLogger("jaxckpt")

# "auto": on for object stores (every byte read is a request to a service that every
# host shares), off for local paths (processes on one host share its page cache, where
# reading is cheaper than the exchange); "1": always; "0": never.
READ_ONCE = os.environ.get("JAXCKPT_READ_ONCE", "auto")
SLICE_BALANCE = 1.1
VIEW_SHARE = 0.75  # see ReadOnce._exchange
# How long a process that has read its part waits for a peer that has not started the
# restore (processes reach a restore at different times: one may load data first). A
# peer inside the restore is waited for while it heartbeats; a dead one fails it after
# ``_distributed.STALE_S``.
START_TIMEOUT_S = 300.0
WAVE_BYTES = 512 << 20  # bytes gathered per collective (bounds the transient buffers)
_ALIGN = 64  # pieces start 64-byte aligned in the gathered rows (zero-copy placement on CPU)


class Piece(NamedTuple):
    """Part of a shared slice inside one saved chunk, read by process ``reader``."""

    path: str
    index: _layout.Index
    nbytes: int
    reader: int


class SharedSlice(NamedTuple):
    rec: LeafRecord
    index: _layout.Index
    processes: tuple[int, ...]


def applies(global_requests: int, loc: Location) -> bool:
    """Whether a restore from ``loc`` with ``global_requests`` leaves placed on shardings
    that span processes exchanges pieces (the same answer in every process)."""
    if global_requests == 0 or _distributed.process_count() == 1:
        return False
    mode = READ_ONCE
    return mode == "1" or (mode == "auto" and loc.local is None)


def plan_pieces(shared: list[SharedSlice], load: dict[int, int], chunked: bool,
                packed_chunks: dict[int, int] | None = None, nproc: int = 0) -> list[list[Piece]]:
    """The pieces of each shared slice, each assigned a reader. ``load``: the bytes
    each process reads for itself already (updated); ``nproc``: the processes of the
    job (default: those named in ``shared`` and ``load``).

    A saved chunk is read whole (its checksum covers all of it), so everything needed
    from one chunk goes to one reader: slices that share a chunk (column blocks of a
    row-chunked leaf) form one unit. Whole slices are assigned (a slice then arrives in
    one piece and is placed without a copy) when that keeps the busiest reader within
    ``SLICE_BALANCE`` of the average; otherwise, with ``chunked`` (jaxckpt's format;
    other formats' slices are never cut), pieces cut at the saved chunk boundaries are
    balanced too, and win unless whole slices are within ``SLICE_BALANCE`` of them.
    Small leaves share the stored chunks of their packed array (``packed_chunks``: each
    packed array's chunk size by saving process): those chunks are the units for them.
    """
    units = _Units(shared, chunked, packed_chunks or {})
    nproc = nproc or len(set(load) | {p for s in shared for p in s.processes})
    best, loads = _assign(shared, units.whole(), dict(load))
    if chunked and max(loads.values()) > SLICE_BALANCE * sum(loads.values()) / max(nproc, 1):
        cut, cut_loads = _assign(shared, units.chunks(), dict(load))
        if max(loads.values()) > SLICE_BALANCE * max(cut_loads.values()):
            best, loads = cut, cut_loads
    load.update(loads)
    return best


class _Units:
    """The two ways to group ``shared`` into units of reading (see ``plan_pieces``)."""

    def __init__(self, shared: list[SharedSlice], chunked: bool, packed_chunks: dict[int, int]):
        self.shared, self.chunked, self.packed_chunks = shared, chunked, packed_chunks

    def _unit(self, rec: Any, cell: Any) -> tuple[Any, ...]:
        if rec.store != "packed":
            return (rec.path, cell)
        grid = _layout.chunk_grid_shape(rec.shape, rec.chunk_shape)
        proc, offset = rec.chunks[min(_layout.chunk_flat_index(cell, grid), len(rec.chunks) - 1)]
        return ("packed", proc, offset // self.packed_chunks.get(proc, 1 << 62))

    def whole(self) -> list[list[tuple[int, _layout.Index]]]:
        """Whole slices, those sharing a saved chunk together (union-find). A file-store
        slice that is a union of whole chunks shares none and is not walked."""
        owner = list(range(len(self.shared)))

        def root(i: int) -> int:
            while owner[i] != i:
                owner[i] = owner[owner[i]]
                i = owner[i]
            return i

        first: dict[tuple[Any, ...], int] = {}
        for i, s in enumerate(self.shared):
            rec = s.rec
            if not self.chunked or (rec.store != "packed"
                                    and _aligned(s.index, rec.chunk_shape, rec.shape)):
                continue
            for cell, _ in _layout.chunks_overlapping(s.index, rec.chunk_shape):
                j = first.setdefault(self._unit(rec, cell), i)
                owner[root(i)] = root(j)
        groups: dict[int, list[tuple[int, _layout.Index]]] = {}
        for i, s in enumerate(self.shared):
            groups.setdefault(root(i), []).append((i, s.index))
        return list(groups.values())

    def chunks(self) -> list[list[tuple[int, _layout.Index]]]:
        """Pieces cut at the saved chunk boundaries, one unit per stored chunk."""
        by_chunk: dict[tuple[Any, ...], list[tuple[int, _layout.Index]]] = {}
        for i, s in enumerate(self.shared):
            for cell, idx in _layout.chunks_overlapping(s.index, s.rec.chunk_shape):
                by_chunk.setdefault(self._unit(s.rec, cell), []).append((i, idx))
        return list(by_chunk.values())


def _assign(shared: list[SharedSlice], units: list[list[tuple[int, _layout.Index]]],
            loads: dict[int, int]) -> tuple[list[list[Piece]], dict[int, int]]:
    """One reader per unit (a list of (slice number, piece index)), balanced over the
    processes that need all of its slices (or any that needs one, if none needs all)."""
    weights = []
    for unit in units:
        if len(unit) == 1:
            i, idx = unit[0]
            weights.append((_nbytes(shared[i].rec, idx), shared[i].processes))
            continue
        needs = [set(shared[i].processes) for i, _ in unit]
        holders = set.intersection(*needs) or set.union(*needs)
        weights.append((sum(_nbytes(shared[i].rec, idx) for i, idx in unit), sorted(holders)))
    out: list[list[Piece]] = [[] for _ in shared]
    for unit, reader in zip(units, _layout.assign_with_loads(weights, loads)):
        for i, idx in unit:
            out[i].append(Piece(shared[i].rec.path, idx, _nbytes(shared[i].rec, idx), reader))
    return out, loads


def _nbytes(rec: LeafRecord, index: _layout.Index) -> int:
    return _layout.index_size(index) * _dtypes.DTYPES[rec.storage_dtype].itemsize


@functools.lru_cache(maxsize=1024)
def _leaf_plan(sharding: Any, shape: tuple[int, ...], chunk_shape: tuple[int, ...], itemsize: int, chunked: bool,
               me: int) -> tuple[tuple[tuple[_layout.Index, tuple[int, ...]], ...], tuple[tuple[int, int], ...],
                                 tuple[_layout.Index, ...]]:
    """What ``ReadOnce.add_global`` needs of a kind of leaf (the same for every leaf of
    that sharding, shape and chunking; a 70B-shaped state has a few dozen kinds): the
    exchanged slices with their holders, the bytes each process reads for itself, and
    the slices process ``me`` reads for itself."""
    shards = _layout.shards_of(sharding, shape)
    crossing = _crossing(shards, shape, chunk_shape) if chunked else set()
    shared, load, local = [], collections.Counter(), []
    for k, shard in enumerate(shards):
        if len(shard.processes) == 1 and k not in crossing:
            load[shard.processes[0]] += _layout.index_size(shard.index) * itemsize
            if shard.processes[0] == me:
                local.append(shard.index)
        else:
            shared.append((shard.index, shard.processes))
    return tuple(shared), tuple(sorted(load.items())), tuple(local)


def _aligned(index: _layout.Index, chunk_shape: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """Whether ``index`` is a union of whole saved chunks (then no other slice touches
    any chunk it touches)."""
    return all(a % c == 0 and (b % c == 0 or b == n) for (a, b), c, n in zip(index, chunk_shape, shape))


def _crossing(shards: Any, shape: tuple[int, ...], chunk_shape: tuple[int, ...]) -> set[int]:
    """The positions in ``shards`` of the slices that touch a saved chunk some slice
    held by another process touches too."""
    if all(_aligned(shard.index, chunk_shape, shape) for shard in shards):
        return set()  # the usual case: the target cuts along saved chunk boundaries
    touched: dict[tuple[int, ...], set[int]] = {}
    cells = []
    for shard in shards:
        cells.append([cell for cell, _ in _layout.chunks_overlapping(shard.index, chunk_shape)])
        for cell in cells[-1]:
            touched.setdefault(cell, set()).update(shard.processes)
    return {k for k, cs in enumerate(cells) if any(len(touched[c]) > 1 for c in cs)}


def waves(pieces: list[Piece], budget: int = 0) -> list[list[Piece]]:
    """``pieces`` (in plan order) in consecutive groups of about ``budget`` bytes."""
    return _tasks.batches(pieces, budget or WAVE_BYTES)


def _padded(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class ReadOnce:
    """A reader (``_sources.ReaderLike``) that reads shared slices once per job.

    ``add`` a slice only this process needs; ``add_global`` a leaf placed on a sharding
    that spans processes (in the same order in every process). ``run`` then reads,
    agrees and exchanges; ``get`` returns any slice added either way.
    """

    def __init__(self, new_reader: Any, where: str, chunked: bool):
        self.new_reader, self.where, self.chunked = new_reader, where, chunked
        self.inner = new_reader()
        self.me = _distributed.process_index()
        self.load: dict[int, int] = {}
        self.shared: list[SharedSlice] = []
        self.needed: set[tuple[str, _layout.Index]] = set()
        self.records: dict[str, LeafRecord] = {}
        self.out: dict[tuple[str, _layout.Index], np.ndarray] = {}

    def add(self, rec: LeafRecord, index: _layout.Index) -> None:
        self.inner.add(rec, index)

    def add_global(self, rec: LeafRecord, sharding: Any, mine: set[_layout.Index]) -> None:
        """Plan ``rec`` placed on ``sharding`` (``mine``: the slices this process's
        devices hold). A slice is exchanged when several processes hold it, or when it
        touches a saved chunk that another process's slice touches too (a restore onto
        a layout that cuts across the saved chunks: each chunk is then read once per
        job, not once per process that needs part of it)."""
        itemsize = _dtypes.DTYPES[rec.storage_dtype].itemsize
        self.records[rec.path] = rec
        shared, load, local = _leaf_plan(sharding, rec.shape, rec.chunk_shape, itemsize, self.chunked, self.me)
        for p, nbytes in load:
            self.load[p] = self.load.get(p, 0) + nbytes
        for index in local:
            self.inner.add(rec, index)
        for index, processes in shared:
            self.shared.append(SharedSlice(rec, index, processes))
            if index in mine:
                self.needed.add((rec.path, index))

    def get(self, rec: LeafRecord, index: _layout.Index) -> np.ndarray:
        got = self.out.get((rec.path, index))
        if got is None:
            return self.inner.get(rec, index)
        saved = _dtypes.DTYPES[rec.dtype]
        return got if got.dtype == saved else got.view(saved)

    def run(self) -> None:
        if not self.shared:
            self.inner.run()
            return
        packed = {p.process: p.chunk_bytes for p in getattr(getattr(self.inner, "man", None), "packed", ())}
        plan = plan_pieces(self.shared, self.load, self.chunked, packed, _distributed.process_count())
        for s, pieces in zip(self.shared, plan):
            for p in pieces:
                if p.reader == self.me:
                    self.inner.add(s.rec, p.index)
        t0 = time.perf_counter()
        op = _distributed.Operation(f"restore{_distributed.next_id()}", self.where, START_TIMEOUT_S,
                                    lane="restore")
        with op:
            try:
                self.inner.run()
            except BaseException as e:
                op.post("read", e)  # the others fail too, instead of waiting in the collective
                raise
            others = [p for p in range(_distributed.process_count()) if p != self.me]
            op.post("read")
            op.wait_for("read", others)
            # A second round before the collective: a process that gave up waiting for a
            # late peer (after posting "read") never posts "go", so the late one fails
            # here too instead of entering the all-gather alone.
            op.post("go")
            op.wait_for("go", others)
        t1 = time.perf_counter()
        try:
            self._exchange(plan)
        except Exception as e:  # noqa: BLE001 - every process fails alike: read from storage instead
            _log.warning("jaxckpt: '%s': exchanging replicated slices between processes failed (%s); "
                         "every process reads them from storage", self.where, e)
            self.out.clear()
            self._read_the_rest()
            return
        _log.debug("jaxckpt: '%s': read %.3f s (with the agreement), exchange and assembly %.3f s",
                   self.where, t1 - t0, time.perf_counter() - t1)

    def _exchange(self, plan: list[list[Piece]]) -> None:
        """One all-gather per wave. Each wave's pieces go into the slices this process
        needs before the next wave is gathered, so at most one wave's buffer is alive
        beyond the slices; a slice that arrived in one piece stays a view of that buffer
        only when this process needs most of the wave (``VIEW_SHARE``), else it is copied
        out and the buffer freed."""
        owner = {(p.path, p.index): i for i, pieces in enumerate(plan) for p in pieces}
        for wave in waves([p for pieces in plan for p in pieces]):
            parts = self._gather(wave)
            mine = sum(p.nbytes for p in wave if self._key(owner[(p.path, p.index)]) in self.needed)
            view_ok = mine >= VIEW_SHARE * sum(p.nbytes for p in wave)
            for p, data in zip(wave, parts):
                self._put(owner[(p.path, p.index)], len(plan[owner[(p.path, p.index)]]), p, data, view_ok)

    def _key(self, i: int) -> tuple[str, _layout.Index]:
        return self.shared[i].rec.path, self.shared[i].index

    def _gather(self, wave: list[Piece]) -> list[np.ndarray]:
        """The bytes of every piece of ``wave``, in every process."""
        nproc = _distributed.process_count()
        lengths = [0] * nproc
        for p in wave:
            lengths[p.reader] += _padded(p.nbytes)
        row = np.zeros((1, row_width(lengths)), np.uint8)
        at = 0
        for p in wave:
            if p.reader == self.me:
                data = np.ascontiguousarray(self.inner.get(self.records[p.path], p.index)).reshape(-1)
                row[0, at:at + p.nbytes] = data.view(np.uint8)
                at += _padded(p.nbytes)
        rows = all_gather(row, lengths)
        offsets, parts = [0] * nproc, []
        for p in wave:
            at = offsets[p.reader]
            parts.append(rows[p.reader][at:at + p.nbytes])
            offsets[p.reader] = at + _padded(p.nbytes)
        return parts

    def _put(self, i: int, npieces: int, piece: Piece, data: np.ndarray, view_ok: bool) -> None:
        """Piece ``piece`` of shared slice ``i`` (of ``npieces``) into that slice, if
        this process needs it."""
        key = self._key(i)
        if key not in self.needed:
            return
        s = self.shared[i]
        storage = _dtypes.DTYPES[s.rec.storage_dtype]
        part = data.view(storage).reshape(_layout.index_shape(piece.index))
        if npieces == 1 and piece.index == s.index:
            self.out[key] = part if view_ok else _copy_aligned(part)
            return
        if key not in self.out:
            self.out[key] = _chunkfiles.aligned_empty(_layout.index_shape(s.index), storage)
        self.out[key][_layout.relative(piece.index, s.index)] = part

    def _read_the_rest(self) -> None:
        """The fallback: read every needed shared slice from storage in this process."""
        wanted = [s for s in self.shared if (s.rec.path, s.index) in self.needed]
        if not wanted:
            return
        reader = self.new_reader()
        for s in wanted:
            reader.add(s.rec, s.index)
        reader.run()
        for s in wanted:
            storage = _dtypes.DTYPES[s.rec.storage_dtype]
            self.out[(s.rec.path, s.index)] = reader.get(s.rec, s.index).view(storage)


def _copy_aligned(x: np.ndarray) -> np.ndarray:
    out = _chunkfiles.aligned_empty(x.shape, x.dtype)
    out[...] = x
    return out


def all_gather(row: np.ndarray, lengths: list[int]) -> list[np.ndarray]:
    """Each process's ``row`` (uint8, shape ``(1, row_width(lengths))``, its first
    ``lengths[p]`` bytes meaningful in process p) in every process: one jitted reshard
    over one device per process."""
    devices = _one_device_per_process()
    mesh = jax.sharding.Mesh(np.array(devices), ("p",))
    spread = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("p"))
    local = jax.device_put(row, devices[_distributed.process_index()])
    arr = jax.make_array_from_single_device_arrays((len(devices), row.shape[1]), spread, [local])
    out = _replicate(mesh)(arr)
    host = np.asarray(out.addressable_data(0))
    return [host[p, :n] for p, n in enumerate(lengths)]


def _one_device_per_process() -> list[Any]:
    first: dict[int, Any] = {}
    for d in sorted(jax.devices(), key=lambda d: d.id):
        first.setdefault(d.process_index, d)
    return [first[p] for p in sorted(first)]


def row_width(lengths: list[int]) -> int:
    """The longest of ``lengths`` rounded up to 4 significant bits (at most 12.5% more),
    so that few distinct shapes are compiled over many restores."""
    n = max(max(lengths), 4096)
    step = 1 << max(n.bit_length() - 4, 0)
    return -(-n // step) * step


@functools.lru_cache(maxsize=8)
def _replicate(mesh: Any) -> Any:
    everywhere = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.jit(lambda x: x, out_shardings=everywhere)
