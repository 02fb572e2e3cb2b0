"""The manifest: schema, (de)serialisation and validation of untrusted input.

``manifest.json`` is the only thing a reader trusts to find data, and it comes from
disk, so every field is checked before anything is allocated or opened: kinds, dtypes,
shapes and byte counts agree, chunk grids are sane, every data key stays inside the
checkpoint, the container description references each leaf exactly once.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from . import _layout, _storage
from ._errors import CorruptCheckpointError

MANIFEST = "manifest.json"
FORMAT = "jaxckpt"
FORMAT_VERSION = 1

KINDS = ("array", "prng_key", "value")
STORES = ("file", "packed")
_MAX_RANK = 64
_MAX_DIM = 1 << 62
_MAX_CHUNKS = 1 << 20
_MAX_NBYTES = 1 << 56


@dataclass(frozen=True)
class LeafRecord:
    """One leaf as the manifest records it."""

    path: str
    kind: str
    value: Any = None  # kind == "value"
    dtype: str = ""  # stored element type (uint32 for PRNG keys)
    shape: tuple[int, ...] = ()  # stored shape (key data shape for PRNG keys)
    scalar: bool = False  # saved as a numpy scalar, comes back as one
    impl: str | None = None  # PRNG key implementation
    key_ndim: int = 0  # leading dims of ``shape`` that are the key array's shape
    sharding: dict[str, Any] | None = None
    store: str = "file"
    key: str = ""
    chunk_shape: tuple[int, ...] = ()
    storage_dtype: str = ""
    nbytes: int = 0
    chunks: tuple[tuple[int, int], ...] = ()  # packed: per chunk (C order) (process, offset)

    def to_json(self) -> dict[str, Any]:
        if self.kind == "value":
            return {"path": self.path, "kind": "value", "value": self.value}
        out: dict[str, Any] = {
            "path": self.path,
            "kind": self.kind,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "sharding": self.sharding,
            "store": self.store,
            "key": self.key,
            "chunk_shape": list(self.chunk_shape),
            "nbytes": self.nbytes,
        }
        if self.scalar:
            out["scalar"] = True
        if self.kind == "prng_key":
            out["impl"] = self.impl
            out["key_ndim"] = self.key_ndim
        if self.storage_dtype != self.dtype:
            out["storage_dtype"] = self.storage_dtype
        if self.store == "packed":
            out["chunks"] = [list(c) for c in self.chunks]
        return out


class PackedArray(NamedTuple):
    """One process's byte array of small leaves (``packed/p<process>/``)."""

    process: int
    nbytes: int
    chunk_bytes: int


@dataclass(frozen=True)
class Manifest:
    format_version: int
    structure: dict[str, Any]
    leaves: tuple[LeafRecord, ...]
    metadata: dict[str, Any]
    process_count: int
    info: dict[str, Any] = field(default_factory=dict)  # versions, times, stats
    packed: tuple[PackedArray, ...] = ()

    def to_bytes(self) -> bytes:
        doc = {
            "format": FORMAT,
            "format_version": self.format_version,
            **self.info,
            "process_count": self.process_count,
            "packed": [p._asdict() for p in self.packed],
            "metadata": self.metadata,
            "structure": self.structure,
            "leaves": [r.to_json() for r in self.leaves],
        }
        return json.dumps(doc, separators=(",", ":"), allow_nan=True).encode()


def parse(data: bytes, where: str) -> Manifest:
    """Parse and validate a manifest; raise ``CorruptCheckpointError`` naming ``where``."""

    def bad(msg: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"Checkpoint '{where}': invalid manifest: {msg}")

    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad(f"not JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise bad("not a jaxckpt manifest (field 'format' is missing or wrong)")
    version = doc.get("format_version")
    if version != FORMAT_VERSION:
        raise bad(f"format_version {version!r} is not supported (this jaxckpt reads {FORMAT_VERSION})")
    process_count = doc.get("process_count")
    if not _is_int(process_count) or not 1 <= process_count <= 1 << 20:
        raise bad(f"process_count {process_count!r}")
    metadata = doc.get("metadata")
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict):
        raise bad("metadata is not an object")
    packed = _parse_packed(doc.get("packed", []), process_count, bad)
    raw_leaves = doc.get("leaves")
    if not isinstance(raw_leaves, list):
        raise bad("leaves is not a list")
    leaves = []
    seen_paths: set[str] = set()
    seen_keys: set[tuple[str, str]] = set()
    for i, raw in enumerate(raw_leaves):
        rec = _parse_leaf(raw, i, packed, bad)
        if rec.path in seen_paths:
            raise bad(f"duplicate leaf path '{rec.path}'")
        seen_paths.add(rec.path)
        if rec.kind != "value":
            if (rec.store, rec.key) in seen_keys:
                raise bad(f"leaf '{rec.path}': data key '{rec.key}' used twice")
            seen_keys.add((rec.store, rec.key))
        leaves.append(rec)
    structure = doc.get("structure")
    _check_structure(structure, len(leaves), bad)
    info = {k: v for k, v in doc.items()
            if k not in ("format", "format_version", "process_count", "packed", "metadata", "structure",
                         "leaves")}
    return Manifest(version, structure, tuple(leaves), metadata, process_count, info,
                    tuple(packed[k] for k in sorted(packed)))


def _parse_packed(raw: Any, process_count: int, bad) -> dict[int, PackedArray]:
    if not isinstance(raw, list):
        raise bad("packed is not a list")
    out: dict[int, PackedArray] = {}
    for entry in raw:
        if not isinstance(entry, dict):
            raise bad("packed entry is not an object")
        p, n, c = entry.get("process"), entry.get("nbytes"), entry.get("chunk_bytes")
        if not (_is_int(p) and 0 <= p < process_count and p not in out and _is_int(n)
                and 0 < n <= _MAX_NBYTES and _is_int(c) and 0 < c <= n):
            raise bad(f"packed entry {entry!r}")
        out[p] = PackedArray(p, n, c)
    return out


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _int_list(x: Any, lo: int, hi: int) -> bool:
    return isinstance(x, list) and len(x) <= _MAX_RANK and all(_is_int(v) and lo <= v < hi for v in x)


def _parse_leaf(raw: Any, i: int, packed: dict[int, PackedArray], bad) -> LeafRecord:
    if not isinstance(raw, dict):
        raise bad(f"leaf #{i} is not an object")
    path = raw.get("path")
    if not isinstance(path, str):
        raise bad(f"leaf #{i} has no path")
    kind = raw.get("kind")
    if kind not in KINDS:
        raise bad(f"leaf '{path}': unknown kind {kind!r}")
    if kind == "value":
        value = raw.get("value")
        if value is not None and not isinstance(value, (bool, int, float, str)):
            raise bad(f"leaf '{path}': inline value of type {type(value).__name__}")
        return LeafRecord(path=path, kind="value", value=value)
    dtype = raw.get("dtype")
    if dtype not in _storage.DTYPES:
        raise bad(f"leaf '{path}': unknown dtype {dtype!r}")
    storage_dtype = raw.get("storage_dtype", dtype)
    if storage_dtype != _storage.storage_dtype_name(dtype):
        raise bad(f"leaf '{path}': storage dtype {storage_dtype!r} does not fit dtype {dtype!r}")
    shape, chunk_shape = raw.get("shape"), raw.get("chunk_shape")
    if not _int_list(shape, 0, _MAX_DIM):
        raise bad(f"leaf '{path}': shape {shape!r}")
    if not _int_list(chunk_shape, 1, _MAX_DIM) or len(chunk_shape) != len(shape):
        raise bad(f"leaf '{path}': chunk_shape {chunk_shape!r} does not fit shape {shape!r}")
    itemsize = _storage.DTYPES[dtype].itemsize
    nbytes = raw.get("nbytes")
    if not _is_int(nbytes) or nbytes != math.prod(shape) * itemsize or nbytes > _MAX_NBYTES:
        raise bad(f"leaf '{path}': nbytes {nbytes!r} does not equal shape × itemsize")
    grid = _layout.chunk_grid_shape(shape, chunk_shape)
    n_chunks = math.prod(grid)
    if n_chunks > _MAX_CHUNKS:
        raise bad(f"leaf '{path}': {n_chunks} chunks is too many")
    store = raw.get("store")
    if store not in STORES:
        raise bad(f"leaf '{path}': unknown store {store!r}")
    key = raw.get("key")
    if not isinstance(key, str) or not _storage.is_safe_key(key):
        raise bad(f"leaf '{path}': data key {key!r} is not a relative path inside the checkpoint")
    chunks: tuple[tuple[int, int], ...] = ()
    if store == "packed":
        raw_chunks = raw.get("chunks")
        if not isinstance(raw_chunks, list) or len(raw_chunks) != n_chunks:
            raise bad(f"leaf '{path}': chunks do not match its {n_chunks} chunk grid")
        cells = _layout.chunk_cells(shape, chunk_shape)
        for cell, c in zip(cells, raw_chunks):
            region = _layout.chunk_region(cell, chunk_shape, shape)
            size = _layout.index_size(region) * itemsize
            if not (isinstance(c, list) and len(c) == 2 and _is_int(c[0]) and c[0] in packed
                    and _is_int(c[1]) and 0 <= c[1] and c[1] + size <= packed[c[0]].nbytes):
                raise bad(f"leaf '{path}': chunk {c!r} lies outside the packed data")
        chunks = tuple((c[0], c[1]) for c in raw_chunks)
    sharding = raw.get("sharding")
    try:
        _layout.sharding_from_json(sharding)
    except (KeyError, TypeError, AttributeError, ValueError):
        raise bad(f"leaf '{path}': sharding {sharding!r}") from None
    impl, key_ndim = None, 0
    if kind == "prng_key":
        impl, key_ndim = raw.get("impl"), raw.get("key_ndim")
        if not isinstance(impl, str) or not _is_int(key_ndim) or not 0 <= key_ndim <= len(shape):
            raise bad(f"leaf '{path}': PRNG key impl/key_ndim")
    return LeafRecord(
        path=path, kind=kind, dtype=dtype, shape=tuple(shape), scalar=bool(raw.get("scalar", False)),
        impl=impl, key_ndim=key_ndim, sharding=sharding, store=store, key=key,
        chunk_shape=tuple(chunk_shape), storage_dtype=storage_dtype, nbytes=nbytes, chunks=chunks,
    )


def _check_structure(structure: Any, n_leaves: int, bad) -> None:
    seen = [False] * n_leaves
    stack = [(structure, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > 1000 or not isinstance(node, dict) or len(node) not in (1, 2):
            raise bad("structure is malformed")
        if "leaf" in node:
            i = node["leaf"]
            if not _is_int(i) or not 0 <= i < n_leaves or seen[i]:
                raise bad(f"structure references leaf {i!r} badly")
            seen[i] = True
        elif "dict" in node:
            items = node["dict"]
            if not isinstance(items, list):
                raise bad("structure is malformed")
            for item in items:
                if not (isinstance(item, list) and len(item) == 2 and
                        (isinstance(item[0], str) or _is_int(item[0]))):
                    raise bad("structure has a bad dict key")
                stack.append((item[1], depth + 1))
        elif "list" in node or "tuple" in node:
            items = node.get("list", node.get("tuple"))
            if not isinstance(items, list):
                raise bad("structure is malformed")
            stack.extend((c, depth + 1) for c in items)
        elif "items" in node and isinstance(node.get("node"), str):
            items = node["items"]
            if not isinstance(items, list):
                raise bad("structure is malformed")
            for item in items:
                if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)):
                    raise bad("structure has a bad node item")
                stack.append((item[1], depth + 1))
        else:
            raise bad("structure is malformed")
    if not all(seen):
        raise bad("structure does not reference every leaf")
