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

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorstore as ts

from .. import _layout, _storage
from .._dtypes import DTYPES
from . import kvstore as _kvstore
from .location import Location, resolve


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
    ``CheckpointError`` naming the array's URL (within the I/O bound, see ``_storage``)."""

    __slots__ = ("_future", "_kvstore", "_issued")

    def __init__(self, future: ts.Future, kvstore: dict[str, Any]):
        self._future, self._kvstore = _kvstore.track(future), kvstore
        self._issued = time.monotonic()

    def result(self, timeout: float | None = None) -> ts.TensorStore:
        if timeout is not None:
            return _kvstore.call(resolve(self._kvstore), "opening array", "",
                                 lambda: self._future.result(timeout=timeout))
        return _kvstore.wait(self._future, _ArrayLocation(self._kvstore), "opening array", "", self._issued)

    def done(self) -> bool:
        return self._future.done()


class _Pending:
    """A started read or write of array data: ``result()`` waits for it within the I/O
    bound and raises a ``CheckpointError`` naming the array's URL."""

    __slots__ = ("_future", "_store", "_doing", "_nbytes", "_issued")

    def __init__(self, future: Any, store: ts.TensorStore, doing: str, nbytes: int):
        self._future, self._store, self._doing = _kvstore.track(future), store, doing
        self._nbytes, self._issued = nbytes, time.monotonic()

    def result(self, timeout: float | None = None) -> Any:
        if timeout is not None:
            return self._future.result(timeout=timeout)
        return _kvstore.wait(self._future, _ArrayLocation(self._store), self._doing, "", self._issued,
                             self._nbytes)

    def done(self) -> bool:
        return self._future.done()

    def cancel(self) -> bool:
        return self._future.cancel()

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        self._future.add_done_callback(lambda _: callback(self))


class _ArrayLocation:
    """The location of an array's kvstore (a ``ts.TensorStore`` or a kvstore spec),
    worked out only when an error names it."""

    def __init__(self, where: ts.TensorStore | dict[str, Any]):
        self._where = where

    def _resolved(self) -> Location:
        try:
            spec = self._where if isinstance(self._where, dict) else self._where.kvstore.spec().to_json()
            return resolve(spec)
        except Exception:  # noqa: BLE001 - a name for a message; never fail on it
            return resolve("memory://array")

    @property
    def url(self) -> str:
        return self._resolved().url


def open_array(spec: dict[str, Any], ctx: ts.Context, *, create: bool, check_metadata: bool = False) -> _Opening:
    """Start opening the array of ``spec``: creating it, or for reading. A read trusts
    the manifest's metadata in ``spec`` and never reads ``zarr.json``, unless
    ``check_metadata`` (``verify``): then ``zarr.json`` is read, and one that disagrees
    with ``spec`` (another shape, chunk grid, dtype or codecs) fails the opening."""
    if create:
        return _Opening(ts.open(spec, create=True, context=ctx), spec["kvstore"])
    if check_metadata:
        return _Opening(ts.open(spec, open=True, context=ctx), spec["kvstore"])
    return _Opening(ts.open(spec, assume_metadata=True, context=ctx), spec["kvstore"])


def write_region(store: ts.TensorStore, index: Sequence[tuple[int, int]], data: np.ndarray,
                 key: str) -> _Pending:
    """Start writing ``data`` (already in the storage dtype) to ``store[index]``."""
    _storage.fault("write", key)
    _storage.count(bytes_written=data.nbytes, writes=1)
    future = store[_layout.index_to_slices(index)].write(data) if index else store.write(data)
    return _Pending(future, store, "writing", data.nbytes)


def read_into(dest: np.ndarray, store: ts.TensorStore, index: Sequence[tuple[int, int]],
              fetched: int = 0) -> _Pending:
    """Start reading ``store[index]`` straight into ``dest`` (a numpy array or view);
    ``fetched``: the bytes this reads from storage, when more than ``dest`` (the whole
    stored chunks a part of them costs), for ``io_stats``."""
    _storage.fault("read", "")
    _storage.count(bytes_read=max(fetched, dest.nbytes), reads=1)
    target = ts.array(dest, copy=False, write=True)
    return _Pending(target.write(store[_layout.index_to_slices(index)] if index else store), store, "reading",
                    dest.nbytes)
