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
4. the pieces go to every process in all-gathers (one device per process, a jitted
   reshard from "one row per process" to "replicated"; gloo on CPU, NCCL on GPU), in
   *waves* (``plan_waves``), and each process assembles the slices it needs from them.

Before reading, every process posts a digest of its plan (``plan_digest``: the shared
slices, the pieces with their readers, the waves) and compares it with everyone's.
The plan is a function of global facts, so the digests agree; if they do not (the
processes were given different leaves or shardings, or different settings), every
process raises a ``CheckpointError`` naming the processes that differ, instead of
exchanging another leaf's bytes.

Memory: the all-gather pads every process's row to the longest, so a wave gathers
``nproc`` times its longest row. A wave's rows are therefore capped per reader, not
in total: with ``w = row_cap(nproc, WAVE_BYTES)``, the largest row width with
``(nproc + 2) * w <= WAVE_BYTES``, a process holds per wave its own row (on host and
on its device) and the ``nproc`` gathered rows: at most ``WAVE_BYTES`` in all on CPU
(where device memory is host memory), and at most ``WAVE_BYTES`` of device memory and
of host memory each on an accelerator, whatever the number of processes (when
``WAVE_BYTES < (nproc + 2) * 4096``, the smallest row, ``(nproc + 2) * 4096``). A
piece larger than ``w`` is sent in blocks (rows, or parts of one row, of the piece:
each a contiguous run of its bytes) over several waves; its reader holds the piece,
read whole, as it holds everything it reads (a slice it read whole is placed from
that copy, not from the waves). Each wave takes from every reader's queue up to ``w``
bytes, so the rows are balanced and the number of waves is set by the busiest reader.
Beyond the waves a process holds what it reads and the slices it needs; a slice
placed as a view of a wave's gathered rows keeps them alive only when this process
needs ``VIEW_SHARE`` of that wave's bytes.

If the collective itself fails (a multi-process CPU job without
``jax_cpu_collectives_implementation``), every process reads what it lacks from
storage instead, and says so in a warning.

When: ``JAXCKPT_READ_ONCE``, read at each restore, is ``auto`` by default: on for
object stores, off for local paths, where the processes of one host share its page
cache and reading again is cheaper than the exchange (measured in
``benchmarks/read_once.py``); ``1`` always (a cluster file system many hosts read),
``0`` never. ``READ_ONCE``, when set (tests), overrides it.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import logging
import os
import time
from typing import Any, NamedTuple

import jax
import numpy as np

from . import _distributed, _dtypes, _layout
from ._errors import CheckpointError
from ._manifest import LeafRecord
from ._storage import chunkfiles as _chunkfiles
from ._storage.location import Location

_log = logging.getLogger("jaxckpt")

# JAXCKPT_READ_ONCE: "auto" (the default): on for object stores (every byte read is a
# request to a service that every host shares), off for local paths (processes on one
# host share its page cache, where reading is cheaper than the exchange); "1": always;
# "0": never. Read at each restore (a library reads the environment when it is asked,
# not when it is imported); READ_ONCE, when not None, overrides it (tests).
READ_ONCE: str | None = None
_MODES = ("auto", "1", "0")
SLICE_BALANCE = 1.1
VIEW_SHARE = 0.75  # see ReadOnce._exchange
# How long a process that has read its part waits for a peer that has not started the
# restore (processes reach a restore at different times: one may load data first). A
# peer inside the restore is waited for while it heartbeats; a dead one fails it after
# ``_distributed.STALE_S``.
START_TIMEOUT_S = 300.0
WAVE_BYTES = 512 << 20  # a wave's buffers in each process, gathered rows included (see above)
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
    mode = read_once_mode()
    return mode == "1" or (mode == "auto" and loc.local is None)


def read_once_mode() -> str:
    """``READ_ONCE`` if set, else ``JAXCKPT_READ_ONCE`` as it is now (default ``auto``)."""
    mode = READ_ONCE if READ_ONCE is not None else os.environ.get("JAXCKPT_READ_ONCE", "auto")
    if mode not in _MODES:
        raise ValueError(f"JAXCKPT_READ_ONCE={mode!r}: expected one of {', '.join(_MODES)}")
    return mode


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


class Part(NamedTuple):
    """What a reader sends in one wave: block ``index`` of ``piece`` (all of it, unless
    the piece is larger than a row), a piece of shared slice number ``slice_no``."""

    slice_no: int
    piece: Piece
    index: _layout.Index
    nbytes: int


def row_cap(nproc: int, budget: int) -> int:
    """The widest row a wave may gather from each of ``nproc`` processes: the largest
    width that ``row_width`` keeps (so no wave's row rounds up past it) with the
    process's own row on host and device plus the ``nproc`` gathered rows within
    ``budget``; 4096 at least (the narrowest row)."""
    fits = budget // (nproc + 2)
    if fits <= 4096:
        return 4096
    step = 1 << max(fits.bit_length() - 4, 0)  # row_width's grid at this size
    return fits // step * step


def plan_waves(shared: list[SharedSlice], plan: list[list[Piece]], nproc: int, budget: int = 0) -> list[list[Part]]:
    """The waves of the exchange: each reader's pieces (in plan order) cut into blocks of
    at most ``row_cap`` bytes, each wave taking up to that many bytes from every reader
    (see the module docstring for the bound this keeps)."""
    cap = row_cap(nproc, budget or WAVE_BYTES)
    queues: list[collections.deque[Part]] = [collections.deque() for _ in range(nproc)]
    for i, pieces in enumerate(plan):
        itemsize = _dtypes.DTYPES[shared[i].rec.storage_dtype].itemsize
        for piece in pieces:
            for index in blocks(piece.index, itemsize, cap):
                queues[piece.reader].append(Part(i, piece, index, _layout.index_size(index) * itemsize))
    out = []
    while any(queues):
        wave = []
        for queue in queues:
            used = 0
            while queue and used + _padded(queue[0].nbytes) <= cap:
                used += _padded(queue[0].nbytes)
                wave.append(queue.popleft())
        out.append(wave)
    return out


def blocks(index: _layout.Index, itemsize: int, cap: int) -> list[_layout.Index]:
    """``index`` cut into blocks of at most ``cap`` bytes (``cap`` >= ``itemsize``): runs
    of whole rows along its first dimension, or, where one row is larger, blocks of each
    row cut the same way along the next. Each block is a contiguous run of the C-order
    bytes of ``index``, so a reader copies it out of the piece it read whole."""
    if _layout.index_size(index) * itemsize <= cap:
        return [index]
    (a, b), rest = index[0], index[1:]
    row = _layout.index_size(rest) * itemsize
    if row <= cap:
        k = cap // row
        return [((i, min(i + k, b)),) + rest for i in range(a, b, k)]
    return [((i, i + 1),) + sub for i in range(a, b) for sub in blocks(rest, itemsize, cap)]


def plan_digest(shared: list[SharedSlice], waves: list[list[Part]]) -> str:
    """A digest of everything the processes must agree on: the shared slices with their
    holders, and what each wave carries from which reader (pieces, blocks, order)."""
    h = hashlib.sha256()
    for s in shared:
        h.update(repr((s.rec.path, s.rec.storage_dtype, s.index, s.processes)).encode())
    h.update(b"|")
    for wave in waves:
        h.update(repr([(p.slice_no, p.piece.index, p.piece.reader, p.index) for p in wave]).encode())
        h.update(b";")
    return h.hexdigest()


def plan_mismatch(digests: dict[int, bytes]) -> str:
    """'' when every process posted the same digest, else which processes differ from
    process 0 (the same text in every process: each sees every digest)."""
    ref = digests[0]
    differ = [p for p in sorted(digests) if digests[p] != ref]
    if not differ:
        return ""
    groups: dict[bytes, list[int]] = {}
    for p in sorted(digests):
        groups.setdefault(digests[p], []).append(p)
    detail = "; ".join(f"process{'es' if len(ps) > 1 else ''} {', '.join(map(str, ps))}: {d[:12].decode()}"
                       for d, ps in groups.items())
    return (f"process{'es' if len(differ) > 1 else ''} {', '.join(map(str, differ))} planned a different "
            f"exchange than process 0 ({detail})")


def _padded(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class ReadOnce:
    """A reader (``_formats.ReaderLike``) that reads shared slices once per job.

    ``add`` a slice only this process needs; ``add_global`` a leaf placed on a sharding
    that spans processes (in the same order in every process). ``run`` then plans,
    checks that every process planned the same, reads, agrees and exchanges; ``get``
    returns any slice added either way.
    """

    def __init__(self, new_reader: Any, where: str, chunked: bool):
        self.new_reader, self.where, self.chunked = new_reader, where, chunked
        self.inner = new_reader()
        self.me = _distributed.process_index()
        self.load: dict[int, int] = {}
        self.shared: list[SharedSlice] = []
        self.needed: set[tuple[str, _layout.Index]] = set()
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
        nproc = _distributed.process_count()
        packed = {p.process: p.chunk_bytes for p in getattr(getattr(self.inner, "man", None), "packed", ())}
        plan = plan_pieces(self.shared, self.load, self.chunked, packed, nproc) if self.shared else []
        waves = plan_waves(self.shared, plan, nproc)
        for s, pieces in zip(self.shared, plan):
            for p in pieces:
                if p.reader == self.me:
                    self.inner.add(s.rec, p.index)
        t0 = time.perf_counter()
        op = _distributed.Operation(f"restore{_distributed.next_id()}", self.where, START_TIMEOUT_S,
                                    lane="restore")
        others = [p for p in range(nproc) if p != self.me]
        with op:
            # Even an empty plan is compared: a process that planned nothing while
            # another planned an exchange must fail too, not leave it waiting.
            self._agree_on_plan(op, others, plan_digest(self.shared, waves))
            if not waves:
                self.inner.run()
                return
            try:
                self.inner.run()
            except BaseException as e:
                op.post("read", e)  # the others fail too, instead of waiting in the collective
                raise
            op.post("read")
            op.wait_for("read", others)
            # A second round before the collective: a process that gave up waiting for a
            # late peer (after posting "read") never posts "go", so the late one fails
            # here too instead of entering the all-gather alone.
            op.post("go")
            op.wait_for("go", others)
        t1 = time.perf_counter()
        try:
            self._exchange(waves)
        except Exception as e:  # noqa: BLE001 - every process fails alike: read from storage instead
            _log.warning("jaxckpt: '%s': exchanging replicated slices between processes failed (%s); "
                         "every process reads them from storage", self.where, e)
            self.out.clear()
            self._read_the_rest()
            return
        _log.debug("jaxckpt: '%s': read %.3f s (with the agreement), exchange and assembly %.3f s "
                   "(%d waves)", self.where, t1 - t0, time.perf_counter() - t1, len(waves))

    def _agree_on_plan(self, op: _distributed.Operation, others: list[int], digest: str) -> None:
        """Raise in every process if the processes' plans differ (see ``plan_digest``)."""
        op.post("plan", digest.encode())
        digests = op.wait_for("plan", others)
        digests[self.me] = digest.encode()
        differ = plan_mismatch(digests)
        if differ:
            raise CheckpointError(
                f"Checkpoint '{self.where}': read-once plan mismatch: {differ}. The processes planned "
                "from different inputs (the leaves and shardings each restores, or settings such as "
                "WAVE_BYTES); nothing was exchanged")

    def _exchange(self, waves: list[list[Part]]) -> None:
        """One all-gather per wave. Each wave's blocks go into the slices this process
        needs before the next wave is gathered, so at most one wave's buffers are alive
        beyond the slices; a slice that arrived in one block stays a view of that
        buffer only when this process needs most of the wave (``VIEW_SHARE``), else it
        is copied out and the buffer freed."""
        nparts = collections.Counter(p.slice_no for wave in waves for p in wave)
        for wave in waves:
            self._receive(wave, nparts)

    def _receive(self, wave: list[Part], nparts: collections.Counter[int]) -> None:
        """Gather ``wave`` and put its blocks in place (a function of its own so that the
        wave's buffers are released on return, before the next wave is gathered)."""
        data = self._gather(wave)
        # what this process takes from the wave: its own reads it keeps from the reader
        # (``_put``), so its own row counts as waste a view would keep alive
        mine = sum(p.nbytes for p in wave if self._key(p.slice_no) in self.needed and p.piece.reader != self.me)
        view_ok = mine >= VIEW_SHARE * sum(p.nbytes for p in wave)
        for part, got in zip(wave, data):
            self._put(part, nparts[part.slice_no], got, view_ok)

    def _key(self, i: int) -> tuple[str, _layout.Index]:
        return self.shared[i].rec.path, self.shared[i].index

    def _gather(self, wave: list[Part]) -> list[np.ndarray]:
        """The bytes of every block of ``wave``, in every process."""
        nproc = _distributed.process_count()
        lengths = [0] * nproc
        for p in wave:
            lengths[p.piece.reader] += _padded(p.nbytes)
        row = np.zeros((1, row_width(lengths)), np.uint8)
        at = 0
        for p in wave:
            if p.piece.reader == self.me:
                whole = self.inner.get(self.shared[p.slice_no].rec, p.piece.index)
                block = whole[_layout.relative(p.index, p.piece.index)]
                np.copyto(row[0, at:at + p.nbytes].view(block.dtype).reshape(block.shape), block)
                at += _padded(p.nbytes)
        rows = all_gather(row, lengths)
        del row
        offsets, out = [0] * nproc, []
        for p in wave:
            at = offsets[p.piece.reader]
            out.append(rows[p.piece.reader][at:at + p.nbytes])
            offsets[p.piece.reader] = at + _padded(p.nbytes)
        return out

    def _put(self, part: Part, nparts: int, data: np.ndarray, view_ok: bool) -> None:
        """Block ``part`` into its shared slice (one of ``nparts``), if this process
        needs that slice."""
        key = self._key(part.slice_no)
        if key not in self.needed:
            return
        s = self.shared[part.slice_no]
        storage = _dtypes.DTYPES[s.rec.storage_dtype]
        if part.piece.reader == self.me and part.piece.index == s.index:
            # this process read the whole slice itself: keep what it read (no second copy)
            self.out[key] = self.inner.get(s.rec, s.index).view(storage)
            return
        block = data.view(storage).reshape(_layout.index_shape(part.index))
        if nparts == 1 and part.index == s.index:
            self.out[key] = block if view_ok else _copy_aligned(block)
            return
        if key not in self.out:
            self.out[key] = _chunkfiles.aligned_empty(_layout.index_shape(s.index), storage)
        self.out[key][_layout.relative(part.index, s.index)] = block

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
