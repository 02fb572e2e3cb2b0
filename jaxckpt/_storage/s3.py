"""S3 through boto3, beside tensorstore: one level listed with a delimiter, a prefix
listed with sizes, a tree deleted 1,000 keys a request (tensorstore lists every key
under a prefix and deletes object by object), and large objects written in parts
(``ObjectUpload``: tensorstore's s3 kvstore writes a value with one PUT; format 3's
data objects go up as multipart uploads). Optional: without boto3 (``pip install jaxckpt[s3]``) or without
credentials boto3 can find, each function says so (``None``/``False``) and ``kvstore``
goes through tensorstore instead.

The client uses the location's endpoint, region and credentials, as tensorstore does
there, with timeouts and retries within the I/O bound (``bounds.io_timeout_s``).
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import threading
import time
from typing import Any

from .. import _storage
from .._errors import CheckpointError
from . import kvstore as _kvstore
from .bounds import DEFAULT_IO_TIMEOUT_S, IO_TIMEOUT_ENV, io_timeout_s
from .location import Location

_log = logging.getLogger("jaxckpt")


def attempts() -> tuple[int, float]:
    """How boto3 gives up on a store that does not answer: the attempts a request gets,
    and the seconds each may go without an answer (its connect and read timeouts), so
    that all of them take about half the I/O bound."""
    bound = io_timeout_s() or DEFAULT_IO_TIMEOUT_S
    return 3, max(1.0, bound / 6)


def no_answer(seconds: float) -> str:
    """The cause of a request boto3 gave up on after ``seconds`` without an answer, naming
    the bound that fired: ``no answer from the store in N s (3 attempts of T s each,
    boto3's timeouts for JAXCKPT_IO_TIMEOUT_S=B)``."""
    bound = io_timeout_s()
    tries, each = attempts()
    setting = f"{IO_TIMEOUT_ENV}={bound:g}" if bound is not None else \
        f"{IO_TIMEOUT_ENV}=0, whose requests keep the default {DEFAULT_IO_TIMEOUT_S:g} s"
    return f"no answer from the store in {seconds:.3g} s ({tries} attempts of {each:g} s each, boto3's timeouts for {setting})"


def _failed(doing: str, root: Location, error: Exception, started: float) -> CheckpointError:
    """``<doing> '<url>' failed: <cause>``: a refusal's code and message, or why boto3 gave up."""
    import botocore.exceptions

    if isinstance(error, botocore.exceptions.ClientError):
        err = error.response.get("Error", {})
        return CheckpointError(f"{doing} '{root.url}' failed: {err.get('Code', '?')}: {err.get('Message', '')}")
    cause = _cause(error, started)
    _kvstore.note_failure(root.url, cause)
    return CheckpointError(f"{doing} '{root.url}' failed: {cause}")


def _cause(error: Exception, started: float) -> str:
    """A botocore error (not a ``ClientError``) as a short cause. A request boto3 gave up
    on because the store did not answer (its connect or read timeout, after its retries:
    within the I/O bound, ``new_client``; or a body the store stopped taking) reads as
    ``no_answer``, the time since ``started``; anything else (an unreachable endpoint,
    missing credentials) as botocore says it."""
    import botocore.exceptions as bx

    timed_out = isinstance(error, (bx.ReadTimeoutError, bx.ConnectTimeoutError))
    if isinstance(error, bx.ConnectionClosedError):  # urllib3: ProtocolError('...', TimeoutError())
        inner = getattr(error, "kwargs", {}).get("error")
        timed_out = any(isinstance(a, TimeoutError) for a in getattr(inner, "args", ()))
    return no_answer(time.monotonic() - started) if timed_out else str(error)


def children(root: Location) -> list[str] | None:
    """One level below ``root`` on S3 through boto3 (``Delimiter="/"``), or ``None`` when
    boto3 is missing or has no credentials (the caller falls back to tensorstore). The
    client uses the location's endpoint, region and credentials, within the I/O bound."""
    try:
        import botocore.exceptions
    except ImportError:
        return None
    spec = root.kvstore
    prefix = spec.get("path", "")
    names: set[str] = set()
    started = time.monotonic()
    try:
        client = client_for(root)
        if client is None:
            return None
        pages = client.get_paginator("list_objects_v2").paginate(
            Bucket=spec["bucket"], Prefix=prefix, Delimiter="/")
        for page in pages:
            names.update(p["Prefix"][len(prefix):].rstrip("/") for p in page.get("CommonPrefixes", []))
            names.update(o["Key"][len(prefix):] for o in page.get("Contents", []))
    except botocore.exceptions.ClientError as e:
        err = e.response.get("Error", {})
        cause = f"{err.get('Code', '?')}: {err.get('Message', '')}".rstrip(": ")
        raise CheckpointError(f"Listing '{root.url}' failed: {cause}") from None
    except (botocore.exceptions.NoCredentialsError, botocore.exceptions.NoRegionError,
            botocore.exceptions.ProfileNotFound):
        return None
    except botocore.exceptions.BotoCoreError as e:  # unreachable, timed out, ...
        raise _failed("Listing", root, e, started) from None
    return sorted(n for n in names if n)


def walk(root: Location, visit: Any) -> bool:
    """Every key below ``root`` on S3 through boto3, relative to it, handed to
    ``visit`` page by page (1,000 keys a request, none kept here); ``False`` when boto3
    is missing or has no credentials (nothing visited)."""
    try:
        import botocore.exceptions
    except ImportError:
        return False
    spec = root.kvstore
    prefix = spec.get("path", "")
    started = time.monotonic()
    try:
        client = client_for(root)
        if client is None:
            return False
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=spec["bucket"], Prefix=prefix):
            for o in page.get("Contents", []):
                visit(o["Key"][len(prefix):])
    except botocore.exceptions.ClientError as e:
        err = e.response.get("Error", {})
        cause = f"{err.get('Code', '?')}: {err.get('Message', '')}".rstrip(": ")
        raise CheckpointError(f"Listing '{root.url}' failed: {cause}") from None
    except (botocore.exceptions.NoCredentialsError, botocore.exceptions.NoRegionError,
            botocore.exceptions.ProfileNotFound):
        return False
    except botocore.exceptions.BotoCoreError as e:
        raise _failed("Listing", root, e, started) from None
    return True


# The environment a client's credentials come from: a change to it makes a new client.
ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
       "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE")
MAX_CLIENTS = 64  # least recently used goes first, as with kvstore handles
_clients: collections.OrderedDict[str, Any] = collections.OrderedDict()


def client_for(root: Location) -> Any:
    """A boto3 S3 client for ``root``'s store, made once per store and settings (making
    one costs ~0.1 s: discovery and cleaning list many prefixes) and shared by threads."""
    spec = root.kvstore
    spec.pop("path", None)
    key = json.dumps([spec, root.context_spec, io_timeout_s(), [os.environ.get(v) for v in ENV]],
                     sort_keys=True, default=str)
    return _kvstore.cached(_clients, key, lambda: new_client(root), MAX_CLIENTS)


def new_client(root: Location) -> Any:
    """A boto3 S3 client for ``root``: the endpoint, region and credentials tensorstore
    uses there (``None`` without boto3), with timeouts and retries within the bound."""
    try:
        import boto3
        import botocore
        import botocore.config
        import botocore.session
    except ImportError:
        return None
    spec = root.kvstore
    tries, step = attempts()  # each timing out once: about half the bound
    options: dict[str, Any] = {"connect_timeout": step, "read_timeout": step,
                               "retries": {"total_max_attempts": tries, "mode": "standard"}}
    given = spec.get("context") if isinstance(spec.get("context"), dict) else {}
    credentials = spec.get("aws_credentials") or given.get("aws_credentials") \
        or root.context_spec.get("aws_credentials") or {}
    kind = credentials.get("type") if isinstance(credentials, dict) else None
    kwargs: dict[str, Any] = {}
    session = botocore.session.Session()
    if kind == "anonymous":
        options["signature_version"] = botocore.UNSIGNED
    elif kind == "environment":
        kwargs.update(aws_access_key_id=os.environ.get("AWS_ACCESS_KEY_ID"),
                      aws_secret_access_key=os.environ.get("AWS_SECRET_ACCESS_KEY"),
                      aws_session_token=os.environ.get("AWS_SESSION_TOKEN") or None)
    elif kind in ("profile", "default"):
        for name, value in (("profile", credentials.get("profile")),
                            ("credentials_file", credentials.get("credentials_file")),
                            ("config_file", credentials.get("config_file"))):
            if value and not (name == "profile" and value == "default"):
                session.set_config_variable(name, value)
    if spec.get("endpoint"):
        kwargs["endpoint_url"] = spec["endpoint"]
    if spec.get("aws_region"):
        kwargs["region_name"] = spec["aws_region"]
    config = botocore.config.Config(**options)
    return boto3.session.Session(botocore_session=session).client("s3", config=config, **kwargs)


def delete_batched(root: Location) -> bool:
    """Delete everything under ``root`` on S3 with DeleteObjects, 1,000 keys a request
    (tensorstore deletes object by object). ``False`` when boto3 is not there."""
    try:
        import botocore.exceptions
    except ImportError:
        return False
    spec = root.kvstore
    started = time.monotonic()
    try:
        client = client_for(root)
        if client is None:
            return False
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=spec["bucket"], Prefix=spec.get("path", ""))
        for page in pages:
            batch = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if batch:  # a page holds at most 1,000 keys: one request each
                out = client.delete_objects(Bucket=spec["bucket"], Delete={"Objects": batch, "Quiet": True})
                if out.get("Errors"):
                    err = out["Errors"][0]
                    raise CheckpointError(f"Deleting '{root.url}' failed: {err.get('Code')}: {err.get('Message')}")
    except (botocore.exceptions.NoCredentialsError, botocore.exceptions.NoRegionError,
            botocore.exceptions.ProfileNotFound):
        return False
    except (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError) as e:
        raise _failed("Deleting", root, e, started) from None
    return True


# --- large objects in parts (format 3's data objects) -----------------------------------

# S3's smallest part, for every part of a multipart upload but the last; and its most
# parts per upload. (tensorstore's s3 kvstore writes every value with one PUT: it has no
# multipart upload, so format 3's large objects go up through boto3 here.)
MIN_PART_BYTES = 5 << 20
MAX_PARTS = 10_000


def part_bytes_for(size: int, wanted: int) -> int:
    """The part size for an object of ``size`` bytes: ``wanted``, raised to S3's minimum
    and to what keeps the upload within ``MAX_PARTS`` parts."""
    return max(wanted, MIN_PART_BYTES, -(-size // MAX_PARTS))


class ObjectUpload:
    """One object on S3, written whole (``put``) or as a multipart upload (``part`` from
    any thread, in any order, then ``complete``; ``abort`` on failure). Every request goes
    through the store's boto3 client (``client_for``: timeouts and retries within the I/O
    bound); a failure is a ``CheckpointError`` naming the object's URL."""

    def __init__(self, root: Location, name: str):
        self.root, self.name = root, name
        self.url = f"{root.url}/{name}"
        spec = root.kvstore
        self.bucket, self.key = spec["bucket"], spec.get("path", "") + name
        self.client = client_for(root)
        if self.client is None:
            raise CheckpointError(f"Writing '{self.url}' needs boto3 and credentials it can find "
                                  "(pip install jaxckpt[s3])")
        self.upload_id: str | None = None
        self.etags: dict[int, str] = {}
        self.aborted = False  # then no part starts another upload
        self._lock = threading.Lock()

    def _call(self, doing: str, fn: Any, **kw: Any) -> Any:
        return _request(doing, self.url, fn, Bucket=self.bucket, Key=self.key, **kw)

    def put(self, data: Any) -> None:
        """The whole object in one PUT."""
        self._call("writing", self.client.put_object, Body=data)

    def part(self, number: int, data: Any) -> None:
        """Upload part ``number`` (1-based) of the object; the first part to go starts the
        multipart upload."""
        with self._lock:  # one CreateMultipartUpload, whichever part is first
            if self.aborted:
                raise CheckpointError(f"Writing '{self.url}' failed: its upload was aborted")
            if self.upload_id is None:
                self.upload_id = self._call("starting the upload of", self.client.create_multipart_upload)["UploadId"]
        _storage.fault("upload:part", f"{self.name}#{number}")
        out = self._call("writing a part of", self.client.upload_part, UploadId=self.upload_id,
                         PartNumber=number, Body=data)
        with self._lock:
            self.etags[number] = out["ETag"]

    def complete(self, parts: int) -> None:
        """Assemble parts 1..``parts`` (every one uploaded) into the object."""
        if self.upload_id is None or sorted(self.etags) != list(range(1, parts + 1)):
            raise CheckpointError(f"Writing '{self.url}' failed: {len(self.etags)} of its {parts} parts "
                                  "were uploaded")
        done = [{"PartNumber": n, "ETag": self.etags[n]} for n in range(1, parts + 1)]
        try:
            self._call("completing the upload of", self.client.complete_multipart_upload,
                       UploadId=self.upload_id, MultipartUpload={"Parts": done})
        except CheckpointError:
            if not self._completed(parts):
                raise

    def _completed(self, parts: int) -> bool:
        """Whether the object is there, assembled from exactly our parts: a complete whose
        answer was lost (a timeout: assembling GiBs takes a while) and that boto3 retried
        fails with the upload already gone. The ETag of a multipart object is the MD5 of
        its parts' MD5s, ``-<parts>``."""
        digests = b"".join(bytes.fromhex(self.etags[n].strip('"')) for n in range(1, parts + 1))
        want = f'"{hashlib.md5(digests, usedforsecurity=False).hexdigest()}-{parts}"'
        try:
            return self._call("checking", self.client.head_object).get("ETag") == want
        except CheckpointError:
            return False

    def abort(self) -> None:
        """Drop the parts uploaded so far (best effort: a store that fails here leaves them
        to the bucket's lifecycle rule for incomplete multipart uploads)."""
        with self._lock:
            upload_id, self.upload_id, self.aborted = self.upload_id, None, True
        if upload_id is None:
            return
        try:
            _kvstore.check_cleanup(self, "aborting the upload of", "")
            self._call("aborting the upload of", self.client.abort_multipart_upload, UploadId=upload_id)
        except CheckpointError as e:
            _log.warning("jaxckpt: %s", e)


def sizes(root: Location) -> dict[str, int] | None:
    """Every object under ``root`` on S3 (relative name -> bytes), from one listing per
    1,000 objects; ``None`` without boto3 or credentials it can find."""
    try:
        import botocore.exceptions
    except ImportError:
        return None
    spec = root.kvstore
    prefix = spec.get("path", "")
    out: dict[str, int] = {}
    started = time.monotonic()
    try:
        client = client_for(root)
        if client is None:
            return None
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=spec["bucket"], Prefix=prefix):
            out.update((o["Key"][len(prefix):], int(o["Size"])) for o in page.get("Contents", []))
    except (botocore.exceptions.NoCredentialsError, botocore.exceptions.NoRegionError,
            botocore.exceptions.ProfileNotFound):
        return None
    except (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError) as e:
        raise _failed("Listing", root, e, started) from None
    return out


def _request(doing: str, url: str, fn: Any, **kw: Any) -> Any:
    """``fn(**kw)`` (a boto3 client's request about the object at ``url``); a failure is
    a ``CheckpointError``: ``<Doing> '<url>' failed: <cause>``."""
    import botocore.exceptions

    started = time.monotonic()
    try:
        out = fn(**kw)
    except botocore.exceptions.ClientError as e:
        err = e.response.get("Error", {})
        cause = f"{err.get('Code', '?')}: {err.get('Message', '')}".rstrip(": ")
    except botocore.exceptions.BotoCoreError as e:  # unreachable, timed out, no credentials
        cause = _cause(e, started)
        _kvstore.note_failure(url, cause)
    else:
        _kvstore.note_success(url)
        return out
    raise CheckpointError(f"{doing.capitalize()} '{url}' failed: {cause}") from None


def multipart_uploads(root: Location) -> list[tuple[str, str]] | None:
    """The multipart uploads begun and neither completed nor aborted under ``root`` on
    S3, as ``(name relative to root, upload id)``: one listing per 1,000; ``None``
    without boto3 or credentials it can find (then jaxckpt began none: its uploads in
    parts go through boto3)."""
    try:
        import botocore.exceptions
    except ImportError:
        return None
    spec = root.kvstore
    prefix = spec.get("path", "")
    out: list[tuple[str, str]] = []
    started = time.monotonic()
    try:
        client = client_for(root)
        if client is None:
            return None
        pages = client.get_paginator("list_multipart_uploads").paginate(Bucket=spec["bucket"], Prefix=prefix)
        for page in pages:
            out.extend((u["Key"][len(prefix):], u["UploadId"]) for u in page.get("Uploads", []))
    except (botocore.exceptions.NoCredentialsError, botocore.exceptions.NoRegionError,
            botocore.exceptions.ProfileNotFound):
        return None
    except (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError) as e:
        raise _failed("Listing the uploads under", root, e, started) from None
    return out


def abort_uploads(root: Location, uploads: list[tuple[str, str]]) -> None:
    """Abort the multipart uploads ``(name relative to root, upload id)`` (their parts
    go; S3 bills them until then). One already gone is no error."""
    if not uploads:
        return
    spec = root.kvstore
    client = client_for(root)
    for name, upload_id in uploads:
        try:
            _request("aborting the upload of", f"{root.url}/{name}", client.abort_multipart_upload,
                     Bucket=spec["bucket"], Key=spec.get("path", "") + name, UploadId=upload_id)
        except CheckpointError as e:
            if "NoSuchUpload" not in str(e):
                raise
