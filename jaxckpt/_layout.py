"""Pure layout arithmetic: shardings as JSON, which shards a process writes, which
slices a target needs, and how a slice meets the saved chunk grid.

An *index* here is a tuple of ``(start, stop)`` pairs, one per dimension, with no
``None``s: hashable, JSON-able and easy to intersect.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

Index = tuple[tuple[int, int], ...]


def normalize_index(index: tuple[slice, ...], shape: Sequence[int]) -> Index:
    """A jax shard index (tuple of slices) as explicit ``(start, stop)`` pairs."""
    out = []
    for sl, dim in zip(index, shape):
        start, stop, step = sl.indices(dim)
        if step != 1:
            raise ValueError(f"strided shard index {index} is not supported")
        out.append((start, stop))
    # jax may give fewer slices than dims (trailing dims whole)
    out.extend((0, d) for d in shape[len(out):])
    return tuple(out)


def index_to_slices(index: Index) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in index)


def index_shape(index: Index) -> tuple[int, ...]:
    return tuple(b - a for a, b in index)


def index_size(index: Index) -> int:
    return math.prod(index_shape(index))


def relative(inner: Index, outer: Index) -> tuple[slice, ...]:
    """``inner`` (global coordinates) as slices relative to ``outer``'s origin."""
    return tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(inner, outer))


# --- shardings as JSON --------------------------------------------------------------


def _spec_entry_to_json(entry: Any) -> Any:
    if entry is None or isinstance(entry, str):
        return entry
    if isinstance(entry, tuple):
        return list(entry)
    return str(entry)  # PartitionSpec.UNCONSTRAINED and friends


@functools.lru_cache(maxsize=4096)
def sharding_to_json(sharding: jax.sharding.Sharding | None) -> dict[str, Any] | None:
    """A description of how an array was laid out when saved (for humans and re-layout)."""
    if sharding is None:
        return None
    if isinstance(sharding, NamedSharding):
        mesh = sharding.mesh
        return {
            "type": "named",
            "axis_names": [str(a) for a in mesh.axis_names],
            "axis_sizes": [int(s) for s in mesh.devices.shape],
            "spec": [_spec_entry_to_json(e) for e in sharding.spec],
        }
    if isinstance(sharding, SingleDeviceSharding):
        return {"type": "single_device"}
    return {"type": "other", "repr": repr(sharding)[:500], "num_devices": len(sharding.device_set)}


class SavedSharding(NamedTuple):
    """How a leaf was sharded when saved. ``type`` is ``named``, ``single_device`` or ``other``."""

    type: str
    axis_names: tuple[str, ...] = ()
    axis_sizes: tuple[int, ...] = ()
    spec: PartitionSpec | None = None

    @property
    def mesh_shape(self) -> dict[str, int]:
        return dict(zip(self.axis_names, self.axis_sizes))

    def to_sharding(self, devices: Sequence[jax.Device] | None = None) -> jax.sharding.Sharding:
        """Rebuild an equivalent sharding on ``devices`` (default: ``jax.devices()``).

        Needs as many devices as the saved mesh had; raises ``ValueError`` otherwise.
        """
        devices = list(jax.devices() if devices is None else devices)
        if self.type == "single_device":
            return SingleDeviceSharding(devices[0])
        if self.type != "named":
            raise ValueError(f"cannot rebuild a sharding of type {self.type!r}")
        need = math.prod(self.axis_sizes)
        if len(devices) < need:
            raise ValueError(f"the saved mesh {self.mesh_shape} needs {need} devices, have {len(devices)}")
        mesh = jax.sharding.Mesh(np.array(devices[:need]).reshape(self.axis_sizes), self.axis_names)
        return NamedSharding(mesh, self.spec)


def sharding_from_json(obj: dict[str, Any] | None) -> SavedSharding | None:
    if obj is None:
        return None
    if obj["type"] == "named":
        spec = PartitionSpec(*(tuple(e) if isinstance(e, list) else e for e in obj["spec"]))
        return SavedSharding("named", tuple(obj["axis_names"]), tuple(obj["axis_sizes"]), spec)
    return SavedSharding(obj["type"])


# --- what a process writes ----------------------------------------------------------


@functools.lru_cache(maxsize=4096)
def needed_indices(sharding: jax.sharding.Sharding, shape: Sequence[int]) -> dict[jax.Device, Index]:
    """For each addressable device of ``sharding``: the index of the global array it holds."""
    return {
        d: normalize_index(idx, shape)
        for d, idx in sharding.addressable_devices_indices_map(tuple(shape)).items()
    }


def chunks_overlapping(index: Index, chunk_shape: Sequence[int]) -> Iterator[tuple[tuple[int, ...], Index]]:
    """Chunk grid positions that ``index`` touches, each with the overlap (global coords)."""
    if all(a == 0 and b == c for (a, b), c in zip(index, chunk_shape)):
        yield (0,) * len(index), index  # exactly the first chunk (e.g. a whole one-chunk leaf)
        return
    ranges = []
    for (a, b), c in zip(index, chunk_shape):
        if b <= a:
            return
        ranges.append(range(a // c, (b - 1) // c + 1))
    for pos in np.ndindex(*(len(r) for r in ranges)) if ranges else [()]:
        cell = tuple(r[i] for r, i in zip(ranges, pos))
        overlap = tuple(
            (max(a, g * c), min(b, (g + 1) * c)) for (a, b), c, g in zip(index, chunk_shape, cell)
        )
        yield cell, overlap


def chunk_grid_shape(shape: Sequence[int], chunk_shape: Sequence[int]) -> tuple[int, ...]:
    return tuple(-(-s // c) for s, c in zip(shape, chunk_shape))


def chunk_flat_index(cell: Sequence[int], grid: Sequence[int]) -> int:
    flat = 0
    for g, n in zip(cell, grid):
        flat = flat * n + g
    return flat


class Shard(NamedTuple):
    """One distinct slice of a global array and who holds a copy of it."""

    index: Index
    processes: tuple[int, ...]  # sorted, distinct
    devices: tuple[Any, ...]  # every device holding it, in jax's device-map order


@functools.lru_cache(maxsize=4096)
def shards_of(sharding: jax.sharding.Sharding, shape: Sequence[int]) -> tuple[Shard, ...]:
    """The distinct slices of an array with ``sharding``, from the global sharding alone
    (the same answer in every process)."""
    holders: dict[Index, list[Any]] = {}
    for device, index in sharding.devices_indices_map(tuple(shape)).items():
        holders.setdefault(normalize_index(index, shape), []).append(device)
    return tuple(
        Shard(index, tuple(sorted({d.process_index for d in devices})), tuple(devices))
        for index, devices in holders.items()
    )


@functools.lru_cache(maxsize=4096)
def device_indices(sharding: jax.sharding.Sharding, shape: Sequence[int]) -> tuple[dict[Any, Index], bool]:
    """Each device's slice of an array with ``sharding`` (``normalize_index``d), and
    whether the devices are CPUs (their shards are host memory). Cached: never mutated."""
    out = {d: normalize_index(index, shape) for d, index in sharding.devices_indices_map(tuple(shape)).items()}
    return out, next(iter(out)).platform == "cpu" if out else True


MIN_PIECE_BYTES = 4 << 20  # replicated shards are split into pieces no smaller than this
_MAX_SPLIT = 64


def split_chunk_shape(shard_shape: Sequence[int], replicas: int, itemsize: int) -> tuple[int, ...]:
    """The chunk shape for shards of ``shard_shape`` held by ``replicas`` processes.

    A shard held by several processes is split along its first dimension longer than 1
    into pieces (a divisor of that dimension, so chunks never straddle shards: one
    writer per chunk) that its holders can share: preferably a multiple of
    ``replicas``, each piece at least ``MIN_PIECE_BYTES``. Otherwise chunk = shard.
    zarr needs chunk extents ≥ 1, so zero-length dimensions get extent 1.
    """
    chunk = [max(1, int(c)) for c in shard_shape]
    if replicas <= 1:
        return tuple(chunk)
    dim = next((d for d, n in enumerate(chunk) if n > 1), None)
    if dim is None:
        return tuple(chunk)
    n = chunk[dim]
    row_bytes = math.prod(chunk) // n * itemsize

    def fits(k: int) -> bool:
        return n % k == 0 and (n // k) * row_bytes >= MIN_PIECE_BYTES

    limit = min(n, _MAX_SPLIT * replicas)
    k = next((k for k in range(replicas, limit + 1, replicas) if fits(k)), None)
    if k is None:
        k = next((k for k in range(replicas, limit + 1) if fits(k)), None)
    if k is None:
        k = next((k for k in range(min(replicas, n), 1, -1) if fits(k)), 1)
    chunk[dim] = n // k
    return tuple(chunk)


@functools.lru_cache(maxsize=4096)
def chunk_shape_for(sharding: jax.sharding.Sharding, shape: Sequence[int], itemsize: int = 1,
                    fine: bool = False) -> tuple[int, ...]:
    """Chunks follow the saved shards, split finer where several processes hold a shard
    (see ``split_chunk_shape``), so every chunk has exactly one writer; with ``fine``
    (format 3) finer still, for reading (``fine_chunk_shape``, over the processes the
    array spans)."""
    shards = shards_of(sharding, shape)
    replicas = min((len(s.processes) for s in shards), default=1)
    chunk = split_chunk_shape(sharding.shard_shape(tuple(shape)), replicas, itemsize)
    if not fine:
        return chunk
    return fine_chunk_shape(chunk, shape, itemsize, len({p for s in shards for p in s.processes}))


# Format 3: a chunk no longer costs a file, so chunks are cut as fine as reading needs.
FINE_CHUNK_BYTES = 4 << 20  # chunks are cut until no bigger than this ...
FINE_FLOOR_BYTES = 1 << 20  # ... and, not below this, until every dimension has a piece per process
MIN_RUN_BYTES = 512  # ... keeping each chunk's contiguous rows at least this long
_FACTORS = (2, 3, 5, 7)


def fine_chunk_shape(chunk: Sequence[int], shape: Sequence[int], itemsize: int, processes: int = 1,
                     target: int | None = None) -> tuple[int, ...]:
    """``chunk`` cut into equal parts until, while its parts stay at least
    ``FINE_FLOOR_BYTES``, the array is cut into at least ``processes`` pieces along every
    dimension that can be cut, and then until it holds at most ``target`` bytes
    (default ``FINE_CHUNK_BYTES``).

    Each cut divides one dimension of the chunk by its smallest factor among 2, 3, 5
    and 7 (so chunks still never straddle shards: one writer per chunk). A dimension
    whose cut would leave contiguous runs (the chunk's trailing dimensions from it on)
    under ``MIN_RUN_BYTES``, or that has no such factor, is not cut. Cuts for the
    processes go to the dimension the array is cut into the fewest pieces along (ties:
    the first), so they spread over every dimension; cuts for size go to the first
    dimension that can be cut (rows: a chunk stays contiguous in the slice holding it,
    read straight into place).

    Why: a chunk is the unit of reading (its crc32c covers it whole), so a slice that
    cuts a chunk reads all of it; a slice ``t`` long along a dimension whose chunks are
    ``c`` long reads at most ``t + 2 * (c - 1)`` there, and exactly ``t`` when its ends
    fall on chunk boundaries (power-of-two meshes over power-of-two shapes) and
    ``t >= c``. So the processes of a restore that cuts the array into at most
    ``processes`` pieces along each dimension read what they hold (one process holds
    everything it reads from anyway).

    >>> fine_chunk_shape((8192, 1024), (32768, 1024), 4, 4)  # a row block of 32 MiB, 4 processes
    (2048, 256)
    """
    target = FINE_CHUNK_BYTES if target is None else target
    chunk = [max(1, int(c)) for c in chunk]
    while True:
        nbytes = math.prod(chunk) * itemsize
        spread = size = None
        for d, c in enumerate(chunk):
            f = next((f for f in _FACTORS if c % f == 0), 0)
            if not f or math.prod(chunk[d:]) // f * itemsize < MIN_RUN_BYTES:
                continue
            pieces = -(-int(shape[d]) // c)
            if pieces < processes and nbytes // f >= FINE_FLOOR_BYTES and (spread is None or pieces < spread[0]):
                spread = (pieces, d, f)
            if size is None and nbytes > target:
                size = (pieces, d, f)
        cut = spread or size
        if cut is None:
            return tuple(chunk)
        chunk[cut[1]] //= cut[2]


def assign_writers(chunks: Sequence[tuple[int, Sequence[int]]]) -> list[int]:
    """Pick one writer per chunk, balancing bytes over processes.

    ``chunks[i]`` is ``(nbytes, processes holding chunk i)``. Chunks with one holder go to
    it; then the others, largest first, each to the holder that has the fewest bytes so
    far (ties: the lowest process). A pure
    function of the global layout, so every process computes the same plan without
    talking (the way PyTorch DCP's deduplicating planner and orbax's replica-parallel
    save spread replicated data).
    """
    return assign_with_loads(chunks, {})


def assign_with_loads(chunks: Sequence[tuple[int, Sequence[int]]], load: dict[int, int]) -> list[int]:
    """``assign_writers`` on top of the bytes each process already writes (``load``,
    updated). A chunk with one holder has no choice and is counted first; only chunks
    held by several processes are balanced, largest first (cheap when, as in large
    fully-sharded states, almost every chunk has one holder). The least loaded holder
    is found with a heap per set of holders (entries refreshed lazily: a load only
    grows), so replicated data over hundreds of processes costs a log, not a scan."""
    out = [0] * len(chunks)
    flexible = []
    for i, (nbytes, holders) in enumerate(chunks):
        if len(holders) == 1:
            out[i] = p = holders[0]
            load[p] = load.get(p, 0) + nbytes
        else:
            flexible.append(i)
    heaps: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for i in sorted(flexible, key=lambda i: -chunks[i][0]):
        nbytes, holders = chunks[i]
        key = tuple(holders)
        heap = heaps.get(key)
        if heap is None:
            heap = heaps[key] = [(load.get(p, 0), p) for p in key]
            heapq.heapify(heap)
        while heap[0][0] != load.get(heap[0][1], 0):  # stale: that process got more elsewhere
            heapq.heapreplace(heap, (load.get(heap[0][1], 0), heap[0][1]))
        held, best = heap[0]
        load[best] = held + nbytes
        heapq.heapreplace(heap, (held + nbytes, best))
        out[i] = best
    return out


def chunk_region(cell: Sequence[int], chunk_shape: Sequence[int], shape: Sequence[int]) -> Index:
    """The part of the array that chunk ``cell`` covers (edge chunks are clipped)."""
    return tuple((g * c, min((g + 1) * c, s)) for g, c, s in zip(cell, chunk_shape, shape))


def chunk_cells(shape: Sequence[int], chunk_shape: Sequence[int]) -> list[tuple[int, ...]]:
    """Every chunk grid position in C order (none for a zero-size array)."""
    if tuple(shape) == tuple(chunk_shape):  # the common small-leaf case: one chunk
        return [(0,) * len(shape)]
    return list(np.ndindex(*chunk_grid_shape(shape, chunk_shape)))


def chunk_sizes(shape: Sequence[int], chunk_shape: Sequence[int]) -> list[int]:
    """The number of elements of each chunk, in ``chunk_cells``' order (edge chunks
    clipped): ``index_size(chunk_region(cell, ...))`` for every cell, without building
    the regions."""
    if tuple(shape) == tuple(chunk_shape):
        return [math.prod(shape)]
    per_dim = [[min(c, s - g * c) for g in range(-(-s // c))] for s, c in zip(shape, chunk_shape)]
    return [math.prod(p) for p in itertools.product(*per_dim)]


PACK_ALIGN = 64  # bytes; aligned host buffers let jax alias them on CPU


def pack_offsets(chunk_writers: Sequence[Sequence[tuple[int, int]]]) -> tuple[list[list[int]], dict[int, int]]:
    """Lay the chunks of small leaves out in one byte array per writing process.

    ``chunk_writers[i]`` lists, for leaf ``i``'s chunks in C order, ``(process, nbytes)``.
    Returns each chunk's offset in its process's array and each process's total size.
    A pure function of the global layout, so every process computes the same answer
    (process 0 writes the manifest without asking the others).
    """
    sizes: dict[int, int] = {}
    offsets: list[list[int]] = []
    for chunks in chunk_writers:
        leaf = []
        for proc, nbytes in chunks:
            at = sizes.get(proc, 0)
            leaf.append(at)
            sizes[proc] = at + -(-nbytes // PACK_ALIGN) * PACK_ALIGN
        offsets.append(leaf)
    return offsets, sizes
