"""Pure layout arithmetic: shardings as JSON, which shards a process writes, which
slices a target needs, and how a slice meets the saved chunk grid.

An *index* here is a tuple of ``(start, stop)`` pairs, one per dimension, with no
``None``s: hashable, JSON-able and easy to intersect.
"""

from __future__ import annotations

import functools
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
def chunk_shape_for(sharding: jax.sharding.Sharding, shape: Sequence[int]) -> tuple[int, ...]:
    """Chunk shape = shard shape, so every chunk has exactly one writer.

    zarr needs chunk extents ≥ 1, so zero-length dimensions get extent 1.
    """
    return tuple(max(1, int(c)) for c in sharding.shard_shape(tuple(shape)))


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


@functools.lru_cache(maxsize=4096)
def replica0_devices(sharding: jax.sharding.Sharding, shape: Sequence[int]) -> dict[Any, Index]:
    """Device -> index for the devices holding replica 0 of each distinct index."""
    out: dict[Any, Index] = {}
    seen: set[Index] = set()
    for device, index in sharding.devices_indices_map(tuple(shape)).items():
        key = normalize_index(index, shape)
        if key not in seen:
            seen.add(key)
            out[device] = key
    return out


def chunk_region(cell: Sequence[int], chunk_shape: Sequence[int], shape: Sequence[int]) -> Index:
    """The part of the array that chunk ``cell`` covers (edge chunks are clipped)."""
    return tuple((g * c, min((g + 1) * c, s)) for g, c, s in zip(cell, chunk_shape, shape))


def chunk_cells(shape: Sequence[int], chunk_shape: Sequence[int]) -> list[tuple[int, ...]]:
    """Every chunk grid position in C order (none for a zero-size array)."""
    if tuple(shape) == tuple(chunk_shape):  # the common small-leaf case: one chunk
        return [(0,) * len(shape)]
    return list(np.ndindex(*chunk_grid_shape(shape, chunk_shape)))


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
