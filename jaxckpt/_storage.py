"""Where bytes live: locations (local paths, ``s3://``, ``gs://``, ``memory://`` or a raw
tensorstore kvstore spec), zarr3 arrays through tensorstore, and small blobs.

Two stores hold array data inside a checkpoint:

* ``file``: one zarr3 array per leaf under ``arrays/<i>/``, one object per chunk. Best
  for big leaves: chunks are written and read in parallel at disk speed.
* ``packed``: small leaves are laid out back to back in one zarr3 byte array per
  writing process (``packed/p<k>/``, 4 MiB chunks), so a thousand small leaves are a
  few files and one read, not thousands.

This module also counts what it reads and writes (``io_stats``), so tests can check
that a restore reads only what it needs. It keeps one tensorstore context per store
(``context``) and reports a failed storage call as a ``CheckpointError`` naming the URL.
"""

from __future__ import annotations

import collections
import functools
import json
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

# One tensorstore context per store (a bucket on an endpoint, the local file system, the
# memory kvstore): connections, credentials and thread pools are made once and reused by
# every save, restore and lazy read there. KvStore handles are reused per location.
# Both caches are bounded (least recently used goes first) and thread-safe; the memory
# kvstore's context is never dropped, since its data lives in it.

_MAX_CONTEXTS = 16
_MAX_KVSTORES = 64
_handles_lock = threading.RLock()
_contexts: collections.OrderedDict[str, ts.Context] = collections.OrderedDict()
_kvstores: collections.OrderedDict[str, ts.KvStore] = collections.OrderedDict()


def _store_identity(root: Location) -> str:
    """The kvstore spec without its ``path``: what decides which context a location uses."""
    spec = root.kvstore
    spec.pop("path", None)
    return json.dumps(spec, sort_keys=True, default=str)


def _cached(cache: collections.OrderedDict, key: str, make: Any, limit: int,
            keep: Any = lambda key: False) -> Any:
    # Made under the lock, so two threads never open two handles for one key. (Opening
    # sends no request to the store; an RLock, since a KvStore open takes its context.)
    with _handles_lock:
        if key in cache:
            cache.move_to_end(key)
            return cache[key]
        cache[key] = value = make()
        for old in [k for k in cache if not keep(k)][:max(0, len(cache) - limit)]:
            del cache[old]
        return value


def context(root: Location) -> ts.Context:
    """The tensorstore context of ``root``'s store, shared by every location there."""
    return _cached(_contexts, _store_identity(root), ts.Context, _MAX_CONTEXTS,
                   keep=lambda key: json.loads(key).get("driver") == "memory")


new_context = context  # the name callers used when every call made a fresh context


def _kvstore(root: Location) -> ts.KvStore:
    return _cached(_kvstores, json.dumps(root.kvstore, sort_keys=True, default=str),
                   lambda: _call(root, "opening", "", lambda: ts.KvStore.open(
                       root.kvstore, context=context(root)).result()),
                   _MAX_KVSTORES)


# --- storage errors -------------------------------------------------------------------

_XML_FIELD = re.compile(r"<(Code|Message)>(.*?)</\1>", re.S)
# tensorstore appends payloads like [http_response_body='<?xml ...'] [http_response_code='404']
_PAYLOAD = re.compile(r"\s*(\[[A-Za-z0-9_. -]+='|<\?xml|<Error>)")


def storage_cause(error: BaseException) -> str:
    """A short cause from a tensorstore error: the S3 ``Code: Message`` of an XML error
    body when there is one, else tensorstore's message without its attached payloads."""
    text = str(error)
    fields = dict(_XML_FIELD.findall(text))
    head = _PAYLOAD.split(text, maxsplit=1)[0].strip().rstrip(":").strip()
    if "Code" in fields:
        cause = fields["Code"] + (f": {fields['Message']}" if fields.get("Message") else "")
        if cause in head:  # tensorstore summarised the body itself
            return head
        return f"{head}: {cause}" if head else cause
    return head[:500] or type(error).__name__


def storage_error(root: Location, doing: str, key: str, error: BaseException) -> CheckpointError:
    what = f"'{key}' in '{root.url}'" if key else f"'{root.url}'"
    return CheckpointError(f"{doing.capitalize()} {what} failed: {storage_cause(error)}")


def _call(root: Location, doing: str, key: str, fn: Any) -> Any:
    """``fn()``, with a tensorstore error turned into a ``CheckpointError`` naming the URL."""
    try:
        return fn()
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - tensorstore reports I/O errors as ValueError and others
        raise storage_error(root, doing, key, e) from None


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
        return _call(resolve(self._kvstore), "opening array", "",
                     lambda: self._future.result(timeout=timeout))

    def done(self) -> bool:
        return self._future.done()


def open_array(spec: dict[str, Any], ctx: ts.Context, *, create: bool) -> _Opening:
    if create:
        return _Opening(ts.open(spec, create=True, context=ctx), spec["kvstore"])
    return _Opening(ts.open(spec, assume_metadata=True, context=ctx), spec["kvstore"])


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
    _call(root, "writing", key, lambda: kv.write(key, data).result())


def read_blob(root: Location, key: str) -> bytes | None:
    """The blob's bytes, or ``None`` when it does not exist."""
    if root.local is not None:
        try:
            with open(os.path.join(root.local, key), "rb") as f:
                return f.read()
        except (FileNotFoundError, NotADirectoryError):
            return None
    kv = _kvstore(root)
    result = _call(root, "reading", key, lambda: kv.read(key).result())
    if result.state == "value":
        return bytes(result.value)
    if root.kvstore["driver"] in ("s3", "gcs"):
        # Object stores answer a read from a missing bucket like one of a missing object
        # (404, which tensorstore reports as "no value"). A listing of just this key tells
        # them apart: it fails for a missing bucket. One request, on a miss only.
        _call(root, "reading", key, lambda: kv.list(ts.KvStore.KeyRange(key, key + "\x00")).result())
    return None


def delete_blob(root: Location, key: str) -> None:
    if root.local is not None:
        try:
            os.remove(os.path.join(root.local, key))
        except FileNotFoundError:
            pass
        return
    kv = _kvstore(root)
    _call(root, "deleting", key, lambda: kv.delete_range(ts.KvStore.KeyRange(key, key + "\x00")).result())


def list_children(root: Location) -> list[str]:
    """Names directly below ``root`` (directories or key prefixes).

    On a kvstore this lists every key below ``root``: tensorstore's ``KvStore.list``
    has no delimiter (its S3 driver sends ListObjectsV2 with only a ``prefix``, the
    longest common prefix of the range, and filters the range's lower bound on the
    client), so skipping past a child with a narrower range still fetches every key
    under ``root`` again, once per child. One full listing is the cheapest it offers.
    """
    if root.local is not None:
        try:
            return sorted(os.listdir(root.local))
        except FileNotFoundError:
            return []
    kv = _kvstore(root)
    names = set()
    for key in _call(root, "listing", "", lambda: kv.list().result()):
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
    _call(root, "deleting", "", lambda: kv.delete_range(ts.KvStore.KeyRange()).result())


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
