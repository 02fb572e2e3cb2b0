"""Lossless compression of format 3's entries (``compression=`` on ``save`` and the manager).

A compressed leaf's entries hold each chunk encoded by one of zarr3's byte-to-byte codecs,
the ones tensorstore has (``zstd``; ``blosc`` with lz4 and byte shuffle), followed by the
crc32c of the encoded bytes: exactly the bytes of a zarr3 chunk file with codecs
``bytes`` (little endian) + the codec + ``crc32c``. tensorstore does the encoding and
the decoding (``encode``, ``decode``: an in-memory zarr3 array per thread, one chunk
written or read through it), so jaxckpt adds no compression library of its own.

A chunk whose bytes are all zero (a freshly initialised moment) is not encoded at all:
``encode`` returns ``None`` and the writer stores nothing for it (its size in the
manifest is 0). Zero bytes, not zero values: ``-0.0`` is kept.

The choice (``Compression``): one codec for every array leaf (``"zstd"``, ``("zstd", 9)``),
or a mapping from key-path patterns (``fnmatch``, on the manifest's leaf paths such as
``opt_state/0/mu/dense/kernel``) to codecs, the first matching pattern winning and a leaf
no pattern matches stored raw (``"raw"`` or ``None`` as a mapping's value: raw too).
"""

from __future__ import annotations

import fnmatch
import json
import math
import threading
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
import tensorstore as ts

from . import _dtypes, _quantize

RAW = "raw"
# name -> (default level, lowest, highest)
LEVELS = {"zstd": (3, 1, 22), "blosc": (5, 0, 9)}
NAMES = tuple(LEVELS)


class Codec(NamedTuple):
    """A lossless codec and its level."""

    name: str
    level: int

    def config(self, itemsize: int) -> dict[str, Any]:
        """The zarr3 codec's configuration, as the manifest records it (``codec_config``)."""
        if self.name == "zstd":
            return {"level": self.level, "checksum": False}
        return {"cname": "lz4", "clevel": self.level, "shuffle": "shuffle" if itemsize > 1 else "noshuffle",
                "typesize": itemsize, "blocksize": 0}


def codec(value: Any, what: str = "compression") -> Codec | None:
    """``"zstd"``, ``("zstd", level)``, ``"raw"``/``None`` (no codec) as a ``Codec``."""
    if value is None or value == RAW:
        return None
    name, level = (value, None) if isinstance(value, str) else (None, None)
    if isinstance(value, (tuple, list)) and len(value) == 2 and isinstance(value[0], str):
        name, level = value
    if name not in LEVELS:
        raise ValueError(f"{what}: {value!r:.100} is not a codec: use one of {', '.join(NAMES)} "
                         f"(or (name, level)), or 'raw'")
    default, low, high = LEVELS[name]
    level = default if level is None else level
    if isinstance(level, bool) or not isinstance(level, int) or not low <= level <= high:
        raise ValueError(f"{what}: level {level!r:.100} of {name} is not an int from {low} to {high}")
    return Codec(name, level)


def leaf_config(leaf: Mapping[str, Any], name: str, itemsize: int) -> dict[str, Any] | None:
    """A manifest leaf's ``codec_config`` for its codec ``name`` on ``itemsize``-byte
    elements: for a compressed leaf exactly the configuration ``Codec.config`` gives for
    some valid level (a configuration tensorstore would read otherwise is refused before
    it does), else absent (``None``). ``ValueError`` otherwise."""
    if name not in LEVELS:
        if "codec_config" in leaf:
            raise ValueError(f"codec_config with codec {name!r:.100}")
        return None
    raw = leaf.get("codec_config")
    level = raw.get("level" if name == "zstd" else "clevel") if isinstance(raw, dict) else None
    try:
        want = codec((name, level)).config(itemsize)
    except ValueError:
        want = None
    if raw != want:
        raise ValueError(f"codec_config {raw!r:.200} is not one jaxckpt writes for {name}")
    return want


def payload_bytes(codec: str | None, path: str, dtype: str, shape: Any, chunk_shape: Any) -> int:
    """The payload of one of a stream leaf's entries (before compression): the chunk's
    bytes, or for a quantized leaf (``codec`` a ``_quantize`` form) what the form stores
    (``ValueError`` for a leaf the form cannot store: a manifest says so only falsely)."""
    if codec in _quantize.FORMS:
        _quantize.check_leaf(path, _dtypes.DTYPES[dtype], tuple(shape), codec)
        return _quantize.encoded_nbytes(tuple(chunk_shape), codec)
    return math.prod(chunk_shape) * _dtypes.DTYPES[dtype].itemsize


class Compression:
    """Which codec each array leaf gets: ``rules``, ``(pattern, Codec or None)`` in order."""

    def __init__(self, rules: list[tuple[str, Codec | None]]):
        self.rules = rules

    def codec_for(self, path: str) -> Codec | None:
        return next((c for pattern, c in self.rules if fnmatch.fnmatchcase(path, pattern)), None)

    def __repr__(self) -> str:
        return f"Compression({self.rules!r})"


def parse(value: Any) -> Compression | None:
    """``compression=`` as given to ``save`` or the manager, checked (``ValueError``)."""
    if value is None or isinstance(value, Compression):
        return value
    if isinstance(value, Mapping):
        if not value:
            raise ValueError("compression: an empty mapping (give None for no compression)")
        rules = []
        for pattern, c in value.items():
            if not isinstance(pattern, str) or not pattern:
                raise ValueError(f"compression: pattern {pattern!r:.100} is not a non-empty str")
            rules.append((pattern, codec(c, f"compression[{pattern!r}]")))
        return Compression(rules)
    return Compression([("*", codec(value))])


# --- encoding and decoding through tensorstore ---------------------------------------------

_local = threading.local()


def _scratch(name: str, config: Mapping[str, Any], chunk_shape: tuple[int, ...], dtype: np.dtype) -> Any:
    """This thread's in-memory zarr3 array of one chunk with this codec (opened once)."""
    key = (name, json.dumps(config, sort_keys=True), chunk_shape, dtype.str)
    cache = _local.__dict__.setdefault("arrays", {})
    if key not in cache:
        if len(cache) > 64:
            cache.clear()
        codecs = [{"name": "bytes", "configuration": {"endian": "little"}} if dtype.itemsize > 1 else {"name": "bytes"},
                  {"name": name, "configuration": dict(config)}]
        spec = {"driver": "zarr3", "kvstore": {"driver": "memory"}, "create": True,
                "metadata": {"shape": [1, *chunk_shape], "data_type": _zarr_dtype(dtype),
                             "fill_value": False if dtype == np.bool_ else 0,
                             "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [1, *chunk_shape]}},
                             "codecs": codecs},
                "store_data_equal_to_fill_value": True}
        cache[key] = ts.open(spec).result()
    return cache[key]


def _zarr_dtype(dtype: np.dtype) -> str:
    return "bfloat16" if dtype.name == "bfloat16" else dtype.name


def _chunk_key(ndim: int) -> bytes:
    return ("c" + "/0" * (ndim + 1)).encode()


def encode(name: str, config: Mapping[str, Any], chunk: np.ndarray) -> bytes | None:
    """``chunk`` (a full chunk, C order, the storage dtype) encoded; ``None`` when all of
    its bytes are zero (nothing is stored for it)."""
    if not chunk.reshape(-1).view(np.uint8).any():
        return None
    arr = _scratch(name, config, tuple(chunk.shape), chunk.dtype)
    arr[0].write(chunk).result()
    return arr.kvstore.read(_chunk_key(chunk.ndim)).result().value


def decode(name: str, config: Mapping[str, Any], payload: Any, chunk_shape: tuple[int, ...],
           dtype: np.dtype) -> np.ndarray:
    """The chunk ``payload`` (encoded bytes, checksum already checked and removed) holds.
    Raises ``ValueError`` when tensorstore cannot decode it (or it decodes to another size)."""
    arr = _scratch(name, config, tuple(chunk_shape), np.dtype(dtype))
    arr.kvstore.write(_chunk_key(len(chunk_shape)), bytes(payload)).result()
    try:
        return arr[0].read().result()
    except ValueError as e:
        raise ValueError(f"the {name} entry does not decode: {e}") from None
