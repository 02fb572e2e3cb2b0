"""The data half of a restore: read the slices a restore needs, each once, straight
into 64-byte-aligned host buffers.

Callers ``add`` every (leaf, slice) they need, ``run`` once, then take each slice's
host array with ``get``. ``run`` plans all I/O together:

* packed (small) leaves: the byte ranges needed are merged where they meet in one
  stored chunk and read with one tensorstore read each; slices that are exactly one
  saved shard come back as views of those buffers, without a copy.
* big leaves: each saved chunk a slice needs is read straight into its place in the
  slice's buffer. On a local disk a whole chunk is read with one ``readinto`` and a
  hardware crc32c check (``_chunkfiles.read_chunk_file``), the fastest path; partial
  chunks and object stores go through tensorstore. A saved chunk that several slices
  need (a restore onto another layout) is read once into a temporary buffer and copied
  out, instead of being read and checksummed once per slice.

* stream leaves (format 3): each chunk a slice needs is one entry of its writer's
  stream (``_streams.locate``), read whole (edge chunks are stored full size) with
  ``_dataobjects.read_entry`` and its crc32c checked: straight into its place in the
  slice's buffer when it is an interior chunk the slice needs whole and that place is
  contiguous, else into a temporary chunk buffer and copied out (once, whichever slices
  need it). A slice that is exactly one interior chunk is the buffer read (no copy).
  On a local disk, runs of small consecutive entries are read together (one open and
  one ``preadv``, ``COALESCE_BYTES``), each still checked on its own. A format-3 save
  cuts chunks finer than the shards (``_layout.fine_chunk_shape``), so a slice that
  cuts across the saved shards reads about its own bytes.

Reads run concurrently within a byte budget, so the memory beyond the restored arrays
themselves stays bounded.

The manifest may be hostile (validated, but any size up to its caps): a buffer that
cannot be allocated is a ``CheckpointError``, and before tensorstore reads a chunk it
is checked that tensorstore can (``_check_before_tensorstore``): a local chunk must be
a regular file of its size, and a chunk bigger than the read must be allocatable, since
tensorstore aborts the process when an allocation fails and blocks on a FIFO.
"""

from __future__ import annotations

import collections
import functools
import math
import os
import stat
import sys
from collections.abc import Callable
from typing import Any

import crc32c
import numpy as np

from . import _dtypes, _layout, _quantize, _storage, _streams, _tasks
from ._errors import CheckpointError, CorruptCheckpointError
from ._manifest import LeafRecord, Manifest
from ._storage import chunkfiles as _chunkfiles
from ._storage import codecs as _tscodecs
from ._storage import dataobjects as _dataobjects
from ._storage import kvstore as _kvstore
from ._storage import zarr as _zarr
from ._storage.location import Location

# Bytes of tensorstore reads in flight (their regions; tensorstore also decodes each whole
# chunk they touch). It bounds those reads only: the slices a restore returns and the packed
# ranges are allocated when planned, and direct reads hold at most one temporary chunk per thread.
READ_BUDGET_BYTES = 256 << 20
DIRECT_READ_THREADS = 4
# Format 3 on an object store: each entry a ranged GET, bound by the request's latency more
# than by bandwidth, so more of them in flight (each thread holds one chunk, <= 4 MiB as
# format 3 cuts them unless a chunk cannot be cut).
REMOTE_READ_THREADS = 16
# Whole chunks of big leaves on a local disk are read without tensorstore (see
# _chunkfiles.read_chunk_file); False forces every read through tensorstore.
DIRECT_READS = True
# A tensorstore read that decodes a chunk bigger than this (and than the bytes it reads)
# first checks that such a chunk can be allocated at all (``_check_before_tensorstore``).
PROBE_BYTES = 64 << 20
STREAM_DIR = "data"  # format 3: the data objects ``p<k>.<n>``, below the manifest's data root
# Format 3 on a local disk: consecutive entries of one stream, each smaller than this, are
# read together, up to this many bytes (one open and one preadv for many small leaves
# instead of one each); bigger entries are read one per task, spread over the threads.
COALESCE_BYTES = 1 << 20
# A run's most bytes on an object store, where each entry alone is a request (1,000 leaves
# of 4 KiB: 1,000 ranged GETs): a run is one ranged GET per data object it spans.
REMOTE_COALESCE_BYTES = 8 << 20
_MAX_IOVECS = 900  # under IOV_MAX (1024): an entry takes up to 3 (its gap, payload, crc32c)


def stream_root(loc: Location, man: Manifest) -> Location:
    """Where a format-3 checkpoint's data objects are (``loc``: the checkpoint)."""
    return man.data_root(loc).child(STREAM_DIR)


class Reader:
    def __init__(self, loc: Location, man: Manifest):
        self.loc, self.man = loc, man  # ``loc``: the checkpoint, as messages name it
        self.root = man.data_root(loc)  # where its arrays/ and packed/ are
        self.streams = stream_root(loc, man)  # format 3: its data objects
        self.ctx = _kvstore.context(loc)  # shared by every reader of this store
        self._stores: dict[str, Any] = {}
        self._packed = {p.process: p for p in man.packed}
        self._wanted: dict[tuple[str, _layout.Index], LeafRecord] = {}
        self._out: dict[tuple[str, _layout.Index], np.ndarray] = {}
        self._parts: dict[tuple[str, _layout.Index], list] = {}
        self._refs: dict[int, tuple[Location, int, int]] = {}  # format 4: other steps' streams

    def add(self, rec: LeafRecord, index: _layout.Index) -> None:
        self._wanted[(rec.path, index)] = rec

    def get(self, rec: LeafRecord, index: _layout.Index) -> np.ndarray:
        """The slice as a host array of the saved dtype."""
        out = self._out[(rec.path, index)]
        saved = _dtypes.DTYPES[rec.dtype]
        return out if out.dtype == saved else out.view(saved)

    # --- planning and running ----------------------------------------------------

    def run(self) -> None:
        ops: list[_Op] = []
        packed_requests = []
        by_leaf: dict[str, list[_layout.Index]] = collections.defaultdict(list)
        for (path, index), rec in self._wanted.items():
            if _layout.index_size(index) == 0:
                self._out[(path, index)] = np.zeros(_layout.index_shape(index), _dtypes.DTYPES[rec.storage_dtype])
            elif rec.store == "packed":
                packed_requests.append((rec, index))
            else:
                by_leaf[path].append(index)
        ranges = self._plan_packed(packed_requests, ops)
        for path, indices in by_leaf.items():
            rec = self._wanted[(path, indices[0])]
            if rec.store == "stream":
                self._plan_stream_leaf(rec, indices, ops)
            else:
                self._plan_file_leaf(rec, indices, ops)
        _execute(ops, self.loc)
        for rec, index in packed_requests:
            self._out[(rec.path, index)] = self._assemble_packed(rec, index, ranges)

    def _store(self, spec: dict[str, Any], key: str) -> Any:
        if key not in self._stores:
            self._stores[key] = _zarr.open_array(spec, self.ctx, create=False)
        return self._stores[key]

    def _plan_packed(self, requests, ops) -> dict[int, list[tuple[int, int, np.ndarray]]]:
        needed: dict[int, set[tuple[int, int]]] = collections.defaultdict(set)
        owners: dict[int, list[tuple[int, int, str]]] = collections.defaultdict(list)
        for rec, index in requests:
            self._parts[(rec.path, index)] = parts = _packed_chunks(rec, index)
            for proc, offset, nbytes, _ in parts:
                needed[proc].add((offset, nbytes))
                owners[proc].append((offset, offset + nbytes, rec.path))
        ranges: dict[int, list[tuple[int, int, np.ndarray]]] = {}
        for proc, spans in needed.items():
            info = self._packed[proc]
            store = self._store(_zarr.packed_spec(self.root, proc, info.nbytes, info.chunk_bytes), f"p{proc}")
            merged: list[list[int]] = []
            chunk = info.chunk_bytes
            for offset, nbytes in sorted(spans):
                # Ranges that meet in one stored chunk are read together: that chunk is
                # read and checksummed whole either way.
                if merged and offset // chunk <= (merged[-1][1] - 1) // chunk:
                    merged[-1][1] = max(merged[-1][1], offset + nbytes)
                else:
                    merged.append([offset, offset + nbytes])
            ranges[proc] = []
            for a, b in merged:
                leaves = sorted({p for s, e, p in owners[proc] if s < b and e > a})
                buf = _buffer(self.loc, leaves, (b - a,), np.uint8)
                ranges[proc].append((a, b, buf))
                files = tuple((f, chunk) for f in _chunkfiles.packed_chunk_files(self.root, proc, a, b, chunk))
                # tensorstore fetches (and checksums) each stored chunk the range touches whole
                fetched = min(-(-b // chunk) * chunk, info.nbytes) - a // chunk * chunk
                ops.append(_Op(b - a, leaves, buf, None, store, ((a, b),), files=files, fetched=fetched))
        return ranges

    def _assemble_packed(self, rec: LeafRecord, index: _layout.Index, ranges) -> np.ndarray:
        storage = _dtypes.DTYPES[rec.storage_dtype]
        parts = self._parts[(rec.path, index)]
        views = []
        for proc, offset, nbytes, region in parts:
            for a, b, buf in ranges[proc]:
                if a <= offset and offset + nbytes <= b:
                    views.append(buf[offset - a:offset - a + nbytes].view(storage)
                                 .reshape(_layout.index_shape(region)))
                    break
        if len(parts) == 1 and parts[0][3] == index:
            return views[0]  # exactly one saved chunk: no copy
        out = _buffer(self.loc, [rec.path], _layout.index_shape(index), storage)
        for (_, _, _, region), view in zip(parts, views):
            overlap = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(index, region))
            out[_rel(overlap, index)] = view[_rel(overlap, region)]
        return out

    def _plan_file_leaf(self, rec: LeafRecord, indices: list[_layout.Index], ops) -> None:
        storage = _dtypes.DTYPES[rec.storage_dtype]
        spec = _zarr.array_spec(self.root, rec.key, rec.shape, rec.chunk_shape, rec.storage_dtype)
        store = self._store(spec, f"a{rec.key}")
        direct = DIRECT_READS and (storage.itemsize == 1 or sys.byteorder == "little")
        users: dict[tuple[int, ...], list[tuple[_layout.Index, _layout.Index]]] = collections.defaultdict(list)
        for index in indices:
            for cell, overlap in _layout.chunks_overlapping(index, rec.chunk_shape):
                users[cell].append((index, overlap))

        chunk_nbytes = math.prod(rec.chunk_shape) * storage.itemsize  # edge chunks are stored whole too

        def read(dest: Any, cell: tuple[int, ...], region: _layout.Index, whole: bool,
                 done: Callable[[np.ndarray], None] | None = None) -> _Op:
            # zarr stores an edge chunk at full size: only interior chunks map 1:1 to files
            whole = whole and _layout.index_shape(region) == tuple(rec.chunk_shape)
            local = _chunkfiles.chunk_file(self.root, rec.key, cell)  # None off a local disk
            contiguous = not isinstance(dest, np.ndarray) or dest.flags.c_contiguous
            nbytes = _layout.index_size(region) * storage.itemsize
            if direct and whole and contiguous and local is not None:
                return _Op(nbytes, [rec.path], dest, local, store, region, done)
            files = () if local is None else ((local, chunk_nbytes),)
            return _Op(nbytes, [rec.path], dest, None, store, region, done, files, chunk_nbytes, chunk_nbytes)

        dests = {}
        for index in indices:
            dest = _buffer(self.loc, [rec.path], _layout.index_shape(index), storage)
            dests[index] = dest
            self._out[(rec.path, index)] = dest
        for cell, uses in users.items():
            region = _layout.chunk_region(cell, rec.chunk_shape, rec.shape)
            if len(uses) == 1:  # one slice needs this chunk: read straight into place
                index, overlap = uses[0]
                ops.append(read(dests[index][_rel(overlap, index)], cell, overlap, overlap == region))
                continue

            # Several slices need it: read it once into a temporary buffer (allocated when
            # the read starts, dropped once copied out), then copy out.
            def scatter(tmp: np.ndarray, region=region, uses=uses) -> None:
                for index, overlap in uses:
                    dests[index][_rel(overlap, index)] = tmp[_rel(overlap, region)]

            temp = functools.partial(_buffer, self.loc, [rec.path], _layout.index_shape(region), storage)
            ops.append(read(temp, cell, region, True, scatter))

    def _entry(self, rec: LeafRecord, cell: tuple[int, ...]) -> tuple[Location, int, int, int, int]:
        """``read_entry``'s first five arguments for chunk ``cell`` of stream leaf ``rec``
        (a payload of -4 bytes: a compressed leaf's all-zero chunk, stored nowhere)."""
        flat = _layout.chunk_flat_index(cell, _layout.chunk_grid_shape(rec.shape, rec.chunk_shape))
        stream, offset, nbytes = rec.entry(flat)
        root, process, segment_bytes = self._stream(stream)
        return root, process, offset, nbytes - _streams.CRC_BYTES, segment_bytes

    def _stream(self, stream: int) -> tuple[Location, int, int]:
        """Where a run's stream is: this checkpoint's own, or (format 4) another step's."""
        if stream < self.man.process_count:
            return self.streams, stream, self.man.segment_bytes
        if stream not in self._refs:
            self._refs[stream] = self.man.stream_of(self.loc, stream)
        return self._refs[stream]

    def _plan_stream_leaf(self, rec: LeafRecord, indices: list[_layout.Index], ops) -> None:
        """Each chunk the slices need, read once: into place, or into a temporary buffer
        of the whole chunk (an edge chunk, or one several slices share) copied out. A
        compressed chunk is read into a buffer of its own, decoded and copied out."""
        storage = _dtypes.DTYPES[rec.storage_dtype]
        if rec.codec != _streams.CODEC_RAW:
            self._plan_compressed_leaf(rec, indices, ops)
            return
        if len(indices) == 1 and len(rec.runs) == 1 and tuple(rec.chunk_shape) == tuple(rec.shape) \
                and indices[0] == tuple((0, n) for n in rec.shape):  # a small leaf, whole: its one entry
            index, (stream, _, _, offset) = indices[0], rec.runs[0]
            dest = self._out[(rec.path, index)] = _buffer(self.loc, [rec.path], tuple(rec.shape), storage)
            root, process, segment_bytes = self._stream(stream)
            entry = (root, process, offset, rec.entry_bytes - _streams.CRC_BYTES, segment_bytes)
            ops.append(_Op(dest.nbytes, [rec.path], dest, None, None, index, entry=entry, cell=(0,) * len(index)))
            return
        dests, users = self._slices_and_users(rec, indices, storage)
        for cell, uses in users.items():
            region = _layout.chunk_region(cell, rec.chunk_shape, rec.shape)
            whole = tuple((g * c, (g + 1) * c) for g, c in zip(cell, rec.chunk_shape))  # the entry: full size
            entry = self._entry(rec, cell)
            if len(uses) == 1 and uses[0][1] == whole:
                index, overlap = uses[0]
                dest = dests[index][_rel(overlap, index)]
                if dest.flags.c_contiguous:  # read straight into place
                    ops.append(_Op(dest.nbytes, [rec.path], dest, None, None, region, entry=entry, cell=cell))
                    continue

            def scatter(tmp: np.ndarray, whole=whole, uses=uses) -> None:
                for index, overlap in uses:
                    dests[index][_rel(overlap, index)] = tmp[_rel(overlap, whole)]

            temp = functools.partial(_buffer, self.loc, [rec.path], tuple(rec.chunk_shape), storage)
            ops.append(_Op(entry[3], [rec.path], temp, None, None, region, scatter, entry=entry, cell=cell))

    def _slices_and_users(self, rec: LeafRecord, indices: list[_layout.Index], storage: Any) -> tuple[
            dict[_layout.Index, np.ndarray], dict[tuple[int, ...], list[tuple[_layout.Index, _layout.Index]]]]:
        """Each slice's buffer (allocated, kept as its output) and, per chunk the slices
        touch, the slices that need it with their overlap."""
        users: dict[tuple[int, ...], list[tuple[_layout.Index, _layout.Index]]] = collections.defaultdict(list)
        dests = {}
        for index in indices:
            dests[index] = self._out[(rec.path, index)] = _buffer(
                self.loc, [rec.path], _layout.index_shape(index), storage)
            for cell, overlap in _layout.chunks_overlapping(index, rec.chunk_shape):
                users[cell].append((index, overlap))
        return dests, users

    def _plan_compressed_leaf(self, rec: LeafRecord, indices: list[_layout.Index], ops) -> None:
        """A compressed or quantized leaf: each stored chunk read into a buffer of its own,
        decoded and copied out; an all-zero one (stored nowhere) written as zeros."""
        storage = _dtypes.DTYPES[rec.storage_dtype]
        dests, users = self._slices_and_users(rec, indices, storage)
        for cell, uses in users.items():
            whole = tuple((g * c, (g + 1) * c) for g, c in zip(cell, rec.chunk_shape))
            entry = self._entry(rec, cell)
            if entry[3] < 0:  # all zeros: nothing stored, nothing to read
                for index, overlap in uses:
                    dests[index][_rel(overlap, index)] = 0
                continue

            def decode(payload: np.ndarray, whole=whole, uses=uses) -> None:
                try:
                    chunk = decode_entry(rec, payload)
                except MemoryError as e:
                    raise CheckpointError(f"Checkpoint '{self.loc}': {e}") from None
                for index, overlap in uses:
                    dests[index][_rel(overlap, index)] = chunk[_rel(overlap, whole)]

            temp = functools.partial(_buffer, self.loc, [rec.path], (entry[3],), np.uint8)
            region = _layout.chunk_region(cell, rec.chunk_shape, rec.shape)
            ops.append(_Op(entry[3], [rec.path], temp, None, None, region, decode, entry=entry, cell=cell))


def decode_entry(rec: LeafRecord, payload: np.ndarray) -> np.ndarray:
    """The chunk a compressed or quantized leaf's entry holds (its payload, crc32c
    checked), in the storage dtype. Its size is checked before anything is allocated for
    it (a codec's header by ``_tscodecs.check_header``, a quantized payload's length by
    ``_quantize.decode``); ``ValueError`` when it does not decode."""
    if rec.codec in _quantize.FORMS:
        return _quantize.decode(payload, tuple(rec.chunk_shape), _dtypes.DTYPES[rec.dtype], rec.codec)
    # tensorstore allocates the decoded chunk (about twice its size at the peak) where a failed
    # allocation aborts the process: numpy asks for as much first, so that one raises instead
    decoded = 2 * math.prod(rec.chunk_shape) * _dtypes.DTYPES[rec.storage_dtype].itemsize
    if decoded > PROBE_BYTES:
        try:
            np.empty(decoded, np.uint8)
        except MemoryError:
            raise MemoryError(f"leaf '{rec.path}': could not allocate {decoded} bytes to decode a chunk") from None
    return _tscodecs.decode(rec.codec, rec.codec_config, payload, tuple(rec.chunk_shape),
                            _dtypes.DTYPES[rec.storage_dtype])


class _Op:
    """One read of ``region`` into ``dest`` (an array, or a factory of a temporary one):
    from the local chunk file ``path`` if set, else through tensorstore ``store``;
    ``done(buffer)`` runs after it. A tensorstore read of a local store first checks
    ``files``, the chunk files it touches with their data bytes (``_chunkfiles.check_chunk_file``);
    ``decoded`` is the bytes tensorstore allocates to decode the chunk it reads;
    ``fetched`` the bytes it reads from storage for it (whole stored chunks: a part of
    a chunk costs the whole chunk, which its checksum covers), counted in ``io_stats``.
    With ``entry`` set (format 3): a whole entry, ``read_entry``'s first five arguments,
    and ``cell`` its chunk (errors name it: the entry's data object holds many chunks)."""

    def __init__(self, nbytes: int, leaves: list[str], dest: Any, path: str | None, store: Any,
                 region: _layout.Index, done: Callable[[np.ndarray], None] | None = None,
                 files: tuple[tuple[str, int], ...] = (), decoded: int = 0, fetched: int = 0,
                 entry: tuple[Location, int, int, int, int] | None = None, cell: tuple[int, ...] | None = None):
        self.nbytes, self.leaves, self.dest, self.path = nbytes, leaves, dest, path
        self.store, self.region, self.done = store, region, done
        self.files, self.decoded, self.fetched = files, decoded, fetched or nbytes
        self.entry, self.cell = entry, cell

    @property
    def direct(self) -> bool:
        """Read on the direct threads (a local chunk file or a stream entry), not by tensorstore."""
        return self.path is not None or self.entry is not None

    def buffer(self) -> np.ndarray:
        return self.dest if isinstance(self.dest, np.ndarray) else self.dest()

    def finish(self, buf: np.ndarray) -> None:
        if self.done is not None:
            self.done(buf)


# What tensorstore (and read_chunk_file) say when the stored bytes are wrong or missing;
# anything else (a store that does not answer, refused credentials) is not corruption.
_DATA_ERRORS = ("DATA_LOSS", "NOT_FOUND", "digest", "checksum", "crc32c", "Error decoding", "INVALID_ARGUMENT",
                "FAILED_PRECONDITION", "OUT_OF_RANGE")


def _corrupt(loc: Location, op: _Op, e: BaseException) -> CheckpointError:
    names = ", ".join(f"'{p}'" for p in op.leaves[:5]) + (" ..." if len(op.leaves) > 5 else "")
    if op.cell is not None:  # as verify names it
        names += f" chunk cell {list(op.cell)}"
    if isinstance(e, CorruptCheckpointError) or any(mark in str(e) for mark in _DATA_ERRORS):
        return CorruptCheckpointError(f"Checkpoint '{loc}': leaf {names} could not be read: {e}")
    cause = e if isinstance(e, CheckpointError) else _kvstore.storage_cause(e)
    return CheckpointError(f"Checkpoint '{loc}': reading leaf {names} failed: {cause}")


def _direct_task(op: _Op, loc: Location) -> Callable[[], None]:
    def task() -> None:
        if op.entry is not None and not isinstance(op.dest, np.ndarray):  # a buffer of the entry's own:
            try:  # first see that the data objects hold it (the manifest may lie about its size)
                _dataobjects.check_entry(*op.entry)
            except CorruptCheckpointError as e:
                raise _corrupt(loc, op, e) from e
        buf = op.buffer()
        try:
            if op.entry is not None:
                root, process, offset, nbytes, segment_bytes = op.entry
                _dataobjects.read_entry(root, process, offset, nbytes, buf, segment_bytes)
            else:
                _chunkfiles.read_chunk_file(buf, op.path)
        except (ValueError, OSError, CheckpointError) as e:  # OSError: the file system refused (permissions, ...)
            raise _corrupt(loc, op, e) from e
        _finish(op, buf, loc)

    return task


def _finish(op: _Op, buf: np.ndarray, loc: Location) -> None:
    """``op.finish``; a compressed entry that does not decode names its leaf and chunk
    (its bytes passed their crc32c, so what they hold is damaged: corrupt)."""
    try:
        op.finish(buf)
    except ValueError as e:
        raise _corrupt(loc, op, CorruptCheckpointError(str(e))) from e


def _execute(ops: list[_Op], loc: Location) -> None:
    """Run tensorstore reads within the byte budget, then direct chunk reads on a few
    threads (each holding at most one temporary chunk buffer, or one run of small
    entries, at a time)."""
    _execute_tensorstore([op for op in ops if not op.direct], loc)
    threads = DIRECT_READ_THREADS if loc.local is not None else REMOTE_READ_THREADS
    _tasks.run_tasks(_direct_tasks([op for op in ops if op.direct], loc), threads)


def _direct_tasks(ops: list[_Op], loc: Location) -> list[Callable[[], None]]:
    """One task per op, except runs of small consecutive entries of one stream (each
    under ``COALESCE_BYTES``; a run up to that locally, up to ``REMOTE_COALESCE_BYTES``
    on an object store), one task per run."""
    small = [op for op in ops if op.entry is not None and op.entry[3] + _streams.CRC_BYTES < COALESCE_BYTES]
    ids = {id(op) for op in small}
    tasks = [_direct_task(op, loc) for op in ops if id(op) not in ids]
    small.sort(key=lambda op: (str(op.entry[0]), op.entry[1], op.entry[2]))
    run: list[_Op] = []
    for op in small:
        if run and not _continues(run, op):
            tasks.append(_run_task(run, loc) if len(run) > 1 else _direct_task(run[0], loc))
            run = []
        run.append(op)
    if run:
        tasks.append(_run_task(run, loc) if len(run) > 1 else _direct_task(run[0], loc))
    return tasks


def _continues(run: list[_Op], op: _Op) -> bool:
    """Whether entry ``op`` follows the run's last one in the same stream (only alignment
    padding between them) and fits in the run."""
    first, last, nxt = run[0].entry, run[-1].entry, op.entry
    assert first is not None and last is not None and nxt is not None
    end = last[2] + last[3] + _streams.CRC_BYTES
    same_stream = (nxt[0], nxt[1], nxt[4]) == (last[0], last[1], last[4])
    fits = (nxt[2] + nxt[3] + _streams.CRC_BYTES - first[2] <= _coalesce(first[0])
            and (first[0].local is None or 3 * (len(run) + 1) <= _MAX_IOVECS))
    return same_stream and 0 <= nxt[2] - end < _streams.ALIGN and fits


def _coalesce(root: Location) -> int:
    return COALESCE_BYTES if root.local is not None else REMOTE_COALESCE_BYTES


def _run_task(run: list[_Op], loc: Location) -> Callable[[], None]:
    """Read a run of consecutive entries with one ``preadv`` per data object, check each
    one's crc32c. Anything wrong (a missing or short object, a checksum): each entry is
    read again alone with ``read_entry``, whose error names the object and the entry."""
    def task() -> None:
        for op in run:  # the fault point of each entry, as read_entry has it
            root, process, offset = op.entry[:3]
            try:
                _storage.fault("read", f"p{process}@{offset}")
            except (ValueError, OSError, CheckpointError) as e:
                raise _corrupt(loc, op, e) from e
        bufs = [op.buffer() for op in run]
        try:
            whole = _read_run([op.entry for op in run], bufs)
        except CheckpointError as e:  # the store failed (not the data): no second try entry by entry
            raise _corrupt(loc, run[0], e) from e
        if whole:
            for op, buf in zip(run, bufs):
                _storage.count(bytes_read=op.entry[3], reads=1)
                _finish(op, buf, loc)
            return
        for op, buf in zip(run, bufs):
            _read_entry_into(op, buf, loc)
            _finish(op, buf, loc)

    return task


def _read_run(entries: list[Any], bufs: list[np.ndarray]) -> bool:
    """Read consecutive entries into ``bufs``; whether all arrived and checked out (a
    store that fails raises ``CheckpointError``)."""
    root, process, first, _, segment_bytes = entries[0]
    parts: list[memoryview] = []
    checks = []
    at = first
    for (_, _, offset, nbytes, _), buf in zip(entries, bufs):
        if offset > at:
            parts.append(memoryview(bytearray(offset - at)))  # the alignment gap: zeros
        view, trailer = memoryview(buf.reshape(-1).view(np.uint8)), bytearray(_streams.CRC_BYTES)
        parts += [view, memoryview(trailer)]
        checks.append((view, trailer))
        at = offset + nbytes + _streams.CRC_BYTES
    if any(not buf.flags.c_contiguous for buf in bufs):
        return False
    if root.local is None:
        if not _dataobjects.read_run(root, process, list(_dataobjects.pieces(first, at - first, segment_bytes)),
                                     parts):
            return False
        return all(crc32c.crc32c(view) == int.from_bytes(trailer, "little") for view, trailer in checks)
    if _preadv is None:
        return False
    try:
        for n, start, stop in _dataobjects.pieces(first, at - first, segment_bytes):
            taken = _take(parts, stop - start)
            if not _pread_segment(os.path.join(root.local, _dataobjects.segment_name(process, n)), start, stop, taken):
                return False
    except OSError:
        return False
    return all(crc32c.crc32c(view) == int.from_bytes(trailer, "little") for view, trailer in checks)


_preadv = getattr(os, "preadv", None)


def _take(parts: list[memoryview], nbytes: int) -> list[memoryview]:
    """The first ``nbytes`` of ``parts`` (removed from it, a part cut where needed)."""
    out = []
    while nbytes:
        head = parts[0]
        if len(head) <= nbytes:
            out.append(parts.pop(0))
            nbytes -= len(head)
        else:
            out.append(head[:nbytes])
            parts[0] = head[nbytes:]
            nbytes = 0
    return out


def _pread_segment(path: str, start: int, stop: int, parts: list[memoryview]) -> bool:
    """Fill ``parts`` from bytes ``[start, stop)`` of the regular file ``path``."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size < stop:
            return False
        parts = [p for p in parts if len(p)]
        while parts:
            got = _preadv(fd, parts[:_MAX_IOVECS], start)
            if not got:
                return False
            start += got
            _take(parts, got)
    finally:
        os.close(fd)
    return True


def _read_entry_into(op: _Op, buf: np.ndarray, loc: Location) -> None:
    assert op.entry is not None
    root, process, offset, nbytes, segment_bytes = op.entry
    try:
        _dataobjects.read_entry(root, process, offset, nbytes, buf, segment_bytes)
    except (ValueError, OSError, CheckpointError) as e:
        raise _corrupt(loc, op, e) from e


def _execute_tensorstore(ops: list[_Op], loc: Location) -> None:
    _tasks.run_bounded((_tensorstore_job(op, loc) for op in ops), READ_BUDGET_BYTES)


def _tensorstore_job(op: _Op, loc: Location) -> tuple[int, Callable[[], Any], Callable[[Any], None]]:
    """``(nbytes, start, finish)`` of one read for ``_tasks.run_bounded``; the buffer (a
    temporary one, for a chunk several slices share) is allocated when the read starts."""
    bufs: list[np.ndarray] = []

    def start() -> Any:
        _check_before_tensorstore(op, loc)
        bufs.append(op.buffer())
        try:
            return _zarr.read_into(bufs[0], op.store.result(), op.region, op.fetched)
        except (OSError, ValueError) as e:  # refused before it started (e.g. the store cannot open)
            raise _corrupt(loc, op, e) from e

    def finish(future: Any) -> None:
        try:
            future.result()
        except Exception as e:  # noqa: BLE001 - tensorstore reports corruption as ValueError
            raise _corrupt(loc, op, e) from e
        op.finish(bufs[0])

    return op.nbytes, start, finish


def _check_before_tensorstore(op: _Op, loc: Location) -> None:
    """Refuse a read tensorstore would turn into a hang or a process abort: a local chunk
    that is not a regular file of its size, or a chunk bigger than memory can hold
    (tensorstore allocates the whole chunk before it reads a byte of it and aborts the
    process, ``std::bad_alloc``, when that fails; numpy's ``MemoryError`` for the same
    size is an error a restore can raise instead)."""
    try:
        for path, nbytes in op.files:
            _chunkfiles.check_chunk_file(path, nbytes)
    except ValueError as e:
        raise _corrupt(loc, op, e) from e
    if op.decoded > max(op.nbytes, PROBE_BYTES):
        _buffer(loc, op.leaves, (op.decoded,), np.uint8)  # dropped at once: only a probe


def _buffer(loc: Location, leaves: list[str], shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """``_chunkfiles.aligned_empty``, with a failed allocation a ``CheckpointError`` naming
    the leaves (a hostile manifest may promise any size up to the per-leaf cap)."""
    try:
        return _chunkfiles.aligned_empty(shape, dtype)
    except MemoryError:
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        names = ", ".join(f"'{p}'" for p in leaves[:5]) + (" ..." if len(leaves) > 5 else "")
        raise CheckpointError(f"Checkpoint '{loc}': leaf {names}: could not allocate {nbytes} bytes to read it "
                              "into") from None


def _packed_chunks(rec: LeafRecord, index: _layout.Index) -> list[tuple[int, int, int, _layout.Index]]:
    """(process, offset, nbytes, chunk region) of each saved chunk ``index`` touches."""
    itemsize = _dtypes.DTYPES[rec.dtype].itemsize
    full = tuple((0, d) for d in rec.shape)
    if rec.chunk_shape == rec.shape or len(rec.chunks) == 1:  # one chunk: the whole leaf
        proc, offset = rec.chunks[0]
        return [(proc, offset, rec.nbytes, full)]
    if index == full and _back_to_back(rec, itemsize):  # the whole leaf is one byte range
        proc, offset = rec.chunks[0]
        return [(proc, offset, rec.nbytes, full)]
    grid = _layout.chunk_grid_shape(rec.shape, rec.chunk_shape)
    out = []
    for cell, _ in _layout.chunks_overlapping(index, rec.chunk_shape):
        region = _layout.chunk_region(cell, rec.chunk_shape, rec.shape)
        proc, offset = rec.chunks[_layout.chunk_flat_index(cell, grid)]
        out.append((proc, offset, _layout.index_size(region) * itemsize, region))
    return out


def _back_to_back(rec: LeafRecord, itemsize: int) -> bool:
    """Whether ``rec``'s packed chunks are row blocks (split along the first axis only)
    stored one after the other in one packed array: then the leaf's bytes in C order are
    one range of that array, read and placed without assembling."""
    if tuple(rec.chunk_shape[1:]) != tuple(rec.shape[1:]):
        return False
    step = math.prod(rec.chunk_shape) * itemsize
    proc, first = rec.chunks[0]
    return all(p == proc and offset == first + k * step for k, (p, offset) in enumerate(rec.chunks))


def _rel(inner: _layout.Index, outer: _layout.Index) -> tuple[Any, ...]:
    """``inner`` (global coordinates) as slices relative to ``outer``'s origin. For a 0-d
    array ``(...,)``: indexing with it gives a view (with ``()``, a numpy scalar)."""
    return tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(inner, outer)) or (Ellipsis,)
