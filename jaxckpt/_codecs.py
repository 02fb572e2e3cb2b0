"""Lossless compression of format 3's entries (``compression=`` on ``save`` and the manager).

A compressed leaf's entries hold each chunk encoded by one of zarr3's byte-to-byte codecs,
the ones tensorstore has (``zstd``; ``blosc`` with lz4 and byte shuffle), followed by the
crc32c of the encoded bytes: exactly the bytes of a zarr3 chunk file with codecs
``bytes`` (little endian) + the codec + ``crc32c``. tensorstore does the encoding and
the decoding (``_storage.codecs``), so jaxckpt adds no compression library of its own.
This module is the choice and the manifest's side of it (pure: no tensorstore).

The choice (``Compression``): one codec for every array leaf (``"zstd"``, ``("zstd", 9)``),
or a mapping from key-path patterns (``fnmatch``, on the manifest's leaf paths such as
``opt_state/0/mu/dense/kernel``) to codecs, the first matching pattern winning and a leaf
no pattern matches stored raw (``"raw"`` or ``None`` as a mapping's value: raw too).
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

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
