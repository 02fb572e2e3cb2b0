"""GCS beside tensorstore: a large object written as a parallel composite upload
(``ObjectUpload``: format 3's data objects).

tensorstore's gcs kvstore writes a value with one upload and has no compose, so a large
object goes up the way ``gcloud storage``'s parallel composite uploads do: each part is
its own temporary object ``<name>.part<i>`` beside the object (same attempt prefix),
written through tensorstore's ``write`` from any thread; ``complete`` then asks GCS to
``compose`` them into the object (JSON API ``POST .../o/<name>/compose``, at most
``COMPOSE_SOURCES`` sources a request: more are composed in rounds, through temporary
objects ``<name>.compose<r>.<j>``), checks the composed object's size and crc32c against
what was sent, and deletes the temporary objects (in parallel). ``abort`` deletes the
temporary objects written so far (best effort); those of a process that crashed lie
under its attempt's data prefix, which the clean-up of dead attempts deletes whole.

The compose request is ours (``urllib``): sent to ``TENSORSTORE_GCS_HTTP_URL`` (what
tensorstore uses; default ``https://storage.googleapis.com``) with the token
``GOOGLE_AUTH_TOKEN_FOR_TESTING`` when set (tensorstore's first auth step too), else
google-auth's default credentials (the ``gcs`` extra: ``pip install jaxckpt[gcs]``).
Without either, ``composing`` is false and the caller writes each object whole (one
upload). Every request is bounded (``bounds.io_timeout_s``) and retried within the
bound when GCS says so (408, 429, 5xx) or the connection fails; a failure is a
``CheckpointError`` naming the object's URL.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

import crc32c

from .._errors import CheckpointError
from . import kvstore as _kvstore
from .bounds import DEFAULT_IO_TIMEOUT_S, IO_TIMEOUT_ENV, io_timeout_s
from .location import Location

_log = logging.getLogger("jaxckpt")

URL_ENV = "TENSORSTORE_GCS_HTTP_URL"
DEFAULT_URL = "https://storage.googleapis.com"
TOKEN_ENV = "GOOGLE_AUTH_TOKEN_FOR_TESTING"
SCOPE = "https://www.googleapis.com/auth/devstorage.read_write"
# GCS composes at most 32 sources a request; more go in rounds.
COMPOSE_SOURCES = 32
# The smallest part (a floor for tests that lower ``uploads.PART_BYTES``), and the most
# parts of an object (two rounds of composes at most).
MIN_PART_BYTES = 256 << 10
MAX_PARTS = COMPOSE_SOURCES * COMPOSE_SOURCES
ATTEMPTS = 3  # of a compose request, within the bound


def part_bytes_for(size: int, wanted: int) -> int:
    """The part size for an object of ``size`` bytes: ``wanted``, raised to
    ``MIN_PART_BYTES`` and to what keeps it within ``MAX_PARTS`` parts."""
    return max(wanted, MIN_PART_BYTES, -(-size // MAX_PARTS))


# --- credentials ----------------------------------------------------------------------

_lock = threading.Lock()
_found: list[Any] = []  # [google-auth credentials, or None], once looked for


def _google_credentials() -> Any:
    """google-auth's default credentials (looked for once per process), or ``None``
    without google-auth or credentials it can find."""
    with _lock:
        if not _found:
            try:
                import google.auth
                import google.auth.exceptions
            except ImportError:
                _found.append(None)
                return None
            try:
                _found.append(google.auth.default(scopes=[SCOPE])[0])
            except google.auth.exceptions.GoogleAuthError as e:
                _log.info("jaxckpt: no Google credentials (%s): GCS data objects go up whole", e)
                _found.append(None)
        return _found[0]


def composing(root: Location) -> bool:
    """Whether objects under ``root`` go up as composed parts: a GCS location, and a
    token for the compose request (``TOKEN_ENV``, or google-auth's credentials)."""
    if root.kvstore.get("driver") != "gcs":
        return False
    return bool(os.environ.get(TOKEN_ENV)) or _google_credentials() is not None


def _token(bound: float) -> str:
    fixed = os.environ.get(TOKEN_ENV)
    if fixed:
        return fixed
    credentials = _google_credentials()
    if credentials is None:
        raise CheckpointError("composing a GCS object needs google-auth and credentials it can find "
                              "(pip install jaxckpt[gcs])")
    with _lock:
        if not credentials.valid:
            import google.auth.transport.requests

            request = google.auth.transport.requests.Request()
            credentials.refresh(lambda *a, **kw: request(*a, **{**kw, "timeout": bound}))
        return credentials.token


# --- crc32c of a concatenation ---------------------------------------------------------

_POLY = 0x82F63B78  # Castagnoli, reflected


def _multmodp(a: int, b: int) -> int:
    """``a * b`` modulo the CRC polynomial (reflected bit order; ``a`` nonzero)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


_X2N = [1 << 30]  # x^(2^k) modulo the polynomial
for _ in range(31):
    _X2N.append(_multmodp(_X2N[-1], _X2N[-1]))


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """The crc32c of ``a + b`` from ``crc1 = crc32c(a)``, ``crc2 = crc32c(b)`` and
    ``len2 = len(b)`` (zlib's ``crc32_combine``, for the Castagnoli polynomial)."""
    p, k, n = 1 << 31, 3, len2
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return _multmodp(p, crc1) ^ crc2


# --- the JSON API ------------------------------------------------------------------------


def _bound(nbytes: int = 0) -> float:
    return (io_timeout_s() or DEFAULT_IO_TIMEOUT_S) + nbytes * _kvstore.SECONDS_PER_BYTE


def _post(path: str, body: dict[str, Any], doing: str, bound: float) -> dict[str, Any]:
    """POST ``body`` (JSON) to ``path`` of the JSON API, within ``bound`` seconds all
    told; the answer's JSON. Retried (``ATTEMPTS`` in all) on 408, 429, 5xx and a failed
    connection; a ``CheckpointError`` starting with ``doing`` otherwise."""
    url = os.environ.get(URL_ENV, DEFAULT_URL).rstrip("/") + path
    data = json.dumps(body).encode()
    deadline = time.monotonic() + bound
    cause = "not sent"
    for attempt in range(ATTEMPTS):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        headers = {"Authorization": f"Bearer {_token(remaining)}", "Content-Type": "application/json"}
        request = urllib.request.Request(url, data=data, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=remaining) as answer:
                return json.loads(answer.read() or b"{}")
        except urllib.error.HTTPError as e:
            cause = f"HTTP {e.code}: {_message(e)}"
            if e.code not in (408, 429) and e.code < 500:
                break
        except TimeoutError:
            cause = _no_answer(bound)
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            cause = _no_answer(bound) if isinstance(reason, TimeoutError) else str(reason)
        if attempt + 1 < ATTEMPTS:
            time.sleep(min(0.2 * 4 ** attempt, max(0.0, deadline - time.monotonic())))
    raise CheckpointError(f"{doing} failed: {cause}")


def _no_answer(bound: float) -> str:
    setting = io_timeout_s()
    return f"no answer from the store in {bound:.3g} s ({IO_TIMEOUT_ENV}={setting or 0:g})"


def _message(error: urllib.error.HTTPError) -> str:
    """The error's message from GCS's JSON body (``{"error": {"message": ...}}``), or its reason."""
    try:
        return str(json.loads(error.read())["error"]["message"])
    except Exception:  # noqa: BLE001 - not GCS's JSON error: the HTTP reason then
        return str(error.reason)


# --- one object in composed parts --------------------------------------------------------


class ObjectUpload:
    """One object on GCS, written whole (``put``) or as parts (``part`` from any thread,
    in any order, then ``complete``; ``abort`` on failure): the interface of
    ``s3.ObjectUpload``. See the module docstring."""

    def __init__(self, root: Location, name: str):
        self.root, self.name = root, name
        self.url = f"{root.url}/{name}"
        spec = root.kvstore
        self.bucket, self.key = spec["bucket"], spec.get("path", "") + name
        self.aborted = False  # then no part is written
        self._lock = threading.Lock()
        self._parts: dict[int, tuple[int, int]] = {}  # number -> (crc32c, bytes)
        self._written: list[str] = []  # temporary objects begun: parts and intermediates

    def part_name(self, number: int) -> str:
        return f"{self.name}.part{number}"

    def _write(self, name: str, data: Any) -> None:
        kv = _kvstore._kvstore(self.root)
        _kvstore.wait(_kvstore.track(kv.write(name, data)), self.root, "writing", name, nbytes=len(data))

    def put(self, data: Any) -> None:
        """The whole object in one upload."""
        self._write(self.name, data)

    def part(self, number: int, data: Any) -> None:
        """Write part ``number`` (1-based) as the object ``<name>.part<number>``."""
        name = self.part_name(number)
        with self._lock:
            if self.aborted:
                raise CheckpointError(f"Writing '{self.url}' failed: its upload was aborted")
            self._written.append(name)
        crc = crc32c.crc32c(data)
        self._write(name, data)
        with self._lock:
            self._parts[number] = (crc, len(data))

    def complete(self, parts: int) -> None:
        """Compose parts 1..``parts`` (every one written) into the object, check its size
        and crc32c, and delete the parts."""
        with self._lock:
            got = dict(self._parts)
        if sorted(got) != list(range(1, parts + 1)):
            raise CheckpointError(f"Writing '{self.url}' failed: {len(got)} of its {parts} parts were written")
        crc, size = got[1]
        for number in range(2, parts + 1):
            crc = crc32c_combine(crc, got[number][0], got[number][1])
            size += got[number][1]
        made = self._compose_all([self.part_name(n) for n in range(1, parts + 1)], size)
        stored = made.get("crc32c")
        want = base64.b64encode(crc.to_bytes(4, "big")).decode()
        if int(made.get("size", -1)) != size or stored != want:
            raise CheckpointError(f"Writing '{self.url}' failed: the composed object has {made.get('size')} bytes "
                                  f"and crc32c {stored}, its parts {size} bytes and crc32c {want}")
        self._delete_written(raising=True)

    def _compose_all(self, names: list[str], size: int) -> dict[str, Any]:
        """Compose ``names`` (in order) into the object, ``COMPOSE_SOURCES`` at a time in
        rounds through intermediate objects; the final answer (the object's metadata)."""
        rounds = 0
        while len(names) > COMPOSE_SOURCES:
            groups = [names[i:i + COMPOSE_SOURCES] for i in range(0, len(names), COMPOSE_SOURCES)]
            names = []
            for j, group in enumerate(groups):
                names.append(f"{self.name}.compose{rounds}.{j}")
                with self._lock:
                    self._written.append(names[-1])
                self._compose(group, names[-1], size // len(groups))
            rounds += 1
        return self._compose(names, self.name, size)

    def _compose(self, sources: list[str], dest: str, nbytes: int) -> dict[str, Any]:
        prefix = self.root.kvstore.get("path", "")
        path = (f"/storage/v1/b/{urllib.parse.quote(self.bucket, safe='')}/o/"
                f"{urllib.parse.quote(prefix + dest, safe='')}/compose")
        body = {"sourceObjects": [{"name": prefix + s} for s in sources],
                "destination": {"contentType": "application/octet-stream"}}
        return _post(path, body, f"Writing '{self.root.url}/{dest}' (composing {len(sources)} parts)",
                     _bound(nbytes))

    def _delete_written(self, raising: bool) -> None:
        """Delete every temporary object begun (in parallel, each wait bounded)."""
        with self._lock:
            names, self._written = self._written, []
        kv = _kvstore._kvstore(self.root)
        futures = [(name, _kvstore.track(kv.write(name, None))) for name in names]
        failed = None
        for name, future in futures:
            try:
                _kvstore.wait(future, self.root, "deleting", name)
            except CheckpointError as e:
                failed = failed or e
        if failed is not None and raising:
            raise failed
        if failed is not None:
            _log.warning("jaxckpt: %s (it lies under the attempt's data prefix, deleted with it)", failed)

    def abort(self) -> None:
        """Delete the temporary objects written so far (best effort)."""
        with self._lock:
            self.aborted = True
        self._delete_written(raising=False)
