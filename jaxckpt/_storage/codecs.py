"""Encoding and decoding format 3's compressed entries through tensorstore's zarr3 codecs
(``_codecs`` chooses the codec; ``_writer`` and ``_reader`` call these).

Each thread keeps an in-memory zarr3 array of one chunk per codec, chunk shape and dtype:
a chunk written into it comes out of its memory kvstore encoded, and encoded bytes put
there read back decoded, with tensorstore's own codecs (zstd, blosc) and its threads.

A chunk whose bytes are all zero (a freshly initialised moment) is not encoded at all:
``encode`` returns ``None`` and the writer stores nothing for it (its size in the
manifest is 0). Zero bytes, not zero values: ``-0.0`` is kept.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np
import tensorstore as ts

from . import zarr as _zarr

_local = threading.local()


def _scratch(name: str, config: Mapping[str, Any], chunk_shape: tuple[int, ...], dtype: np.dtype) -> Any:
    """This thread's in-memory zarr3 array of one chunk with this codec (opened once).

    Keyed on the dtype's name: ``dtype.str`` (and ``.char``) do not tell ml_dtypes'
    narrow types apart (int4 and most float8 types are all ``'<V1'``), and a chunk
    written through an array of another dtype is converted, value by value, into it."""
    key = (name, json.dumps(config, sort_keys=True), chunk_shape, dtype.name, dtype.itemsize)
    cache = _local.__dict__.setdefault("arrays", {})
    if key not in cache:
        if len(cache) > 64:
            cache.clear()
        codecs = [{"name": "bytes", "configuration": {"endian": "little"}} if dtype.itemsize > 1 else {"name": "bytes"},
                  {"name": name, "configuration": dict(config)}]
        spec = {"driver": "zarr3", "kvstore": {"driver": "memory"}, "create": True,
                "metadata": {"shape": [1, *chunk_shape], "data_type": _zarr_dtype(dtype),
                             "fill_value": _zarr._fill_value(_zarr_dtype(dtype)),  # complex: [0.0, 0.0]
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
