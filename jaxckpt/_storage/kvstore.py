"""Key-value access to where checkpoints live: one tensorstore context per store,
small blobs (the manifest, the writer lease), listing and deleting, and storage errors
reported as a ``CheckpointError`` naming the URL with a short cause.

Object-store I/O fails, never hangs: ``JAXCKPT_IO_TIMEOUT_S`` (default 60) bounds how
long a wait for the store may go without an answer, and sizes tensorstore's retries
(``s3_request_retries`` / ``gcs_request_retries``, in the store's context) to give up
well within it (docs/storage.md, "Failing, never hanging"). Nothing here writes the
environment: curl's timeouts are process-wide in tensorstore (see ``bounds.http_timeouts``).

On S3, listing one level and deleting a tree go through boto3 when it is installed
(``s3``, this wing's side channel; tensorstore otherwise). Array data goes through
``zarr`` (tensorstore) and ``chunkfiles`` (direct local chunk files); locations are
resolved by ``location``; I/O is counted by the wing's ``__init__`` (``_storage``).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import tensorstore as ts

from .. import _storage
from .._errors import CheckpointError
from .._manifest import MANIFEST
from .bounds import IO_TIMEOUT_ENV, io_timeout_s, request_retries
from .location import Location

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
    """What decides which context a location uses: the kvstore spec without its
    ``path``, the context resources it needs, and the I/O bound (object stores)."""
    spec = root.kvstore
    spec.pop("path", None)
    bound = io_timeout_s() if spec.get("driver") in _RETRIES else None
    return json.dumps([spec, root.context_spec, bound], sort_keys=True, default=str)


def cached(cache: collections.OrderedDict, key: str, make: Any, limit: int,
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
    return cached(_contexts, _store_identity(root), lambda: _new_context(root), _MAX_CONTEXTS,
                   keep=lambda key: json.loads(key)[0].get("driver") == "memory")


def _new_context(root: Location) -> ts.Context:
    resources = root.context_spec
    driver = root.kvstore.get("driver")
    bound = io_timeout_s()
    if driver in _RETRIES and bound is not None:
        resources.setdefault(_RETRIES[driver], request_retries(bound))
    return ts.Context(resources)


def _kvstore(root: Location) -> ts.KvStore:
    key = json.dumps([root.kvstore, _store_identity(root)], sort_keys=True, default=str)
    return cached(_kvstores, key,
                   lambda: wait(ts.KvStore.open(root.kvstore, context=context(root)), root, "opening", ""),
                   _MAX_KVSTORES)


# --- bounded waits ----------------------------------------------------------------

# The context resource holding each object store's retry policy.
_RETRIES = {"s3": "s3_request_retries", "gcs": "gcs_request_retries"}


# Monotonic time of the last answer (a result or an error) to a storage request of this
# process. A wait fails once neither its own request nor any other was answered for the
# bound. After one gave up, the store counts as silent until it answers again: later
# waits get only ``_grace_s`` for their own request, so one dead store does not cost the
# bound once per request.
_last_answer = time.monotonic()
_silent_since: float | None = None  # ``_last_answer`` when a wait last gave up
# A big request gets this much more time per byte (1 s per 8 MiB): a whole-shard chunk
# of GiBs may take minutes on a slow link. A stalled one is dropped sooner by curl's
# low-speed limit, where set (see ``bounds.http_timeouts``), and retried within tensorstore's budget.
SECONDS_PER_BYTE = 1 / (8 << 20)
# Per object store (``s3://bucket``): when a request there first failed for want of the
# store (no answer, no connection) since one last succeeded. The clean-up after a failure
# (``cleaning_up``: a failed save's abort, a manager's close) shares one bound from that
# moment, however many requests it makes; a request past it is not waited for at all.
_failed_at: dict[str, float] = {}
_cleaning = threading.local()
# How ``wait``, boto3, tensorstore and curl word a store that cannot be reached
_UNREACHABLE = re.compile(r"no answer from the store|UNAVAILABLE|DEADLINE_EXCEEDED|ABORTED|CURL error|connect", re.I)


def _grace_s(bound: float) -> float:
    return min(bound, max(1.0, bound / 20))


def _answered(future: Any = None) -> None:
    global _last_answer
    if future is None or not future.cancelled():  # a cancelled request was not answered
        _last_answer = time.monotonic()


def track(future: Any) -> Any:
    """Count ``future``'s completion as an answer from the store; returns it."""
    future.add_done_callback(_answered)
    return future


def no_answer(seconds: float, nbytes: int = 0) -> str:
    """The cause of a wait for the store that the I/O bound ended: ``no answer from the
    store in N s (JAXCKPT_IO_TIMEOUT_S=B)`` (``nbytes``: the bound grew with the request)."""
    more = ", + 1 s per 8 MiB of the request" if nbytes else ""
    return f"no answer from the store in {seconds:.3g} s ({IO_TIMEOUT_ENV}={io_timeout_s() or 0:g}{more})"


def _store_of(url: str) -> str | None:
    """The object store a URL is in (``s3://bucket``); ``None`` for a local path."""
    scheme, sep, rest = str(url).partition("://")
    if not sep or scheme in ("file", "memory"):
        return None
    return f"{scheme}://{rest.split('/', 1)[0]}"


def note_failure(url: str, cause: Any) -> None:
    """Record that a request to ``url``'s store failed, when ``cause`` says the store could
    not be reached or did not answer (the first such failure since a request succeeded)."""
    store = _store_of(url)
    if store is not None and _UNREACHABLE.search(str(cause)):
        _failed_at.setdefault(store, time.monotonic())


def note_success(url: str) -> None:
    """A request to ``url``'s store succeeded: it answers again."""
    if _failed_at:  # (works out the store only while one is counted as failed)
        _failed_at.pop(_store_of(url) or "", None)


@contextlib.contextmanager
def cleaning_up() -> Iterator[None]:
    """The requests of this thread inside are clean-up after a failure: on a store that
    failed (``note_failure``) they all end within one ``io_timeout_s()`` of its first
    failure, and one made after that is not waited for (``CheckpointError``)."""
    before = getattr(_cleaning, "on", False)
    _cleaning.on = True
    try:
        yield
    finally:
        _cleaning.on = before


@contextlib.contextmanager
def until(stop: threading.Event) -> Iterator[None]:
    """The waits of this thread inside end, their requests cancelled, soon (``STOP_POLL_S``)
    after ``stop`` is set: a background thread's request (a lease renewal) never holds up,
    or outlives, the close that stops it."""
    before = getattr(_cleaning, "stop", None)
    _cleaning.stop = stop
    try:
        yield
    finally:
        _cleaning.stop = before


STOP_POLL_S = 0.1


def cleanup_wait(url: str) -> float | None:
    """How long a request of the clean-up of ``url``'s store (``cleaning_up``) may wait
    now: ``_grace_s``, or what is left of one bound since the store failed if less;
    ``None`` when it has not failed (or waits are not bounded)."""
    bound = io_timeout_s()
    failed = _failed_at.get(_store_of(url) or "")
    if bound is None or failed is None:
        return None
    return max(0.0, min(_grace_s(bound), failed + bound - time.monotonic()))


def check_cleanup(root: Any, doing: str, key: str) -> None:
    """Raise, without a request, when this thread cleans up (``cleaning_up``) after
    ``root``'s store failed and the clean-up's bound is spent (for requests no ``wait``
    bounds: boto3's)."""
    if getattr(_cleaning, "on", False) and cleanup_wait(root.url) == 0:
        raise storage_error(root, doing, key, _cleanup_spent(root.url))


def _cleanup_spent(url: str, waited: float | None = None) -> str:
    """Why a clean-up's request ended: not made, or not answered in its share of the
    clean-up's bound (``cleaning_up``)."""
    since = time.monotonic() - _failed_at.get(_store_of(url) or "", time.monotonic())
    bound = io_timeout_s() or 0.0
    head = "not tried" if waited is None else f"no answer from the store in {waited:.3g} s"
    return (f"{head}: the store failed {since:.3g} s ago and has not answered since (the clean-up after a "
            f"failure gets {_grace_s(bound):.3g} s a request, one {IO_TIMEOUT_ENV}={bound:g} in all)")


def wait(future: Any, root: Any, doing: str, key: str, issued: float | None = None, nbytes: int = 0) -> Any:
    """``future.result()``, with its error a ``CheckpointError`` naming the URL (``root``:
    anything with a ``url``); and one when, for ``io_timeout_s()`` seconds (plus 1 s per
    8 MiB of ``nbytes``) since ``issued`` (default: now), the store answered no request of
    this process. The abandoned request is cancelled. Within ``cleaning_up``, after the
    store failed, it gets ``cleanup_wait`` at most."""
    global _silent_since
    bound = io_timeout_s()
    now = time.monotonic()
    start = now if issued is None else issued
    allowed = None if bound is None else bound + nbytes * SECONDS_PER_BYTE
    cause = no_answer(allowed or 0, nbytes)
    if allowed is not None and _silent_since is not None and _silent_since == _last_answer:
        start, allowed = now, _grace_s(bound)  # still silent since a wait gave up
        cause = (f"no answer from the store in {allowed:.3g} s ({IO_TIMEOUT_ENV}={bound:g}: a store that "
                 f"stopped answering gets {allowed:.3g} s a request)")
    stop = getattr(_cleaning, "stop", None)  # (``until``)
    deadline = None  # the clean-up's, after the store failed: whatever else answers meanwhile
    if getattr(_cleaning, "on", False) and bound is not None:
        left = cleanup_wait(root.url)
        if left == 0:
            future.cancel()
            raise storage_error(root, doing, key, _cleanup_spent(root.url))
        deadline = None if left is None else now + left
    while True:
        remaining = None if allowed is None else max(_last_answer, start) + allowed - time.monotonic()
        if deadline is not None and deadline - time.monotonic() < remaining:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                future.cancel()
                raise storage_error(root, doing, key, _cleanup_spent(root.url, time.monotonic() - now))
        if remaining is not None and remaining <= 0:
            _silent_since = _last_answer
            future.cancel()
            note_failure(root.url, cause)
            raise storage_error(root, doing, key, cause)
        if stop is not None:
            if stop.is_set():
                future.cancel()
                raise storage_error(root, doing, key, "given up: it was stopped while waiting for the store")
            remaining = STOP_POLL_S if remaining is None else min(remaining, STOP_POLL_S)
        try:
            result = future.result(timeout=remaining)
        except TimeoutError:
            if not future.done():
                continue  # others may have been answered meanwhile (or stopped): look again
            result = call(root, doing, key, future.result)
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - tensorstore reports I/O errors as ValueError and others
            note_failure(root.url, e)
            raise storage_error(root, doing, key, e) from None
        note_success(root.url)
        return result


# --- storage errors -------------------------------------------------------------------

_XML_FIELD = re.compile(r"<(Code|Message)>(.*?)</\1>", re.S)
# tensorstore appends payloads like [http_response_body='<?xml ...'] [http_response_code='404']
_PAYLOAD = re.compile(r"\s*(\[[A-Za-z0-9_. -]+='|<\?xml|<Error>)")


def storage_cause(error: BaseException | str) -> str:
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
    if len(head) > 500:  # long paths in the middle (several data objects): the cause is at the end
        head = head[:240] + " … " + head[-240:]
    return head or type(error).__name__


def storage_error(root: Any, doing: str, key: str, error: BaseException | str) -> CheckpointError:
    what = f"'{key}' in '{root.url}'" if key else f"'{root.url}'"
    return CheckpointError(f"{doing.capitalize()} {what} failed: {storage_cause(error)}")


def call(root: Any, doing: str, key: str, fn: Any) -> Any:
    """``fn()``, with a tensorstore error turned into a ``CheckpointError`` naming the URL."""
    try:
        return fn()
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - tensorstore reports I/O errors as ValueError and others
        note_failure(root.url, e)
        raise storage_error(root, doing, key, e) from None


# --- small blobs (the manifest) -----------------------------------------------------


def write_blob(root: Location, key: str, data: bytes, *, fault: str | None = None) -> None:
    """Write a small blob whole (one PUT; locally: write, fsync, rename). ``fault``: a
    fault point (``_storage.fault``) met once half of a local blob's bytes are written."""
    if root.local is not None:
        # Write, fsync, then rename: the blob appears whole or not at all.
        path = os.path.join(root.local, key)
        tmp = path + ".writing"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            try:
                view = memoryview(data)
                _write_all(fd, view[:len(view) // 2])
                if fault is not None:
                    _storage.fault(fault, key)
                _write_all(fd, view[len(view) // 2:])
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            _remove_quietly(tmp)  # no half-written leftover (a full disk, a read-only one)
            raise
        fsync_dir(root.local)
        return
    kv = _kvstore(root)
    wait(track(kv.write(key, data)), root, "writing", key)


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        view = view[os.write(fd, view):]


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def read_blob(root: Location, key: str) -> bytes | None:
    """The blob's bytes, or ``None`` when it does not exist."""
    if root.local is not None:
        try:
            with open(os.path.join(root.local, key), "rb") as f:
                return f.read()
        except (FileNotFoundError, NotADirectoryError):
            return None
    kv = _kvstore(root)
    result = wait(track(kv.read(key)), root, "reading", key)
    if result.state == "value":
        return bytes(result.value)
    if root.kvstore["driver"] in ("s3", "gcs"):
        # Object stores answer a read from a missing bucket like one of a missing object
        # (404, which tensorstore reports as "no value"). A listing of just this key tells
        # them apart: it fails for a missing bucket. One request, on a miss only.
        wait(track(kv.list(ts.KvStore.KeyRange(key, key + "\x00"))), root, "reading", key)
    return None


def delete_blob(root: Location, key: str) -> None:
    if root.local is not None:
        try:
            os.remove(os.path.join(root.local, key))
        except FileNotFoundError:
            pass
        return
    kv = _kvstore(root)
    wait(track(kv.delete_range(ts.KvStore.KeyRange(key, key + "\x00"))), root, "deleting", key)


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
        from . import s3 as _s3  # boto3's side channel: only for an S3 location

        names = _s3.children(root)
        if names is not None:
            return names
    kv = _kvstore(root)
    names = set()
    for key in wait(track(kv.list()), root, "listing", ""):
        k = key.decode() if isinstance(key, bytes) else key
        names.add(k.split("/", 1)[0])
    return sorted(names)


def walk(root: Location, visit: Any) -> None:
    """Every key below ``root`` (an object store), relative to it, handed to ``visit``:
    on S3 with boto3 page by page (1,000 keys a request), else tensorstore's one listing
    of every key."""
    if root.kvstore["driver"] == "s3":
        from . import s3 as _s3

        if _s3.walk(root, visit):
            return
    kv = _kvstore(root)
    for key in wait(track(kv.list()), root, "listing", ""):
        visit(key.decode() if isinstance(key, bytes) else key)


def delete_tree(root: Location) -> None:
    """Delete everything under ``root``.

    Locally a checkpoint's manifest goes first, so that a tree deleted halfway (a crash,
    a file that will not go) is never one that validates; fault point ``delete:middle``
    (key: the path) is between the two."""
    if root.local is not None:
        import shutil

        if not os.path.islink(root.local):  # (rmtree leaves a link, and what it points to, alone)
            try:
                os.remove(os.path.join(root.local, MANIFEST))
            except OSError:  # none (not a checkpoint, or not yet), or not a directory at all
                pass
            else:
                _storage.fault("delete:middle", root.local)
        shutil.rmtree(root.local, ignore_errors=True)
        return
    if root.kvstore["driver"] == "s3":
        from . import s3 as _s3  # boto3's side channel: only for an S3 location

        check_cleanup(root, "deleting", "")  # (boto3's requests are bounded by its own timeouts)
        if _s3.delete_batched(root):
            return
    kv = _kvstore(root)
    wait(track(kv.delete_range(ts.KvStore.KeyRange())), root, "deleting", "")


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
