"""Format 3's data objects up to S3 and GCS in parallel parts.

S3: multipart uploads through boto3 (the ``s3`` extra; ``s3.ObjectUpload``):
tensorstore's s3 kvstore has no multipart upload (its ``write`` sends a value with one
PUT). GCS: parallel composite uploads (``gcs.ObjectUpload``): each part its own
temporary object written through tensorstore, then one ``compose`` request and the
parts' deletion (tensorstore has no compose; the request is ours). ``parted_object``
picks one for a location, or none (``memory://``, S3 without boto3, GCS without a token
or google-auth's credentials): then each object goes up whole.

``SegmentParts`` uploads each segment of a ``dataobjects.StreamWriter``'s stream in
parts that fill from the entries as they arrive (views, no copy until a part is whole)
and go up at once, ``UPLOAD_THREADS`` in flight; ``upload_file`` puts a local data
object (a copy to the persistent tier) the same way, each part read from the file just
before it goes. Every wait is bounded (``_upload_bound``); a failure aborts the uploads
begun (best effort). See ``dataobjects`` for the stream and its segments.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Iterator
from typing import Any, Union

from .._errors import CheckpointError
from . import dataobjects as _dataobjects
from . import gcs as _gcs
from . import kvstore as _kvstore
from . import s3 as _s3
from .bounds import DEFAULT_IO_TIMEOUT_S, io_timeout_s
from .location import Location

# An upload's part (on S3 raised to its minimum, ``s3.MIN_PART_BYTES``, and to what keeps
# an object within 10,000 parts; on GCS to ``gcs.MIN_PART_BYTES`` and ``gcs.MAX_PARTS``
# parts); an object that fits in one part is one PUT.
PART_BYTES = 64 << 20
# Part uploads in flight at once per stream (or per ``upload_file``): each holds one part
# buffer, so a writer holds at most this many part buffers.
UPLOAD_THREADS = 8
# An object going up in parts: the two have the same methods (put, part, complete, abort).
Parted = Union[_s3.ObjectUpload, _gcs.ObjectUpload]


def _upload_bound(nbytes: int) -> float:
    """How long a wait for one upload may last: the I/O bound plus 1 s per 8 MiB (as
    ``kvstore.wait``); boto3's own timeouts and retries (``s3.new_client``) end a request
    to a silent store well within it."""
    return (io_timeout_s() or DEFAULT_IO_TIMEOUT_S) + nbytes * _kvstore.SECONDS_PER_BYTE


def parted_object(root: Location, name: str) -> Parted | None:
    """An upload of ``root/name`` in parts: S3 multipart (with boto3) or GCS composite
    (``gcs.composing``); ``None`` elsewhere: the object then goes up whole."""
    driver = root.kvstore.get("driver")
    if driver == "gcs" and _gcs.composing(root):
        return _gcs.ObjectUpload(root, name)
    if driver == "s3" and _s3.client_for(root) is not None:
        return _s3.ObjectUpload(root, name)
    return None


def part_bytes_for(root: Location, size: int) -> int:
    """The part size of an object of ``size`` bytes under ``root``: ``PART_BYTES``,
    raised to what the store needs."""
    if root.kvstore.get("driver") == "gcs":
        return _gcs.part_bytes_for(size, PART_BYTES)
    return _s3.part_bytes_for(size, PART_BYTES)


class _Uploads:
    """Uploads on plain threads (as ``_tasks``: a pending async save must still finish while
    the interpreter exits), at most ``UPLOAD_THREADS`` at once: ``submit`` waits for a free
    one, within the bound; ``join`` waits for all, within the bound, and raises the first
    error."""

    def __init__(self, what: str):
        self.what = what
        self._slots = threading.Semaphore(UPLOAD_THREADS)
        self._lock = threading.Lock()
        self._threads: list[tuple[threading.Thread, int]] = []
        self._errors: list[BaseException] = []

    def submit(self, fn: Any, nbytes: int) -> None:
        self.check()
        if not self._slots.acquire(timeout=_upload_bound(nbytes)):
            raise CheckpointError(f"Writing '{self.what}' failed: {_s3.no_answer(_upload_bound(nbytes))}")
        thread = threading.Thread(target=self._run, args=(fn,), name="jaxckpt-upload", daemon=True)
        with self._lock:
            self._threads.append((thread, nbytes))
        thread.start()

    def _run(self, fn: Any) -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - raised by check/join in the caller's thread
            with self._lock:
                self._errors.append(e)
        finally:
            self._slots.release()

    def check(self) -> None:
        with self._lock:
            if self._errors:
                raise self._errors[0]

    def join(self) -> None:
        with self._lock:
            threads, self._threads = self._threads, []
        for thread, nbytes in threads:
            thread.join(_upload_bound(nbytes))
            if thread.is_alive():
                raise CheckpointError(f"Writing '{self.what}' failed: {_s3.no_answer(_upload_bound(nbytes))}")
        self.check()


def upload_file(root: Location, name: str, path: str) -> None:
    """Upload the local file ``path`` (a data object) as ``root/name``. On S3 and GCS in
    parallel parts (``PART_BYTES``, ``UPLOAD_THREADS`` at once; ``parted_object``), each
    read from the file into its own part buffer (``preadv``) just before it goes: never
    the whole file in memory; a file that fits in one part is one PUT; a failed upload is
    aborted (best effort). Every wait is bounded (``_upload_bound``). Elsewhere
    (``memory://``, S3 without boto3, GCS without a token) the file goes up whole through ``kvstore.write_blob``; to a local ``root`` it is
    copied (write, fsync, rename). Like ``write_blob``, not counted in ``io_stats`` and no
    fault point: the caller's (a copy to the persistent tier counts its files)."""
    size = os.stat(path).st_size
    obj = parted_object(root, name)
    part = part_bytes_for(root, size)
    if obj is None or size <= part:
        data = _read_file_range(path, 0, size)
        if obj is not None:
            obj.put(data)
        else:
            _kvstore.write_blob(root, name, data)
        return
    uploads = _Uploads(obj.url)
    starts = range(0, size, part)
    try:
        for number, start in enumerate(starts, 1):
            nbytes = min(part, size - start)
            uploads.submit(functools.partial(_upload_file_part, obj, number, path, start, nbytes), nbytes)
        uploads.join()
        obj.complete(len(starts))
    except BaseException:
        _abort_after(uploads, [obj])
        raise


def _upload_file_part(obj: Parted, number: int, path: str, start: int, nbytes: int) -> None:
    obj.part(number, _read_file_range(path, start, nbytes))


def _read_file_range(path: str, start: int, nbytes: int) -> bytearray:
    """Bytes ``[start, start + nbytes)`` of the file ``path``, read with ``preadv`` into one
    new buffer; ``OSError`` if it ends early."""
    buffer = bytearray(nbytes)
    parts = [memoryview(buffer)] if nbytes else []
    fd = os.open(path, os.O_RDONLY)
    try:
        position = start
        while parts:
            got = _dataobjects.preadv_into(fd, parts, position)
            if not got:
                raise OSError(f"{path} ended early: no bytes at {position}, {start + nbytes} expected")
            position += got
            _dataobjects.advance(parts, got)
    finally:
        os.close(fd)
    return buffer


def _abort_after(uploads: _Uploads, objects: list[Parted]) -> None:
    """After a failure: wait (bounded) for the part uploads in flight, then abort every
    upload in parts started (best effort: the first failure is the one to report)."""
    try:
        uploads.join()
    except BaseException:  # noqa: BLE001 - already failing; the parts go with the abort
        pass
    for obj in objects:
        obj.abort()


class SegmentParts:
    """A stream's segments on S3 or GCS, each going up as its parts fill:
    ``StreamWriter``'s object-store half (S3 multipart or GCS composite uploads,
    ``parted_object``; see the module docstring).

    An entry owns stream bytes ``[offset, min(round_up(end, _dataobjects.ALIGN), length))``: itself and
    the zeros up to where the next entry starts (the layout packs a stream's entries at
    their strides, so its entries own it exactly, once each). A part records the pieces
    of the entries that reach it (views of the caller's buffers: no copy yet) and how many
    of its bytes are owned; once all are, it is copied into one part buffer (the gaps stay
    zeros) and uploaded on one of ``UPLOAD_THREADS`` threads, while the entries go on
    arriving (from any thread, in any order). A segment of one part is one PUT; ``close``
    completes the others' uploads (S3: CompleteMultipartUpload; GCS: compose, then the
    parts' deletion); ``abort`` drops them."""

    def __init__(self, root: Location, process: int, sizes: list[int], segment_bytes: int, length: int):
        self.process, self.sizes, self.segment_bytes, self.length = process, sizes, segment_bytes, length
        made = [parted_object(root, _dataobjects.segment_name(process, n)) for n in range(len(sizes))]
        if any(obj is None for obj in made):
            raise CheckpointError(f"'{root.url}' takes no upload in parts (S3 needs boto3, GCS a token)")
        self.objects: list[Parted] = [obj for obj in made if obj is not None]
        self.part_bytes = [part_bytes_for(root, size) for size in sizes]
        self.uploads = _Uploads(f"{root.url}/p{process}.*")
        self._lock = threading.Lock()
        self._pieces: dict[tuple[int, int], list[tuple[int, memoryview]]] = {}
        self._owned: dict[tuple[int, int], int] = {}
        self._sent = 0  # parts handed to an upload

    def parts_of(self, n: int) -> int:
        return -(-self.sizes[n] // self.part_bytes[n])

    def add(self, offset: int, parts: list[memoryview]) -> None:
        """Take the entry at ``offset`` (its bytes: ``parts``, in order); upload every part
        it completes."""
        if offset % _dataobjects.ALIGN:
            raise ValueError(f"entry at offset {offset} of stream p{self.process}: not a multiple of {_dataobjects.ALIGN}")
        nbytes = sum(len(p) for p in parts)
        end = min(-(-(offset + nbytes) // _dataobjects.ALIGN) * _dataobjects.ALIGN, self.length)
        ready = []
        with self._lock:
            for n, start, stop in _dataobjects.pieces(offset, end - offset, self.segment_bytes):
                size = self.part_bytes[n]
                for i in range(start // size, (stop - 1) // size + 1):
                    lo, hi = max(start, i * size), min(stop, (i + 1) * size)
                    base = n * self.segment_bytes - offset  # entry position of segment byte 0
                    got = self._pieces.setdefault((n, i), [])
                    got.extend((lo - i * size + at, view) for at, view in _within(parts, lo + base, hi + base))
                    self._owned[(n, i)] = owned = self._owned.get((n, i), 0) + hi - lo
                    if owned > min(size, self.sizes[n] - i * size):
                        raise ValueError(f"entry at offset {offset} of stream p{self.process} overlaps another")
                    if owned == min(size, self.sizes[n] - i * size):
                        ready.append((n, i, self._pieces.pop((n, i))))
            self._sent += len(ready)
        for n, i, got in ready:
            nbytes = min(self.part_bytes[n], self.sizes[n] - i * self.part_bytes[n])
            self.uploads.submit(functools.partial(self._upload, n, i, nbytes, got), nbytes)

    def _upload(self, n: int, i: int, nbytes: int, got: list[tuple[int, memoryview]]) -> None:
        buffer = bytearray(nbytes)  # zeros: the gaps between entries
        for at, view in got:
            buffer[at:at + len(view)] = view
        if self.parts_of(n) == 1:
            self.objects[n].put(buffer)
        else:
            self.objects[n].part(i + 1, buffer)

    def close(self) -> None:
        """Wait for every part (bounded), then complete every upload in parts."""
        self.uploads.join()
        total = sum(self.parts_of(n) for n in range(len(self.sizes)))
        if self._sent != total:
            missing = sum(min(self.part_bytes[n], self.sizes[n] - i * self.part_bytes[n]) - owned
                          for (n, i), owned in self._owned.items() if (n, i) in self._pieces)
            raise CheckpointError(f"stream p{self.process}: {total - self._sent} of its {total} parts were not "
                                  f"written whole ({missing} bytes of the parts begun are missing)")
        for n, obj in enumerate(self.objects):
            if self.parts_of(n) > 1:
                # (bounded as an upload of the object: assembling GiBs takes the store a while)
                self.uploads.submit(functools.partial(obj.complete, self.parts_of(n)), self.sizes[n])
        self.uploads.join()

    def abort(self) -> None:
        _abort_after(self.uploads, self.objects)


def _within(parts: list[memoryview], lo: int, hi: int) -> Iterator[tuple[int, memoryview]]:
    """``(position - lo, view)`` for the bytes of ``parts`` (concatenated) in ``[lo, hi)``;
    bytes past their end (an entry's padding) are none of them."""
    pos = 0
    for part in parts:
        a, b = max(lo, pos), min(hi, pos + len(part))
        if a < b:
            yield a - lo, part[a - pos:b - pos]
        pos += len(part)
