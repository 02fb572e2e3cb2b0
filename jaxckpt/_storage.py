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

    tensorstore's ``KvStore.list`` has no delimiter (its S3 driver sends ListObjectsV2
    with only a ``prefix`` and filters a range's lower bound on the client), so through
    it a listing fetches every key under ``root``: for a manager directory, every chunk
    of every step. On S3, when boto3 is installed (``pip install jaxckpt[s3]``), one
    level is listed with a delimiter instead: one request per 1,000 children.
    """
    if root.local is not None:
        try:
            return sorted(os.listdir(root.local))
        except FileNotFoundError:
            return []
    if root.kvstore["driver"] == "s3":
        names = _s3_children(root)
        if names is not None:
            return names
    kv = _kvstore(root)
    names = set()
    for key in call(root, "listing", "", lambda: kv.list().result()):
        k = key.decode() if isinstance(key, bytes) else key
        names.add(k.split("/", 1)[0])
    return sorted(names)


_S3_TIMEOUT_S = 30


def _s3_children(root: Location) -> list[str] | None:
    """One level below ``root`` on S3 through boto3 (``Delimiter="/"``), or ``None`` when
    boto3 is missing or has no credentials (the caller falls back to tensorstore)."""
    try:
        import boto3
        import botocore.config
        import botocore.exceptions
    except ImportError:
        return None
    spec = root.kvstore
    config = botocore.config.Config(connect_timeout=_S3_TIMEOUT_S, read_timeout=_S3_TIMEOUT_S,
                                    retries={"max_attempts": 3})
    kwargs: dict[str, Any] = {"config": config}
    if spec.get("endpoint"):
        kwargs["endpoint_url"] = spec["endpoint"]
    if spec.get("aws_region"):
        kwargs["region_name"] = spec["aws_region"]
    prefix = spec.get("path", "")
    names: set[str] = set()
    try:
        client = boto3.session.Session().client("s3", **kwargs)
        pages = client.get_paginator("list_objects_v2").paginate(
            Bucket=spec["bucket"], Prefix=prefix, Delimiter="/")
        for page in pages:
            names.update(p["Prefix"][len(prefix):].rstrip("/") for p in page.get("CommonPrefixes", []))
            names.update(o["Key"][len(prefix):] for o in page.get("Contents", []))
    except botocore.exceptions.ClientError as e:
        err = e.response.get("Error", {})
        cause = f"{err.get('Code', '?')}: {err.get('Message', '')}".rstrip(": ")
        raise CheckpointError(f"Listing '{root.url}' failed: {cause}") from None
    except (botocore.exceptions.NoCredentialsError, botocore.exceptions.NoRegionError):
        return None
    return sorted(n for n in names if n)


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
