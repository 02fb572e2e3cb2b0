"""Key-value access to where checkpoints live: one tensorstore context per store,
small blobs (the manifest, the writer lease), listing and deleting, and storage errors
reported as a ``CheckpointError`` naming the URL with a short cause.

Array data goes through ``_zarr`` (tensorstore) and ``_chunkfiles`` (direct local chunk
files); locations are resolved by ``_location``; I/O is counted by ``_iostats``.
"""

from __future__ import annotations

import collections
import json
import os
import re
import sys
import threading
import types
from typing import Any

import tensorstore as ts

from . import _iostats
from ._errors import CheckpointError
from ._location import Location

# Kept here for callers and tests written against the single storage module.
io_stats = _iostats.io_stats
reset_io_stats = _iostats.reset_io_stats


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
                   lambda: call(root, "opening", "", lambda: ts.KvStore.open(
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


def call(root: Location, doing: str, key: str, fn: Any) -> Any:
    """``fn()``, with a tensorstore error turned into a ``CheckpointError`` naming the URL."""
    try:
        return fn()
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - tensorstore reports I/O errors as ValueError and others
        raise storage_error(root, doing, key, e) from None


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
    call(root, "writing", key, lambda: kv.write(key, data).result())


def read_blob(root: Location, key: str) -> bytes | None:
    """The blob's bytes, or ``None`` when it does not exist."""
    if root.local is not None:
        try:
            with open(os.path.join(root.local, key), "rb") as f:
                return f.read()
        except (FileNotFoundError, NotADirectoryError):
            return None
    kv = _kvstore(root)
    result = call(root, "reading", key, lambda: kv.read(key).result())
    if result.state == "value":
        return bytes(result.value)
    if root.kvstore["driver"] in ("s3", "gcs"):
        # Object stores answer a read from a missing bucket like one of a missing object
        # (404, which tensorstore reports as "no value"). A listing of just this key tells
        # them apart: it fails for a missing bucket. One request, on a miss only.
        call(root, "reading", key, lambda: kv.list(ts.KvStore.KeyRange(key, key + "\x00")).result())
    return None


def delete_blob(root: Location, key: str) -> None:
    if root.local is not None:
        try:
            os.remove(os.path.join(root.local, key))
        except FileNotFoundError:
            pass
        return
    kv = _kvstore(root)
    call(root, "deleting", key, lambda: kv.delete_range(ts.KvStore.KeyRange(key, key + "\x00")).result())


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
    for key in call(root, "listing", "", lambda: kv.list().result()):
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
    call(root, "deleting", "", lambda: kv.delete_range(ts.KvStore.KeyRange()).result())


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Module(types.ModuleType):
    """``_storage.fault_hook`` reads and sets ``_iostats.fault_hook`` (tests set it here)."""

    @property
    def fault_hook(self) -> Any:
        return _iostats.fault_hook

    @fault_hook.setter
    def fault_hook(self, hook: Any) -> None:
        _iostats.fault_hook = hook


sys.modules[__name__].__class__ = _Module
