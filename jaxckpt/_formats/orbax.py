"""orbax-checkpoint checkpoints as a ``_formats.Source`` (reading only; orbax is not imported).

What is read (tested against orbax-checkpoint 0.12.8; ``tests/test_orbax.py``):

* a PyTree item directory, as ``StandardCheckpointHandler`` (``StandardSave``) and
  ``PyTreeCheckpointHandler`` (``PyTreeSave``) write it: ``_METADATA`` (JSON: the tree,
  ``use_ocdbt``, ``use_zarr3``), arrays through tensorstore as orbax wrote them (zarr v2
  by default, zarr3 with ``use_zarr3=True``; inside the item's OCDBT database, or one
  directory per parameter with ``use_ocdbt=False``), ``_sharding`` (the saved
  shardings), ``array_metadatas/process_<n>`` (the PRNG key implementation) and
  ``_strings.json`` (string leaves);
* an orbax step directory (``_CHECKPOINT_METADATA``, one subdirectory per item, as
  ``CheckpointManager`` writes it). With exactly one readable item its tree is the
  checkpoint's tree (``<step>/default`` reads like ``<step>``); with several, each item
  is a top-level subtree named by the item (``state/params/w``, ``extra/lr``). Items
  written by ``JsonCheckpointHandler`` (``JsonSave``: ``<item>/metadata``) come back as
  inline values. Items of other handlers are not read; ``info["orbax_unread_items"]``
  names them.

How orbax's leaves map to jaxckpt's:

* ``jax.Array`` and ``np.ndarray`` leaves are arrays of their stored dtype and shape.
  A ``jax.Array``'s saved sharding (``_sharding``) becomes the record's sharding when it
  was a ``NamedSharding`` or a ``SingleDeviceSharding``; numpy leaves have none.
* Python scalars (orbax's ``scalar`` leaves: 0-d ``int64``/``float64``/``bool`` arrays)
  are read when the checkpoint is opened and presented as inline Python values, as
  orbax restores them.
* Typed PRNG keys: orbax stores the ``uint32`` key data and records the implementation
  in ``array_metadatas``; they restore as typed keys. Without that record (orbax
  releases that did not write it) a key is the ``uint32`` key data, as orbax restores it.
* Strings are inline values; ``None`` and empty containers keep their place in the tree
  (empty tuples as tuples, every non-empty sequence as a list, as orbax restores them).
  Dict keys are strings (orbax stores every key as its ``str``).

Where: local directories and object stores (whatever ``_location`` resolves; tested on
S3). Opening a checkpoint opens each array once (its zarr metadata gives shape and
dtype); a reader then reads exactly the slices asked of it through those handles.

The metadata files are untrusted input: JSON only (never unpickled), sizes capped,
types, names and shapes checked; an orbax parameter name must stay inside its item
(no ``/``, no ``.``/``..``). Whatever is wrong ends as ``CorruptCheckpointError``
naming the checkpoint and, where there is one, the leaf.
"""

from __future__ import annotations

import base64
import binascii
import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import tensorstore as ts

from .. import _dtypes, _formats, _layout, _manifest, _tasks, _tree, _untrusted
from .._errors import CheckpointError, CorruptCheckpointError
from .._manifest import LeafRecord, Manifest
from .._storage import chunkfiles as _chunkfiles
from .._storage import kvstore as _kvstore
from .._storage import location as _location
from .._storage import zarr as _zarr
from .._storage.location import Location

METADATA = "_METADATA"  # a PyTree item's tree
CHECKPOINT_METADATA = "_CHECKPOINT_METADATA"  # a step directory's items
JSON_ITEM = "metadata"  # JsonCheckpointHandler's file
STRINGS = "_strings.json"
SHARDINGS = "_sharding"
ARRAY_METADATAS = "array_metadatas"
MAX_JSON_BYTES = _manifest.MAX_MANIFEST_BYTES
READ_BUDGET_BYTES = 256 << 20  # bytes of reads in flight
OPEN_BATCH = 256  # arrays opened at once
_MAX_NBYTES = 1 << 44  # per leaf, as for jaxckpt's own manifests
_MAX_DIM = _MAX_NBYTES
_MAX_RANK = 64
_MAX_ITEMS = 10_000
_OCDBT_CACHE_BYTES = 100_000_000  # b-tree nodes, as orbax's own reader caches them
_EMPTY = {"Dict": {"dict": []}, "List": {"list": []}, "Tuple": {"tuple": []}}
_NONE_TYPES = ("None", "NamedTuple")  # orbax restores an empty NamedTuple as None
_ARRAY_TYPES = ("jax.Array", "np.ndarray", "scalar")


def _bad(where: str, msg: str) -> CorruptCheckpointError:
    if len(msg) > 500:
        msg = msg[:500] + "…"
    return CorruptCheckpointError(f"Checkpoint '{where}': invalid orbax metadata: {msg}")


# --- small files -------------------------------------------------------------------


def _read_small(loc: Location, key: str, where: str) -> bytes | None:
    """A metadata file's bytes (``None`` when absent), never more than ``MAX_JSON_BYTES``.

    A local file is checked first (``_untrusted.read_small``): a hostile checkpoint could
    hold a huge file, a directory or a FIFO (``open`` would block forever) under the name.
    """

    def refuse(why: str, detail: Any) -> CorruptCheckpointError | None:
        if why in (_untrusted.ABSENT, _untrusted.CANNOT_OPEN):
            return None  # absent: None; another OSError of open propagates
        return _bad(where, f"{key} has more than {MAX_JSON_BYTES} bytes" if why == _untrusted.TOO_BIG
                    else f"{key} is {why}")

    return _untrusted.read_small(loc, key, MAX_JSON_BYTES, refuse, _kvstore.read_blob)


def _load(data: bytes, where: str, name: str) -> Any:
    """Parse untrusted JSON (no duplicate keys, bounded integers and nesting)."""

    def bad(msg: str) -> CorruptCheckpointError:
        return _bad(where, f"{name}: {msg}")

    doc = _untrusted.load_json(data, bad)
    if _manifest.nesting_exceeds(doc, _manifest.MAX_DEPTH + 4):
        raise bad(f"nested deeper than {_manifest.MAX_DEPTH} levels")
    return doc


def _read_json(loc: Location, key: str, where: str) -> Any:
    data = _read_small(loc, key, where)
    return None if data is None else _load(data, where, key)


def _safe_component(name: Any) -> bool:
    """A file or key name that stays where it is put: no separators, not ``.``/``..``."""
    return (isinstance(name, str) and 0 < len(name) <= 4096 and name not in (".", "..")
            and not any(c in name for c in "/\\") and all(ord(c) >= 32 for c in name))


# --- items of a step ----------------------------------------------------------------


class _Item(NamedTuple):
    name: str  # "" when the item is the whole checkpoint
    loc: Location
    kind: str  # "pytree" or "json"
    doc: Any  # its parsed _METADATA, or the JSON item's value


def _step_items(loc: Location, ckpt: Any, where: str) -> tuple[list[_Item], dict[str, str]]:
    """The readable items of a step directory, and the unread ones (name -> handler)."""
    if not isinstance(ckpt, dict):
        raise _bad(where, f"{CHECKPOINT_METADATA} is not a JSON object")
    handlers = ckpt.get("item_handlers")
    if isinstance(handlers, dict):
        names = dict(handlers)
    elif handlers is None or isinstance(handlers, str):
        # No item names recorded: the subdirectories holding a PyTree item's metadata.
        names = {n: "" for n in _kvstore.list_children(loc) if _safe_component(n)
                 and _read_small(loc.child(n), METADATA, where) is not None}
    else:
        raise _bad(where, f"{CHECKPOINT_METADATA}: item_handlers is not an object")
    if len(names) > _MAX_ITEMS:
        raise _bad(where, f"{CHECKPOINT_METADATA} names {len(names)} items")
    items, unread = [], {}
    for name in sorted(names):
        handler = names[name]
        if not _safe_component(name) or not isinstance(handler, (str, type(None))):
            raise _bad(where, f"{CHECKPOINT_METADATA}: item {str(name)[:100]!r}")
        item_loc = loc.child(name)
        doc = _read_json(item_loc, METADATA, where)
        if doc is not None:
            items.append(_Item(name, item_loc, "pytree", doc))
            continue
        if (handler or "").endswith("JsonCheckpointHandler"):
            value = _read_json(item_loc, JSON_ITEM, where)
            if value is not None:
                items.append(_Item(name, item_loc, "json", value))
                continue
        unread[name] = handler or ""
    return items, unread


# --- a PyTree item's tree ------------------------------------------------------------


class _Entry(NamedTuple):
    keys: tuple[tuple[str, bool], ...]  # (name, is a sequence index) per level
    value_type: str


def _tree_entries(doc: Any, where: str, item: str) -> list[_Entry]:
    """The leaves ``_METADATA`` lists, checked (types, names, depth)."""
    label = f"{item}/{METADATA}" if item else METADATA
    tree = doc.get("tree_metadata") if isinstance(doc, dict) else None
    if not isinstance(tree, dict):
        raise _bad(where, f"{label} has no tree_metadata object")
    entries = []
    for entry in tree.values():
        keys = entry.get("key_metadata") if isinstance(entry, dict) else None
        value = entry.get("value_metadata") if isinstance(entry, dict) else None
        if not isinstance(keys, list) or not isinstance(value, dict) or not keys:
            raise _bad(where, f"{label}: an entry without key_metadata/value_metadata")
        if len(keys) > _tree.MAX_DEPTH - 1:
            raise _bad(where, f"{label}: a key path deeper than {_tree.MAX_DEPTH - 1} levels")
        parts = []
        for k in keys:
            name = k.get("key") if isinstance(k, dict) else None
            kind = k.get("key_type") if isinstance(k, dict) else None
            if not isinstance(name, str) or len(name) > 4096 or kind not in (1, 2) or isinstance(kind, bool):
                raise _bad(where, f"{label}: key {str(k)[:100]}")
            if kind == 1 and not (name.isdigit() and name.isascii() and str(int(name)) == name):
                raise _bad(where, f"{label}: sequence index {name[:100]!r}")
            parts.append((name, kind == 1))
        value_type = value.get("value_type")
        if not isinstance(value_type, str):
            raise _bad(where, f"{label}: value_type {str(value_type)[:100]!r}")
        entries.append(_Entry(tuple(parts), value_type))
    return entries


def _grow(entries: list[_Entry], depth: int, emit: Callable[[_Entry], dict[str, Any]],
          fail: Callable[[str], Exception]) -> dict[str, Any]:
    """The jaxckpt structure of entries sharing their first ``depth`` keys.

    A shorter entry that is a prefix of longer ones is dropped, as orbax does (a
    placeholder an earlier partial save left). Dict keys are sorted, as jax orders them.
    """
    if len(entries) == 1 and len(entries[0].keys) == depth:
        return emit(entries[0])
    groups: dict[str, list[_Entry]] = {}
    kinds = set()
    for e in entries:
        if len(e.keys) == depth:
            continue
        name, is_seq = e.keys[depth]
        groups.setdefault(name, []).append(e)
        kinds.add(is_seq)
    if len(kinds) > 1:
        raise fail("a container with both sequence and dict keys")
    if kinds == {True}:
        if sorted(int(n) for n in groups) != list(range(len(groups))):
            raise fail("sequence indices are not 0..n-1")
        return {"list": [_grow(groups[str(i)], depth + 1, emit, fail) for i in range(len(groups))]}
    return {"dict": [[k, _grow(groups[k], depth + 1, emit, fail)] for k in sorted(groups)]}


def _key_path(keys: tuple[tuple[str, bool], ...], item: str) -> str:
    parts = [_tree.encode_key(item)] if item else []
    parts.extend(n if is_seq else _tree.encode_key(n) for n, is_seq in keys)
    return "/".join(parts)


def _param_name(keys: tuple[tuple[str, bool], ...]) -> str:
    return ".".join(n for n, _ in keys)  # orbax's tree_utils.param_name_from_keypath


def _check_unique(entries: list[_Entry], where: str, item: str) -> None:
    """No two leaves at one key path or under one orbax parameter name."""
    label = f"{item}/{METADATA}" if item else METADATA
    paths: set[tuple[tuple[str, bool], ...]] = set()
    params: set[str] = set()
    for e in entries:
        if e.keys in paths:
            raise _bad(where, f"{label}: key path {_key_path(e.keys, '')[:200]!r} appears twice")
        paths.add(e.keys)
        if e.value_type in _ARRAY_TYPES:
            param = _param_name(e.keys)
            if not _safe_component(param):
                raise _bad(where, f"{label}: parameter name {param[:200]!r} would leave the checkpoint")
            if param in params:
                raise _bad(where, f"{label}: parameter name {param[:200]!r} used twice")
            params.add(param)


# --- shardings and PRNG key implementations -------------------------------------------


def _spec_entry_ok(e: Any, axes: list[str]) -> bool:
    if e is None:
        return True
    if isinstance(e, str):
        return e in axes
    return isinstance(e, list) and len(e) <= _MAX_RANK and all(isinstance(a, str) and a in axes for a in e)


def _sharding_json(raw: Any, where: str, param: str) -> dict[str, Any] | None:
    """orbax's serialised sharding as jaxckpt's sharding JSON (``None``: not recorded)."""
    if not isinstance(raw, dict):
        raise _bad(where, f"{SHARDINGS}: the sharding of '{param}' is not an object")
    kind = raw.get("sharding_type")
    if kind == "SingleDeviceSharding":
        return {"type": "single_device"}
    if kind != "NamedSharding":
        return None  # PositionalSharding and the like: not described
    axes, sizes, spec = raw.get("axis_names"), raw.get("shape"), raw.get("partition_spec")
    if not (isinstance(axes, list) and isinstance(sizes, list) and isinstance(spec, list)
            and 0 < len(axes) == len(sizes) <= _MAX_RANK and len(spec) <= _MAX_RANK
            and all(isinstance(a, str) and len(a) <= 1024 for a in axes) and len(set(axes)) == len(axes)
            and all(isinstance(s, int) and not isinstance(s, bool) and 1 <= s <= 1 << 24 for s in sizes)
            and all(_spec_entry_ok(e, axes) for e in spec)):
        raise _bad(where, f"{SHARDINGS}: the sharding of '{param}' is malformed")
    return {"type": "named", "axis_names": list(axes), "axis_sizes": list(sizes),
            "spec": [list(e) if isinstance(e, list) else e for e in spec]}


def _shardings(item: _Item, where: str) -> dict[str, dict[str, Any] | None]:
    """Parameter name -> saved sharding, from the item's ``_sharding`` (if there is one)."""
    raw = _read_json(item.loc, SHARDINGS, where)
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise _bad(where, f"{SHARDINGS} is not a JSON object")
    out = {}
    for key, value in raw.items():
        try:
            param = base64.urlsafe_b64decode(key.encode("ascii")).decode("utf-8")
        except (binascii.Error, UnicodeError, ValueError):
            raise _bad(where, f"{SHARDINGS}: key {key[:100]!r} is not a base64 parameter name") from None
        if not isinstance(value, str):
            raise _bad(where, f"{SHARDINGS}: the sharding of '{param[:100]}' is not a string")
        out[param] = _sharding_json(_load(value.encode(), where, f"{SHARDINGS} of '{param[:100]}'"), where, param)
    return out


def _key_impls(item: _Item, where: str) -> dict[str, str]:
    """Parameter name -> PRNG key implementation, from the first process's array metadata."""
    folder = item.loc.child(ARRAY_METADATAS)
    files = [n for n in _kvstore.list_children(folder)
             if n.startswith("process_") and n[8:].isdigit() and n[8:].isascii() and len(n) < 20]
    if not files:
        return {}
    name = min(files, key=lambda n: int(n[8:]))
    doc = _read_json(folder, name, where)
    entries = doc.get("array_metadatas") if isinstance(doc, dict) else None
    if not isinstance(entries, list):
        raise _bad(where, f"{ARRAY_METADATAS}/{name} has no array_metadatas list")
    out = {}
    for e in entries:
        meta = e.get("array_metadata") if isinstance(e, dict) else None
        param = meta.get("param_name") if isinstance(meta, dict) else None
        if not isinstance(param, str):
            raise _bad(where, f"{ARRAY_METADATAS}/{name}: an entry without param_name")
        ext = meta.get("ext_metadata")
        impl = ext.get("random_key_impl") if isinstance(ext, dict) else None
        if impl is not None:
            if not (isinstance(impl, str) and 0 < len(impl) <= 64 and impl.replace("_", "").isalnum()
                    and impl.isascii()):
                raise _bad(where, f"{ARRAY_METADATAS}/{name}: random_key_impl {str(impl)[:100]!r}")
            out[param] = impl
    return out


@functools.lru_cache(maxsize=64)
def _key_data_trailing(impl: str) -> tuple[int, ...]:
    import jax

    return tuple(jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=impl))).shape)


def _key_data_shape(impl: str, where: str, path: str) -> tuple[int, ...]:
    """The trailing key-data dimensions of one key of ``impl`` (jax refuses unknown names)."""
    try:
        return _key_data_trailing(impl)
    except Exception as e:  # noqa: BLE001 - jax refuses an unknown implementation name
        raise _bad(where, f"leaf '{path}': PRNG key implementation {impl!r}: {str(e)[:200]}") from None


# --- arrays -------------------------------------------------------------------------


class _Arrays(NamedTuple):
    """How one item's arrays are stored."""

    item: _Item
    driver: str  # "zarr" or "zarr3"
    ocdbt: bool
    fill_missing: bool  # chunks equal to the fill value were not written
    shardings: dict[str, dict[str, Any] | None]
    impls: dict[str, str]

    def spec(self, param: str) -> dict[str, Any]:
        if self.ocdbt:
            kvstore = {"driver": "ocdbt", "base": self.item.loc.kvstore, "path": param,
                       "cache_pool": "cache_pool#ocdbt"}
        else:
            kvstore = self.item.loc.key_spec(param + "/")
        return {"driver": self.driver, "kvstore": kvstore, "recheck_cached_data": False,
                "recheck_cached_metadata": False, "fill_missing_data_reads": self.fill_missing}


def _item_arrays(item: _Item, where: str) -> _Arrays:
    doc, label = item.doc, (f"{item.name}/{METADATA}" if item.name else METADATA)
    ocdbt = doc.get("use_ocdbt")
    if ocdbt is None:  # older orbax: an OCDBT item has its database's manifest
        ocdbt = _read_small(item.loc, "manifest.ocdbt", where) is not None
    zarr3 = doc.get("use_zarr3", False)
    stored_fill = doc.get("store_array_data_equal_to_fill_value", False)
    if not all(isinstance(x, bool) for x in (ocdbt, zarr3, stored_fill)):
        raise _bad(where, f"{label}: use_ocdbt, use_zarr3 or store_array_data_equal_to_fill_value "
                          "is not a boolean")
    return _Arrays(item, "zarr3" if zarr3 else "zarr", ocdbt, not stored_fill,
                   _shardings(item, where), _key_impls(item, where))


class _Pending(NamedTuple):
    index: int  # in the manifest's leaf list
    path: str
    param: str
    value_type: str
    arrays: _Arrays


def _leaf_error(where: str, p: _Pending, doing: str, e: BaseException) -> CorruptCheckpointError:
    item = f" of item '{p.arrays.item.name}'" if p.arrays.item.name else ""
    return CorruptCheckpointError(f"Checkpoint '{where}': leaf '{p.path}' (orbax parameter "
                                  f"'{p.param}'{item}) {doing}: {_kvstore.storage_cause(e)}")


def _open_stores(pending: list[_Pending], ctx: ts.Context, where: str) -> list[Any]:
    """Open every array (``OPEN_BATCH`` at a time); its metadata gives shape and dtype."""
    out = []
    for start in range(0, len(pending), OPEN_BATCH):
        batch = pending[start:start + OPEN_BATCH]
        futures = []
        for p in batch:
            try:
                futures.append(ts.open(p.arrays.spec(p.param), open=True, read=True, context=ctx))
            except Exception as e:  # noqa: BLE001 - a spec tensorstore refuses
                raise _leaf_error(where, p, "could not be opened", e) from None
        for p, future in zip(batch, futures):
            out.append(_result(future, where, p, "could not be opened"))
    return out


def _result(future: Any, where: str, p: _Pending, doing: str) -> Any:
    """A tensorstore future's result within the I/O bound (``_kvstore.wait``); its own
    error (missing or malformed metadata, corruption) as a ``CorruptCheckpointError``."""
    try:
        return _kvstore.wait(future, _Where(where), doing, p.param)
    except CheckpointError as bounded:
        if not future.done() or future.cancelled():
            raise _leaf_error(where, p, doing, bounded) from None  # the store stopped answering
    try:
        return future.result()
    except Exception as e:  # noqa: BLE001 - tensorstore reports corruption as ValueError
        raise _leaf_error(where, p, doing, e) from None


class _Where(NamedTuple):
    url: str


def _array_record(p: _Pending, store: Any, where: str) -> LeafRecord:
    """The record of one opened array, its stored dtype, shape and sharding checked."""
    try:
        name = np.dtype(store.dtype.numpy_dtype).name
    except Exception:  # noqa: BLE001 - a tensorstore dtype numpy has no name for
        name = str(store.dtype)
    if name not in _dtypes.DTYPES:
        raise _bad(where, f"leaf '{p.path}': dtype {name[:100]!r} is not supported")
    shape = tuple(int(d) for d in store.shape)
    if (len(shape) > _MAX_RANK or any(d > _MAX_DIM for d in shape)
            or any(int(a) != 0 for a in store.domain.inclusive_min)
            or math.prod(shape) * _dtypes.DTYPES[name].itemsize > _MAX_NBYTES):
        raise _bad(where, f"leaf '{p.path}': shape {shape} (origin {tuple(store.domain.inclusive_min)})")
    fields: dict[str, Any] = {"path": p.path, "kind": "array", "dtype": name, "shape": shape,
                              "scalar": p.value_type == "scalar", "store": "orbax", "key": p.param,
                              "storage_dtype": name,
                              "nbytes": math.prod(shape) * _dtypes.DTYPES[name].itemsize}
    rank = len(shape)
    impl = p.arrays.impls.get(p.param)
    if impl is not None:
        trailing = _key_data_shape(impl, where, p.path)
        if name != "uint32" or rank < len(trailing) or shape[rank - len(trailing):] != trailing:
            raise _bad(where, f"leaf '{p.path}': {name}{list(shape)} is not key data of {impl}")
        rank -= len(trailing)
        fields.update(kind="prng_key", impl=impl, key_ndim=rank)
    sharding = p.arrays.shardings.get(p.param)
    if sharding is not None and sharding["type"] == "named" and len(sharding["spec"]) > rank:
        # orbax records a fresh replicated key's spec as [None] (one entry per key-data
        # dimension, none of them sharded): entries past the rank are harmless when None.
        if any(e is not None for e in sharding["spec"][rank:]):
            raise _bad(where, f"leaf '{p.path}': sharding spec {sharding['spec']} is longer than its rank {rank}")
        sharding = {**sharding, "spec": sharding["spec"][:rank]}
    chunk = store.chunk_layout.read_chunk.shape
    fields["chunk_shape"] = tuple(int(c) for c in chunk) if chunk is not None else shape
    return LeafRecord(sharding=sharding, **fields)


def _scalar_values(pending: list[_Pending], stores: list[Any], records: list[LeafRecord],
                   where: str) -> dict[int, Any]:
    """orbax's Python scalars (0-d bool/int/float arrays), read now: leaf index -> value."""
    reads = {}
    for p, store, rec in zip(pending, stores, records):
        if rec.scalar and rec.kind == "array" and rec.shape == () and _dtypes.DTYPES[rec.dtype].kind in "biuf":
            try:
                reads[p.index] = (p, store.read())
            except Exception as e:  # noqa: BLE001
                raise _leaf_error(where, p, "could not be read", e) from None
    out = {}
    for i, (p, future) in reads.items():
        out[i] = _result(future, where, p, "could not be read").item()
    return out


def _strings(item: _Item, where: str) -> dict[str, Any]:
    raw = _read_json(item.loc, STRINGS, where)
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise _bad(where, f"{STRINGS} is not a JSON object")
    return raw


# --- the synthetic manifest -----------------------------------------------------------


class _Builder:
    """Collects the leaves of every item in structure order: inline values at once,
    arrays as ``_Pending`` (opened together later)."""

    def __init__(self, where: str):
        self.where = where
        self.leaves: list[LeafRecord | None] = []
        self.pending: list[_Pending] = []

    def value(self, path: str, value: Any) -> dict[str, Any]:
        self.leaves.append(LeafRecord(path=path, kind="value", value=value))
        return {"leaf": len(self.leaves) - 1}

    def item(self, item: _Item, prefix: str) -> dict[str, Any]:
        return self.pytree(item, prefix) if item.kind == "pytree" else self.json_value(item, prefix)

    def pytree(self, item: _Item, prefix: str) -> dict[str, Any]:
        where = self.where
        entries = _tree_entries(item.doc, where, item.name)
        _check_unique(entries, where, item.name)
        types = {e.value_type for e in entries}
        arrays = _item_arrays(item, where) if types & set(_ARRAY_TYPES) else None
        strings = _strings(item, where) if "string" in types else {}

        def emit(e: _Entry) -> dict[str, Any]:
            path, param = _key_path(e.keys, prefix), _param_name(e.keys)
            if e.value_type in _EMPTY:
                return {k: list(v) for k, v in _EMPTY[e.value_type].items()}
            if e.value_type in _NONE_TYPES:
                return self.value(path, None)
            if e.value_type == "string":
                if not isinstance(strings.get(param), str):
                    raise _bad(where, f"leaf '{path}': no string '{param[:100]}' in {STRINGS}")
                return self.value(path, strings[param])
            if e.value_type in _ARRAY_TYPES and arrays is not None:
                self.leaves.append(None)
                self.pending.append(_Pending(len(self.leaves) - 1, path, param, e.value_type, arrays))
                return {"leaf": len(self.leaves) - 1}
            raise CheckpointError(f"Checkpoint '{where}': leaf '{path}': orbax value type "
                                  f"{e.value_type[:100]!r} is not supported")

        def fail(msg: str) -> CorruptCheckpointError:
            return _bad(where, f"{item.name + '/' if item.name else ''}{METADATA}: {msg}")

        return _grow(entries, 0, emit, fail)

    def json_value(self, item: _Item, prefix: str) -> dict[str, Any]:
        """A ``JsonSave`` item: containers as containers, the rest as inline values."""
        if _manifest.nesting_exceeds(item.doc, _tree.MAX_DEPTH - 1):
            raise _bad(self.where, f"{item.name}/{JSON_ITEM} is nested too deeply")

        def walk(v: Any, parts: list[str]) -> dict[str, Any]:
            if isinstance(v, dict):
                return {"dict": [[k, walk(v[k], [*parts, _tree.encode_key(k)])] for k in sorted(v)]}
            if isinstance(v, list):
                return {"list": [walk(x, [*parts, str(i)]) for i, x in enumerate(v)]}
            return self.value("/".join(parts), v)

        return walk(item.doc, [_tree.encode_key(prefix)] if prefix else [])


def _context(loc: Location) -> ts.Context:
    """The store's shared context, plus a cache for OCDBT b-tree nodes (as orbax reads)."""
    spec = ts.Context.Spec({"cache_pool#ocdbt": {"total_bytes_limit": _OCDBT_CACHE_BYTES}})
    return ts.Context(spec, parent=_kvstore.context(loc))


def _info(items: list[_Item], unread: dict[str, str], ckpt: Any, leaves: list[LeafRecord]) -> dict[str, Any]:
    info: dict[str, Any] = {"format": "orbax", "orbax_items": [it.name for it in items if it.name],
                            "bytes": sum(r.nbytes for r in leaves)}
    if unread:
        info["orbax_unread_items"] = dict(unread)
    stamp = ckpt.get("commit_timestamp_nsecs") if isinstance(ckpt, dict) else None
    if isinstance(stamp, int) and not isinstance(stamp, bool) and 0 < stamp < 1 << 63:
        info["created_unix"] = stamp / 1e9
    return info


def _build_source(loc: Location, items: list[_Item], unread: dict[str, str], ckpt: Any) -> _formats.Source:
    where = str(loc)
    b = _Builder(where)
    single = len(items) == 1
    subtrees = [[it.name, b.item(it, "" if single else it.name)] for it in items]
    structure = subtrees[0][1] if single else {"dict": subtrees}
    stores = _open_stores(b.pending, _context(loc), where)
    records = [_array_record(p, s, where) for p, s in zip(b.pending, stores)]
    values = _scalar_values(b.pending, stores, records, where)
    arrays: dict[str, tuple[Any, _Pending]] = {}
    for p, store, rec in zip(b.pending, stores, records):
        if p.index in values:
            b.leaves[p.index] = LeafRecord(path=p.path, kind="value", value=values[p.index])
        else:
            b.leaves[p.index] = rec
            arrays[p.path] = (store, p)
    leaves = [r for r in b.leaves if r is not None]
    man = Manifest(format_version=_manifest.FORMAT_VERSION, structure=structure, leaves=tuple(leaves),
                   metadata={}, process_count=1, info=_info(items, unread, ckpt, leaves))
    return _formats.Source(loc, man, lambda: OrbaxReader(where, arrays), "orbax")


def open_source(loc: Any) -> _formats.Source | None:
    """The orbax checkpoint at ``loc`` as a ``Source``, or ``None`` when it is not one.

    ``loc`` is a PyTree item directory (it has ``_METADATA``) or an orbax step directory
    (``_CHECKPOINT_METADATA`` and item subdirectories); anything else is not claimed.

    Raises:
      CorruptCheckpointError: orbax's metadata files are malformed or hostile, or an
        array's metadata cannot be read.
      CheckpointError: an orbax step with no item this reader understands, or a leaf of
        a type it does not read.
    """
    loc = _location.resolve(loc)
    where = str(loc)
    doc = _read_json(loc, METADATA, where)
    ckpt = _read_json(loc, CHECKPOINT_METADATA, where)
    if doc is not None:
        return _build_source(loc, [_Item("", loc, "pytree", doc)], {}, ckpt)
    if ckpt is None:
        return None
    items, unread = _step_items(loc, ckpt, where)
    if not items:
        names = ", ".join(f"'{n}'" for n in sorted(unread)[:20]) or "none"
        raise CheckpointError(f"Checkpoint '{where}': an orbax step whose items jaxckpt cannot read "
                              f"(items: {names}; PyTree and JSON items are read)")
    return _build_source(loc, items, unread, ckpt)


# --- reading --------------------------------------------------------------------------


class OrbaxReader:
    """Reads the slices a restore needs from orbax's arrays, each requested slice once
    and nothing else (``_reader.Reader``'s interface: ``add``, ``run``, ``get``), within
    ``READ_BUDGET_BYTES`` of reads in flight."""

    def __init__(self, where: str, arrays: dict[str, tuple[Any, _Pending]]):
        self._where, self._arrays = where, arrays  # path -> (open TensorStore, its leaf)
        self._wanted: dict[tuple[str, _layout.Index], LeafRecord] = {}
        self._out: dict[tuple[str, _layout.Index], np.ndarray] = {}

    def add(self, rec: LeafRecord, index: _layout.Index) -> None:
        if rec.path not in self._arrays:
            raise CheckpointError(f"Checkpoint '{self._where}': leaf '{rec.path}' has no array data")
        if len(index) != len(rec.shape) or any(not 0 <= a <= b <= d for (a, b), d in zip(index, rec.shape)):
            raise CheckpointError(f"Checkpoint '{self._where}': leaf '{rec.path}': index {index} is "
                                  f"outside its shape {rec.shape}")
        self._wanted[(rec.path, index)] = rec

    def run(self) -> None:
        jobs = [self._job(rec, index) for (path, index), rec in self._wanted.items()
                if (path, index) not in self._out]
        _tasks.run_bounded(jobs, READ_BUDGET_BYTES)

    def get(self, rec: LeafRecord, index: _layout.Index) -> np.ndarray:
        """The slice as a host array of the saved dtype."""
        return self._out[(rec.path, index)]

    def _job(self, rec: LeafRecord, index: _layout.Index) -> tuple[int, Callable[[], Any], Callable[[Any], None]]:
        dtype = _dtypes.DTYPES[rec.dtype]
        store, pending = self._arrays[rec.path]

        def start() -> Any:
            buf = _chunkfiles.aligned_empty(_layout.index_shape(index), dtype)
            self._out[(rec.path, index)] = buf
            return None if buf.size == 0 else _zarr.read_into(buf, store, index)

        def finish(future: Any) -> None:
            if future is None:
                return
            try:
                future.result()
            except Exception as e:  # noqa: BLE001 - tensorstore reports corruption as ValueError
                self._out.pop((rec.path, index), None)
                raise _leaf_error(self._where, pending, "could not be read", e) from None

        return _layout.index_size(index) * dtype.itemsize, start, finish
