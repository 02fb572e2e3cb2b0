"""The manifest: schema, (de)serialisation and validation of untrusted input.

``manifest.json`` is the only thing a reader trusts to find data, and it comes from
disk, so every field is checked before anything is allocated or opened: kinds, dtypes,
shapes and byte counts agree, chunk grids are sane, every data key stays inside the
checkpoint, the container description references each leaf exactly once; and the
manifest's own checksum (its last field) matches its bytes.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import jax
import numpy as np

from . import _codecs, _dtypes, _layout, _streams, _tree, _untrusted
from ._errors import CorruptCheckpointError
from ._storage import location as _location
from ._untrusted import MAX_INT_DIGITS

MANIFEST = "manifest.json"
FORMAT = "jaxckpt"
# The version written for a checkpoint whose data lies at its root (arrays/, packed/):
# every local checkpoint (renamed into place at its commit). Synthetic manifests of
# foreign formats (orbax, safetensors) use it too.
FORMAT_VERSION = 1
# The version written for a checkpoint whose data lies under the prefix named by its
# manifest's ``data`` field (object stores: one prefix per save attempt). A reader of
# version 1 only would look for arrays/ at the root and fail (missing chunks), so the
# field bumps the version (docs/format.md, "Format versions").
DATA_PREFIX_VERSION = 2
# The aggregated layout (issue 22, ``_streams``): each writer's chunks in data objects ``data/p<k>.<n>``.
STREAMS_VERSION = 3
# Format 3 whose data objects lie in the manager directory's pool and whose runs may
# refer to other steps' streams (``CheckpointManager(dedup=True)``; docs/format.md, "Format 4").
DEDUP_VERSION = 4
SUPPORTED_VERSIONS = (1, 2, 3, 4)
STREAM_VERSIONS = (STREAMS_VERSION, DEDUP_VERSION)
POOL_DIR = ".jaxckpt-data"  # format 4: <manager directory>/.jaxckpt-data/<pool>/data/p<k>.<n>
POOL_FIELDS = ("pool", "refs")
STREAM_DIR = "data"
DATA_PREFIX_DIR = "d"  # data prefixes are d/<name>: one component below d/
DATA_DIRS = {"arrays", "packed", "data"}  # a checkpoint's data when it has no data prefix (formats 1 and 3)
_DATA_KEY = re.compile(r"^d/[A-Za-z0-9_.-]{1,64}$")

KINDS = ("array", "prng_key", "value")
# A Python ``bytes`` leaf (grain's data-loader state) is an inline value in memory, but
# its manifest entry has a kind of its own, ``"bytes"``, its value base64: every reader
# before it refuses an unknown kind (the loud failure DESIGN rule 10 asks for), where a
# new ``type`` beside kind ``value`` would reach readers that predate ``type`` as a
# plain str, silently. So no format_version bump.
BYTES_KIND = "bytes"
# A bytes leaf lives in the manifest, which every listing, ``show`` and restore reads
# whole: data-loader state is a few KB; a bigger blob belongs in an array
# (``np.frombuffer(b, np.uint8)``). The reader refuses more too, before decoding.
MAX_INLINE_BYTES = 1 << 20
_MAX_INLINE_BASE64 = 4 * -(-MAX_INLINE_BYTES // 3)
STORES = ("file", "packed")  # format_version 1 and 2
STREAM = "stream"  # format_version 3: every array leaf's chunks are entries of the writers' streams
_MAX_RANK = 64
_MAX_NBYTES = 1 << 44  # 16 TiB per leaf (and per packed array)
# Every itemsize is at least one byte, so no dimension of a non-empty array can be
# longer; the same bound keeps zero-size arrays' other dimensions sane.
_MAX_DIM = _MAX_NBYTES
_MAX_CHUNKS = 1 << 20  # a leaf's chunks, and a packed array's: verify walks them one by one
# A packed array's chunks are 4 MiB at most (``_snapshot.PACK_CHUNK_BYTES``). tensorstore
# allocates a whole chunk to read any byte of it, and a failed allocation aborts the
# process, so a manifest may not ask for chunks much bigger than any save writes.
MAX_PACKED_CHUNK_BYTES = 64 << 20
# Data keys are a leaf's index (``"12"``); a longer key would only make file names the
# file system refuses.
_MAX_KEY = 255
_MAX_IMPL = 64  # characters of a PRNG implementation's name
_MAX_DEVICES = 1 << 24  # devices of a saved mesh

# Limits on untrusted input (docs/format.md, "Limits on untrusted input").
MAX_MANIFEST_BYTES = 256 << 20
# Integers longer than ``_untrusted.MAX_INT_DIGITS`` are refused by the reader (int() is
# quadratic in the digit count) and so at save too.
_INT_BOUND = 10**MAX_INT_DIGITS
# Containers in ``structure`` (the tree) and in ``metadata``/extra fields nest at most
# this deep: the reader and restore walk them recursively, and json's decoder itself
# gives up near Python's recursion limit (three JSON levels per tree level).
MAX_DEPTH = _tree.MAX_DEPTH
_MAX_MESSAGE = 500  # characters of a validation message (a hostile repr may be huge)

# The manifest's checksum of itself, its last field: ``"sha256:<hex>"`` of the
# manifest's bytes without that field (``{…,"leaves":[…]}``). Chunks carry crc32c of
# their own bytes, but the manifest's inline values, metadata, step and data prefix had
# nothing: a flipped digit restored another value without an error. No format_version bump: a reader without it keeps the
# field among the info (unknown fields are info) and reads the data exactly as before.
# A manifest without the field (written before it, or by a tool that removed it) is read
# as before; one whose field was damaged or moved, or whose bytes changed, is corrupt.
CHECKSUM_FIELD = "checksum"
_CHECKSUM_VALUE = re.compile(r"sha256:[0-9a-f]{64}")


# Inline values whose type JSON does not keep, by the manifest's "type" name:
# (type, to its JSON string, back from it). Bytes travel as latin-1 (one char per byte).
INLINE_TYPES: dict[str, tuple[type, Callable[[Any], str], Callable[[str], Any]]] = {
    "numpy.str_": (np.str_, str, np.str_),
    "numpy.bytes_": (np.bytes_, lambda b: bytes(b).decode("latin-1"),
                     lambda s: np.bytes_(s.encode("latin-1"))),
}


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
    codec: str = ""  # stream: "raw", or a lossless codec (``_codecs``)
    entry_bytes: int = 0  # stream: one full chunk's payload bytes + its crc32c (raw)
    runs: tuple[_streams.Run, ...] = ()  # stream: (process, first, count, offset), sorted by first
    hashes: tuple[str, ...] = ()  # format 4: each run's content hash (blake3, 128 bits, hex), or none
    codec_config: dict[str, Any] | None = None  # a compressed leaf: the zarr3 codec's configuration
    sizes: tuple[int, ...] = ()  # a compressed leaf: each chunk's entry bytes (0: all zeros, not stored)

    @property
    def stored_nbytes(self) -> int:
        """The bytes its data takes: its entries (checksums included) in format 3, else ``nbytes``."""
        return _streams.stored_bytes(self.runs, self.entry_bytes, self.sizes) if self.store == STREAM else self.nbytes

    def entry(self, flat: int) -> tuple[int, int, int]:
        """``(process, stream offset, entry bytes)`` of chunk ``flat`` (``_streams.find_entry``)."""
        return _streams.find_entry(self.runs, self.entry_bytes, self.sizes, flat)

    def to_json(self) -> dict[str, Any]:
        if self.kind == "value" and isinstance(self.value, bytes) and not isinstance(self.value, np.bytes_):
            return {"path": self.path, "kind": BYTES_KIND, "value": base64.b64encode(self.value).decode("ascii")}
        if self.kind == "value":
            for name, (cls, encode, _) in INLINE_TYPES.items():
                if type(self.value) is cls:
                    return {"path": self.path, "kind": "value", "value": encode(self.value), "type": name}
            return {"path": self.path, "kind": "value", "value": self.value}
        out: dict[str, Any] = {
            "path": self.path,
            "kind": self.kind,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "sharding": self.sharding,
            "store": self.store,
            **({} if self.store == STREAM else {"key": self.key}),
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
        if self.store == STREAM:
            out.update(codec=self.codec, entry_bytes=self.entry_bytes, runs=_streams.runs_to_json(self.runs))
            if self.codec_config is not None:
                out.update(codec_config=self.codec_config, sizes=list(self.sizes))
            if self.hashes:
                out["hashes"] = list(self.hashes)
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
    data: str = ""  # the data prefix, relative to the checkpoint; "" = the root (version 1)
    segment_bytes: int = 0  # version 3: the size of a data object (the last of a stream is shorter)
    streams: dict[int, int] = field(default_factory=dict)  # version 3: {process: stream length}
    pool: str = ""  # version 4: the pool entry holding this save's own data objects
    refs: tuple[_streams.Ref, ...] = ()  # version 4: other steps' streams its runs refer to

    def data_root(self, loc: _location.Location) -> _location.Location:
        """Where this checkpoint's ``arrays/``, ``packed/`` and ``data/`` are, ``loc`` being
        the checkpoint's own location (the manifest's directory or prefix); in format 4 its
        pool entry in the manager directory (``loc``'s parent)."""
        if self.pool:
            return pool_location(loc.parent(), self.pool)
        return loc.child(self.data) if self.data else loc

    def stream_of(self, loc: _location.Location, stream: int) -> tuple[_location.Location, int, int]:
        """``(data objects' directory, process, segment_bytes)`` of a run's stream: this
        save's own process ``stream``'s, or (format 4, ``stream >= process_count``) the
        other step's stream it refers to."""
        if stream < self.process_count:
            return self.data_root(loc).child(STREAM_DIR), stream, self.segment_bytes
        ref = self.refs[stream - self.process_count]
        return pool_location(loc.parent(), ref.pool).child(STREAM_DIR), ref.process, ref.segment_bytes

    def to_bytes(self) -> bytes:
        """The manifest's JSON, its checksum computed here, over these very bytes (a
        manifest changed with ``dataclasses.replace`` gets its own, never a stale one)."""
        info = {k: v for k, v in self.info.items() if k != CHECKSUM_FIELD}
        doc = {
            "format": FORMAT,
            "format_version": self.format_version,
            **({"data": self.data} if self.data else {}),
            **info,
            "process_count": self.process_count,
            **({"segment_bytes": self.segment_bytes, "streams": _streams.streams_to_json(self.streams)}
               if self.format_version in STREAM_VERSIONS else {}),
            **({"pool": self.pool, "refs": [r._asdict() for r in self.refs]}
               if self.format_version == DEDUP_VERSION else {}),
            "packed": [p._asdict() for p in self.packed],
            "metadata": self.metadata,
            "structure": self.structure,
            "leaves": [r.to_json() for r in self.leaves],
        }
        body = json.dumps(doc, separators=(",", ":"), allow_nan=True).encode()
        return body[:-1] + _checksum_tail(checksum(body))


def pool_location(directory: _location.Location, pool: str) -> _location.Location:
    """Pool entry ``pool`` of manager ``directory`` (format 4's data objects)."""
    return directory.child(POOL_DIR).child(pool)


def checksum(body: bytes) -> str:
    """The checksum of a manifest whose bytes without the field are ``body``."""
    return "sha256:" + hashlib.sha256(body).hexdigest()


def _checksum_tail(value: str) -> bytes:
    return b',"' + CHECKSUM_FIELD.encode() + b'":"' + value.encode() + b'"}'


def parse(data: bytes, where: str) -> Manifest:
    """Parse and validate a manifest; raise ``CorruptCheckpointError`` naming ``where``.

    The bytes come from disk and may be hostile, so whatever goes wrong (deep nesting,
    huge numbers, wrong types in well-formed JSON) ends as ``CorruptCheckpointError``.
    """

    def bad(msg: str) -> CorruptCheckpointError:
        if len(msg) > _MAX_MESSAGE:
            msg = msg[:_MAX_MESSAGE] + "…"
        return CorruptCheckpointError(f"Checkpoint '{where}': invalid manifest: {msg}")

    if len(data) > MAX_MANIFEST_BYTES:
        raise bad(f"{len(data)} bytes is more than the {MAX_MANIFEST_BYTES} a manifest may have")
    try:
        return _parse_document(data, bad, where)
    except CorruptCheckpointError:
        raise
    except RecursionError:
        raise bad("nested too deeply") from None
    except Exception as e:  # noqa: BLE001 - nothing but CorruptCheckpointError may escape
        raise bad(f"{type(e).__name__}: {e}") from e


def nesting_exceeds(value: Any, limit: int) -> bool:
    """Whether JSON-like ``value`` has containers nested more than ``limit`` deep.

    Iterative, so it is safe on hostile input; a cycle counts as too deep.
    """
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children: Any = node.values()
        elif isinstance(node, (list, tuple)):
            children = node
        else:
            continue
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in children)
    return False


def int_fits(x: int) -> bool:
    """Whether the reader accepts ``x`` back (at most ``MAX_INT_DIGITS`` digits); O(1)."""
    return -_INT_BOUND < x < _INT_BOUND


def unsaveable(value: Any, where: str) -> str | None:
    """Why JSON-like ``value`` (metadata) could not be saved and read back, or ``None``.

    ``where`` names ``value``; the reason names the key path inside it, e.g.
    ``metadata['opt']['lr']: value of type ndarray is not JSON-serialisable``.
    """
    return _unsaveable(value, where, 1)


def _unsaveable(value: Any, where: str, depth: int) -> str | None:
    if value is None or isinstance(value, (str, float)):
        return None
    if isinstance(value, int):
        return None if int_fits(value) else f"{where}: int has more than {MAX_INT_DIGITS} digits"
    if not isinstance(value, (dict, list, tuple)):
        return f"{where}: value of type {type(value).__name__} is not JSON-serialisable"
    if depth > MAX_DEPTH:  # also ends a cycle
        return f"{where}: nested deeper than {MAX_DEPTH} levels (or contains itself)"
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):  # json would silently turn 1 into "1"
                return f"{where}: key {k!r} of type {type(k).__name__} is not a str"
            if (reason := _unsaveable(v, f"{where}[{k!r}]", depth + 1)) is not None:
                return reason
        return None
    for i, v in enumerate(value):
        if (reason := _unsaveable(v, f"{where}[{i}]", depth + 1)) is not None:
            return reason
    return None


def _parse_document(data_bytes: bytes, bad, where: str) -> Manifest:
    doc = _untrusted.load_json(data_bytes, bad)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise bad("not a jaxckpt manifest (field 'format' is missing or wrong)")
    version = doc.get("format_version")
    if not _is_int(version) or version not in SUPPORTED_VERSIONS:  # 1.0 and true equal 1 in Python
        readable = ", ".join(map(str, SUPPORTED_VERSIONS))
        raise bad(f"format_version {version!r} is not supported (this jaxckpt reads {readable})")
    data = _parse_data_prefix(doc, version, bad)
    process_count = doc.get("process_count")
    if not _is_int(process_count) or not 1 <= process_count <= 1 << 20:
        raise bad(f"process_count {process_count!r}")
    metadata = doc.get("metadata")
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict):
        raise bad("metadata is not an object")
    packed = _parse_packed(doc.get("packed", []), process_count, bad)
    v3 = _v3_fields(doc, version, process_count, where, bad)
    if v3 is not None and packed:
        raise bad(f"packed arrays in format_version {version} (its small leaves are streamed)")
    raw_leaves = doc.get("leaves")
    if not isinstance(raw_leaves, list):
        raise bad("leaves is not a list")
    leaves = []
    seen_paths: set[str] = set()
    seen_keys: set[tuple[str, str]] = set()
    for i, raw in enumerate(raw_leaves):
        rec = _parse_leaf(raw, i, packed, bad, v3)
        if rec.path in seen_paths:
            raise bad(f"duplicate leaf path '{rec.path}'")
        seen_paths.add(rec.path)
        if rec.kind != "value" and rec.store != STREAM:
            if (rec.store, rec.key) in seen_keys:
                raise bad(f"leaf '{rec.path}': data key '{rec.key}' used twice")
            seen_keys.add((rec.store, rec.key))
        leaves.append(rec)
    _check_packed_sizes(packed, leaves, bad)
    if v3 is not None:  # every leaf's runs, validated together (overlaps across leaves)
        runs, hashes = iter(v3.runs()), iter(v3.hashes)
        for r in leaves:  # records made above, seen by no one yet: set in place (a replace per
            if r.kind != "value":  # leaf was a tenth of a 1,000-leaf restore)
                object.__setattr__(r, "runs", next(runs))
                if (h := next(hashes)):
                    object.__setattr__(r, "hashes", h)
    structure = doc.get("structure")
    _tree.check_structure(structure, [r.path for r in leaves], bad)
    info = {k: v for k, v in doc.items()
            if k not in ("format", "format_version", "data", "process_count", "packed", "metadata",
                         "structure", "leaves", CHECKSUM_FIELD, *_streams.ManifestStreams.FIELDS,
                         *POOL_FIELDS)}
    # Handed to users and to code that walks them recursively (inspect, the CLI).
    for name, value in (("metadata", metadata), *info.items()):
        if nesting_exceeds(value, MAX_DEPTH):
            raise bad(f"field '{name[:100]}' is nested deeper than {MAX_DEPTH} levels")
    _check_checksum(data_bytes, doc, bad)
    return Manifest(version, structure, tuple(leaves), metadata, process_count, info,
                    tuple(packed[k] for k in sorted(packed)), data,
                    *((v3.segment_bytes, v3.streams, doc.get("pool", ""), v3.refs) if v3 is not None else ()))


def _v3_fields(doc: dict[str, Any], version: int, process_count: int, where: str,
               bad) -> _streams.ManifestStreams | None:
    """Format 3's top-level stream fields (``segment_bytes``, ``streams``), checked; refused
    in another version. Its leaves' runs are checked together once all are parsed."""
    fields = _streams.ManifestStreams.FIELDS + (POOL_FIELDS if version == DEDUP_VERSION else ())
    if (extra := [n for n in POOL_FIELDS if n in doc and n not in fields]):
        raise bad(f"field '{extra[0]}' needs format_version {DEDUP_VERSION}")
    present = [name for name in fields if name in doc]
    if version not in STREAM_VERSIONS:
        if present:
            raise bad(f"field '{present[0]}' needs format_version {STREAMS_VERSION}")
        return None
    if len(present) < len(fields):
        missing = next(n for n in fields if n not in present)
        raise bad(f"field '{missing}' is missing (format_version {version})")
    if version == DEDUP_VERSION and not _streams.pool_name_ok(doc["pool"]):
        raise bad(f"pool {doc['pool']!r:.100} is not a pool entry's name")
    return _streams.ManifestStreams(doc, process_count, where)


def _check_checksum(data: bytes, doc: dict[str, Any], bad) -> None:
    """The manifest's checksum, last: every other check names what is wrong more
    precisely. What it catches that they cannot: a changed inline value, metadata, step or
    creation time (any byte). What it cannot: a whole manifest copied from another
    checkpoint carries its own valid checksum (the recorded step and, on object stores,
    the data prefix it names catch that; docs/format.md, "The manifest's checksum")."""
    for name, value in doc.items():  # one flipped bit in the field's name must not switch it off
        if name != CHECKSUM_FIELD and isinstance(value, str) and _CHECKSUM_VALUE.fullmatch(value):
            raise bad(f"field {name[:100]!r} holds a checksum: the manifest's checksum field is damaged")
    if CHECKSUM_FIELD not in doc:
        return  # written before manifests had checksums: read as before
    recorded = doc[CHECKSUM_FIELD]
    if not isinstance(recorded, str) or not _CHECKSUM_VALUE.fullmatch(recorded):
        raise bad(f"checksum {str(recorded)[:100]!r} is not 'sha256:' and 64 hex digits")
    tail = _checksum_tail(recorded)
    if not data.endswith(tail):
        raise bad("the checksum is not the manifest's last field, as written: the manifest was edited")
    computed = checksum(data[:-len(tail)] + b"}")
    if computed != recorded:
        raise bad(f"checksum mismatch: the manifest's bytes changed after it was written "
                  f"(recorded {recorded}, computed {computed})")


def check_step(man: Manifest, step: int, where: str) -> None:
    """Raise ``CorruptCheckpointError`` when ``man``, found in the directory of step
    ``step`` (a manager's ``<directory>/<step>/``), records another step in its info.

    The manager records the step it saves. Chunks carry their own checksums, not the
    step's, so a manifest copied from step 1 into ``2/`` would read step 2's arrays
    under step 1's inline values, metadata and metrics without any checksum failing.
    """
    recorded = man.info.get("step")
    if _is_int(recorded) and recorded != step:
        raise CorruptCheckpointError(
            f"Checkpoint '{where}': its manifest.json records step {recorded}, but it is the directory "
            f"of step {step} (a manifest copied from another step?)")


def _parse_data_prefix(doc: dict[str, Any], version: int, bad) -> str:
    """The ``data`` field: absent in version 1; in version 2 a prefix ``d/<name>`` (one
    component of ``[A-Za-z0-9_.-]``, not ``.``/``..``) inside the checkpoint; in version 3
    either (absent: the data objects lie in the checkpoint's own ``data/``)."""
    if version == 1:
        if "data" in doc:
            raise bad("field 'data' (a data prefix) needs format_version 2")
        return ""
    if version == STREAMS_VERSION and "data" not in doc:
        return ""
    if version == DEDUP_VERSION:
        if "data" in doc:
            raise bad("field 'data' in format_version 4 (its data objects are in the pool entry 'pool' names)")
        return ""
    data = doc.get("data")
    if not isinstance(data, str) or not _DATA_KEY.match(data) or not _location.is_safe_key(data):
        shown = repr(data)[:100]
        raise bad(f"data prefix {shown} is not 'd/<name>' inside the checkpoint (format_version 2)")
    return data


def _parse_packed(raw: Any, process_count: int, bad) -> dict[int, PackedArray]:
    if not isinstance(raw, list):
        raise bad("packed is not a list")
    out: dict[int, PackedArray] = {}
    for entry in raw:
        if not isinstance(entry, dict):
            raise bad("packed entry is not an object")
        p, n, c = entry.get("process"), entry.get("nbytes"), entry.get("chunk_bytes")
        if not (_is_int(p) and 0 <= p < process_count and p not in out and _is_int(n)
                and 0 < n <= _MAX_NBYTES and _is_int(c) and 0 < c <= n and n <= c * _MAX_CHUNKS):
            raise bad(f"packed entry {entry!r}")
        if c > MAX_PACKED_CHUNK_BYTES:
            raise bad(f"packed entry {entry!r}: chunks of {c} bytes (at most {MAX_PACKED_CHUNK_BYTES})")
        out[p] = PackedArray(p, n, c)
    return out


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _int_list(x: Any, lo: int, hi: int) -> bool:
    return isinstance(x, list) and len(x) <= _MAX_RANK and all(_is_int(v) and lo <= v < hi for v in x)


def _parse_leaf(raw: Any, i: int, packed: dict[int, PackedArray], bad, v3: _streams.ManifestStreams | None) -> LeafRecord:
    if not isinstance(raw, dict):
        raise bad(f"leaf #{i} is not an object")
    path = raw.get("path")
    if not isinstance(path, str):
        raise bad(f"leaf #{i} has no path")
    kind = raw.get("kind")
    if kind == BYTES_KIND:
        return _parse_bytes(raw, path, bad)
    if kind not in KINDS:
        raise bad(f"leaf '{path}': unknown kind {kind!r}")
    if kind == "value":
        return _parse_value(raw, path, bad)
    return _parse_array(raw, path, kind, packed, bad, v3)


def _parse_value(raw: dict[str, Any], path: str, bad) -> LeafRecord:
    if "value" not in raw:  # every writer writes it, null included: a missing one is no None
        raise bad(f"leaf '{path}': inline value is missing")
    value = raw["value"]
    if value is not None and not isinstance(value, (bool, int, float, str)):
        raise bad(f"leaf '{path}': inline value of type {type(value).__name__}")
    type_name = raw.get("type")
    if type_name is not None:
        if type_name not in INLINE_TYPES or not isinstance(value, str):
            raise bad(f"leaf '{path}': inline value type {type_name!r}")
        try:
            value = INLINE_TYPES[type_name][2](value)
        except UnicodeEncodeError:
            raise bad(f"leaf '{path}': inline {type_name} value is not latin-1") from None
    return LeafRecord(path=path, kind="value", value=value)


def _parse_bytes(raw: dict[str, Any], path: str, bad) -> LeafRecord:
    """A ``bytes`` leaf: base64 of at most ``MAX_INLINE_BYTES``, an inline value in memory."""
    value = raw.get("value")
    if not isinstance(value, str):
        raise bad(f"leaf '{path}': bytes value is not a base64 string")
    if len(value) > _MAX_INLINE_BASE64:  # refused before decoding anything
        raise bad(f"leaf '{path}': bytes value of {len(value)} base64 characters (a bytes leaf holds "
                  f"at most {MAX_INLINE_BYTES} bytes)")
    try:
        data = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise bad(f"leaf '{path}': bytes value is not valid base64") from None
    return LeafRecord(path=path, kind="value", value=data)


def _parse_array(raw: dict[str, Any], path: str, kind: str, packed: dict[int, PackedArray], bad,
                 v3: _streams.ManifestStreams | None) -> LeafRecord:
    dtype = raw.get("dtype")
    if dtype not in _dtypes.DTYPES:
        raise bad(f"leaf '{path}': unknown dtype {dtype!r}")
    storage_dtype = raw.get("storage_dtype", dtype)
    if storage_dtype != _dtypes.storage_dtype_name(dtype):
        raise bad(f"leaf '{path}': storage dtype {storage_dtype!r} does not fit dtype {dtype!r}")
    shape, chunk_shape = raw.get("shape"), raw.get("chunk_shape")
    if not _int_list(shape, 0, _MAX_DIM):
        raise bad(f"leaf '{path}': shape {shape!r}")
    # A chunk never extends past its array (nor past 1 on an empty axis), so one chunk is
    # never more bytes than the leaf: a hostile chunk_shape cannot make a read allocate more.
    if (not _int_list(chunk_shape, 1, _MAX_DIM) or len(chunk_shape) != len(shape)
            or any(c > max(s, 1) for c, s in zip(chunk_shape, shape))):
        raise bad(f"leaf '{path}': chunk_shape {chunk_shape!r} does not fit shape {shape!r}")
    itemsize = _dtypes.DTYPES[dtype].itemsize
    nbytes = raw.get("nbytes")
    if not _is_int(nbytes) or nbytes != math.prod(shape) * itemsize or nbytes > _MAX_NBYTES:
        raise bad(f"leaf '{path}': nbytes {nbytes!r} does not equal shape × itemsize")
    grid = _layout.chunk_grid_shape(shape, chunk_shape)
    n_chunks = math.prod(grid)
    if n_chunks > _MAX_CHUNKS:
        raise bad(f"leaf '{path}': {n_chunks} chunks is too many")
    store, key = _parse_store(raw, path, v3 is not None, bad)
    chunks: tuple[tuple[int, int], ...] = ()
    if store == "packed":
        chunks = _parse_packed_chunks(raw.get("chunks"), path, shape, chunk_shape, itemsize, n_chunks, packed, bad)
    # format 3: codec and entry bytes checked, the raw runs kept (validated with every leaf's at the end)
    try:  # quantized: what the form holds, of a float leaf
        payload = _codecs.payload_bytes(raw.get("codec") if v3 else None, path, dtype, shape, chunk_shape)
    except ValueError as e:
        raise bad(f"leaf '{path}': {e}") from None
    codec, entry, sizes = v3.leaf(raw, path, n_chunks, payload) if v3 else ("", 0, ())
    try:
        codec_config = _codecs.leaf_config(raw, codec, _dtypes.DTYPES[storage_dtype].itemsize)
    except ValueError as e:
        raise bad(f"leaf '{path}': {e}") from None
    sharding = raw.get("sharding")
    if not _sharding_ok(sharding):
        raise bad(f"leaf '{path}': sharding {sharding!r}")
    impl, key_ndim = _parse_key_fields(raw, path, dtype, shape, bad) if kind == "prng_key" else (None, 0)
    scalar = raw.get("scalar", False)
    if not isinstance(scalar, bool) or (scalar and (kind != "array" or shape)):
        raise bad(f"leaf '{path}': scalar {scalar!r} (true only for a 0-d array)")
    return LeafRecord(
        path=path, kind=kind, dtype=dtype, shape=tuple(shape), scalar=scalar,
        impl=impl, key_ndim=key_ndim, sharding=sharding, store=store, key=key,
        chunk_shape=tuple(chunk_shape), storage_dtype=storage_dtype, nbytes=nbytes, chunks=chunks,
        codec=codec, entry_bytes=entry, codec_config=codec_config, sizes=sizes,
    )


def _parse_store(raw: dict[str, Any], path: str, v3: bool, bad) -> tuple[str, str]:
    """A leaf's store and data key ("" for a stream leaf: format 3 has no data keys)."""
    store = raw.get("store")
    if v3:
        if store != STREAM:
            raise bad(f"leaf '{path}': store {store!r:.100} in format_version {STREAMS_VERSION} (its array "
                      f"leaves are '{STREAM}')")
        if raw.get("key", "") != "":
            raise bad(f"leaf '{path}': data key {raw['key']!r:.100} (a '{STREAM}' leaf has none)")
        return store, ""
    if store == STREAM:
        raise bad(f"leaf '{path}': store '{STREAM}' needs format_version {STREAMS_VERSION}")
    if store not in STORES:
        raise bad(f"leaf '{path}': unknown store {store!r}")
    key = raw.get("key")
    if not isinstance(key, str) or len(key) > _MAX_KEY or not _location.is_safe_key(key):
        raise bad(f"leaf '{path}': data key {key!r} is not a relative path inside the checkpoint")
    return store, key


def _sharding_ok(sharding: Any) -> bool:
    """The sharding a leaf was saved with (``_layout.sharding_to_json``): ``None``,
    ``single_device``, ``other``, or ``named``: a mesh of distinct axis names and sizes
    of at least 1, and a spec of ``None``, strings (axis names) or lists of them."""
    if sharding is None:
        return True
    if not isinstance(sharding, dict) or sharding.get("type") not in ("named", "single_device", "other"):
        return False
    if sharding["type"] != "named":
        return True
    names, sizes, spec = (sharding.get(k) for k in ("axis_names", "axis_sizes", "spec"))
    return (isinstance(names, list) and all(isinstance(n, str) for n in names) and len(set(names)) == len(names)
            and _int_list(sizes, 1, _MAX_DEVICES + 1) and len(sizes) == len(names)
            and math.prod(sizes) <= _MAX_DEVICES and isinstance(spec, list) and len(spec) <= _MAX_RANK
            and all(e is None or isinstance(e, str) or (isinstance(e, list) and all(isinstance(a, str) for a in e))
                    for e in spec))


def _parse_key_fields(raw: dict[str, Any], path: str, dtype: str, shape: list[int], bad) -> tuple[str, int]:
    """A PRNG key's ``impl`` and ``key_ndim``: an implementation jax knows, whose key data
    (dtype and trailing shape) is what the record stores."""
    impl, key_ndim = raw.get("impl"), raw.get("key_ndim")
    if not isinstance(impl, str) or not _is_int(key_ndim) or not 0 <= key_ndim <= len(shape):
        raise bad(f"leaf '{path}': PRNG key impl/key_ndim")
    data = _prng_key_data(impl) if len(impl) <= _MAX_IMPL else None
    if data is None:
        raise bad(f"leaf '{path}': unknown PRNG key implementation {impl!r}")
    if (dtype, tuple(shape[key_ndim:])) != data:
        raise bad(f"leaf '{path}': {impl} keys are {data[0]} data of trailing shape {data[1]}, not "
                  f"{dtype} of shape {tuple(shape[key_ndim:])}")
    return impl, key_ndim


@functools.lru_cache(maxsize=16)
def _prng_key_data(impl: str) -> tuple[str, tuple[int, ...]] | None:
    """The dtype name and shape of one key's data for PRNG implementation ``impl``, or
    ``None`` when jax knows no such implementation."""
    try:
        data = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=impl)))
    except (ValueError, TypeError, KeyError):
        return None
    return np.dtype(data.dtype).name, tuple(data.shape)


def _parse_packed_chunks(raw_chunks: Any, path: str, shape: list[int], chunk_shape: list[int], itemsize: int,
                         n_chunks: int, packed: dict[int, PackedArray], bad) -> tuple[tuple[int, int], ...]:
    """Each chunk's (process, offset) in the packed arrays, every one inside its array."""
    if not isinstance(raw_chunks, list) or len(raw_chunks) != n_chunks:
        raise bad(f"leaf '{path}': chunks do not match its {n_chunks} chunk grid")
    for elements, c in zip(_layout.chunk_sizes(shape, chunk_shape), raw_chunks):
        size = elements * itemsize
        if not (isinstance(c, list) and len(c) == 2 and _is_int(c[0]) and c[0] in packed
                and _is_int(c[1]) and 0 <= c[1] and c[1] + size <= packed[c[0]].nbytes):
            raise bad(f"leaf '{path}': chunk {c!r} lies outside the packed data")
        if c[1] % _layout.PACK_ALIGN:  # every writer aligns them: a digit changed on disk
            raise bad(f"leaf '{path}': chunk {c!r} does not start on a {_layout.PACK_ALIGN}-byte boundary")
    return tuple((c[0], c[1]) for c in raw_chunks)


def _check_packed_sizes(packed: dict[int, PackedArray], leaves: list[LeafRecord], bad) -> None:
    """Each packed array ends where its last chunk does (padded to ``PACK_ALIGN``), as
    ``_layout.pack_offsets`` lays them out: no byte of it belongs to no leaf."""
    ends = dict.fromkeys(packed, 0)
    for rec in leaves:
        if rec.kind == "value" or rec.store != "packed":
            continue
        itemsize = _dtypes.DTYPES[rec.dtype].itemsize
        for elements, (proc, offset) in zip(_layout.chunk_sizes(rec.shape, rec.chunk_shape), rec.chunks):
            size = elements * itemsize
            ends[proc] = max(ends[proc], offset + -(-size // _layout.PACK_ALIGN) * _layout.PACK_ALIGN)
    for proc, end in ends.items():
        if packed[proc].nbytes != end:
            raise bad(f"packed entry of process {proc}: nbytes {packed[proc].nbytes}, but its chunks end at {end}")
