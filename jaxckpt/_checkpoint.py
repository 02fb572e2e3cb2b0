"""``save``, ``restore`` and ``metadata``: blocking functions with no hidden state.

Save runs in two halves so the manager can split them across threads: ``snapshot``
(host buffers of everything this process writes; see ``_snapshot``) and
``save_snapshot`` (write, agree, manifest last, commit). Restore matches the target
against the manifest, reads through ``_reader`` and places the slices on devices.
"""

from __future__ import annotations

import datetime
import functools
import json
import time
from typing import Any, NamedTuple

import jax
import numpy as np

from . import _commit, _distributed, _layout, _manifest, _reader, _storage, _tree
from ._errors import CheckpointError, TreeMismatchError
from ._manifest import LeafRecord, Manifest
from ._snapshot import Snapshot, snapshot, write_data
from ._snapshot import is_inline as _is_inline
from ._storage import Location


def build_manifest(snap: Snapshot, metadata: dict[str, Any] | None,
                   extra_info: dict[str, Any] | None = None) -> Manifest:
    from importlib.metadata import version as dist_version  # ~10 ms to import: only when saving

    from ._version import __version__

    info = {
        "library_version": __version__,
        "jax_version": jax.__version__,
        "tensorstore_version": dist_version("tensorstore"),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "created_unix": time.time(),
        "bytes": sum(r.nbytes for r in snap.records),
    }
    info.update(extra_info or {})
    return Manifest(
        format_version=_manifest.FORMAT_VERSION,
        structure=snap.structure,
        leaves=tuple(snap.records),
        metadata=metadata or {},
        process_count=_distributed.process_count(),
        info=info,
        packed=snap.packed,
    )


def _check_metadata(metadata: Any) -> dict[str, Any]:
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise CheckpointError(f"metadata must be a dict, got {type(metadata).__name__}")
    try:
        return json.loads(json.dumps(metadata))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"metadata must be JSON-serialisable: {e}") from None


def save_snapshot(path: Any, snap: Snapshot, *, metadata: Any = None, overwrite: bool = False,
                  extra_info: dict[str, Any] | None = None, timeout_s: float | None = None,
                  total_since: float | None = None, clock: Any = None, op_id: int | None = None) -> Manifest:
    """The writing half of ``save``: stage, write every shard, manifest last, commit.

    In a multi-process job every process calls this with its own snapshot; the phases
    (staged, written, committed) are agreed through jax's key-value store, so a failure
    in any process fails the save in all of them and nothing is committed.

    ``total_since`` (a ``time.perf_counter()`` value) and ``clock`` (returns the commit
    time in seconds) add ``total_seconds`` and ``commit_time`` to the manifest; ``op_id``
    is the collective sequence number (taken in program order by the caller).
    ``metadata`` must already have passed ``_check_metadata`` (``save`` checks it
    before taking the snapshot). Returns the committed manifest.
    """
    final = _storage.resolve(path)
    timeout = timeout_s or _distributed.DEFAULT_TIMEOUT_S
    name = f"save{_distributed.next_id() if op_id is None else op_id}"
    me = _distributed.process_index()
    staging = token = None
    manifest = None
    try:
        if me == 0:
            error = None
            try:
                token = _commit.new_token()
                staging = _commit.prepare(final, token, overwrite)
                _distributed.broadcast(f"{name}/token", token, timeout)
            except BaseException as e:  # noqa: BLE001 - reported to every process
                error = e
            _distributed.agree(f"{name}/staged '{final}'", error, timeout)
        else:
            _distributed.agree(f"{name}/staged '{final}'", None, timeout)
            token = _distributed.broadcast(f"{name}/token", None, timeout)
            staging = _commit.staging_location(final, token)

        t0 = time.perf_counter()
        error = None
        try:
            write_data(staging, snap)
        except BaseException as e:  # noqa: BLE001
            error = e
        _distributed.agree(f"{name}/written '{final}'", error, timeout)

        error = None
        if me == 0:
            try:
                info = {"write_seconds": round(time.perf_counter() - t0, 6), **(extra_info or {})}
                if total_since is not None:
                    info["total_seconds"] = round(time.perf_counter() - total_since, 6)
                if clock is not None:
                    info["commit_time"] = clock()
                manifest = build_manifest(snap, metadata, info)
                _commit.commit(final, staging, manifest.to_bytes(), token)
            except BaseException as e:  # noqa: BLE001
                error = e
        _distributed.agree(f"{name}/committed '{final}'", error, timeout)
    except BaseException:
        if me == 0 and staging is not None and manifest is None:
            _commit.abort(final, staging)
        raise
    return manifest if manifest is not None else _commit.read_manifest(final)


def save(path: Any, tree: Any, *, metadata: dict[str, Any] | None = None,
         overwrite: bool = False, timeout_s: float | None = None) -> None:
    """Save ``tree`` to ``path``, blocking until it is committed.

    Each process writes only the shards of its own devices with ``replica_id == 0``.
    The checkpoint becomes visible atomically: ``manifest.json`` is written last.

    Args:
      path: a local directory, an ``s3://``/``gs://``/``memory://`` URL, or a
        tensorstore kvstore spec dict.
      tree: any PyTree of ``jax.Array``, ``numpy.ndarray``, typed PRNG keys and
        ``int/float/bool/str/None``.
      metadata: a JSON-serialisable dict stored in the manifest.
      overwrite: replace an existing checkpoint at ``path`` (otherwise it raises).
      timeout_s: multi-process only: how long processes wait for each other at each
        phase before the save fails in all of them (default 30 s).

    Example:
      >>> jaxckpt.save("/tmp/ckpt", {"params": params, "step": 100})
    """
    metadata = _check_metadata(metadata)
    snap = snapshot(tree, copy_host_arrays=False)
    save_snapshot(path, snap, metadata=metadata, overwrite=overwrite, timeout_s=timeout_s)


# --- metadata -----------------------------------------------------------------------


class LeafInfo(NamedTuple):
    """Shape, dtype and saved sharding of one array leaf (no data is read)."""

    shape: tuple[int, ...]
    dtype: Any  # numpy dtype, or a jax PRNG key dtype
    sharding: _layout.SavedSharding | None
    path: str = ""
    nbytes: int = 0


class CheckpointInfo(NamedTuple):
    """What ``metadata(path)`` returns."""

    tree: Any  # nested dicts/lists of LeafInfo and inline Python values
    metadata: dict[str, Any]
    format_version: int
    info: dict[str, Any]  # versions, creation time, byte count, save stats
    path: str = ""


def _leaf_info(rec: LeafRecord) -> Any:
    if rec.kind == "value":
        return rec.value
    if rec.kind == "prng_key":
        dtype = _key_dtype(rec.impl)
        shape = rec.shape[: rec.key_ndim]
    else:
        dtype, shape = _storage.DTYPES[rec.dtype], rec.shape
    return LeafInfo(shape, dtype, _layout.sharding_from_json(rec.sharding), rec.path, rec.nbytes)


def metadata(path: Any) -> CheckpointInfo:
    """Describe a checkpoint without reading array data.

    Example:
      >>> info = jaxckpt.metadata("/tmp/ckpt")
      >>> info.tree["params"]["w"].shape
      (1024, 1024)
    """
    loc = _storage.resolve(path)
    with _tree.gc_paused():
        man = _commit.read_manifest(loc)
        tree = _tree.build(man.structure, lambda i: _leaf_info(man.leaves[i]))
    return CheckpointInfo(tree, man.metadata, man.format_version, man.info, str(loc))


# --- restore ------------------------------------------------------------------------


class _Request(NamedTuple):
    rec: LeafRecord
    mode: str  # "numpy", "jax", "value", "scalar"
    dtype: Any  # target element dtype (numpy) for arrays
    sharding: Any  # jax sharding for mode == "jax"
    target: Any  # the target leaf (for value casting)


def _target_kind(path: str, leaf: Any, rec: LeafRecord, sharding: Any, where: str) -> _Request:
    """How to restore saved ``rec`` as target ``leaf``; raise on mismatch."""

    def mismatch(msg: str) -> TreeMismatchError:
        return TreeMismatchError(f"Checkpoint '{where}': leaf '{path}': {msg}", [path])

    if rec.kind == "value":
        if _is_inline(leaf):
            return _Request(rec, "value", None, None, leaf)
        raise mismatch(f"saved an inline value {rec.value!r}, target is {type(leaf).__name__}")
    if leaf is None and sharding is None:
        raise mismatch("saved an array, target is None")
    if leaf is not None and _is_inline(leaf):
        if rec.kind == "array" and rec.shape == ():
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
    if saved_key or target_key:
        if not (saved_key and (target_key or dtype is None)):
            raise mismatch("PRNG key and non-key array do not mix")
        if target_key and dtype != _key_dtype(rec.impl):
            raise mismatch(f"PRNG key dtype {dtype} in target, impl {rec.impl} on disk")
    else:
        saved = _storage.DTYPES[rec.dtype]
        if dtype is not None and not _castable(saved, np.dtype(dtype)):
            raise mismatch(f"dtype {np.dtype(dtype).name} in target cannot hold {rec.dtype} from disk")
    if sharding is None and isinstance(leaf, jax.Array):
        sharding = leaf.sharding
    if sharding is None and isinstance(leaf, jax.ShapeDtypeStruct):
        sharding = leaf.sharding
    if isinstance(leaf, (np.ndarray, np.generic)) and sharding is None:
        return _Request(rec, "numpy", np.dtype(dtype), None, leaf)
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    if saved_key:
        return _Request(rec, "jax", None, sharding, leaf)
    return _Request(rec, "jax", np.dtype(dtype) if dtype is not None else _storage.DTYPES[rec.dtype],
                    sharding, leaf)


@functools.cache
def _key_dtype(impl: str) -> Any:
    return jax.eval_shape(lambda: jax.random.key(0, impl=impl)).dtype


def _dtype_kind(dt: np.dtype) -> str:
    """numpy's kind letter, with ml_dtypes' float and int types (kind 'V') classified."""
    if dt.kind != "V":
        return dt.kind
    return "f" if "float" in dt.name else ("u" if dt.name.startswith("u") else "i")


# Casts allowed on restore: within a kind and towards "bigger" kinds (bool < int < float < complex).
_KIND_ORDER = {"b": 0, "u": 1, "i": 1, "f": 2, "c": 3}


def _castable(src: np.dtype, dst: np.dtype) -> bool:
    a, b = _KIND_ORDER.get(_dtype_kind(src)), _KIND_ORDER.get(_dtype_kind(dst))
    return a is not None and b is not None and a <= b


def _restore_leaves(loc: Location, man: Manifest, requests: list[_Request]) -> list[Any]:
    """Read what every request needs (each distinct slice once), then place it."""
    reader = _reader.Reader(loc, man)
    plans: list[Any] = []
    for req in requests:
        rec = req.rec
        if req.mode == "value":
            plans.append(None)
        elif req.mode in ("numpy", "scalar"):
            full = tuple((0, d) for d in rec.shape)
            reader.add(rec, full)
            plans.append(full)
        else:
            sharding = req.sharding
            if rec.kind == "prng_key":
                sharding = _key_data_sharding(sharding, len(rec.shape) - rec.key_ndim, rec.path)
            per_device = _layout.needed_indices(sharding, rec.shape)
            for index in set(per_device.values()):
                reader.add(rec, index)
            plans.append((sharding, per_device))
    reader.run()

    out: list[Any] = [None] * len(requests)
    # Device placement, batched. On CPU jax adopts our 64-byte-aligned host buffers
    # without a copy (devices holding the same slice share it; jax arrays are
    # immutable and a donated external buffer is not written in place).
    xs, ds, slots = [], [], []
    for i, (req, plan) in enumerate(zip(requests, plans)):
        rec = req.rec
        if req.mode == "value":
            out[i] = rec.value
            continue
        if req.mode in ("numpy", "scalar"):
            arr = reader.get(rec, plan)
            if req.mode == "scalar":
                out[i] = type(req.target)(arr.item())
                continue
            if req.dtype is not None and arr.dtype != req.dtype:
                arr = arr.astype(req.dtype)
            out[i] = arr[()] if rec.scalar else arr
            continue
        sharding, per_device = plan
        single = len(per_device) == 1 and len(sharding.device_set) == 1
        host: dict[_layout.Index, np.ndarray] = {}
        for device, index in per_device.items():
            if index not in host:
                arr = reader.get(rec, index)
                if req.dtype is not None and arr.dtype != req.dtype:
                    arr = arr.astype(req.dtype)
                host[index] = arr
            xs.append(host[index])
            # one device: place with the sharding itself, no assembly needed
            ds.append(sharding if single else device)
            slots.append((i, device))
    per_leaf: dict[int, dict[Any, Any]] = {}
    for (i, device), arr in zip(slots, jax.device_put(xs, ds) if xs else []):
        per_leaf.setdefault(i, {})[device] = arr
    for i, arrays in per_leaf.items():
        rec = requests[i].rec
        sharding, per_device = plans[i]
        if len(arrays) == 1 and len(sharding.device_set) == 1:
            (arr,) = arrays.values()
        else:
            arr = jax.make_array_from_single_device_arrays(
                rec.shape, sharding, [arrays[d] for d in per_device])
        if rec.kind == "prng_key":
            arr = jax.random.wrap_key_data(arr, impl=rec.impl)
        out[i] = arr
    return out


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


def _restore_all_numpy(loc: Location, man: Manifest) -> Any:
    requests = [
        _Request(r, "value" if r.kind == "value" else "numpy", None, None, None) for r in man.leaves
    ]
    # PRNG keys come back as typed keys on the default device; everything else as numpy.
    for i, r in enumerate(man.leaves):
        if r.kind == "prng_key":
            requests[i] = _Request(r, "jax", None, jax.sharding.SingleDeviceSharding(jax.devices()[0]), None)
    values = _restore_leaves(loc, man, requests)
    return _tree.build(man.structure, lambda i: values[i])


def restore(path: Any, target: Any = None, *, shardings: Any = None, partial: bool = False) -> Any:
    """Restore a checkpoint, optionally onto a target structure and shardings.

    Each process reads only the slices its devices hold (equal slices once).

    Args:
      path: the checkpoint (as for ``save``).
      target: a PyTree of ``jax.ShapeDtypeStruct`` (with ``.sharding``), ``jax.Array``,
        ``numpy.ndarray`` or Python values. Its structure is the structure returned and
        its dtypes are cast to on the host.
      shardings: a PyTree of ``jax.sharding.Sharding`` (``None`` for non-array leaves)
        matching ``target`` (or used alone as the target), or one ``Sharding`` for all
        array leaves.
      partial: restore the subset of the saved tree that ``target`` names; otherwise
        every saved leaf must appear in the target.

    Returns:
      The restored PyTree. Without ``target`` and ``shardings``: numpy arrays (typed
      PRNG keys as jax arrays) in dicts, lists and tuples.

    Raises:
      CheckpointNotFoundError: no committed checkpoint at ``path``.
      TreeMismatchError: missing/unexpected key paths, shape or dtype mismatches.
      CorruptCheckpointError: the manifest or a chunk fails validation.

    Example:
      >>> state = jaxckpt.restore("/tmp/ckpt", target=abstract_state)
    """
    with _tree.gc_paused():
        return _restore(path, target, shardings, partial)


def _restore(path: Any, target: Any, shardings: Any, partial: bool) -> Any:
    loc = _storage.resolve(path)
    man = _commit.read_manifest(loc)
    single_sharding = isinstance(shardings, jax.sharding.Sharding)
    if target is None and (shardings is None or single_sharding):
        if shardings is None:
            return _restore_all_numpy(loc, man)
        target = _tree.build(man.structure, lambda i: _abstract(man.leaves[i]))
    ref = target if target is not None else shardings
    flat, treedef = _tree.flatten(ref)
    shard_map: dict[str, Any] = {}
    if shardings is not None and not single_sharding:
        sflat, _ = _tree.flatten(shardings)
        shard_map = dict(sflat)
        if target is not None and set(shard_map) != {p for p, _ in flat}:
            extra = sorted(set(shard_map) ^ {p for p, _ in flat})
            raise TreeMismatchError(
                f"Checkpoint '{loc}': shardings and target have different key paths: "
                + ", ".join(extra), extra)
    by_path = {r.path: r for r in man.leaves}
    missing = [p for p, _ in flat if p not in by_path]
    unexpected = [] if partial else sorted(set(by_path) - {p for p, _ in flat})
    if missing or unexpected:
        parts = []
        if missing:
            parts.append("not in the checkpoint: " + ", ".join(missing))
        if unexpected:
            parts.append("in the checkpoint but not in the target: " + ", ".join(unexpected)
                         + " (pass partial=True to restore a subset)")
        raise TreeMismatchError(f"Checkpoint '{loc}': trees differ; " + "; ".join(parts),
                                missing + unexpected)
    requests, errors = [], []
    for p, leaf in flat:
        if target is None:  # shardings tree used as the target
            sharding = leaf
            leaf = _abstract(by_path[p]) if by_path[p].kind != "value" else None
        elif single_sharding:
            sharding = shardings
        else:
            sharding = shard_map.get(p)
        if sharding is not None and not isinstance(sharding, jax.sharding.Sharding):
            raise TreeMismatchError(
                f"Checkpoint '{loc}': leaf '{p}': shardings entry is {type(sharding).__name__}, "
                "not a jax.sharding.Sharding", [p])
        if by_path[p].kind == "value":
            sharding = None
        try:
            requests.append(_target_kind(p, leaf, by_path[p], sharding, str(loc)))
        except TreeMismatchError as e:
            errors.append(e)
    if errors:
        paths = [q for e in errors for q in e.paths]
        raise TreeMismatchError("; ".join(str(e) for e in errors), paths)
    values = _restore_leaves(loc, man, requests)
    return _tree.unflatten(treedef, values)


def _abstract(rec: LeafRecord) -> Any:
    """A stand-in target leaf for ``rec`` (used when only shardings are given)."""
    if rec.kind == "value":
        return rec.value
    if rec.kind == "prng_key":
        dtype = _key_dtype(rec.impl)
        return jax.ShapeDtypeStruct(rec.shape[: rec.key_ndim], dtype)
    return jax.ShapeDtypeStruct(rec.shape, _storage.DTYPES[rec.dtype])
