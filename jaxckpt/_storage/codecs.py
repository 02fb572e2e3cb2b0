"""Encoding and decoding format 3's compressed entries through tensorstore's zarr3 codecs
(``_codecs`` chooses the codec; ``_writer`` and ``_reader`` call these).

Each thread keeps an in-memory zarr3 array of one chunk per codec, chunk shape and dtype:
a chunk written into it comes out of its memory kvstore encoded, and encoded bytes put
there read back decoded, with tensorstore's own codecs (zstd, blosc) and its threads.

A chunk whose bytes are all zero (a freshly initialised moment) is not encoded at all:
``encode`` returns ``None`` and the writer stores nothing for it (its size in the
manifest is 0). Zero bytes, not zero values: ``-0.0`` is kept.

An entry is untrusted: before tensorstore decodes one, the size its codec's own header
declares is checked against the chunk's (``check_header``). tensorstore's blosc decoder
allocates and fills whatever the header declares before comparing it with the chunk (a
58 KB entry declaring 1.9 GB took 1.9 GB of memory, or aborted the process with
``std::bad_alloc`` under a memory limit); its zstd decoder stops at the chunk's size, but
a frame that declares no content size makes zstd allocate the window the frame asks for
(up to 2 GiB, whatever the chunk). tensorstore's encoders write both fields, always.
"""

from __future__ import annotations

import json
import math
import struct
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
    Raises ``ValueError`` when its header declares another size than the chunk's
    (``check_header``, before tensorstore sees it), or when tensorstore cannot decode it."""
    dtype = np.dtype(dtype)
    check_header(name, payload, math.prod(chunk_shape) * dtype.itemsize)
    arr = _scratch(name, config, tuple(chunk_shape), dtype)
    arr.kvstore.write(_chunk_key(len(chunk_shape)), bytes(payload)).result()
    try:
        return arr[0].read().result()
    except ValueError as e:
        raise ValueError(f"the {name} entry does not decode: {e}") from None


_BLOSC_HEADER = struct.Struct("<BBBBiii")  # version, versionlz, flags, typesize, nbytes, blocksize, cbytes
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_ZSTD_FCS_BYTES = (0, 2, 4, 8)  # by Frame_Content_Size_flag (0: 1 byte with Single_Segment_flag, else absent)
_ZSTD_DICT_ID_BYTES = (0, 1, 2, 4)  # by Dictionary_ID_flag


def check_header(name: str, payload: Any, nbytes: int) -> None:
    """Refuse (``ValueError``) an encoded entry whose codec header does not declare exactly
    ``nbytes`` decoded bytes (the chunk's): blosc's ``nbytes`` must be the chunk's,
    ``cbytes`` the entry's length and ``blocksize`` at most the chunk; a zstd entry must
    start with a frame whose header declares its content size, the chunk's. Reads the
    first 18 bytes only."""
    view = memoryview(payload).cast("B")
    head, size = bytes(view[:18]), len(view)
    bad = f"the {name} entry does not decode: "
    if name == "blosc":
        if size < _BLOSC_HEADER.size:
            raise ValueError(f"{bad}it has {size} bytes, less than its {_BLOSC_HEADER.size}-byte header")
        _, _, _, _, declared, blocksize, cbytes = _BLOSC_HEADER.unpack_from(head)
        if declared != nbytes:
            raise ValueError(f"{bad}it declares {declared} decoded bytes, but its chunk has {nbytes}")
        if cbytes != size:
            raise ValueError(f"{bad}it declares {cbytes} encoded bytes, but it has {size}")
        if not 0 < blocksize <= nbytes:
            raise ValueError(f"{bad}it declares blocks of {blocksize} bytes, for a chunk of {nbytes}")
    elif name == "zstd":
        if size < 6 or head[:4] != _ZSTD_MAGIC:
            raise ValueError(f"{bad}it does not start with a zstd frame")
        descriptor = head[4]
        fcs_bytes = _ZSTD_FCS_BYTES[descriptor >> 6] or (1 if descriptor & 0x20 else 0)
        if not fcs_bytes:
            raise ValueError(f"{bad}its frame does not declare its decoded size")
        at = 5 + (0 if descriptor & 0x20 else 1) + _ZSTD_DICT_ID_BYTES[descriptor & 3]
        if size < at + fcs_bytes:
            raise ValueError(f"{bad}it has {size} bytes, less than its frame header")
        declared = int.from_bytes(head[at:at + fcs_bytes], "little") + (256 if fcs_bytes == 2 else 0)
        if declared != nbytes:
            raise ValueError(f"{bad}it declares {declared} decoded bytes, but its chunk has {nbytes}")
