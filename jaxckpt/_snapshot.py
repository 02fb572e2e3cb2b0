"""The first half of a save: flatten the tree, plan which process writes which chunk
(replicated chunks balanced over their holders), and take host buffers of everything
this process writes (``snapshot``). ``_writer`` writes them.

After ``snapshot`` returns the caller may donate, delete or overwrite what it passed:
big shards are host views jax keeps alive for us (on CPU zero-copy; a jitted call does
not donate a buffer a view still holds), small leaves are copied into one packed
buffer, and numpy leaves are copied when the save continues in the background.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import numpy as np

from . import _distributed, _dtypes, _layout, _tree
from ._errors import CheckpointError
from ._manifest import MAX_INT_DIGITS, LeafRecord, PackedArray, int_fits

# Leaves smaller than this are packed into one byte array per process; bigger ones get
# a zarr3 array of their own with one file per shard.
SMALL_LEAF_BYTES = 1 << 20
PACK_CHUNK_BYTES = 4 << 20


@dataclass
class Snapshot:
    """What the writing half of a save needs once the caller's arrays may be gone."""

    structure: dict[str, Any]
    records: list[LeafRecord]
    file_shards: dict[int, list[tuple[_layout.Index, np.ndarray]]]  # leaf -> this process's shards
    packed: tuple[PackedArray, ...]  # every process's packed array
    packed_buf: np.ndarray | None  # this process's packed bytes
    nbytes_local: int  # host bytes this snapshot holds
    group: tuple[int, ...] = ()  # the processes sharing this process's directory; () = all


def is_inline(x: Any) -> bool:
    """Stored in the manifest's JSON rather than as an array.

    numpy scalars are 0-d arrays (``np.float64`` subclasses ``float`` but must come
    back as itself), except ``np.str_``/``np.bytes_``: inline, with their type recorded.
    """
    if isinstance(x, np.generic):
        return isinstance(x, (np.str_, np.bytes_))
    return x is None or isinstance(x, (bool, int, float, str))


def is_prng(x: Any) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def cell_of(index: _layout.Index, chunk_shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(a // c for (a, _), c in zip(index, chunk_shape))


def snapshot(tree: Any, *, copy_host_arrays: bool, group: tuple[int, ...] = ()) -> Snapshot:
    """Flatten ``tree`` and take host buffers of every shard this process must write.

    With ``copy_host_arrays`` numpy leaves are copied, so the caller may mutate them
    once this returns.

    ``group``: the processes that share this process's directory, when the job's
    processes do not all share one (a per-host local tier). Then each group writes a
    copy of every chunk its processes hold (balanced over them), so that every host's
    directory holds what its devices need; every array gets a file store of its own
    (chunk files are named by position, the same in every host's copy).
    """
    with _tree.gc_paused():
        return _snapshot(tree, copy_host_arrays, group)


def _snapshot(tree: Any, copy_host_arrays: bool, group: tuple[int, ...]) -> Snapshot:
    flat, _ = _tree.flatten(tree)
    structure = _tree.describe(tree)
    me = _distributed.process_index()
    records: list[LeafRecord | None] = []
    arrays: list[_ArrayLeaf] = []
    for i, (path, leaf) in enumerate(flat):
        if is_inline(leaf):
            if isinstance(leaf, int) and not int_fits(leaf):  # the reader would refuse it
                raise CheckpointError(f"Leaf '{path}': an int of more than {MAX_INT_DIGITS} digits "
                                      "cannot be saved")
            records.append(LeafRecord(path=path, kind="value", value=leaf))
            continue
        fields: dict[str, Any] = {"path": path, "kind": "array", "key": str(i)}
        if is_prng(leaf):
            fields.update(kind="prng_key", impl=str(jax.random.key_impl(leaf)), key_ndim=leaf.ndim)
            leaf = jax.random.key_data(leaf)
        if isinstance(leaf, np.generic):
            leaf, fields["scalar"] = np.asarray(leaf), True
        arrays.append(_plan_array(len(records), path, leaf, fields, copy_host_arrays))
        if group:
            arrays[-1].fields["store"] = "file"
        records.append(None)
    _assign(arrays, group)
    packed, packed_buf = _lay_out_packed(arrays, me)
    file_shards: dict[int, list[tuple[_layout.Index, np.ndarray]]] = {}
    total = 0 if packed_buf is None else packed_buf.nbytes
    _start_transfers(arrays, me)
    for leaf in arrays:
        rec = LeafRecord(**leaf.fields)
        records[leaf.slot] = rec
        mine = [(c, leaf.host(c)) for c, w in zip(leaf.chunks, leaf.writers) if w == me]
        if rec.store == "file":
            file_shards[leaf.slot] = [(c.region, data) for c, data in mine]
            total += sum(data.nbytes for _, data in mine)
        else:
            _copy_packed(rec, mine, packed_buf)
    return Snapshot(structure, records, file_shards, packed, packed_buf, total, group)


class _Chunk(NamedTuple):
    region: _layout.Index  # what the chunk covers (global coordinates)
    nbytes: int
    holders: tuple[int, ...]  # processes holding a copy: the candidates to write it
    shard: _layout.Index  # the saved shard it lies in


@dataclass
class _ArrayLeaf:
    """One array leaf while a snapshot is planned: its record fields, chunks in C order,
    this process's copy of each shard it holds, and (once assigned) each chunk's writer."""

    slot: int
    fields: dict[str, Any]
    chunks: list[_Chunk]
    local: dict[_layout.Index, Any]
    writers: list[int] = dataclasses.field(default_factory=list)

    def host(self, chunk: _Chunk) -> np.ndarray:
        data = self.local[chunk.shard]
        host = data if isinstance(data, np.ndarray) else np.asarray(data)
        if chunk.region == chunk.shard:
            return host
        return host[_layout.relative(chunk.region, chunk.shard)]  # a contiguous view: dim-0 split


def _plan_array(slot: int, path: str, leaf: Any, fields: dict[str, Any], copy_host_arrays: bool) -> _ArrayLeaf:
    """Shapes, chunks and the shards this process holds of one array leaf (no data moved)."""
    if isinstance(leaf, jax.Array):
        dtype = _dtypes.dtype_name(leaf.dtype)
        itemsize = _dtypes.DTYPES[dtype].itemsize
        shape, sharding = tuple(leaf.shape), leaf.sharding
        shards = _layout.shards_of(sharding, shape)
        chunk_shape = _layout.chunk_shape_for(sharding, shape, itemsize)
        by_device = {s.device: s for s in leaf.addressable_shards}
        local = {}
        for shard in shards:
            device = next((d for d in shard.devices if d in by_device), None)
            if device is not None:
                local[shard.index] = by_device[device].data
        sharding_json = _layout.sharding_to_json(sharding)
    elif isinstance(leaf, np.ndarray):
        dtype = _dtypes.dtype_name(leaf.dtype)
        itemsize = _dtypes.DTYPES[dtype].itemsize
        shape = tuple(leaf.shape)
        # A host array is the same in every process: all of them hold it, and share its writes.
        everyone = tuple(range(_distributed.process_count()))
        full = tuple((0, d) for d in shape)
        shards = (_layout.Shard(full, everyone, ()),)
        chunk_shape = _layout.split_chunk_shape(shape, len(everyone), itemsize)
        data = np.array(leaf, order="C", copy=True) if copy_host_arrays else np.asarray(leaf, order="C")
        local = {full: data}
        sharding_json = None
    else:
        raise CheckpointError(
            f"Leaf '{path}' has type {type(leaf).__name__}, which cannot be saved: use "
            "jax/numpy arrays or int/float/bool/str/None"
        )
    nbytes = math.prod(shape) * itemsize
    fields.update(dtype=dtype, shape=shape, sharding=sharding_json, chunk_shape=chunk_shape,
                  storage_dtype=_dtypes.storage_dtype_name(dtype), nbytes=nbytes,
                  store="packed" if nbytes < SMALL_LEAF_BYTES else "file")
    return _ArrayLeaf(slot, fields, _chunks(shape, chunk_shape, shards, itemsize), local)


def _chunks(shape: tuple[int, ...], chunk_shape: tuple[int, ...], shards: tuple[_layout.Shard, ...],
            itemsize: int) -> list[_Chunk]:
    cells = _layout.chunk_cells(shape, chunk_shape)
    if len(cells) == 1 and len(shards) == 1:  # the common small-leaf case
        region = _layout.chunk_region(cells[0], chunk_shape, shape)
        return [_Chunk(region, _layout.index_size(region) * itemsize, shards[0].processes, shards[0].index)]
    owner: dict[tuple[int, ...], _layout.Shard] = {}
    for shard in shards:
        for cell, _ in _layout.chunks_overlapping(shard.index, chunk_shape):
            owner[cell] = shard
    out = []
    for cell in cells:
        region = _layout.chunk_region(cell, chunk_shape, shape)
        shard = owner[cell]
        out.append(_Chunk(region, _layout.index_size(region) * itemsize, shard.processes, shard.index))
    return out


def _assign(arrays: list[_ArrayLeaf], group: tuple[int, ...]) -> None:
    """Every chunk's writer, balanced over the whole tree (the same plan in every process).

    With a ``group``, each chunk that a process of the group holds gets a writer among
    those (``-1``: nobody in the group holds it, so the group writes no copy of it)."""
    chunks = [c for a in arrays for c in a.chunks]
    if group:
        held = [tuple(h for h in c.holders if h in group) for c in chunks]
        picked = iter(_layout.assign_writers([(c.nbytes, h) for c, h in zip(chunks, held) if h]))
        flat = [next(picked) if h else -1 for h in held]
    else:
        flat = _layout.assign_writers([(c.nbytes, c.holders) for c in chunks])
    writers = iter(flat)
    for a in arrays:
        a.writers = [next(writers) for _ in a.chunks]


def _lay_out_packed(arrays: list[_ArrayLeaf], me: int) -> tuple[tuple[PackedArray, ...], np.ndarray | None]:
    """Offsets of the small leaves' chunks in each writer's packed array (recorded in
    their fields), every process's packed array, and this process's zeroed buffer."""
    small = [a for a in arrays if a.fields["store"] == "packed"]
    offsets, sizes = _layout.pack_offsets([[(w, c.nbytes) for w, c in zip(a.writers, a.chunks)] for a in small])
    for a, offs in zip(small, offsets):
        a.fields["chunks"] = tuple(zip(a.writers, offs))
    # zarr stores an edge chunk at full size, so split evenly instead of in 4 MiB pieces
    packed = tuple(PackedArray(p, n, -(-n // -(-n // PACK_CHUNK_BYTES))) for p, n in sorted(sizes.items()))
    # zeros, not empty: alignment padding must not carry stale process memory to disk
    return packed, np.zeros(sizes[me], np.uint8) if sizes.get(me) else None


def _start_transfers(arrays: list[_ArrayLeaf], me: int) -> None:
    """Start every device-to-host copy this process needs before waiting on any."""
    for a in arrays:
        shards = {c.shard for c, w in zip(a.chunks, a.writers) if w == me}
        for index in shards:
            data = a.local[index]
            if isinstance(data, jax.Array) and next(iter(data.devices())).platform != "cpu":
                data.copy_to_host_async()


def _copy_packed(rec: LeafRecord, mine: list[tuple[_Chunk, np.ndarray]], packed_buf: np.ndarray | None) -> None:
    storage = _dtypes.DTYPES[rec.storage_dtype]
    grid = _layout.chunk_grid_shape(rec.shape, rec.chunk_shape)
    for chunk, host in mine:
        if not chunk.nbytes:
            continue
        cell = cell_of(chunk.region, rec.chunk_shape)
        _, offset = rec.chunks[_layout.chunk_flat_index(cell, grid)]
        view = packed_buf[offset:offset + host.nbytes].view(storage).reshape(host.shape)
        view[...] = host.view(storage)
