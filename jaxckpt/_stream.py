"""Writing a checkpoint leaf by leaf from host data (offline conversion: ``convert``).

``save`` snapshots a whole tree before it writes; a conversion cannot hold a whole
checkpoint in memory. Here the caller gives the leaf records up front (path, dtype,
shape, chunk shape, sharding description) and, per leaf, a function that hands out
each chunk's data; the leaves are written one after another, so host memory stays near
the largest leaf (the producer's buffer) plus a few bounded write buffers:

* big leaves (≥ ``_snapshot.SMALL_LEAF_BYTES``): their zarr3 array through
  ``_writer.write_data`` (whole chunks as chunk files, the rest through tensorstore).
  A whole chunk that is a strided view (a column block of a row-major buffer) or needs
  a cast is written to its chunk file a block at a time (``BLOCK_BYTES``), with the
  same bytes and crc32c trailer as ``_chunkfiles.write_chunk_file``, instead of being
  copied whole first.
* small leaves: laid out as ``_snapshot`` lays them out (``_layout.pack_offsets``, one
  writing process), streamed into the packed array one stored chunk at a time.

Then the manifest is written last and the staging location committed
(``_commit.prepare``/``commit``). Single process only.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import crc32c
import numpy as np

from . import (
    _chunkfiles,
    _commit,
    _distributed,
    _dtypes,
    _iostats,
    _layout,
    _location,
    _storage,
    _tasks,
    _writer,
    _zarr,
)
from ._checkpoint import build_manifest
from ._errors import CheckpointError
from ._location import Location
from ._manifest import LeafRecord, Manifest, PackedArray
from ._snapshot import PACK_CHUNK_BYTES, SMALL_LEAF_BYTES, Snapshot

# Bytes copied (or cast) at a time when a chunk is not a plain contiguous buffer.
BLOCK_BYTES = 8 << 20

# chunk_data(i, record) -> a function from a chunk's index to its data (any dtype that
# casts to the record's; a view is fine). Called once per array leaf, in order.
ChunkData = Callable[[_layout.Index], np.ndarray]


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
    records, packed = plan(leaves)
    token = _commit.new_token()
    staging = _commit.prepare(final, token, overwrite)
    committed = False
    try:
        t0 = time.perf_counter()
        _write_leaves(staging, records, packed, chunk_data, progress)
        extra = {"write_seconds": round(time.perf_counter() - t0, 6), **(info or {})}
        manifest = build_manifest(Snapshot(structure, records, {}, packed, None, 0), metadata, extra)
        _commit.commit(final, staging, manifest.to_bytes(), token)
        committed = True
    finally:
        if not committed:
            _commit.abort(final, staging)
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
        itemsize = _dtypes.DTYPES[_dtypes.dtype_name(rec.dtype)].itemsize
        chunk_shape = tuple(max(1, min(int(c), max(s, 1))) for c, s in zip(rec.chunk_shape, rec.shape))
        if len(chunk_shape) != len(rec.shape):
            raise CheckpointError(f"Leaf '{rec.path}': chunk shape {rec.chunk_shape} does not fit shape {rec.shape}")
        nbytes = math.prod(rec.shape) * itemsize
        store = "packed" if nbytes < SMALL_LEAF_BYTES else "file"
        out.append(LeafRecord(
            path=rec.path, kind=rec.kind, dtype=rec.dtype, shape=tuple(rec.shape), scalar=rec.scalar,
            impl=rec.impl, key_ndim=rec.key_ndim, sharding=rec.sharding, store=store, key=str(i),
            chunk_shape=chunk_shape, storage_dtype=_dtypes.storage_dtype_name(rec.dtype), nbytes=nbytes))
        if store == "packed":
            small.append(i)
    sizes = [[(0, _layout.index_size(region) * _dtypes.DTYPES[out[i].dtype].itemsize) for _, region in _cells(out[i])]
             for i in small]
    offsets, totals = _layout.pack_offsets(sizes)
    for i, offs in zip(small, offsets):
        out[i] = _with_chunks(out[i], tuple((0, o) for o in offs))
    # zarr stores an edge chunk at full size, so split evenly (as _snapshot does)
    packed = tuple(PackedArray(p, n, -(-n // -(-n // PACK_CHUNK_BYTES))) for p, n in sorted(totals.items()))
    return out, packed


def _with_chunks(rec: LeafRecord, chunks: tuple[tuple[int, int], ...]) -> LeafRecord:
    fields = {f: getattr(rec, f) for f in rec.__dataclass_fields__}
    return LeafRecord(**{**fields, "chunks": chunks})


def _cells(rec: LeafRecord) -> Iterator[tuple[tuple[int, ...], _layout.Index]]:
    """Every chunk of ``rec`` in C order, with the region it covers."""
    for cell in _layout.chunk_cells(rec.shape, rec.chunk_shape):
        yield cell, _layout.chunk_region(cell, rec.chunk_shape, rec.shape)


def _write_leaves(staging: Location, records: list[LeafRecord], packed: tuple[PackedArray, ...],
                  chunk_data: Callable[[int, LeafRecord], ChunkData],
                  progress: Callable[[int, int], None] | None) -> None:
    packer = _PackedStream(staging, packed[0]) if packed else None
    total = sum(r.nbytes for r in records)
    done = 0
    for i, rec in enumerate(records):
        if rec.kind == "value":
            continue
        try:
            data = chunk_data(i, rec)
            if rec.store == "file":
                _write_file_leaf(staging, rec, data)
            else:
                for (_, offset), (_, region) in zip(rec.chunks, _cells(rec)):
                    packer.put(offset, _stored(rec, _chunk(rec, region, data)).view(np.uint8).reshape(-1))
            del data  # the producer's buffer goes before the next leaf's arrives
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - named for the user, chained for the details
            raise CheckpointError(f"Writing checkpoint '{staging}': leaf '{rec.path}' failed: {e}") from e
        done += rec.nbytes
        if progress is not None:
            progress(done, total)
    if packer is not None:
        try:
            packer.close()
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - as above
            raise CheckpointError(f"Writing checkpoint '{staging}': the packed small leaves failed: {e}") from e


def _chunk(rec: LeafRecord, region: _layout.Index, data: ChunkData) -> np.ndarray:
    """Chunk ``region`` of ``rec`` from the producer, its shape checked."""
    piece = data(region)
    if tuple(piece.shape) != _layout.index_shape(region):
        raise CheckpointError(f"Leaf '{rec.path}': chunk {region} came as shape {piece.shape}")
    return piece


def _stored(rec: LeafRecord, piece: np.ndarray) -> np.ndarray:
    """``piece`` cast to the leaf's dtype, contiguous, viewed as its storage dtype."""
    dtype = _dtypes.DTYPES[rec.dtype]
    piece = piece if piece.dtype == dtype else piece.astype(dtype)
    return np.ascontiguousarray(piece).view(_dtypes.DTYPES[rec.storage_dtype])


def _write_file_leaf(staging: Location, rec: LeafRecord, data: ChunkData) -> None:
    """One big leaf: whole plain chunks through ``_writer`` (direct chunk files on a local
    disk), strided or cast whole chunks to their chunk files a block at a time, the rest
    (edge chunks, which zarr stores at full size; object stores) through tensorstore,
    one copy at a time."""
    dtype, storage = _dtypes.DTYPES[rec.dtype], _dtypes.DTYPES[rec.storage_dtype]
    blockwise = staging.local is not None and (storage.itemsize == 1 or sys.byteorder == "little")
    plain, blocked, copied = [], [], []
    for cell, region in _cells(rec):
        piece = _chunk(rec, region, data)
        whole = _layout.index_shape(region) == tuple(rec.chunk_shape)
        if whole and piece.dtype == dtype and piece.flags.c_contiguous:
            plain.append((region, piece))
        elif whole and blockwise:
            blocked.append((_chunkfiles.chunk_file(staging, rec.key, cell), piece))
        else:
            copied.append((region, piece))
    spec = _zarr.array_spec(staging, rec.key, rec.shape, rec.chunk_shape, rec.storage_dtype)
    ctx = _storage.context(staging)
    if plain:  # _writer creates the array
        _writer.write_data(staging, Snapshot({}, [rec], {0: plain}, (), None, 0))
    else:
        _zarr.open_array(spec, ctx, create=True).result()
    if copied:
        store = _zarr.open_array(spec, ctx, create=False).result()
        for region, piece in copied:
            _zarr.write_region(store, region, _stored(rec, piece), rec.key).result()
    if blocked:
        dirs = {os.path.dirname(p) for p, _ in blocked}
        for d in dirs:
            os.makedirs(d, exist_ok=True)
        _tasks.run_tasks([_blocked_write(p, piece, dtype, storage, rec.key) for p, piece in blocked],
                         _writer.WRITE_THREADS)
        for d in _writer._parents_up_to(dirs, staging.local):
            _storage.fsync_dir(d)


def _blocked_write(path: str, piece: np.ndarray, dtype: np.dtype, storage: np.dtype, key: str) -> Callable[[], None]:
    def task() -> None:
        write_chunk_blocks(path, piece, dtype, storage, key)

    return task


def write_chunk_blocks(path: str, piece: np.ndarray, dtype: np.dtype, storage: np.dtype, key: str) -> None:
    """Write one whole zarr3 chunk (``bytes`` + ``crc32c``) from a strided or uncast view,
    ``BLOCK_BYTES`` at a time: the bytes ``_chunkfiles.write_chunk_file`` writes."""
    _iostats.fault("write", key)
    nbytes = piece.size * dtype.itemsize
    _iostats.count(bytes_written=nbytes, writes=1)
    crc = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for block in c_order_blocks(piece, BLOCK_BYTES):
            out = np.ascontiguousarray(block if block.dtype == dtype else block.astype(dtype)).view(storage)
            view = memoryview(out.reshape(-1).view(np.uint8))
            crc = crc32c.crc32c(view, crc)
            done = 0
            while done < len(view):
                done += os.write(fd, view[done:])
        os.write(fd, crc.to_bytes(4, "little"))
        os.fsync(fd)
    finally:
        os.close(fd)


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
        self._store = _zarr.open_array(spec, _storage.context(staging), create=True)
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
