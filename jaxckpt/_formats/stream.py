"""Writing a checkpoint leaf by leaf from host data (offline conversion: ``convert``).

``save`` snapshots a whole tree and then writes it (``_snapshot``, ``_writer``); a
conversion cannot hold a whole checkpoint in memory. Here the caller gives the leaf
records up front (path, dtype, shape, chunk shape, sharding description) and, per leaf,
a function that hands out each chunk's data (a view of a leaf it read whole, or a
chunk it reads when asked); leaves are written one after another, chunk by chunk, so
host memory stays near the largest leaf plus a few bounded write buffers:

* big leaves (≥ ``_snapshot.SMALL_LEAF_BYTES``): a zarr3 array each, written the way
  ``_writer`` writes (``_zarr.array_spec``; whole chunks on a local disk as chunk files
  with ``_chunkfiles.write_chunk_file``; edge chunks and object stores through
  tensorstore), but chunk by chunk as they are produced, at most
  ``STREAM_BUDGET_BYTES`` of them in flight, instead of ``_writer.write_data``'s one
  call with every buffer ready. A whole chunk that is a strided view (a column block of
  a row-major leaf) or needs a cast goes to its chunk file ``BLOCK_BYTES`` at a time
  (the same bytes and crc32c trailer) instead of being copied whole first.
* small leaves: laid out as ``_snapshot`` lays them out (``_layout.pack_offsets``, one
  writing process), streamed into the packed array one stored chunk at a time.

Unless ``JAXCKPT_FORMAT=1`` (``_snapshot.streams_wanted``, as for ``save``) the checkpoint
is format 3 instead: every array leaf, small ones too (no packing), is a stream leaf whose
chunks are entries of process 0's one stream (``_streams.plan``, computed from the shapes
and chunk shapes before any data is read), written leaf after leaf, chunk by chunk,
straight into ``_storage.dataobjects.StreamWriter`` (``data/p0.<n>``). An entry's payload
must be one contiguous buffer: a chunk that is a strided view or needs a cast is copied
whole once (not ``BLOCK_BYTES`` at a time), so fewer such chunks are in flight at once.

Then the manifest is written last and the staging location committed
(``_commit.prepare``/``commit``, ``_checkpoint.build_manifest``). Single process only.
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Union

import crc32c
import numpy as np

from .. import _commit, _distributed, _dtypes, _layout, _snapshot, _storage, _streams, _tasks, _writer
from .._checkpoint import build_manifest
from .._errors import CheckpointError
from .._manifest import STREAM, LeafRecord, Manifest, PackedArray
from .._snapshot import PACK_CHUNK_BYTES, SMALL_LEAF_BYTES, Snapshot
from .._storage import chunkfiles as _chunkfiles
from .._storage import dataobjects as _dataobjects
from .._storage import kvstore as _kvstore
from .._storage import location as _location
from .._storage import uploads as _uploads
from .._storage import zarr as _zarr
from .._storage.location import Location

# Bytes copied (or cast) at a time when a chunk is not a plain contiguous buffer.
BLOCK_BYTES = 8 << 20
# Bytes of chunks in flight per big leaf (at least one chunk): a producer that reads each
# chunk when asked (an import) holds about this much besides the leaf being written.
STREAM_BUDGET_BYTES = 64 << 20
# See limit_malloc_retention.
MMAP_THRESHOLD_BYTES = 1 << 20
KEEP_MALLOC_ENV = "JAXCKPT_KEEP_MALLOC"
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h

# What chunk_data(i, record) gives for one array leaf (called once per leaf, in order):
# the whole leaf, held (chunks are written from views of it), or a function from a
# chunk's index to its data, called when the chunk is written (at most
# STREAM_BUDGET_BYTES of them in flight). Any dtype that casts to the record's.
ChunkData = Union[np.ndarray, Callable[[_layout.Index], np.ndarray]]


def write_checkpoint(path: Any, structure: dict[str, Any], leaves: Sequence[LeafRecord],
                     chunk_data: Callable[[int, LeafRecord], ChunkData], *, metadata: dict[str, Any] | None = None,
                     overwrite: bool = False, info: dict[str, Any] | None = None,
                     progress: Callable[[int, int], None] | None = None) -> Manifest:
    """Write a checkpoint leaf by leaf and commit it; returns its manifest.

    ``leaves`` are templates: ``path``, ``kind``, ``value`` (inline values), ``dtype``,
    ``shape``, ``chunk_shape``, ``sharding`` (JSON or ``None``), ``scalar``, ``impl`` and
    ``key_ndim``; the data fields (store, key, storage dtype, byte counts, packed
    offsets) are filled in here. ``metadata`` must already be valid JSON metadata.
    """
    if _distributed.process_count() > 1:
        raise CheckpointError("Converting checkpoints runs in a single process; this job has "
                              f"{_distributed.process_count()} (run it outside the training job)")
    final = _location.resolve(path)
    layout = None
    if _snapshot.streams_wanted():
        records, layout, packed = *plan_streams(leaves), ()
        snap = Snapshot(structure, records, {}, (), None, 0, streams=layout.streams,
                        segment_bytes=_uploads.segment_bytes_for(final, _snapshot.SEGMENT_BYTES))
    else:
        records, packed = plan(leaves)
        snap = Snapshot(structure, records, {}, packed, None, 0)
    token = _commit.new_token(final)
    staging = _commit.prepare(final, token, overwrite)
    committed = False
    try:
        t0 = time.perf_counter()
        data = _commit.data_location(final, token)
        if layout is None:
            _write_leaves(data, records, packed, chunk_data, progress, final)
        else:
            _write_stream(data, snap, chunk_data, progress, final)
        extra = {"write_seconds": round(time.perf_counter() - t0, 6), **(info or {})}
        manifest = build_manifest(snap, metadata, extra, _commit.data_key(final, token))
        _commit.commit(final, staging, manifest.to_bytes(), token)
        committed = True
    finally:
        if not committed:
            _commit.abort(final, staging, token)
    return manifest


def plan(leaves: Sequence[LeafRecord]) -> tuple[list[LeafRecord], tuple[PackedArray, ...]]:
    """Complete records (data key = position, store by size, packed offsets) and the
    packed array, laid out as ``_snapshot`` does with every chunk written by process 0."""
    out: list[LeafRecord] = []
    small: list[int] = []
    for i, rec in enumerate(leaves):
        if rec.kind == "value":
            out.append(LeafRecord(path=rec.path, kind="value", value=rec.value))
            continue
        out.append(_array_record(rec, key=str(i)))
        if out[-1].nbytes < SMALL_LEAF_BYTES:
            out[-1] = _with(out[-1], store="packed")
            small.append(i)
    sizes = [[(0, _layout.index_size(region) * _dtypes.DTYPES[out[i].dtype].itemsize) for _, region in _cells(out[i])]
             for i in small]
    offsets, totals = _layout.pack_offsets(sizes)
    for i, offs in zip(small, offsets):
        out[i] = _with(out[i], chunks=tuple((0, o) for o in offs))
    # zarr stores an edge chunk at full size, so split evenly (as _snapshot does)
    packed = tuple(PackedArray(p, n, -(-n // -(-n // PACK_CHUNK_BYTES))) for p, n in sorted(totals.items()))
    return out, packed


def plan_streams(leaves: Sequence[LeafRecord]) -> tuple[list[LeafRecord], _streams.Layout]:
    """Format 3: complete records (every array leaf a stream leaf, its runs in process
    0's stream) and the layout, from the shapes and chunk shapes alone (``_streams.plan``
    with process 0 the writer of every chunk, as ``_snapshot`` lays a save out)."""
    out: list[LeafRecord] = []
    arrays: list[int] = []
    for rec in leaves:
        if rec.kind == "value":
            out.append(LeafRecord(path=rec.path, kind="value", value=rec.value))
            continue
        arrays.append(len(out))
        out.append(_array_record(rec, key="", store=STREAM, codec=_streams.CODEC_RAW))
    payloads = [math.prod(out[i].chunk_shape) * _dtypes.DTYPES[out[i].storage_dtype].itemsize for i in arrays]
    writers = [np.zeros(math.prod(_layout.chunk_grid_shape(out[i].shape, out[i].chunk_shape)), np.int64)
               for i in arrays]
    try:
        layout = _streams.plan(zip(payloads, writers))
    except ValueError as e:  # a stream longer than any reader accepts
        raise CheckpointError(f"Cannot lay the checkpoint out in format 3: {e}") from None
    for i, payload, runs in zip(arrays, payloads, layout.runs):
        out[i] = _with(out[i], entry_bytes=_streams.entry_bytes_for(payload), runs=runs)
    return out, layout


def _array_record(rec: LeafRecord, **fields: Any) -> LeafRecord:
    """The record of array leaf ``rec`` (a template) with ``fields``: chunk shape clipped
    to the shape, storage dtype and byte count filled in."""
    itemsize = _dtypes.DTYPES[_dtypes.dtype_name(rec.dtype)].itemsize
    if len(rec.chunk_shape) != len(rec.shape):
        raise CheckpointError(f"Leaf '{rec.path}': chunk shape {rec.chunk_shape} does not fit shape {rec.shape}")
    chunk_shape = tuple(max(1, min(int(c), max(s, 1))) for c, s in zip(rec.chunk_shape, rec.shape))
    return LeafRecord(
        path=rec.path, kind=rec.kind, dtype=rec.dtype, shape=tuple(rec.shape), scalar=rec.scalar,
        impl=rec.impl, key_ndim=rec.key_ndim, sharding=rec.sharding, chunk_shape=chunk_shape,
        storage_dtype=_dtypes.storage_dtype_name(rec.dtype), nbytes=math.prod(rec.shape) * itemsize, **fields)


def _with(rec: LeafRecord, **fields: Any) -> LeafRecord:
    return LeafRecord(**{**{f: getattr(rec, f) for f in rec.__dataclass_fields__}, **fields})


def _cells(rec: LeafRecord) -> Iterator[tuple[tuple[int, ...], _layout.Index]]:
    """Every chunk of ``rec`` in C order, with the region it covers."""
    for cell in _layout.chunk_cells(rec.shape, rec.chunk_shape):
        yield cell, _layout.chunk_region(cell, rec.chunk_shape, rec.shape)


# Writes one leaf: (its record, its chunks' producer, whether that is a held leaf's views).
_LeafWriter = Callable[[LeafRecord, Callable[[_layout.Index], np.ndarray], bool], None]


def _each_leaf(records: list[LeafRecord], chunk_data: Callable[[int, LeafRecord], ChunkData],
               progress: Callable[[int, int], None] | None, final: Location, write: _LeafWriter) -> None:
    """Every array leaf in order: its data asked for, checked and written; progress after
    each. A failure names the leaf (a ``CheckpointError`` passes as it is)."""
    total = sum(r.nbytes for r in records)
    done = 0
    for i, rec in enumerate(records):
        if rec.kind == "value":
            continue
        try:
            data = chunk_data(i, rec)
            held = isinstance(data, np.ndarray)
            if held and tuple(data.shape) != tuple(rec.shape):
                raise CheckpointError(f"Leaf '{rec.path}': data of shape {data.shape}, expected {rec.shape}")
            if held:
                data = functools.partial(_view, data)
            write(rec, data, held)
            del data  # the producer's buffer goes before the next leaf's arrives
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - named for the user, chained for the details
            raise CheckpointError(f"Writing checkpoint '{final}': leaf '{rec.path}' failed: {e}") from e
        done += rec.nbytes
        if progress is not None:
            progress(done, total)


def _write_leaves(staging: Location, records: list[LeafRecord], packed: tuple[PackedArray, ...],
                  chunk_data: Callable[[int, LeafRecord], ChunkData],
                  progress: Callable[[int, int], None] | None, final: Location) -> None:
    packer = _PackedStream(staging, packed[0]) if packed else None

    def write(rec: LeafRecord, data: Callable[[_layout.Index], np.ndarray], held: bool) -> None:
        if rec.store == "file":
            _write_file_leaf(staging, rec, data, held)
            return
        for (_, offset), (_, region) in zip(rec.chunks, _cells(rec)):
            packer.put(offset, _stored(rec, _chunk(rec, region, data)).reshape(-1).view(np.uint8))

    _each_leaf(records, chunk_data, progress, final, write)
    if packer is not None:
        try:
            packer.close()
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - as above
            raise CheckpointError(f"Writing checkpoint '{final}': the packed small leaves failed: {e}") from e


def _write_stream(data: Location, snap: Snapshot, chunk_data: Callable[[int, LeafRecord], ChunkData],
                  progress: Callable[[int, int], None] | None, final: Location) -> None:
    """Format 3: every leaf's chunks as entries of process 0's stream, leaf after leaf,
    then the stream made durable (``close``). A failure abandons it unsynced."""
    length = snap.streams.get(0, 0)
    if not length:  # no array holds an element: no data object
        _each_leaf(snap.records, chunk_data, progress, final, lambda rec, data, held: None)
        return
    root = data.child(_writer.STREAM_DIR)
    with _dataobjects.StreamWriter(root, 0, length, snap.segment_bytes) as stream:
        _each_leaf(snap.records, chunk_data, progress, final, functools.partial(_write_stream_leaf, stream))
        try:
            stream.close()
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - as in _write_leaves
            raise CheckpointError(f"Writing checkpoint '{final}': its data objects failed: {e}") from e


def _write_stream_leaf(stream: _dataobjects.StreamWriter, rec: LeafRecord,
                       data: Callable[[_layout.Index], np.ndarray], held: bool) -> None:
    """One leaf's entries, at the offsets its runs give: on a few threads, fewer when
    each entry may be a copy of its chunk (at most ``STREAM_BUDGET_BYTES`` of copies in
    flight, one at least); a leaf of one chunk in this thread."""
    stride = _streams.stride_for(rec.entry_bytes)
    grid = _layout.chunk_grid_shape(rec.shape, rec.chunk_shape)
    cells = list(_cells(rec))  # none for a leaf without elements
    if len(cells) <= 1:
        for cell, region in cells:
            _write_entry(stream, rec, data, stride, grid, cell, region)
        return
    chunk_bytes = rec.entry_bytes - _streams.CRC_BYTES
    threads = _writer.WRITE_THREADS
    if not (held and _views_in_place(rec, data, cells[0][1])):  # copies: BLOCK_BYTES each where
        whole = not (stream.blockwise and _no_edge_chunks(rec))  # written block by block, else whole
        copy = chunk_bytes if whole else min(chunk_bytes, BLOCK_BYTES)
        threads = max(1, min(threads, STREAM_BUDGET_BYTES // max(1, copy)))
    _tasks.run_tasks([functools.partial(_write_entry, stream, rec, data, stride, grid, cell, region)
                      for cell, region in cells], threads)


def _views_in_place(rec: LeafRecord, data: Callable[[_layout.Index], np.ndarray], region: _layout.Index) -> bool:
    """Whether a held leaf's chunks are its entries' payloads as they are (a contiguous
    view of the leaf's dtype; its first chunk tells, as the chunks are alike but at the
    edges, which are copied anyway)."""
    piece = data(region)
    return piece.dtype == _dtypes.DTYPES[rec.dtype] and piece.flags.c_contiguous


def _no_edge_chunks(rec: LeafRecord) -> bool:
    """Whether every chunk of ``rec`` is whole (its chunk shape divides its shape)."""
    return all(n % c == 0 for n, c in zip(rec.shape, rec.chunk_shape))


def _write_entry(stream: _dataobjects.StreamWriter, rec: LeafRecord, data: Callable[[_layout.Index], np.ndarray],
                 stride: int, grid: tuple[int, ...], cell: tuple[int, ...], region: _layout.Index) -> None:
    """Chunk ``cell`` written as its entry: a whole chunk that needs a copy (a cast, a
    strided view) ``BLOCK_BYTES`` at a time where the stream takes blocks (as format 1's
    chunk files are written), anything else in one piece (``entry_payload``)."""
    _, offset = _streams.locate(rec.runs, _layout.chunk_flat_index(cell, grid), stride)
    piece = _chunk(rec, region, data)
    dtype, storage = _dtypes.DTYPES[rec.dtype], _dtypes.DTYPES[rec.storage_dtype]
    in_place = piece.dtype == dtype and piece.flags.c_contiguous
    swap = sys.byteorder != "little" and storage.itemsize > 1
    if stream.blockwise and not in_place and not swap and piece.shape == tuple(rec.chunk_shape):
        blocks = (b.view(storage) for b in cast_blocks(piece, dtype, BLOCK_BYTES))
        stream.write_entry_blocks(offset, blocks, piece.size * storage.itemsize)
        return
    stream.write_entry(offset, entry_payload(rec, piece))


def entry_payload(rec: LeafRecord, piece: np.ndarray) -> np.ndarray:
    """A chunk's entry payload (the full ``chunk_shape`` in the storage dtype, C order,
    little endian): ``piece`` itself when it is that already; otherwise one pass that
    casts, gathers a strided view and pads an edge chunk with zeros into a buffer of its
    own, an anonymous mapping unmapped when freed (as ``cast_blocks``' scratch: copies
    freed on a few threads would otherwise stay in malloc's per-thread arenas)."""
    dtype, storage = _dtypes.DTYPES[rec.dtype], _dtypes.DTYPES[rec.storage_dtype]
    swap = sys.byteorder != "little" and storage.itemsize > 1
    if piece.dtype == dtype and piece.flags.c_contiguous and piece.shape == tuple(rec.chunk_shape) and not swap:
        return piece.view(storage)
    nbytes = math.prod(rec.chunk_shape) * storage.itemsize
    full = np.frombuffer(mmap.mmap(-1, max(nbytes, 1)), np.uint8)[:nbytes].view(storage).reshape(rec.chunk_shape)
    within = tuple(slice(0, n) for n in piece.shape) or ...  # (full[()] of a 0-d array is no view)
    np.copyto(full[within].view(dtype), piece, casting="unsafe")
    if swap:
        full.byteswap(inplace=True)
    return full


def limit_malloc_retention(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Make glibc's malloc map every allocation of ``threshold`` bytes or more on its own
    and unmap it when freed (``mallopt(M_MMAP_THRESHOLD)``); ``False`` where that is not
    available (not glibc), or when ``JAXCKPT_KEEP_MALLOC`` is set (to anything but ``0``):
    then malloc is left alone. Process-wide and for the rest of the process (glibc has no
    call to read the setting back, so it cannot be restored): the ``jaxckpt`` conversion
    commands and ``convert.from_orbax`` call it, and it is checked here so that each of
    them honours the variable; nothing else in the library does.

    Why: chunks that tensorstore decodes on its threads (orbax's compressed chunks) are
    freed into malloc's per-thread arenas, which keep them, and ``malloc_trim`` does not
    get them back; an orbax import then peaks near 2× the largest leaf instead of 1×
    (``benchmarks/convert_rss.py`` measures both). ``MALLOC_MMAP_THRESHOLD_=1048576`` in
    the environment does the same for any process.
    """
    if os.environ.get(KEEP_MALLOC_ENV, "") not in ("", "0") or not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, int(threshold)))


def _view(leaf: np.ndarray, index: _layout.Index) -> np.ndarray:
    return leaf[_layout.index_to_slices(index)]


def _chunk(rec: LeafRecord, region: _layout.Index, data: Callable[[_layout.Index], np.ndarray]) -> np.ndarray:
    """Chunk ``region`` of ``rec`` from the producer, its shape checked."""
    piece = data(region)
    if tuple(piece.shape) != _layout.index_shape(region):
        raise CheckpointError(f"Leaf '{rec.path}': chunk {region} came as shape {piece.shape}")
    return piece


def _stored(rec: LeafRecord, piece: np.ndarray) -> np.ndarray:
    """``piece`` cast to the leaf's dtype, contiguous, viewed as its storage dtype."""
    dtype = _dtypes.DTYPES[rec.dtype]
    piece = piece if piece.dtype == dtype else piece.astype(dtype)
    if not piece.flags.c_contiguous:  # (np.ascontiguousarray would make a 0-d array 1-d)
        piece = piece.copy(order="C")
    return piece.view(_dtypes.DTYPES[rec.storage_dtype])


def _write_file_leaf(staging: Location, rec: LeafRecord, data: Callable[[_layout.Index], np.ndarray],
                     held: bool) -> None:
    """One big leaf, chunk by chunk, on a few threads; when the chunks are not views of
    a ``held`` leaf, fewer for big chunks (at most ``STREAM_BUDGET_BYTES`` in flight)."""
    spec = _zarr.array_spec(staging, rec.key, rec.shape, rec.chunk_shape, rec.storage_dtype)
    store = _zarr.open_array(spec, _kvstore.context(staging), create=True).result()
    storage = _dtypes.DTYPES[rec.storage_dtype]
    direct = (_writer.DIRECT_WRITES and staging.local is not None
              and (storage.itemsize == 1 or sys.byteorder == "little"))
    cells = list(_cells(rec))
    dirs = set()
    if direct:
        dirs = {os.path.dirname(_chunkfiles.chunk_file(staging, rec.key, cell)) for cell, _ in cells}
        for d in sorted(dirs):
            os.makedirs(d, exist_ok=True)
    chunk_bytes = math.prod(rec.chunk_shape) * storage.itemsize
    threads = _writer.WRITE_THREADS if held else max(1, min(_writer.WRITE_THREADS, STREAM_BUDGET_BYTES // chunk_bytes))
    _tasks.run_tasks([functools.partial(_write_chunk, staging, rec, store, data, cell, region, direct)
                      for cell, region in cells], threads)
    for d in _writer.parents_up_to(dirs, staging.local):
        _kvstore.fsync_dir(d)


def _write_chunk(staging: Location, rec: LeafRecord, store: Any, data: Callable[[_layout.Index], np.ndarray],
                 cell: tuple[int, ...], region: _layout.Index, direct: bool) -> None:
    """One chunk: a whole one on a local disk straight to its chunk file (as ``_writer``
    does; block by block when it is strided or needs a cast), anything else (edge
    chunks, which zarr stores at full size; object stores) through tensorstore."""
    piece = _chunk(rec, region, data)
    dtype, storage = _dtypes.DTYPES[rec.dtype], _dtypes.DTYPES[rec.storage_dtype]
    if direct and _layout.index_shape(region) == tuple(rec.chunk_shape):
        path = _chunkfiles.chunk_file(staging, rec.key, cell)
        if piece.dtype == dtype and piece.flags.c_contiguous:
            _chunkfiles.write_chunk_file(path, piece.view(storage), rec.key)
        else:
            write_chunk_blocks(path, piece, dtype, storage, rec.key)
        return
    _zarr.write_region(store, region, _stored(rec, piece), rec.key).result()


def write_chunk_blocks(path: str, piece: np.ndarray, dtype: np.dtype, storage: np.dtype, key: str) -> None:
    """Write one whole zarr3 chunk (``bytes`` + ``crc32c``) from a strided or uncast view,
    ``BLOCK_BYTES`` at a time: the bytes ``_chunkfiles.write_chunk_file`` writes."""
    _storage.fault("write", key)
    _storage.count(bytes_written=piece.size * dtype.itemsize, writes=1)
    crc = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for block in cast_blocks(piece, dtype, BLOCK_BYTES):
            view = memoryview(block.view(storage).reshape(-1).view(np.uint8))
            crc = crc32c.crc32c(view, crc)
            done = 0
            while done < len(view):
                done += os.write(fd, view[done:])
        os.write(fd, crc.to_bytes(4, "little"))
        os.fsync(fd)
    finally:
        os.close(fd)


def cast_blocks(x: np.ndarray, dtype: np.dtype, limit: int) -> Iterator[np.ndarray]:
    """``x`` as C-contiguous arrays of ``dtype``, in C order: views of ``x`` where it is
    contiguous and of ``dtype`` already, otherwise copies of at most ``limit`` bytes into
    one scratch buffer (each valid until the next is asked for).

    The scratch buffer is an anonymous mapping of its own, unmapped when done: copies
    made with ``numpy`` on a few threads, leaf after leaf, otherwise stay in malloc's
    per-thread arenas and the process grows by that much per leaf.
    """
    scratch = None
    for block in c_order_blocks(x, limit):
        if block.dtype == dtype and block.flags.c_contiguous:
            yield block
            continue
        nbytes = block.size * dtype.itemsize
        if scratch is None or len(scratch) < nbytes:
            scratch = np.frombuffer(mmap.mmap(-1, max(nbytes, 1)), np.uint8)
        out = scratch[:nbytes].view(dtype).reshape(block.shape)
        np.copyto(out, block, casting="unsafe")
        yield out


def c_order_blocks(x: np.ndarray, limit: int) -> Iterator[np.ndarray]:
    """Views of ``x`` that, one after another, are its elements in C order; each one is
    at most ``limit`` bytes, unless one element is bigger (so a copy or cast of one
    costs at most ``limit``)."""
    if x.ndim == 0 or x.nbytes <= limit:
        yield x
        return
    row = x[0].nbytes
    if x.ndim > 1 and row > limit:
        for r in x:
            yield from c_order_blocks(r, limit)
        return
    step = max(1, limit // max(1, row))
    for a in range(0, len(x), step):
        yield x[a:a + step]


class _PackedStream:
    """The packed array written one stored chunk at a time, as the small leaves arrive
    in offset order (gaps are the zeroed alignment padding)."""

    def __init__(self, staging: Location, packed: PackedArray):
        spec = _zarr.packed_spec(staging, packed.process, packed.nbytes, packed.chunk_bytes)
        self._store = _zarr.open_array(spec, _kvstore.context(staging), create=True)
        self._key = f"packed/p{packed.process}"
        self._total, self._size = packed.nbytes, packed.chunk_bytes
        self._start = 0
        self._buf = np.zeros(min(self._size, self._total), np.uint8)

    def put(self, offset: int, data: np.ndarray) -> None:
        while len(data):
            end = self._start + len(self._buf)
            if offset >= end:
                self._flush()
                continue
            n = min(len(data), end - offset)
            self._buf[offset - self._start:offset - self._start + n] = data[:n]
            offset, data = offset + n, data[n:]

    def _flush(self) -> None:
        region = ((self._start, self._start + len(self._buf)),)
        _zarr.write_region(self._store.result(), region, self._buf, self._key).result()
        self._start += len(self._buf)
        self._buf = np.zeros(min(self._size, self._total - self._start), np.uint8)

    def close(self) -> None:
        while self._start < self._total:
            self._flush()
