"""The data half of a save: take host buffers of everything this process writes
(``snapshot``), then write them through tensorstore (``write_data``).

After ``snapshot`` returns the caller may donate, delete or overwrite what it passed:
big shards are host views jax keeps alive for us (on CPU zero-copy; a jitted call does
not donate a buffer a view still holds), small leaves are copied into one packed
buffer, and numpy leaves are copied when the save continues in the background.
"""

from __future__ import annotations

import collections
import functools
import math
import os
import sys
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from . import _distributed, _layout, _storage, _tree
from ._errors import CheckpointError
from ._manifest import LeafRecord, PackedArray
from ._storage import Location

# Leaves smaller than this are packed into one byte array per process; bigger ones get
# a zarr3 array of their own with one file per shard.
SMALL_LEAF_BYTES = 1 << 20
PACK_CHUNK_BYTES = 4 << 20
# Bytes of writes in flight at once: bounds tensorstore's encode buffers (host memory)
# while keeping the disk busy.
WRITE_BUDGET_BYTES = 256 << 20
WRITE_THREADS = 4
# Whole shards of big leaves on a local disk are written without tensorstore (see
# _storage.write_chunk_file); False sends every write through tensorstore.
DIRECT_WRITES = True


@dataclass
class Snapshot:
    """What the writing half of a save needs once the caller's arrays may be gone."""

    structure: dict[str, Any]
    records: list[LeafRecord]
    file_shards: dict[int, list[tuple[_layout.Index, np.ndarray]]]  # leaf -> this process's shards
    packed: tuple[PackedArray, ...]  # every process's packed array
    packed_buf: np.ndarray | None  # this process's packed bytes
    nbytes_local: int  # host bytes this snapshot holds


def is_inline(x: Any) -> bool:
    return x is None or isinstance(x, (bool, int, float, str))


def is_prng(x: Any) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _cell_of(index: _layout.Index, chunk_shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(a // c for (a, _), c in zip(index, chunk_shape))


def snapshot(tree: Any, *, copy_host_arrays: bool) -> Snapshot:
    """Flatten ``tree`` and take host buffers of every shard this process must write.

    With ``copy_host_arrays`` numpy leaves are copied, so the caller may mutate them
    once this returns.
    """
    with _tree.gc_paused():
        return _snapshot(tree, copy_host_arrays)


def _snapshot(tree: Any, copy_host_arrays: bool) -> Snapshot:
    flat, _ = _tree.flatten(tree)
    structure = _tree.describe(tree)
    me = _distributed.process_index()
    records: list[LeafRecord | None] = []
    # per array leaf: (position, record fields, [(index, data)], [(writer, nbytes)] per chunk)
    arrays: list[tuple[int, dict[str, Any], list[tuple[_layout.Index, Any]], list[tuple[int, int]]]] = []
    for i, (path, leaf) in enumerate(flat):
        if is_inline(leaf):
            records.append(LeafRecord(path=path, kind="value", value=leaf))
            continue
        fields: dict[str, Any] = {"path": path, "kind": "array", "key": str(i)}
        if is_prng(leaf):
            fields.update(kind="prng_key", impl=str(jax.random.key_impl(leaf)), key_ndim=leaf.ndim)
            leaf = jax.random.key_data(leaf)
        if isinstance(leaf, np.generic):
            leaf, fields["scalar"] = np.asarray(leaf), True
        if isinstance(leaf, jax.Array):
            shape = tuple(leaf.shape)
            sharding = leaf.sharding
            chunk_shape = _layout.chunk_shape_for(sharding, shape)
            replica0 = _layout.replica0_devices(sharding, shape)
            local = []
            for shard in leaf.addressable_shards:
                index = replica0.get(shard.device)
                if index is not None:
                    if shard.device.platform != "cpu":
                        shard.data.copy_to_host_async()  # start every transfer before waiting on any
                    local.append((index, shard.data))
            grid = _layout.chunk_grid_shape(shape, chunk_shape)
            writers = [0] * math.prod(grid)
            for device, index in replica0.items() if writers else ():
                writers[_layout.chunk_flat_index(_cell_of(index, chunk_shape), grid)] = device.process_index
            sharding_json = _layout.sharding_to_json(sharding)
        elif isinstance(leaf, np.ndarray):
            shape = tuple(leaf.shape)
            chunk_shape = tuple(max(1, d) for d in shape)
            full = tuple((0, d) for d in shape)
            data = np.array(leaf, order="C", copy=True) if copy_host_arrays else np.asarray(leaf, order="C")
            # A host array is the same in every process: process 0 writes it.
            local = [(full, data)] if me == 0 else []
            writers = [0] if 0 not in shape else []
            sharding_json = None
        else:
            raise CheckpointError(
                f"Leaf '{path}' has type {type(leaf).__name__}, which cannot be saved: use "
                "jax/numpy arrays or int/float/bool/str/None"
            )
        dtype = _storage.dtype_name(leaf.dtype)
        itemsize = _storage.DTYPES[dtype].itemsize
        nbytes = math.prod(shape) * itemsize
        fields.update(dtype=dtype, shape=shape, sharding=sharding_json, chunk_shape=chunk_shape,
                      storage_dtype=_storage.storage_dtype_name(dtype), nbytes=nbytes,
                      store="packed" if nbytes < SMALL_LEAF_BYTES else "file")
        chunk_bytes = [
            _layout.index_size(_layout.chunk_region(cell, chunk_shape, shape)) * itemsize
            for cell in _layout.chunk_cells(shape, chunk_shape)
        ]
        arrays.append((len(records), fields, local, list(zip(writers, chunk_bytes))))
        records.append(None)

    # Lay out the small leaves of every process (the same answer everywhere).
    small = [a for a in arrays if a[1]["store"] == "packed"]
    offsets, sizes = _layout.pack_offsets([a[3] for a in small])
    # zarr stores an edge chunk at full size, so split evenly instead of in 4 MiB pieces
    packed = tuple(PackedArray(p, n, -(-n // -(-n // PACK_CHUNK_BYTES))) for p, n in sorted(sizes.items()))
    packed_buf = None
    if sizes.get(me):
        # zeros, not empty: alignment padding must not carry stale process memory to disk
        packed_buf = np.zeros(sizes[me], np.uint8)
    for (slot, fields, _, chunks), offs in zip(small, offsets):
        fields["chunks"] = tuple((w, off) for (w, _), off in zip(chunks, offs))

    file_shards: dict[int, list[tuple[_layout.Index, np.ndarray]]] = {}
    total = 0 if packed_buf is None else packed_buf.nbytes
    for slot, fields, local, _ in arrays:
        rec = LeafRecord(**fields)
        records[slot] = rec
        storage = _storage.DTYPES[rec.storage_dtype]
        if rec.store == "file":
            bufs = []
            for index, data in local:
                host = data if isinstance(data, np.ndarray) else np.asarray(data)
                bufs.append((index, host))
                total += host.nbytes
            file_shards[slot] = bufs
            continue
        grid = _layout.chunk_grid_shape(rec.shape, rec.chunk_shape)
        for index, data in local:
            if _layout.index_size(index) == 0:
                continue
            host = np.asarray(data)
            _, offset = rec.chunks[_layout.chunk_flat_index(_cell_of(index, rec.chunk_shape), grid)]
            view = packed_buf[offset:offset + host.nbytes].view(storage).reshape(host.shape)
            view[...] = host.view(storage)
    return Snapshot(structure, records, file_shards, packed, packed_buf, total)


def write_data(staging: Location, snap: Snapshot) -> None:
    """Write this process's part of every leaf, all in flight at once; return when every
    write is durable.

    Whole shards of big leaves on a local disk are written as zarr3 chunk files directly
    (``_storage.write_chunk_file``: no encode copy, hardware crc32c) by a few threads;
    everything else (the packed small leaves, object stores) goes through tensorstore,
    within a byte budget that bounds its encode buffers.
    """
    me = _distributed.process_index()
    ctx = _storage.new_context(staging)
    direct = DIRECT_WRITES and staging.local is not None
    opens = []
    if snap.packed_buf is not None:
        mine = next(p for p in snap.packed if p.process == me)
        spec = _storage.packed_spec(staging, me, mine.nbytes, mine.chunk_bytes)
        opens.append((None, _storage.open_array(spec, ctx, create=True)))
    for slot, shards in snap.file_shards.items():
        rec = snap.records[slot]
        spec = _storage.array_spec(staging, rec.key, rec.shape, rec.chunk_shape, rec.storage_dtype)
        # Process 0 writes each array's zarr.json; the others open blind from the spec.
        if shards or me == 0:
            opens.append((slot, _storage.open_array(spec, ctx, create=me == 0)))
    in_flight: collections.deque = collections.deque()
    budget = 0
    direct_jobs: list[Any] = []
    dirs: set[str] = set()
    try:
        for slot, fut in opens:
            store = fut.result()
            if slot is None:
                jobs = [((), snap.packed_buf, f"packed/p{me}", None)]
            else:
                rec = snap.records[slot]
                storage = _storage.DTYPES[rec.storage_dtype]
                little = storage.itemsize == 1 or sys.byteorder == "little"
                jobs = []
                for index, data in snap.file_shards[slot]:
                    if not data.size:
                        continue
                    path = None
                    if direct and little and data.flags.c_contiguous:
                        path = _storage.chunk_file(staging, rec.key, _cell_of(index, rec.chunk_shape))
                    jobs.append((index, data.view(storage), rec.key, path))
            for index, data, key, path in jobs:
                if path is not None:
                    parent = os.path.dirname(path)
                    if parent not in dirs:
                        os.makedirs(parent, exist_ok=True)
                        dirs.add(parent)
                    direct_jobs.append(functools.partial(_storage.write_chunk_file, path, data, key))
                    continue
                while in_flight and budget + data.nbytes > WRITE_BUDGET_BYTES:
                    n, done = in_flight.popleft()
                    done.result()
                    budget -= n
                in_flight.append((data.nbytes, _storage.write_region(store, index, data, key)))
                budget += data.nbytes
        _storage.run_tasks(direct_jobs, WRITE_THREADS)
        while in_flight:
            in_flight.popleft()[1].result()
        # The new chunk files' directory entries must be durable too.
        for d in _parents_up_to(dirs, staging.local):
            _storage.fsync_dir(d)
    except BaseException as e:
        # Let every started write settle first: none may land after the caller cleans up.
        for _, pending in in_flight:
            try:
                pending.result()
            except Exception:  # noqa: BLE001, S110 - the first error is the one reported
                pass
        if isinstance(e, CheckpointError) or not isinstance(e, Exception):
            raise
        raise CheckpointError(f"Writing checkpoint '{staging}' failed: {e}") from e


def _parents_up_to(dirs: set[str], root: str | None) -> list[str]:
    """``dirs`` and every directory between them and ``root`` (exclusive), deepest first."""
    out: set[str] = set()
    for d in dirs:
        while root is not None and d.startswith(root) and d != root and d not in out:
            out.add(d)
            d = os.path.dirname(d)
    return sorted(out, key=len, reverse=True)
