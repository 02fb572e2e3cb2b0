"""Where bytes live: locations (local paths, ``s3://``, ``gs://``, ``memory://`` or a raw
tensorstore kvstore spec), zarr3 arrays through tensorstore, and small blobs.

Two stores hold array data inside a checkpoint:

* ``file``: one zarr3 array per leaf under ``arrays/<i>/``, one object per chunk. Best
  for big leaves: chunks are written and read in parallel at disk speed.
* ``packed``: small leaves are laid out back to back in one zarr3 byte array per
  writing process (``packed/p<k>/``, 4 MiB chunks), so a thousand small leaves are a
  few files and one read, not thousands.

This module also counts what it reads and writes (``io_stats``), so tests can check
that a restore reads only what it needs.
"""

from __future__ import annotations

import functools
import os
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import crc32c
import ml_dtypes
import numpy as np
import tensorstore as ts

from . import _layout
from ._errors import CheckpointError

# --- dtypes -------------------------------------------------------------------------

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


# --- locations ----------------------------------------------------------------------

_SAFE_KEY = re.compile(r"^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*$")


def is_safe_key(key: str) -> bool:
    """True when ``key`` is a relative path that stays inside the checkpoint."""
    return bool(_SAFE_KEY.match(key)) and not any(p in (".", "..") for p in key.split("/"))


@dataclass(frozen=True)
class Location:
    """A checkpoint's root: a local directory or a prefix in a kvstore."""

    spec: tuple[tuple[str, Any], ...]  # the kvstore spec, hashable; "path" ends with "/"
    local: str | None  # absolute local directory, when the kvstore is a local file system

    @property
    def kvstore(self) -> dict[str, Any]:
        return dict(self.spec)

    def child(self, key: str) -> Location:
        spec = self.kvstore
        spec["path"] = spec.get("path", "") + key.strip("/") + "/"
        local = os.path.join(self.local, key) if self.local is not None else None
        return Location(tuple(sorted(spec.items())), local)

    def key_spec(self, key: str) -> dict[str, Any]:
        spec = self.kvstore
        spec["path"] = spec.get("path", "") + key
        return spec

    @property
    def url(self) -> str:
        if self.local is not None:
            return self.local
        spec = self.kvstore
        driver = spec["driver"]
        if driver in ("s3", "gcs"):
            scheme = "s3" if driver == "s3" else "gs"
            return f"{scheme}://{spec['bucket']}/{spec.get('path', '')}".rstrip("/")
        return f"{driver}://{spec.get('path', '')}".rstrip("/")

    def __str__(self) -> str:
        return self.url


def resolve(path: Any) -> Location:
    """A ``Location`` from a path, URL (``s3://b/p``, ``gs://b/p``, ``memory://p``,
    ``file://p``) or a tensorstore kvstore spec dict (e.g. an ``s3`` spec with an
    ``endpoint``)."""
    if isinstance(path, Location):
        return path
    if isinstance(path, dict):
        spec = dict(path)
        if spec.get("driver") == "file":
            return resolve(spec["path"])
        spec["path"] = spec.get("path", "").strip("/") + "/" if spec.get("path", "").strip("/") else ""
        return Location(tuple(sorted(spec.items())), None)
    text = os.fspath(path)
    if "://" not in text or text.startswith("file://"):
        local = os.path.abspath(text.removeprefix("file://"))
        return Location((("driver", "file"), ("path", local.rstrip("/") + "/")), local)
    scheme, rest = text.split("://", 1)
    if scheme in ("s3", "gs"):
        bucket, _, prefix = rest.partition("/")
        prefix = prefix.strip("/")
        spec = {"driver": "s3" if scheme == "s3" else "gcs", "bucket": bucket,
                "path": prefix + "/" if prefix else ""}
        return Location(tuple(sorted(spec.items())), None)
    if scheme == "memory":
        rest = rest.strip("/")
        return Location((("driver", "memory"), ("path", rest + "/" if rest else "")), None)
    raise CheckpointError(f"unsupported checkpoint location {text!r}")


# --- I/O accounting -----------------------------------------------------------------

_stats_lock = threading.Lock()
_stats = {"bytes_read": 0, "bytes_written": 0, "reads": 0, "writes": 0}


def _count(**kw: int) -> None:
    with _stats_lock:
        for k, v in kw.items():
            _stats[k] += v


def io_stats() -> dict[str, int]:
    """Array bytes and calls read/written through this module since the process started
    (or the last ``reset_io_stats``). Counts this process only."""
    with _stats_lock:
        return dict(_stats)


def reset_io_stats() -> None:
    with _stats_lock:
        for k in _stats:
            _stats[k] = 0


# A hook for tests: called with ("write", key) before each chunk write is issued; an
# exception it raises fails that write like an I/O error would.
fault_hook = None


# --- arrays -------------------------------------------------------------------------

_memory_context: ts.Context | None = None


def new_context(root: Location) -> ts.Context:
    """A fresh tensorstore context, except for ``memory://``: the memory kvstore lives
    in its context, so everything there shares one (made on first use)."""
    global _memory_context
    if root.kvstore["driver"] == "memory":
        if _memory_context is None:
            _memory_context = ts.Context()
        return _memory_context
    return ts.Context()


def _kvstore(root: Location) -> ts.KvStore:
    return ts.KvStore.open(root.kvstore, context=new_context(root)).result()


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


def open_array(spec: dict[str, Any], ctx: ts.Context, *, create: bool) -> ts.Future:
    if create:
        return ts.open(spec, create=True, context=ctx)
    return ts.open(spec, assume_metadata=True, context=ctx)


def aligned_empty(shape: Sequence[int], dtype: Any) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on a 64-byte boundary.

    On CPU, jax can adopt such a buffer without copying (``device_put(may_alias=True)``).
    """
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + 64, np.uint8)
    start = (-raw.ctypes.data) % 64
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def write_region(store: ts.TensorStore, index: Sequence[tuple[int, int]], data: np.ndarray,
                 key: str) -> ts.WriteFutures:
    """Start writing ``data`` (already in the storage dtype) to ``store[index]``."""
    if fault_hook is not None:
        fault_hook("write", key)
    _count(bytes_written=data.nbytes, writes=1)
    return store[_layout.index_to_slices(index)].write(data) if index else store.write(data)


def run_tasks(tasks: Sequence[Any], n_threads: int) -> None:
    """Run callables on up to ``n_threads`` threads; raise the first error once all stopped.

    Plain threads, not ``concurrent.futures``: that refuses new work once the
    interpreter starts exiting, and a pending async save must still finish then.
    """
    if not tasks:
        return
    todo = iter(tasks)
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker() -> None:
        while True:
            with lock:
                task = None if errors else next(todo, None)
            if task is None:
                return
            try:
                task()
            except BaseException as e:  # noqa: BLE001 - re-raised below
                with lock:
                    errors.append(e)

    threads = [threading.Thread(target=worker, name="jaxckpt-io", daemon=True)
               for _ in range(min(n_threads, len(tasks)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


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
    _count(bytes_read=dest.nbytes, reads=1)
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
    if fault_hook is not None:
        fault_hook("write", key)
    _count(bytes_written=data.nbytes, writes=1)
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


def read_into(dest: np.ndarray, store: ts.TensorStore, index: Sequence[tuple[int, int]]) -> ts.Future:
    """Start reading ``store[index]`` straight into ``dest`` (a numpy array or view)."""
    _count(bytes_read=dest.nbytes, reads=1)
    target = ts.array(dest, copy=False, write=True)
    return target.write(store[_layout.index_to_slices(index)] if index else store)


# --- small blobs (the manifest) -----------------------------------------------------


def write_blob(root: Location, key: str, data: bytes) -> None:
    if root.local is not None:
        # Write, fsync, then rename: the blob appears whole or not at all.
        path = os.path.join(root.local, key)
        tmp = path + ".writing"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        fsync_dir(root.local)
        return
    kv = _kvstore(root)
    kv.write(key, data).result()


def read_blob(root: Location, key: str) -> bytes | None:
    """The blob's bytes, or ``None`` when it does not exist."""
    if root.local is not None:
        try:
            with open(os.path.join(root.local, key), "rb") as f:
                return f.read()
        except (FileNotFoundError, NotADirectoryError):
            return None
    kv = _kvstore(root)
    result = kv.read(key).result()
    if result.state != "value":
        return None
    return bytes(result.value)


def delete_blob(root: Location, key: str) -> None:
    if root.local is not None:
        try:
            os.remove(os.path.join(root.local, key))
        except FileNotFoundError:
            pass
        return
    kv = _kvstore(root)
    kv.delete_range(ts.KvStore.KeyRange(key, key + "\x00")).result()


def list_children(root: Location) -> list[str]:
    """Names directly below ``root`` (directories or key prefixes)."""
    if root.local is not None:
        try:
            return sorted(os.listdir(root.local))
        except FileNotFoundError:
            return []
    kv = _kvstore(root)
    names = set()
    for key in kv.list().result():
        k = key.decode() if isinstance(key, bytes) else key
        names.add(k.split("/", 1)[0])
    return sorted(names)


def delete_tree(root: Location) -> None:
    """Delete everything under ``root``."""
    if root.local is not None:
        import shutil

        shutil.rmtree(root.local, ignore_errors=True)
        return
    kv = _kvstore(root)
    kv.delete_range(ts.KvStore.KeyRange()).result()


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
