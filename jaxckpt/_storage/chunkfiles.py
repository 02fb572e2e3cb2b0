"""Whole zarr3 chunks of big leaves as local files, without tensorstore, and the
64-byte-aligned host buffers they are read into.

The bytes are exactly tensorstore's (codecs ``bytes`` little endian + ``crc32c``): the
data straight from or into the array's own buffer, then a 4-byte crc32c, checked by
a hardware crc32c that releases the GIL. Only whole interior chunks go this way; zarr
stores edge chunks at full size, and those go through tensorstore.
"""

from __future__ import annotations

import math
import os
import stat
from collections.abc import Sequence
from typing import Any

import crc32c
import numpy as np

from .. import _storage
from .location import Location


def aligned_empty(shape: Sequence[int], dtype: Any) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on a 64-byte boundary.

    On CPU, jax can adopt such a buffer without copying (``device_put(may_alias=True)``).
    """
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize  # (Python ints: no overflow, no numpy call per buffer)
    raw = np.empty(nbytes + 64, np.uint8)
    start = (-raw.ctypes.data) % 64
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def chunk_file(root: Location, key: str, cell: Sequence[int]) -> str | None:
    """The local file holding chunk ``cell`` of big leaf ``key`` (zarr3 default key
    encoding), or ``None`` when the checkpoint is not on a local file system."""
    if root.local is None:
        return None
    return os.path.join(root.local, "arrays", key, "c", *map(str, cell))


def packed_chunk_files(root: Location, process: int, start: int, stop: int, chunk_bytes: int) -> list[str]:
    """The local files of the chunks of process ``process``'s packed array (chunks of
    ``chunk_bytes``) that bytes ``[start, stop)`` lie in; ``[]`` off a local disk."""
    if root.local is None:
        return []
    return [os.path.join(root.local, "packed", f"p{process}", "c", str(n))
            for n in range(start // chunk_bytes, (stop - 1) // chunk_bytes + 1)]


def read_chunk_file(dest: np.ndarray, path: str) -> None:
    """Read one whole zarr3 chunk (``bytes`` + ``crc32c`` codecs) from a local file
    straight into the C-contiguous ``dest`` and verify its checksum.

    This is tensorstore's format read without tensorstore: one ``readinto`` into the
    final buffer and a hardware crc32c, instead of a read into a staging buffer, a
    checksum and a copy. Raises ``ValueError`` on a missing, short or corrupt chunk, or
    one that is not a regular file (opened without blocking: a FIFO planted in a hostile
    checkpoint does not hang the read); ``OSError`` when the file system refuses it.
    """
    _storage.fault("read", path)
    _storage.count(bytes_read=dest.nbytes, reads=1)
    view = memoryview(dest.reshape(-1).view(np.uint8))
    fd = _open_chunk(path)
    try:
        _check_size(os.fstat(fd), path, dest.nbytes)  # before fdopen, which refuses a directory
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb", buffering=0) as f:
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


def check_chunk_file(path: str, nbytes: int) -> None:
    """Raise ``ValueError`` unless ``path`` is a regular file holding a chunk of
    ``nbytes`` data bytes (plus its 4-byte crc32c).

    Checked before tensorstore reads a local chunk: tensorstore allocates the whole chunk
    the metadata promises before it looks at the file (a failed allocation aborts the
    process), and its open of a FIFO would block forever.
    """
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        raise ValueError(f"NOT_FOUND: chunk file {path} is missing") from None
    _check_size(st, path, nbytes)


def _open_chunk(path: str) -> int:
    try:
        return os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except (FileNotFoundError, NotADirectoryError):
        raise ValueError(f"NOT_FOUND: chunk file {path} is missing") from None
    except IsADirectoryError:
        raise ValueError(f"DATA_LOSS: chunk file {path} is not a regular file") from None


def _check_size(st: os.stat_result, path: str, nbytes: int) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"DATA_LOSS: chunk file {path} is not a regular file")
    if st.st_size != nbytes + 4:
        raise ValueError(f"DATA_LOSS: chunk file {path} has {st.st_size} bytes, expected {nbytes + 4}")


def write_chunk_file(path: str, data: np.ndarray, key: str) -> None:
    """Write one whole zarr3 chunk (``bytes`` + ``crc32c`` codecs) to a local file:
    the C-contiguous little-endian ``data`` straight from its buffer, then its crc32c,
    then fsync. The same bytes tensorstore would write, without its encode copy.

    Only for a staging directory nobody else reads yet: the file is written in place.
    """
    _storage.fault("write", key)
    _storage.count(bytes_written=data.nbytes, writes=1)
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

