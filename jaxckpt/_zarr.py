"""Array data through tensorstore: the zarr3 specs of a checkpoint's arrays, opening
them, and starting region reads and writes.

Two stores hold array data inside a checkpoint:

* ``file``: one zarr3 array per leaf under ``arrays/<i>/``, one object per chunk. Best
  for big leaves: chunks are written and read in parallel at disk speed.
* ``packed``: small leaves are laid out back to back in one zarr3 byte array per
  writing process (``packed/p<k>/``, 4 MiB chunks), so a thousand small leaves are a
  few files and one read, not thousands.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorstore as ts

from . import _iostats, _layout, _storage
from ._dtypes import DTYPES
from ._location import Location, resolve


def _zarr3(kvstore: dict[str, Any], shape: Sequence[int], chunk_shape: Sequence[int],
           storage_dtype: str) -> dict[str, Any]:
    itemsize = np.dtype(DTYPES[storage_dtype]).itemsize
    codecs = [{"name": "bytes"} if itemsize == 1 else
              {"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]
    return {
        "driver": "zarr3",
        "kvstore": kvstore,
        # A missing chunk must be an error, never zeros; so all-zero chunks are written too.
        "fill_missing_data_reads": False,
        "store_data_equal_to_fill_value": True,
        "metadata": {
            "shape": list(shape),
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunk_shape)}},
            "chunk_key_encoding": {"name": "default"},
            "data_type": storage_dtype,
            "codecs": codecs,
            "fill_value": _fill_value(storage_dtype),
        },
    }



def array_spec(root: Location, key: str, shape: Sequence[int], chunk_shape: Sequence[int],
               storage_dtype: str) -> dict[str, Any]:
    """The zarr3 spec of a big leaf's own array, ``arrays/<key>/``."""
    return _zarr3(root.key_spec(f"arrays/{key}/"), shape, chunk_shape, storage_dtype)



def packed_spec(root: Location, process: int, nbytes: int, chunk_bytes: int) -> dict[str, Any]:
    """The zarr3 spec of one process's byte array of small leaves, ``packed/p<k>/``."""
    return _zarr3(root.key_spec(f"packed/p{process}/"), [nbytes], [chunk_bytes], "uint8")



def _fill_value(storage_dtype: str) -> Any:
    if storage_dtype == "bool":
        return False
    if storage_dtype.startswith("complex"):
        return [0.0, 0.0]
    return 0



class _Opening:
    """A pending ``ts.open``: ``result()`` gives the ``ts.TensorStore`` or raises a
    ``CheckpointError`` naming the array's URL."""

    __slots__ = ("_future", "_kvstore")

    def __init__(self, future: ts.Future, kvstore: dict[str, Any]):
        self._future, self._kvstore = future, kvstore

    def result(self, timeout: float | None = None) -> ts.TensorStore:
        return _storage.call(resolve(self._kvstore), "opening array", "",
                     lambda: self._future.result(timeout=timeout))

    def done(self) -> bool:
        return self._future.done()



def open_array(spec: dict[str, Any], ctx: ts.Context, *, create: bool) -> _Opening:
    if create:
        return _Opening(ts.open(spec, create=True, context=ctx), spec["kvstore"])
    return _Opening(ts.open(spec, assume_metadata=True, context=ctx), spec["kvstore"])



def write_region(store: ts.TensorStore, index: Sequence[tuple[int, int]], data: np.ndarray,
                 key: str) -> ts.WriteFutures:
    """Start writing ``data`` (already in the storage dtype) to ``store[index]``."""
    _iostats.fault("write", key)
    _iostats.count(bytes_written=data.nbytes, writes=1)
    return store[_layout.index_to_slices(index)].write(data) if index else store.write(data)



def read_into(dest: np.ndarray, store: ts.TensorStore, index: Sequence[tuple[int, int]]) -> ts.Future:
    """Start reading ``store[index]`` straight into ``dest`` (a numpy array or view)."""
    _iostats.count(bytes_read=dest.nbytes, reads=1)
    target = ts.array(dest, copy=False, write=True)
    return target.write(store[_layout.index_to_slices(index)] if index else store)

