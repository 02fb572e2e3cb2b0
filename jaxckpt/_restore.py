"""``restore``: match a target against a checkpoint's records, plan the reads, place.

The restore half of the core (``save`` and ``metadata`` are in ``_checkpoint``): the
target is matched against the manifest (``key_map``, ``partial``, ``missing``), each
leaf gets a request (host value, numpy array or device array with its sharding), the
slices it needs are read through ``_reader`` (or read once per job through
``_exchange``) and placed on devices in one batched ``device_put``.

State it keeps, as ``_checkpoint`` does (its docstring lists the storage caches): the
dtype of each PRNG key impl (``key_dtype``), and the switches read when used, read-once
(``_exchange.READ_ONCE``, else ``JAXCKPT_READ_ONCE``) and ``_reader.DIRECT_READS``,
which choose how slices are read, never which values come back.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import ml_dtypes
import numpy as np

from . import _distributed, _dtypes, _exchange, _formats, _layout, _placement, _tree, _waves
from ._errors import SHOWN_PATHS, CheckpointError, TreeMismatchError, some_paths
from ._manifest import LeafRecord, Manifest
from ._storage.location import Location

# Leaves up to this size whose target sharding this process holds entirely are read
# whole and placed with one device_put (many small sharded leaves restore faster).
WHOLE_LEAF_BYTES = 1 << 20


class _Request(NamedTuple):
    rec: LeafRecord
    mode: str  # "numpy", "jax", "value", "scalar"
    dtype: Any  # target element dtype (numpy) for arrays
    sharding: Any  # jax sharding for mode == "jax"
    target: Any  # the target leaf (for value casting)
    value: Any = None  # mode == "value": the saved value, converted to the target's type
    check_range: bool = False  # integer narrowing: every value read must fit ``dtype``


def _target_kind(path: str, leaf: Any, rec: LeafRecord, sharding: Any, where: str,
                 allow_narrowing: bool = False) -> _Request:
    """How to restore saved ``rec`` as target ``leaf``; raise on mismatch."""

    def mismatch(msg: str) -> TreeMismatchError:
        return TreeMismatchError(f"Checkpoint '{where}': leaf '{path}': {msg}", [path])

    if rec.kind == "value":
        return _value_request(rec, leaf, mismatch, allow_narrowing)
    if leaf is None and sharding is None:
        raise mismatch("saved an array, target is None")
    if leaf is not None and _is_python_scalar(leaf):
        if rec.kind == "array" and rec.shape == ():
            if not _kind_castable(_dtype_kind(_dtypes.DTYPES[rec.dtype]), _scalar_kind(leaf)):
                raise mismatch(f"target of type {type(leaf).__name__} cannot hold a {rec.dtype} "
                               "scalar from disk")
            return _Request(rec, "scalar", None, None, leaf)
        raise mismatch(f"saved an array of shape {rec.shape}, target is {type(leaf).__name__}")
    if leaf is not None and not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
        raise mismatch(f"target leaf of type {type(leaf).__name__} is neither an array, a "
                       "jax.ShapeDtypeStruct nor a Python value")
    saved_key = rec.kind == "prng_key"
    if leaf is None:
        shape, dtype = None, None
    else:
        shape, dtype = tuple(leaf.shape), leaf.dtype
    if shape is not None:
        want = rec.shape[: rec.key_ndim] if saved_key else rec.shape
        if shape != want:
            raise mismatch(f"shape {shape} in target, {want} on disk")
    target_key = dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
    check_range = False
    if saved_key or target_key:
        if not (saved_key and (target_key or dtype is None)):
            raise mismatch("PRNG key and non-key array do not mix")
        if target_key and dtype != key_dtype(rec.impl):
            raise mismatch(f"PRNG key dtype {dtype} in target, impl {rec.impl} on disk")
    else:
        saved = _dtypes.DTYPES[rec.dtype]
        if dtype is not None and not _castable(saved, np.dtype(dtype)):
            raise mismatch(f"dtype {np.dtype(dtype).name} in target cannot hold {rec.dtype} from disk")
        check_range = dtype is not None and not allow_narrowing and _may_narrow(saved, np.dtype(dtype))
    if sharding is None and isinstance(leaf, jax.Array):
        sharding = leaf.sharding
    if sharding is None and isinstance(leaf, jax.ShapeDtypeStruct):
        sharding = leaf.sharding
    if isinstance(leaf, (np.ndarray, np.generic)) and sharding is None:
        return _Request(rec, "numpy", np.dtype(dtype), None, leaf, check_range=check_range)
    if sharding is not None:  # None: placed with the restore's other leaves known (_placement)
        sharding = _concrete_sharding(sharding, path, where)
    if saved_key:
        return _Request(rec, "jax", None, sharding, leaf)
    return _Request(rec, "jax", np.dtype(dtype) if dtype is not None else _dtypes.DTYPES[rec.dtype],
                    sharding, leaf, check_range=check_range)


def _concrete_sharding(sharding: Any, path: str, where: str) -> Any:
    """``sharding`` placed on the concrete mesh in context when it names an ``AbstractMesh``.

    ``nnx.eval_shape`` under ``jax.set_mesh`` gives such shardings; jax cannot place
    data with them, and the concrete mesh inside ``jax.set_mesh`` is the one meant.
    """
    if not (isinstance(sharding, jax.sharding.NamedSharding)
            and isinstance(sharding.mesh, jax.sharding.AbstractMesh)):
        return sharding
    abstract = sharding.mesh
    mesh = jax.sharding.get_mesh()
    axes = ", ".join(f"{n}={s}" for n, s in abstract.shape.items())
    if mesh.empty or isinstance(mesh, jax.sharding.AbstractMesh):
        raise CheckpointError(
            f"Checkpoint '{where}': leaf '{path}': the target's sharding is on an abstract mesh "
            f"({axes}) and no concrete mesh is set; restore inside `with jax.set_mesh(mesh):` "
            "or pass shardings= with concrete shardings")
    if dict(mesh.shape) != dict(abstract.shape):
        have = ", ".join(f"{n}={s}" for n, s in mesh.shape.items())
        raise CheckpointError(
            f"Checkpoint '{where}': leaf '{path}': the target's sharding is on an abstract mesh "
            f"({axes}) but the mesh set in context has axes ({have})")
    return jax.sharding.NamedSharding(mesh, sharding.spec, memory_kind=sharding.memory_kind)


def _all_devices_replicated() -> Any:
    """Replicated over every device of the job: a leaf every process holds."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("devices",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def _processes(sharding: Any) -> frozenset[int]:
    """The processes whose devices ``sharding`` places data on: a global fact, the same
    in every process (``is_fully_addressable`` is not: it depends on who asks)."""
    return frozenset(d.process_index for d in sharding.device_set)


def _value_request(rec: LeafRecord, leaf: Any, mismatch: Any, allow_narrowing: bool) -> _Request:
    """An inline saved value restored as target ``leaf``: the same kind rules as arrays."""
    value = rec.value
    if leaf is None:  # a None target takes whatever was saved
        return _Request(rec, "value", None, None, leaf, value)
    saved, wanted = _scalar_kind(value), _scalar_kind(leaf)
    if wanted is None or value is None:
        raise mismatch(f"saved an inline value {value!r}, target is {type(leaf).__name__}")
    if not _kind_castable(saved, wanted):
        raise mismatch(f"saved {type(value).__name__} {value!r} cannot be restored into a target "
                       f"of type {type(leaf).__name__}")
    if isinstance(leaf, np.generic) and wanted in "iu" and saved != "b":
        info = ml_dtypes.iinfo(leaf.dtype)
        if not info.min <= value <= info.max:
            if not allow_narrowing:
                raise mismatch(f"saved {value!r} does not fit target dtype {leaf.dtype.name} "
                               f"[{info.min}, {info.max}]; pass allow_narrowing=True to wrap it")
            value = _wrap_int(value, info)
    try:
        return _Request(rec, "value", None, None, leaf, type(leaf)(value))
    except (TypeError, ValueError, OverflowError) as e:  # e.g. an IntEnum target without that member
        raise mismatch(f"saved {value!r} cannot be restored into a target of type "
                       f"{type(leaf).__name__}: {e}") from None


def _wrap_int(value: int, info: Any) -> int:
    """``value`` wrapped into ``info``'s range in two's complement, as numpy's astype does."""
    span = 1 << info.bits
    value %= span
    return value - span if value > info.max else value


def _is_python_scalar(x: Any) -> bool:
    # numpy scalars have a dtype and restore like (0-d) arrays instead
    return not isinstance(x, np.generic) and _scalar_kind(x) is not None


def _scalar_kind(x: Any) -> str | None:
    """numpy's kind letter for a scalar (numpy or Python: b, i, f, c, U, S); None otherwise."""
    if isinstance(x, np.generic):
        return _dtype_kind(x.dtype)
    for t, kind in ((bool, "b"), (int, "i"), (float, "f"), (complex, "c"), (str, "U"), (bytes, "S")):
        if isinstance(x, t):
            return kind
    return None


@functools.cache
def key_dtype(impl: str) -> Any:
    """jax's dtype of a typed key of ``impl`` (``key<fry>``), as ``metadata`` reports it."""
    return jax.eval_shape(lambda: jax.random.key(0, impl=impl)).dtype


def _dtype_kind(dt: np.dtype) -> str:
    """numpy's kind letter, with ml_dtypes' float and int types (kind 'V') classified."""
    if dt.kind != "V":
        return dt.kind
    return "f" if "float" in dt.name else ("u" if dt.name.startswith("u") else "i")


# Casts allowed on restore: within a kind and towards "bigger" kinds (bool < int < float < complex).
# Strings (U) and bytes (S) only to their own kind.
_KIND_ORDER = {"b": 0, "u": 1, "i": 1, "f": 2, "c": 3}


def _kind_castable(src: str | None, dst: str | None) -> bool:
    if src in ("U", "S") or dst in ("U", "S"):
        return src == dst
    a, b = _KIND_ORDER.get(src or ""), _KIND_ORDER.get(dst or "")
    return a is not None and b is not None and a <= b


def _castable(src: np.dtype, dst: np.dtype) -> bool:
    return _kind_castable(_dtype_kind(src), _dtype_kind(dst))


def _may_narrow(src: np.dtype, dst: np.dtype) -> bool:
    """True when some value of integer dtype ``src`` falls outside integer dtype ``dst``."""
    if _dtype_kind(src) not in "iu" or _dtype_kind(dst) not in "iu":
        return False
    have, want = ml_dtypes.iinfo(src), ml_dtypes.iinfo(dst)
    return have.min < want.min or have.max > want.max


def _cast(arr: np.ndarray, req: _Request, where: str) -> np.ndarray:
    """``arr`` (one slice as read) in the target dtype; integer narrowing only when every value fits."""
    if req.dtype is None or arr.dtype == req.dtype:
        return arr
    if req.check_range and arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        info = ml_dtypes.iinfo(req.dtype)
        if lo < info.min or hi > info.max:
            path = req.rec.path
            raise TreeMismatchError(
                f"Checkpoint '{where}': leaf '{path}': saved {req.rec.dtype} values in [{lo}, {hi}] "
                f"do not fit target dtype {req.dtype.name} [{info.min}, {info.max}]; pass "
                "allow_narrowing=True to wrap them as numpy's astype does", [path])
    return arr.astype(req.dtype)


def _restore_leaves(source: _formats.Source, requests: list[_Request], max_bytes: int | None = None) -> list[Any]:
    """Read what every request needs (each distinct slice once), then place it. In a
    multi-process job a slice several processes need is read once per job (``_exchange``):
    whether it is, and each leaf's part in it, follow from global facts only (the
    shardings and the manifest), so that every process plans the same exchange.

    With ``max_bytes`` (a host-memory budget) the leaves go in waves (``_waves.restore_waves``): the
    next wave is read while the one before it is placed, and a wave's host buffers are
    let go once its arrays are on their devices; two waves at most are in host memory."""
    spanning = sum(req.mode == "jax" and len(_processes(req.sharding)) > 1 for req in requests)
    exchanging = _exchange.applies(spanning, source.loc)
    where = str(source.loc)

    def read(wave: Sequence[int]) -> tuple[Any, list[Any]]:
        if exchanging:
            reader: Any = _exchange.ReadOnce(source.new_reader, where, source.format == "jaxckpt")
        else:
            reader = source.new_reader()
        plans = [_plan_reads(reader, requests[i]) for i in wave]
        reader.run()
        return reader, plans

    groups = _waves.restore_waves([_host_bytes(r) for r in requests], max_bytes)
    if len(groups) <= 1:
        reader, plans = read(range(len(requests)))
        return _place(reader, requests, plans, where)
    out: list[Any] = []
    ahead = None if exchanging else _waves.ReadAhead(read, groups[0])  # the exchange's reads stay in order
    for k, wave in enumerate(groups):
        got = ahead.result() if ahead is not None else read(wave)
        ahead = _waves.ReadAhead(read, groups[k + 1]) if ahead is not None and k + 1 < len(groups) else None
        try:
            placed = _place(got[0], [requests[i] for i in wave], got[1], where)
            del got
            for x in placed:  # on its devices: the wave's host buffers may go
                if isinstance(x, jax.Array):
                    x.block_until_ready()
        except BaseException:
            if ahead is not None:
                ahead.join()
            raise
        out.extend(placed)
    return out


def _host_bytes(req: _Request) -> int:
    """What ``req`` takes in this process's host memory while read, from global facts
    only (a sharded leaf: its size over the number of processes holding it), so that
    every process of a job forms the same waves (its exchange plans them alike)."""
    if req.mode == "value":
        return 0
    if req.mode == "jax":
        return -(-req.rec.nbytes // max(1, len(_processes(req.sharding))))
    return req.rec.nbytes


def _plan_reads(reader: _formats.ReaderLike, req: _Request) -> Any:
    """Tell ``reader`` which slices ``req`` needs: ``None`` (an inline value), the full
    index (host arrays) or ``(sharding, {device: index})`` (``{}``: this process holds
    none of it). A leaf on devices of several processes goes to the exchange in every
    process, those without a device in it included, so that all plan it alike."""
    rec = req.rec
    if req.mode == "value":
        return None
    if req.mode in ("numpy", "scalar"):
        full = tuple((0, d) for d in rec.shape)
        reader.add(rec, full)
        return full
    sharding = req.sharding
    if rec.kind == "prng_key":
        sharding = _key_data_sharding(sharding, len(rec.shape) - rec.key_ndim, rec.path)
    processes = _processes(sharding)
    if rec.nbytes <= WHOLE_LEAF_BYTES and processes == {_distributed.process_index()}:
        # A small leaf this process places whole: read it once, one device_put with its
        # sharding (jax slices it; 4x cheaper than a put per device plus assembly).
        full = tuple((0, d) for d in rec.shape)
        reader.add(rec, full)
        return sharding, None
    per_device = _layout.needed_indices(sharding, rec.shape)
    if isinstance(reader, _exchange.ReadOnce) and len(processes) > 1:
        reader.add_global(rec, sharding, set(per_device.values()))
        return sharding, per_device
    for index in set(per_device.values()):
        reader.add(rec, index)
    return sharding, per_device


def _place(reader: _formats.ReaderLike, requests: list[_Request], plans: list[Any], where: str) -> list[Any]:
    """Host values for host requests; device arrays, placed in one batched
    ``device_put``, for the rest. On CPU jax adopts our 64-byte-aligned host buffers
    without a copy (devices holding the same slice share it; jax arrays are immutable
    and a donated external buffer is not written in place)."""
    out: list[Any] = [_UNSET] * len(requests)
    xs, ds, slots = [], [], []
    assembled = []
    for i, (req, plan) in enumerate(zip(requests, plans)):
        rec = req.rec
        if req.mode == "value":
            out[i] = req.value
        elif req.mode == "scalar":
            out[i] = _python_scalar(reader.get(rec, plan), req, where)
        elif req.mode == "numpy":
            arr = _cast(reader.get(rec, plan), req, where)
            out[i] = arr[()] if rec.scalar else arr
        elif plan[1] is None:  # a small leaf, whole
            xs.append(_cast(reader.get(rec, tuple((0, d) for d in rec.shape)), req, where))
            ds.append(plan[0])
            slots.append((i, None))
        else:
            sharding, per_device = plan
            assembled.append(i)
            single = len(per_device) == 1 and len(sharding.device_set) == 1
            host: dict[_layout.Index, np.ndarray] = {}
            for device, index in per_device.items():
                if index not in host:
                    host[index] = _cast(reader.get(rec, index), req, where)
                xs.append(host[index])
                ds.append(sharding if single else device)  # one device: no assembly needed
                slots.append((i, device))
    per_leaf: dict[int, dict[Any, Any]] = {}
    for (i, device), arr in zip(slots, jax.device_put(xs, ds) if xs else []):
        if device is None:  # placed whole
            out[i] = _as_key(requests[i].rec, arr)
            continue
        per_leaf.setdefault(i, {})[device] = arr
    for i in assembled:  # those this process holds no part of too: they are global arrays
        out[i] = _assemble(requests[i], plans[i], per_leaf.get(i, {}), where)
    got_none = [requests[i].rec.path for i, x in enumerate(out) if x is _UNSET]
    if got_none:  # a leaf the target asked for is never left out (or None)
        raise CheckpointError(f"Checkpoint '{where}': process {_distributed.process_index()} got no data "
                              f"for leaves {', '.join(got_none)}")
    return out


_UNSET = object()  # a placed leaf's slot before its value (None is a value)


def _assemble(req: _Request, plan: Any, arrays: dict[Any, Any], where: str) -> Any:
    """One leaf's array from its slices on this process's devices (none: a global array
    with no part here, whose dtype jax cannot infer from the slices)."""
    rec, (sharding, per_device) = req.rec, plan
    if len(arrays) == 1 and len(sharding.device_set) == 1:
        (arr,) = arrays.values()
    elif per_device:
        arr = jax.make_array_from_single_device_arrays(rec.shape, sharding, [arrays[d] for d in per_device])
    else:
        dtype = req.dtype if req.dtype is not None else _dtypes.DTYPES[rec.dtype]
        try:
            arr = jax.make_array_from_single_device_arrays(rec.shape, sharding, [], dtype=dtype)
        except (ValueError, RuntimeError) as e:
            raise CheckpointError(  # a sharding on other processes' devices only, where jax refuses that
                f"Checkpoint '{where}': leaf '{rec.path}': process {_distributed.process_index()} holds no "
                f"device of its sharding and jax cannot make an array with no part here: {e}") from None
    return _as_key(rec, arr)


def _as_key(rec: LeafRecord, arr: Any) -> Any:
    """A PRNG key leaf's key array from its key data; any other leaf as it is."""
    return jax.random.wrap_key_data(arr, impl=rec.impl) if rec.kind == "prng_key" else arr


def _python_scalar(arr: np.ndarray, req: _Request, where: str) -> Any:
    """A saved 0-d array as the Python scalar type of the target (kinds checked before)."""
    try:
        return type(req.target)(arr.item())
    except (TypeError, ValueError, OverflowError) as e:  # e.g. an IntEnum target without that member
        path = req.rec.path
        raise TreeMismatchError(f"Checkpoint '{where}': leaf '{path}': saved {arr.item()!r} cannot be "
                                f"restored into a target of type {type(req.target).__name__}: {e}",
                                [path]) from None


def _key_data_sharding(sharding: Any, extra: int, path: str) -> Any:
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = tuple(sharding.spec) + (None,) * extra
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec))
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return sharding
    raise CheckpointError(
        f"leaf '{path}': restoring a PRNG key onto a {type(sharding).__name__} is not supported; "
        "use a NamedSharding"
    )


def _restore_all_numpy(source: _formats.Source) -> Any:
    man = source.manifest
    requests = [
        _Request(r, "value" if r.kind == "value" else "numpy", None, None, None, r.value)
        for r in man.leaves
    ]
    # PRNG keys come back as typed keys (on the default device; in a multi-process job
    # replicated over all its devices, so that every process holds them); everything
    # else as numpy.
    if _distributed.process_count() == 1:
        keys = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    else:
        keys = _all_devices_replicated()
    for i, r in enumerate(man.leaves):
        if r.kind == "prng_key":
            requests[i] = _Request(r, "jax", None, keys, None)
    values = _restore_leaves(source, requests)
    return _tree.build(man.structure, lambda i: values[i])


def restore(path: Any, target: Any = None, *, shardings: Any = None, partial: bool = False,
            allow_narrowing: bool = False, key_map: Any = None, missing: str | None = None,
            max_staging_bytes: int | None = None) -> Any:
    """Restore a checkpoint, optionally onto a target structure and shardings.

    Each process reads only the slices its devices hold (equal slices once).

    Args:
      path: the checkpoint (as for ``save``).
      target: a PyTree of ``jax.ShapeDtypeStruct`` (with ``.sharding``), ``jax.Array``,
        ``numpy.ndarray`` or Python values. Its structure is the structure returned and
        its dtypes (and Python scalar types) are cast to on the host. Shardings on an
        ``AbstractMesh`` (``nnx.eval_shape`` under ``jax.set_mesh``) resolve against
        the mesh set with ``jax.set_mesh``. A leaf with no sharding (``jax.eval_shape``
        gives none to a step counter or a key, and to every leaf under Auto axes) gets
        the PartitionSpec it was saved with: on the mesh set with ``jax.set_mesh`` when
        the spec's axes fit it (names present, sizes dividing the shape), or, with no mesh
        set, on the saved mesh when the job's devices fit it (as many as it had; built
        from ``jax.devices()``). Otherwise it goes replicated on the mesh in context, else
        on the one mesh every sharded leaf uses; with neither, a single process puts it on
        its default device and a multi-process job raises. Leaves over 1 MiB placed so
        are named in a ``PlacementWarning`` (docs/training.md).
      shardings: a PyTree of ``jax.sharding.Sharding`` (``None`` for non-array leaves)
        matching ``target`` (or used alone as the target), or one ``Sharding`` for all
        array leaves.
      partial: restore the subset of the saved tree that ``target`` names; otherwise
        every saved leaf must appear in the target.
      allow_narrowing: cast integers to a narrower or differently signed target dtype
        even when values do not fit, wrapping them as ``numpy.ndarray.astype`` does.
        By default such a cast happens only when every value read fits the target dtype
        (checked on the host); otherwise ``TreeMismatchError``. Float precision casts
        (float32 -> bfloat16), int -> float and bool -> number are always allowed;
        float -> int, complex -> float and non-bool -> bool never are.
      key_map: model surgery: where each target key path is found in the checkpoint.
        A dict of key-path prefixes (``{"params/decoder": "params/old_decoder"}``; the
        longest matching prefix wins; a value of ``None`` means "not in the
        checkpoint") or a callable from a target key path to a saved one (or
        ``None``). Saved names may also use ``.`` separators (safetensors tensors).
      missing: ``"target"`` keeps the target's own value for every target leaf the
        checkpoint lacks (a new head the model initialised), listing them in a
        ``MissingKeysWarning``; such target leaves must be concrete values. ``None``
        (default): a missing leaf raises.
      max_staging_bytes: the most host memory the read buffers may take (waves, each
        placed while the next is read: docs/training.md). ``None``: all at once.

    Returns:
      The restored PyTree. Without ``target`` and ``shardings``: numpy arrays (typed
      PRNG keys as jax arrays, in a multi-process job replicated over all its devices)
      in dicts, lists and tuples.

    Raises:
      CheckpointNotFoundError: no committed checkpoint at ``path``.
      TreeMismatchError: missing/unexpected key paths, shape or dtype mismatches,
        integers that do not fit the target dtype.
      CorruptCheckpointError: the manifest or a chunk fails validation.

    Example: ``state = jaxckpt.restore("/tmp/ckpt", target=abstract_state)``"""
    with _tree.gc_paused():
        return _restore_tree(path, target, shardings, partial, allow_narrowing, key_map, missing, max_staging_bytes)


class MissingKeysWarning(UserWarning):
    """``restore(..., missing="target")`` kept the target's values for these key paths."""


def _restore_tree(path: Any, target: Any, shardings: Any, partial: bool, allow_narrowing: bool = False,
             key_map: Any = None, missing: str | None = None, max_bytes: int | None = None) -> Any:
    if missing not in (None, "target"):
        raise CheckpointError(f"missing must be None or 'target', got {missing!r}")
    _waves.check_budget(max_bytes)
    source = _formats.open_source(path)
    loc, man = source.loc, source.manifest
    single_sharding = isinstance(shardings, jax.sharding.Sharding)
    if target is None and (shardings is None or single_sharding):
        if shardings is None and key_map is None:
            return _restore_all_numpy(source)
        target = _tree.build(man.structure, lambda i: _abstract(man.leaves[i]))
    ref = target if target is not None else shardings
    flat, treedef = _tree.flatten(ref)
    shard_map = _sharding_map(shardings, single_sharding, target, flat, loc)
    empties = functools.partial(_tree.empty_node_paths, ref) if _orbax_made(source) else None
    saved = _match(flat, man, key_map, partial, missing, loc, source.format == "safetensors", empties)
    requests, errors, kept = [], [], {}
    for p, leaf in flat:
        rec = saved.get(p)
        if rec is None:  # missing="target": the target's own value stays
            kept[p] = leaf
            continue
        sharding = _leaf_sharding(p, leaf, rec, target, shardings, single_sharding, shard_map, loc)
        if target is None:  # shardings tree used as the target
            leaf = _abstract(rec) if rec.kind != "value" else None
        try:
            requests.append(_target_kind(p, leaf, rec, sharding, str(loc), allow_narrowing))
        except TreeMismatchError as e:
            errors.append(e)
    if errors:
        raise _leaves_mismatch(errors)
    values = iter(_restore_leaves(source, _placement.place_unsharded(requests, str(loc)), max_bytes))
    return _tree.unflatten(treedef, [kept[p] if p in kept else next(values) for p, _ in flat])


def _leaves_mismatch(errors: list[TreeMismatchError]) -> TreeMismatchError:
    """One error of many leaves' own: the first few messages and a count of the rest."""
    shown = "; ".join(str(e) for e in errors[:SHOWN_PATHS])
    more = len(errors) - SHOWN_PATHS
    if more > 0:
        shown += f"; and {more} more leaves ({len(errors)} in all: the error's .paths)"
    return TreeMismatchError(shown, [q for e in errors for q in e.paths])


def _sharding_map(shardings: Any, single: bool, target: Any, flat: list[tuple[str, Any]], loc: Location) -> dict:
    if shardings is None or single:
        return {}
    shard_map = dict(_tree.flatten(shardings)[0])
    if target is not None and set(shard_map) != {p for p, _ in flat}:
        extra = sorted(set(shard_map) ^ {p for p, _ in flat})
        raise TreeMismatchError(
            f"Checkpoint '{loc}': shardings and target have different key paths: " + some_paths(extra), extra)
    return shard_map


def _leaf_sharding(p: str, leaf: Any, rec: LeafRecord, target: Any, shardings: Any, single: bool,
                   shard_map: dict, loc: Location) -> Any:
    if rec.kind == "value":
        return None
    if target is None:
        sharding = leaf
    elif single:
        sharding = shardings
    else:
        sharding = shard_map.get(p)
    if sharding is not None and not isinstance(sharding, jax.sharding.Sharding):
        raise TreeMismatchError(
            f"Checkpoint '{loc}': leaf '{p}': shardings entry is {type(sharding).__name__}, "
            "not a jax.sharding.Sharding", [p])
    return sharding


def _orbax_made(source: _formats.Source) -> bool:
    """An orbax checkpoint, or jaxckpt's import of one (``import-orbax``)."""
    made = source.manifest.info.get("converted_from")
    return source.format == "orbax" or (isinstance(made, dict) and made.get("format") == "orbax")


def _match(flat: list[tuple[str, Any]], man: Manifest, key_map: Any, partial: bool, missing: str | None,
           loc: Location, dotted: bool = False,
           empties: Callable[[], set[str]] | None = None) -> dict[str, LeafRecord]:
    """Target key path -> the saved record it restores from; strict about the rest.

    A ``.``-separated name stands for its ``/`` key path only where it is a convention:
    in a safetensors source (``dotted``; its tensor names are dotted), and in a name
    ``key_map`` gave (the user wrote it). Elsewhere ``a.b`` and ``a/b`` are different
    leaves, and taking one for the other is the silent fallback strictness forbids.

    ``empties`` (orbax-made checkpoints only) gives the key paths of the target's empty
    containers: orbax saves an empty NamedTuple (optax's ``EmptyState()``, ``MaskedNode()``)
    as ``None``, and such a saved ``None`` matches an empty container of the target at
    the same key path (as orbax restores it), and nothing else.
    """
    by_path = {r.path: r for r in man.leaves}
    paths = [p for p, _ in flat]
    found, absent = _pair(paths, by_path, key_map, dotted)
    unused = sorted(set(by_path) - {r.path for r in found.values()})
    if empties is not None and any(by_path[p].kind == "value" and by_path[p].value is None for p in unused):
        empty = {map_key(key_map, q) for q in empties()}
        unused = [p for p in unused if not (p in empty and by_path[p].kind == "value" and by_path[p].value is None)]
    unexpected = [] if partial else unused
    if missing == "target" and absent:
        _check_kept(flat, absent, loc)
        warnings.warn(MissingKeysWarning(
            f"Checkpoint '{loc}': kept the target's values for {len(absent)} leaves not in the "
            "checkpoint: " + some_paths(absent)), stacklevel=4)
        absent = []
    if absent or unexpected:
        parts = []
        if absent:
            parts.append("not in the checkpoint: " + some_paths(absent))
        if unexpected:
            parts.append("in the checkpoint but not in the target: " + some_paths(unexpected)
                         + " (pass partial=True to restore a subset)")
        offending = [a.split(" (as ")[0] for a in absent] + unexpected
        hint = "" if key_map is not None else _key_map_hint(paths, by_path, partial, dotted, absent, unused)
        count = f" in {len(offending)} key paths (all in the error's .paths)" if len(offending) > SHOWN_PATHS else ""
        raise TreeMismatchError(f"Checkpoint '{loc}': trees differ{count}; " + "; ".join(parts) + hint, offending)
    return found


def _pair(paths: list[str], by_path: dict[str, LeafRecord], key_map: Any,
          dotted: bool) -> tuple[dict[str, LeafRecord], list[str]]:
    """Each target path's saved record under ``key_map``, and the target paths without one
    (``"p (as 'name')"`` where the map renamed it)."""
    found: dict[str, LeafRecord] = {}
    absent = []
    for p in paths:
        name = map_key(key_map, p)
        rec = None if name is None else by_path.get(name)
        if rec is None and name is not None and (dotted or name != p):
            rec = by_path.get(name.replace(".", "/"))
        if rec is None:
            absent.append(p if name == p else f"{p} (as '{name}')")
        else:
            found[p] = rec
    return found, absent


def _key_map_hint(paths: list[str], by_path: dict[str, LeafRecord], partial: bool, dotted: bool,
                  absent: list[str], unused: list[str]) -> str:
    """"Did you mean key_map=…": the guess (``_tree.near_miss_key_maps``) that leaves the
    fewest mismatches when tried, if it leaves fewer than there are; else ``""``."""
    before = len(absent) + (0 if partial else len(unused))
    best = None
    for guess in _tree.near_miss_key_maps(absent, unused):
        found, left = _pair(paths, by_path, guess.key_map, dotted)
        after = len(left) + (0 if partial else len(by_path) - len({r.path for r in found.values()}))
        if after < before and (best is None or after < best[0]):
            best = (after, len(absent) - len(left), guess)
    if best is None:
        return ""
    after, fixed, guess = best
    if after == 0:
        return (f". Did you mean key_map={guess.code}? With it every leaf matches: "
                f"restore(path, target, key_map={guess.code})")
    return (f". Did you mean key_map={guess.code}? With it {fixed} of the {len(absent)} target leaves "
            f"not in the checkpoint match")


def map_key(key_map: Any, path: str) -> str | None:
    if key_map is None:
        return path
    if callable(key_map):
        return key_map(path)
    best = max((k for k in key_map if path == k or path.startswith(k.rstrip("/") + "/") or k == ""),
               key=len, default=None)
    if best is None:
        return path
    new = key_map[best]
    if new is None:
        return None
    # joined with one "/" (a "" prefix must not glue {"": "params"} to the path's first key)
    rest = path[len(best.rstrip("/")):].lstrip("/")
    new = new.rstrip("/")
    return (f"{new}/{rest}" if new and rest else new or rest).lstrip("/")


def _check_kept(flat: list[tuple[str, Any]], absent: list[str], loc: Location) -> None:
    leaves = dict(flat)
    abstract = [a for a in absent if isinstance(leaves[a.split(" (as ")[0]], jax.ShapeDtypeStruct)]
    if abstract:
        raise TreeMismatchError(
            f"Checkpoint '{loc}': missing='target' keeps the target's values, but these target leaves "
            "are abstract (jax.ShapeDtypeStruct) and not in the checkpoint: " + some_paths(abstract),
            [a.split(" (as ")[0] for a in abstract])


def _abstract(rec: LeafRecord) -> Any:
    """A stand-in target leaf for ``rec`` (used when only shardings are given)."""
    if rec.kind == "value":
        return rec.value
    if rec.kind == "prng_key":
        dtype = key_dtype(rec.impl)
        return jax.ShapeDtypeStruct(rec.shape[: rec.key_ndim], dtype)
    return jax.ShapeDtypeStruct(rec.shape, _dtypes.DTYPES[rec.dtype])
