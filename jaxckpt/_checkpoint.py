"""``save``, ``restore`` and ``metadata``: blocking functions with no hidden state.

Save runs in two halves so the manager can split them across threads:
``snapshot`` (flatten, describe, copy local replica-0 shards into host buffers this
library owns) and ``write_snapshot`` (tensorstore writes of every leaf at once, then
the manifest, then the commit).
"""

from __future__ import annotations

import datetime
import functools
import json
import math
import time
from dataclasses import dataclass, field
from importlib.metadata import version as _dist_version
from typing import Any, NamedTuple

import jax
import numpy as np

from . import _commit, _distributed, _layout, _manifest, _storage, _tree
from ._errors import CheckpointError, CorruptCheckpointError, TreeMismatchError
from ._manifest import LeafRecord, Manifest
from ._storage import Location

# Leaves smaller than this go to the per-process OCDBT database; bigger ones get a
# zarr3 array of their own with one file per chunk.
SMALL_LEAF_BYTES = 1 << 20


# --- save ---------------------------------------------------------------------------


@dataclass
class Snapshot:
    """What a save needs after the caller's arrays may be gone."""

    structure: dict[str, Any]
    records: list[LeafRecord]
    # per leaf: [(index, host buffer)] for the shards this process writes
    shards: list[list[tuple[_layout.Index, np.ndarray]]]
    nbytes_local: int = 0
    stats: dict[str, Any] = field(default_factory=dict)


def _is_inline(x: Any) -> bool:
    return x is None or isinstance(x, (bool, int, float, str))


def _is_prng(x: Any) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def snapshot(tree: Any, *, copy_host_arrays: bool) -> Snapshot:
    """Flatten ``tree`` and take host buffers of every shard this process must write.

    With ``copy_host_arrays`` numpy leaves are copied, so the caller may mutate them
    once this returns (jax arrays are immutable; their host buffers are kept alive).
    """
    flat, _ = _tree.flatten(tree)
    structure = _tree.describe(tree)
    me = _distributed.process_index()
    records: list[LeafRecord] = []
    pending: list[tuple[int, list[tuple[_layout.Index, Any]]]] = []
    shards: list[list[tuple[_layout.Index, np.ndarray]]] = []
    for i, (path, leaf) in enumerate(flat):
        if _is_inline(leaf):
            records.append(LeafRecord(path=path, kind="value", value=leaf))
            shards.append([])
            continue
        kind, impl, key_ndim, scalar = "array", None, 0, False
        if _is_prng(leaf):
            kind, impl, key_ndim = "prng_key", str(jax.random.key_impl(leaf)), leaf.ndim
            leaf = jax.random.key_data(leaf)
        if isinstance(leaf, np.generic):
            leaf, scalar = np.asarray(leaf), True
        if isinstance(leaf, jax.Array):
            sharding = leaf.sharding
            shape = tuple(leaf.shape)
            chunk_shape = _layout.chunk_shape_for(sharding, shape)
            owned = [(s.index, s.data) for s in leaf.addressable_shards if s.replica_id == 0]
            for _, data in owned:
                data.copy_to_host_async()  # start every transfer before waiting on any
            local = [(_layout.normalize_index(idx, shape), data) for idx, data in owned]
            writers_by_index = _layout.writer_processes(sharding, shape)
            sharding_json = _layout.sharding_to_json(sharding)
        elif isinstance(leaf, np.ndarray):
            shape = tuple(leaf.shape)
            chunk_shape = tuple(max(1, d) for d in shape)
            full = tuple((0, d) for d in shape)
            data = np.array(leaf, copy=True) if copy_host_arrays else leaf
            # A host array is the same on every process: process 0 writes it.
            local = [(full, data)] if me == 0 else []
            writers_by_index = {full: 0}
            sharding_json = None
        else:
            raise CheckpointError(
                f"Leaf '{path}' has type {type(leaf).__name__}, which cannot be saved: use "
                "jax/numpy arrays or int/float/bool/str/None"
            )
        dtype = _storage.dtype_name(leaf.dtype)
        nbytes = math.prod(shape) * _storage.DTYPES[dtype].itemsize
        store = "ocdbt" if nbytes < SMALL_LEAF_BYTES else "file"
        writers: tuple[int, ...] = ()
        if store == "ocdbt" and 0 not in shape:
            grid = _layout.chunk_grid_shape(shape, chunk_shape)
            w = [0] * math.prod(grid)
            for index, proc in writers_by_index.items():
                cell = tuple(a // c for (a, _), c in zip(index, chunk_shape))
                w[_layout.chunk_flat_index(cell, grid)] = proc
            writers = tuple(w)
        records.append(LeafRecord(
            path=path, kind=kind, dtype=dtype, shape=shape, scalar=scalar, impl=impl,
            key_ndim=key_ndim, sharding=sharding_json, store=store, key=str(i),
            chunk_shape=chunk_shape, storage_dtype=_storage.storage_dtype_name(dtype),
            nbytes=nbytes, writers=writers,
        ))
        pending.append((len(shards), local))
        shards.append([])
    total = 0
    for slot, local in pending:
        bufs = []
        for index, data in local:
            host = data if isinstance(data, np.ndarray) else np.asarray(data)
            total += host.nbytes
            bufs.append((index, host))
        shards[slot] = bufs
    return Snapshot(structure, records, shards, nbytes_local=total)


def _writer_of(rec: LeafRecord, index: _layout.Index) -> int:
    if rec.store != "ocdbt":
        return 0
    grid = _layout.chunk_grid_shape(rec.shape, rec.chunk_shape)
    cell = tuple(a // c for (a, _), c in zip(index, rec.chunk_shape))
    return rec.writers[_layout.chunk_flat_index(cell, grid)] if index else rec.writers[0]


def write_data(staging: Location, snap: Snapshot) -> None:
    """Write this process's shards of every leaf, all in flight at once; wait until durable."""
    me = _distributed.process_index()
    ctx = _storage.new_context(staging)
    opens: list[tuple[int, Any]] = []
    for i, rec in enumerate(snap.records):
        if rec.kind == "value":
            continue
        spec = _storage.array_spec(staging, rec.store, rec.key, rec.shape, rec.chunk_shape,
                                   rec.storage_dtype, writer=me)
        # Process 0 writes each array's zarr.json (in its own db for OCDBT leaves);
        # everyone else opens blind from the spec and only writes chunks.
        create = me == 0
        if snap.shards[i] or create:
            opens.append((i, _storage.open_array(spec, ctx, create=create)))
    writes = []
    try:
        for i, fut in opens:
            store = fut.result()
            rec = snap.records[i]
            for index, data in snap.shards[i]:
                if data.size == 0:
                    continue
                writes.append((rec, _storage.write_chunk(store, index, data, rec.storage_dtype, rec.key)))
        for rec, w in writes:
            w.result()
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"Writing checkpoint '{staging}' failed: {e}") from e


def build_manifest(snap: Snapshot, metadata: dict[str, Any] | None,
                   extra_info: dict[str, Any] | None = None) -> Manifest:
    from . import __version__

    info = {
        "library_version": __version__,
        "jax_version": jax.__version__,
        "tensorstore_version": _dist_version("tensorstore"),
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
    Returns the committed manifest.
    """
    final = _storage.resolve(path)
    metadata = _check_metadata(metadata)
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
    if _is_inline(leaf):
        if rec.kind == "array" and rec.shape == () and leaf is not None:
            return _Request(rec, "scalar", None, None, leaf)
        raise mismatch(f"saved an array of shape {rec.shape}, target is {type(leaf).__name__}")
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
    return _Request(rec, "jax", None if saved_key else np.dtype(dtype or _storage.DTYPES[rec.dtype]),
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


class _Reader:
    """Issues every read of a restore at once, then hands out host arrays."""

    def __init__(self, loc: Location, man: Manifest):
        self.loc, self.man = loc, man
        self.ctx = _storage.new_context(loc)
        self.stores: dict[tuple[str, int], Any] = {}

    def _store(self, rec: LeafRecord, writer: int) -> Any:
        key = (rec.key, writer)
        if key not in self.stores:
            spec = _storage.array_spec(self.loc, rec.store, rec.key, rec.shape, rec.chunk_shape,
                                       rec.storage_dtype, writer=writer)
            self.stores[key] = _storage.open_array(spec, self.ctx, create=False)
        return self.stores[key]

    def start(self, rec: LeafRecord, index: _layout.Index) -> list[tuple[_layout.Index, Any]]:
        """Futures covering ``index``: [(sub-index in global coords, future)]."""
        itemsize = _storage.DTYPES[rec.dtype].itemsize
        if _layout.index_size(index) == 0:
            return []
        if rec.store == "file" or len(set(rec.writers)) == 1:
            writer = rec.writers[0] if rec.writers else 0
            store = self._store(rec, writer).result()
            return [(index, _storage.read_region(store, index, _layout.index_size(index) * itemsize))]
        # OCDBT leaf written by several processes: read each chunk from its writer's db.
        grid = _layout.chunk_grid_shape(rec.shape, rec.chunk_shape)
        parts = []
        for cell, overlap in _layout.chunks_overlapping(index, rec.chunk_shape):
            writer = rec.writers[_layout.chunk_flat_index(cell, grid)]
            store = self._store(rec, writer).result()
            parts.append((overlap, _storage.read_region(store, overlap, _layout.index_size(overlap) * itemsize)))
        return parts

    def finish(self, rec: LeafRecord, index: _layout.Index, parts: list) -> np.ndarray:
        saved = _storage.DTYPES[rec.dtype]
        try:
            if len(parts) == 1 and parts[0][0] == index:
                out = parts[0][1].result()
            else:
                out = np.zeros(_layout.index_shape(index), _storage.DTYPES[rec.storage_dtype])
                for sub, fut in parts:
                    rel = tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(sub, index))
                    out[rel] = fut.result()
        except Exception as e:
            raise CorruptCheckpointError(
                f"Checkpoint '{self.loc}': leaf '{rec.path}' could not be read: {e}"
            ) from e
        if out.dtype != saved:
            out = out.view(saved)
        return out


def _restore_leaves(loc: Location, man: Manifest, requests: list[_Request]) -> list[Any]:
    reader = _Reader(loc, man)
    # 1. plan and start every read
    plans: list[Any] = []
    for req in requests:
        rec = req.rec
        if req.mode == "value":
            plans.append(None)
            continue
        if req.mode in ("numpy", "scalar"):
            full = tuple((0, d) for d in rec.shape)
            plans.append({full: reader.start(rec, full)})
            continue
        sharding = req.sharding
        if rec.kind == "prng_key":
            sharding = _key_data_sharding(sharding, len(rec.shape) - rec.key_ndim, rec.path)
        per_device = _layout.needed_indices(sharding, rec.shape)
        unique: dict[_layout.Index, Any] = {}
        for index in per_device.values():
            if index not in unique:
                unique[index] = reader.start(rec, index)
        plans.append((sharding, per_device, unique))
    # 2. collect and assemble
    out: list[Any] = []
    for req, plan in zip(requests, plans):
        rec = req.rec
        if req.mode == "value":
            out.append(rec.value)
            continue
        if req.mode in ("numpy", "scalar"):
            (full, parts), = plan.items()
            arr = _empty_or(reader, rec, full, parts)
            if req.mode == "scalar":
                out.append(type(req.target)(arr.item()))
                continue
            if req.dtype is not None and arr.dtype != req.dtype:
                arr = arr.astype(req.dtype)
            out.append(arr[()] if rec.scalar else arr)
            continue
        sharding, per_device, unique = plan
        host = {index: _empty_or(reader, rec, index, parts) for index, parts in unique.items()}
        if req.dtype is not None:
            host = {k: (v.astype(req.dtype) if v.dtype != req.dtype else v) for k, v in host.items()}
        arrays = [jax.device_put(host[index], device) for device, index in per_device.items()]
        arr = jax.make_array_from_single_device_arrays(rec.shape, sharding, arrays)
        if rec.kind == "prng_key":
            arr = jax.random.wrap_key_data(arr, impl=rec.impl)
        out.append(arr)
    return out


def _empty_or(reader: _Reader, rec: LeafRecord, index: _layout.Index, parts: list) -> np.ndarray:
    if _layout.index_size(index) == 0:
        return np.zeros(_layout.index_shape(index), _storage.DTYPES[rec.dtype])
    return reader.finish(rec, index, parts)


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
