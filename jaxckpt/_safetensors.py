"""Safetensors files as a ``_sources.Source`` (reading), and the format's shared facts.

The format: 8 bytes little-endian header length N, N bytes of JSON header
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``,
offsets relative to the end of the header), then the tensors' bytes, C order, little
endian. A sharded export is a directory of ``model-0000k-of-0000N.safetensors`` files
and ``model.safetensors.index.json`` (``{"metadata": {"total_size"}, "weight_map":
{name: file}}``).

Names: a jaxckpt key path with ``/`` replaced by ``.`` (``params/dense/kernel`` →
``params.dense.kernel``), below the exported prefix.
"""

from __future__ import annotations

from typing import Any

# safetensors dtype names <-> jaxckpt (numpy / ml_dtypes) dtype names
DTYPE_TO_ST = {
    "bool": "BOOL", "uint8": "U8", "int8": "I8", "uint16": "U16", "int16": "I16", "uint32": "U32",
    "int32": "I32", "uint64": "U64", "int64": "I64", "float16": "F16", "bfloat16": "BF16",
    "float32": "F32", "float64": "F64", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
}
ST_TO_DTYPE = {v: k for k, v in DTYPE_TO_ST.items()}
INDEX_FILE = "model.safetensors.index.json"


def name_of(key_path: str) -> str:
    """The tensor name of a key path (``/`` becomes ``.``)."""
    return key_path.replace("/", ".")


def open_source(loc: Any) -> Any:
    """The safetensors file or sharded directory at ``loc`` as a ``Source``, or ``None``."""
    return None
