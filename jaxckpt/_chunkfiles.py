"""Whole zarr3 chunks of big leaves as local files, without tensorstore, and the
64-byte-aligned host buffers they are read into.

The bytes are exactly tensorstore's (codecs ``bytes`` little endian + ``crc32c``): the
data straight from or into the array's own buffer, then a 4-byte crc32c, checked by
a hardware crc32c that releases the GIL. Only whole interior chunks go this way; zarr
stores edge chunks at full size, and those go through tensorstore.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import crc32c
import numpy as np

from . import _iostats
from ._location import Location


def aligned_empty(shape: Sequence[int], dtype: Any) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on a 64-byte boundary.

    On CPU, jax can adopt such a buffer without copying (``device_put(may_alias=True)``).
    """
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + 64, np.uint8)
    start = (-raw.ctypes.data) % 64
    return raw[start:start + nbytes].view(dtype).reshape(shape)



def chunk_file(root: Location, key: str, cell: Sequence[int]) -> str | None:
    """The local file holding chunk ``cell`` of big leaf ``key`` (zarr3 default key
    encoding), or ``None`` when the checkpoint is not on a local file system."""
    if root.local is None:
        return None
    return os.path.join(root.local, "arrays", key, "c", *map(str, cell))



def read_chunk_file(dest: np.ndarray, path: str) -> None:
    """Read one whole zarr3 chunk (``bytes`` + ``crc32c`` codecs) from a local file
    straight into the C-contiguous ``dest`` and verify its checksum.

    This is tensorstore's format read without tensorstore: one ``readinto`` into the
    final buffer and a hardware crc32c, instead of a read into a staging buffer, a
    checksum and a copy. Raises ``ValueError`` on a missing, short or corrupt chunk.
    """
    _iostats.count(bytes_read=dest.nbytes, reads=1)
    view = memoryview(dest.reshape(-1).view(np.uint8))
    try:
        f = open(path, "rb", buffering=0)  # noqa: SIM115 - closed below
    except FileNotFoundError:
        raise ValueError(f"NOT_FOUND: chunk file {path} is missing") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        if size != dest.nbytes + 4:
            raise ValueError(f"DATA_LOSS: chunk file {path} has {size} bytes, expected {dest.nbytes + 4}")
        got = 0
        while got < dest.nbytes:
            n = f.readinto(view[got:])
            if not n:
                raise ValueError(f"DATA_LOSS: chunk file {path} ended early")
            got += n
        stored = int.from_bytes(f.read(4), "little")
    computed = crc32c.crc32c(view)
    if stored != computed:
        raise ValueError(f"DATA_LOSS: chunk file {path}: digest mismatch, stored digest is "
                         f"0x{stored:08x} but computed digest is 0x{computed:08x}")



def write_chunk_file(path: str, data: np.ndarray, key: str) -> None:
    """Write one whole zarr3 chunk (``bytes`` + ``crc32c`` codecs) to a local file:
    the C-contiguous little-endian ``data`` straight from its buffer, then its crc32c,
    then fsync. The same bytes tensorstore would write, without its encode copy.

    Only for a staging directory nobody else reads yet: the file is written in place.
    """
    _iostats.fault("write", key)
    _iostats.count(bytes_written=data.nbytes, writes=1)
    view = memoryview(data.reshape(-1).view(np.uint8))
    trailer = crc32c.crc32c(view).to_bytes(4, "little")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        done = 0
        while done < len(view):
            done += os.write(fd, view[done:done + (1 << 30)])
        os.write(fd, trailer)
        os.fsync(fd)
    finally:
        os.close(fd)

