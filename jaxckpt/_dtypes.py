"""The dtypes a checkpoint can hold, by name (pure: numpy and ml_dtypes only).

zarr3 in tensorstore refuses a few narrow types; they are stored bit for bit as
unsigned integers of the same width (``storage_dtype_name``) and viewed back on read.
"""

from __future__ import annotations

import functools
from typing import Any

import ml_dtypes
import numpy as np

from ._errors import CheckpointError

_NUMPY_NAMES = [
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128",
]

_ML_NAMES = [
    "bfloat16", "int2", "int4", "uint2", "uint4", "float4_e2m1fn", "float8_e3m4",
    "float8_e4m3", "float8_e4m3b11fnuz", "float8_e4m3fn", "float8_e4m3fnuz",
    "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
]

DTYPES: dict[str, np.dtype] = {n: np.dtype(n) for n in _NUMPY_NAMES}
DTYPES.update({n: np.dtype(getattr(ml_dtypes, n)) for n in _ML_NAMES if hasattr(ml_dtypes, n)})

# zarr3 data types tensorstore 0.1.x refuses; they are stored bit-for-bit as unsigned
# integers of the same width and viewed back on read.
_ZARR3_UNSUPPORTED = {"int2", "uint2", "uint4", "float8_e4m3", "float4_e2m1fn"}


@functools.lru_cache(maxsize=256)
def dtype_name(dtype: Any) -> str:
    name = np.dtype(dtype).name
    if name not in DTYPES:
        raise CheckpointError(f"dtype {name!r} cannot be saved")
    return name


def storage_dtype_name(name: str) -> str:
    if name in _ZARR3_UNSUPPORTED:
        return f"uint{8 * DTYPES[name].itemsize}"
    return name

