"""Where a restore puts a target leaf that has no sharding (``jax.eval_shape`` gives none
to every leaf under a mesh of Auto axes, and to step counters and typed keys).

The rule (docs/training.md, "Targets without shardings"), leaf by leaf:

1. With a concrete mesh set in context (``jax.set_mesh``): the PartitionSpec the leaf
   was saved with, on that mesh, when its axes fit it: every axis the spec names is the
   mesh's, none twice, and each dimension is a multiple of its axes' sizes.
2. With none: the saved spec on the saved mesh, when the job's devices fit it (as many
   devices as the saved mesh had): on the one mesh the target's sharded leaves use when it
   has the saved axis names and sizes, else on a mesh of ``jax.devices()`` (in their
   order) shaped as the saved one.
3. Otherwise (no saved spec, or it does not fit): replicated on the mesh in context, else
   on the one mesh every sharded leaf of the target uses; with neither, a single process
   puts the leaf on its default device and a multi-process job raises, naming the leaves.
   Leaves larger than ``WARN_BYTES`` placed so, unless that is how they were saved
   (replicated; on one device, or from the host, and now on one device), are named in one
   ``PlacementWarning`` per restore.

Everything the choice reads is a global fact (the manifest, the target's shardings, the
mesh in context, ``jax.devices()``), so every process of a job makes the same one.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from . import _distributed, _dtypes, _layout
from ._errors import CheckpointError

WARN_BYTES = 1 << 20  # a leaf this large replicated or on one device is worth a word
SHOWN_LEAVES = 5


class PlacementWarning(UserWarning):
    """A restore placed target leaves that have no sharding, larger than 1 MiB, replicated
    or on one device: their saved PartitionSpec fitted neither the mesh in context nor the
    devices at hand (``jaxckpt.restore``, docs/training.md)."""


def place_unsharded(requests: list[Any], where: str) -> list[Any]:
    """``requests`` (``_restore._Request``) with every device leaf that has no sharding
    placed by the rule above."""
    unplaced = [i for i, r in enumerate(requests) if r.mode == "jax" and r.sharding is None]
    if not unplaced:
        return requests
    placed = [r.sharding for r in requests if r.mode == "jax" and r.sharding is not None]
    context, target_mesh = mesh_in_context(), one_mesh(placed)
    built: dict[tuple[Any, ...], Any] = {}  # a saved mesh's shape -> its mesh, made once per restore
    out, rest = list(requests), []
    for i in unplaced:
        sharding = as_saved(requests[i].rec, context, target_mesh, built)
        if sharding is None:
            rest.append(i)
        else:
            out[i] = out[i]._replace(sharding=sharding)
    if rest:
        fallback = unsharded_placement(context or target_mesh, [requests[i].rec.path for i in rest], where)
        for i in rest:
            out[i] = out[i]._replace(sharding=fallback)
        _warn_large([requests[i].rec for i in rest], fallback, context is not None, where)
    return out


def as_saved(rec: Any, context: Any, target_mesh: Any, built: dict[tuple[Any, ...], Any]) -> Any:
    """``rec``'s saved spec on the mesh in context (rule 1) or on the saved mesh (rule 2);
    None when it has none or it does not fit."""
    saved = _layout.sharding_from_json(rec.sharding)
    if saved is None or saved.type != "named":
        return None
    shape = tuple(rec.shape[: rec.key_ndim] if rec.kind == "prng_key" else rec.shape)
    spec = _spec_of_rank(saved.spec, len(shape))
    if spec is None:
        return None
    if context is not None:
        return NamedSharding(context, spec) if fits(dict(context.shape), spec, shape) else None
    sizes = dict(zip(saved.axis_names, saved.axis_sizes))
    if math.prod(saved.axis_sizes) != len(jax.devices()) or not fits(sizes, spec, shape):
        return None
    key = (saved.axis_names, saved.axis_sizes)
    if target_mesh is not None and (tuple(target_mesh.axis_names), tuple(target_mesh.devices.shape)) == key:
        return NamedSharding(target_mesh, spec)
    if key not in built:
        built[key] = jax.sharding.Mesh(np.array(jax.devices()).reshape(saved.axis_sizes), saved.axis_names)
    return NamedSharding(built[key], spec)


def _spec_of_rank(spec: PartitionSpec, rank: int) -> PartitionSpec | None:
    """``spec`` cut to ``rank`` entries (orbax may record a ``None`` past a key's rank);
    None when an entry past it names an axis."""
    entries = tuple(spec)
    if any(e is not None for e in entries[rank:]):
        return None
    return PartitionSpec(*entries[:rank])


def fits(sizes: dict[str, int], spec: PartitionSpec, shape: tuple[int, ...]) -> bool:
    """Whether ``spec`` can lay ``shape`` out on a mesh of axes ``sizes``: every axis it
    names is one of them, none twice, and each dimension divides evenly (jax places no
    uneven shards).

    Example:
        >>> fits({"x": 4}, PartitionSpec("x", None), (8, 3)), fits({"x": 4}, PartitionSpec("x"), (6,))
        (True, False)
    """
    used: set[str] = set()
    for dim, entry in zip(shape, spec):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        if any(not isinstance(a, str) or a not in sizes or a in used for a in axes) or len(set(axes)) != len(axes):
            return False
        used.update(axes)
        if dim % math.prod(sizes[a] for a in axes):
            return False
    return True


def unsharded_placement(mesh: Any, unplaced: list[str], where: str) -> Any:
    """Rule 3: replicated on ``mesh`` (the mesh in context, else the target's one mesh).
    With no mesh to choose, a single process keeps the default device; in a multi-process
    job one process's device is no place for a leaf every process asked for, so it raises."""
    if mesh is not None:
        return NamedSharding(mesh, PartitionSpec())
    if _distributed.process_count() == 1:
        return SingleDeviceSharding(jax.devices()[0])
    shown = ", ".join(unplaced[:5]) + (f" and {len(unplaced) - 5} more" if len(unplaced) > 5 else "")
    raise CheckpointError(
        f"Checkpoint '{where}': {len(unplaced)} target leaves have no sharding ({shown}) and there is no "
        "mesh to place them on in this multi-process job (none set in context, the target's sharded "
        "leaves do not all use one mesh, and their saved shardings do not fit the job's devices); pass "
        "shardings= for them, or restore inside `with jax.set_mesh(mesh):` to have them placed on that mesh")


def mesh_in_context() -> Any:
    """The concrete mesh set with ``jax.set_mesh``, or None."""
    mesh = jax.sharding.get_mesh()
    if mesh.empty or isinstance(mesh, jax.sharding.AbstractMesh):
        return None
    return mesh


def one_mesh(shardings: list[Any]) -> Any:
    """The mesh all of ``shardings`` are on, or None (none, several, or one not on a mesh)."""
    if not shardings or not all(isinstance(s, NamedSharding) for s in shardings):
        return None
    meshes = {s.mesh for s in shardings}
    return meshes.pop() if len(meshes) == 1 else None


def _warn_large(recs: list[Any], sharding: Any, in_context: bool, where: str) -> None:
    """One ``PlacementWarning`` naming the leaves of ``recs`` larger than ``WARN_BYTES``
    that rule 3 placed otherwise than they were saved."""
    large = [(r, n) for r in recs if (n := _nbytes(r)) > WARN_BYTES and not _as_it_was(r, sharding)]
    if not large:
        return
    if isinstance(sharding, NamedSharding):
        how = "replicated on the mesh (" + ", ".join(f"{a}={s}" for a, s in sharding.mesh.shape.items()) + ")"
    else:
        how = "on one device (no mesh set in context, none used by the target)"
    shown = ", ".join(f"'{r.path}' ({n / 2**20:.1f} MiB, saved {_saved_text(r)})" for r, n in large[:SHOWN_LEAVES])
    if len(large) > SHOWN_LEAVES:
        shown += f" and {len(large) - SHOWN_LEAVES} more"
    fit = "the mesh in context" if in_context else "the devices at hand"
    warnings.warn(PlacementWarning(
        f"Checkpoint '{where}': {len(large)} target leaves without a sharding were placed {how}: {shown}; "
        f"their saved sharding does not fit {fit}. Give them a sharding (in the target or shardings=), or "
        "restore inside `with jax.set_mesh(mesh):` with a mesh whose axes fit their saved PartitionSpec"),
        stacklevel=4)


def _nbytes(rec: Any) -> int:
    return math.prod(rec.shape) * _dtypes.DTYPES[rec.dtype].itemsize


def _as_it_was(rec: Any, sharding: Any) -> bool:
    """Placed as it was saved: on one device (saved so, or from the host), or replicated."""
    saved = _layout.sharding_from_json(rec.sharding)
    if saved is None or saved.type == "single_device":
        return isinstance(sharding, SingleDeviceSharding)
    return saved.type == "named" and all(e is None for e in saved.spec) and isinstance(sharding, NamedSharding)


def _saved_text(rec: Any) -> str:
    saved = _layout.sharding_from_json(rec.sharding)
    if saved is None:
        return "without a sharding"
    if saved.type != "named":
        return saved.type.replace("_", " ")
    return f"{saved.spec} on " + ", ".join(f"{a}={s}" for a, s in saved.mesh_shape.items())
