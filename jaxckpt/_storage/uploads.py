"""Format 3's data objects up to S3 and GCS in parallel parts.

S3: multipart uploads through boto3 (the ``s3`` extra; ``s3.ObjectUpload``):
tensorstore's s3 kvstore has no multipart upload (its ``write`` sends a value with one
PUT). GCS: parallel composite uploads (``gcs.ObjectUpload``): each part its own
temporary object written through tensorstore, then one ``compose`` request and the
parts' deletion (tensorstore has no compose; the request is ours). ``parted_object``
picks one for a location, or none (``memory://``, S3 without boto3, GCS without a token
or google-auth's credentials): then each object goes up whole (``WholeObject``, one PUT
through tensorstore's kvstore), so a save there cuts its stream into smaller objects
(``segment_bytes_for``: ``WHOLE_OBJECT_BYTES``) and puts them one by one as they fill,
at most ``WHOLE_UPLOADS`` at once: never the stream in memory.

``SegmentParts`` uploads each segment of a ``dataobjects.StreamWriter``'s stream in
parts that fill from the entries as they arrive (views, no copy until a part is whole)
and go up at once, ``UPLOAD_THREADS`` in flight; ``upload_file`` puts a local data
object (a copy to the persistent tier) the same way, each part read from the file just
before it goes. Every wait is bounded (``_upload_bound``); a failure aborts the uploads
begun (best effort). See ``dataobjects`` for the stream and its segments.
"""

from __future__ import annotations

import contextlib
import ctypes
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
# Where no upload in parts is to be had (S3 without boto3, GCS without a token for the
# compose request, ``memory://``), an object goes up whole with one PUT through
# tensorstore's kvstore, whose ``write`` takes the whole value: the object is assembled in
# host memory first (and tensorstore copies it as the write is issued; ours is freed
# then). A save there cuts its stream into objects of at most WHOLE_OBJECT_BYTES (the
# manifest's ``segment_bytes`` says so: format 3 as it is) and puts at most WHOLE_UPLOADS
# at once, each as soon as its bytes are all written: its assembled objects take at most
# WHOLE_UPLOADS x WHOLE_OBJECT_BYTES (128 MiB) whatever the state's size; before, every
# object of the process (1 GiB each) was held until the end. 32 MiB: a PUT long enough to
# keep a link busy, and a TiB per process is 32,768 objects.
WHOLE_OBJECT_BYTES = 32 << 20
WHOLE_UPLOADS = 4


@functools.lru_cache(maxsize=1)
def _malloc_trim() -> Any:
    try:
        return ctypes.CDLL(None).malloc_trim  # the process's own symbols: glibc's, where it is glibc
    except (OSError, AttributeError):  # not glibc: nothing to give back this way
        return None


def _trim() -> None:
    """Give the heap's free pages back to the system (glibc's ``malloc_trim``; elsewhere
    nothing). After each object put whole: tensorstore's copy of it is freed on its own
    threads, and glibc kept such memory in per-thread arenas, so a save's peak grew with
    its state (S3 without boto3: +323 / +521 MiB for 256 / 512 MiB states; with this
    +197 / +223 MiB). It changes no setting of the allocator, only returns what is free."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


class WholeObject:
    """One object written whole (``put``: one PUT through tensorstore's kvstore), where
    the store takes no upload in parts: the interface of ``s3.ObjectUpload`` without
    parts. Nothing is left to abort: an object either landed whole or not at all."""

    def __init__(self, root: Location, name: str):
        self.root, self.name = root, name
        self.url = f"{root.url}/{name}"

    def put(self, data: Any) -> None:
        self.put_made(lambda: data, len(data))

    def put_made(self, make: Any, nbytes: int) -> None:
        """Put the ``nbytes`` bytes ``make()`` returns. tensorstore copies them as the write
        is issued: ours are freed then, before the PUT is waited for."""
        kv = _kvstore._kvstore(self.root)
        future = _kvstore.track(kv.write(self.name, make()))
        _kvstore.wait(future, self.root, "writing", self.name, nbytes=nbytes)
        _trim()

    def part(self, number: int, data: Any) -> None:
        raise CheckpointError(f"Writing '{self.url}' failed: this store takes no upload in parts")

    def complete(self, parts: int) -> None:
        raise CheckpointError(f"Writing '{self.url}' failed: this store takes no upload in parts")

    def abort(self) -> None:
        pass


# An object going up: in parts (S3's or GCS's) or whole; the same methods (put, part,
# complete, abort).
Parted = Union[_s3.ObjectUpload, _gcs.ObjectUpload]
Upload = Union[_s3.ObjectUpload, _gcs.ObjectUpload, WholeObject]


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


def in_parts(root: Location) -> bool:
    """Whether objects under ``root`` (an object store) go up in parts (``parted_object``)."""
    driver = root.kvstore.get("driver")
    if driver == "gcs":
        return _gcs.composing(root)
    return driver == "s3" and _s3.client_for(root) is not None


def segment_bytes_for(root: Location, wanted: int) -> int:
    """The size of the data objects of a save to ``root``: ``wanted`` on a local disk and
    where objects go up in parts, at most ``WHOLE_OBJECT_BYTES`` where each goes up whole
    (see there). Every process of a job decides it alike when their extras are alike; a
    job where they differ fails its save (``_checkpoint``: process 0 checks every
    process's objects against its own layout)."""
    if root.local is not None or in_parts(root):
        return wanted
    return min(wanted, WHOLE_OBJECT_BYTES)


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

    def __init__(self, what: str, threads: int = UPLOAD_THREADS):
        self.what = what
        self._slots = threading.Semaphore(threads)
        self._lock = threading.Lock()
        self._threads: list[tuple[threading.Thread, int]] = []
        self._errors: list[BaseException] = []

    def submit(self, fn: Any, nbytes: int) -> None:
        self.check()
        if not self._slots.acquire(timeout=_upload_bound(nbytes)):
            raise self._no_answer(nbytes)
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
                raise self._no_answer(nbytes)
        self.check()

    def _no_answer(self, nbytes: int) -> CheckpointError:
        """An upload the I/O bound gave up on (boto3's own timeouts had not yet)."""
        cause = _kvstore.no_answer(_upload_bound(nbytes), nbytes)
        _kvstore.note_failure(self.what, cause)
        return CheckpointError(f"Writing '{self.what}' failed: {cause}")


_WHOLE_FILE = threading.Lock()  # upload_file: one file bigger than WHOLE_OBJECT_BYTES going up whole at a time


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
        # whole: one file at a time in this process (the persistent tier copies with
        # several threads; without parts each would hold its whole data object, and
        # tensorstore a copy of it): at most one object's bytes beyond a part's
        with _WHOLE_FILE if size > WHOLE_OBJECT_BYTES else contextlib.nullcontext():
            data = _read_file_bytes(path, size)  # bytes: tensorstore copies a bytearray once more
            if obj is not None:
                obj.put(data)
            else:
                _kvstore.write_blob(root, name, data)
            del data
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


def _read_file_bytes(path: str, size: int) -> bytes:
    """The ``size`` bytes of the file ``path`` as one ``bytes``; ``OSError`` if it is shorter."""
    with open(path, "rb") as f:
        data = f.read(size)
    if len(data) != size:
        raise OSError(f"{path}: {len(data)} bytes read of {size}")
    return data


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


def _abort_after(uploads: _Uploads, objects: list[Upload] | list[Parted]) -> None:
    """After a failure: wait (bounded) for the part uploads in flight, then abort every
    upload in parts started (best effort: the first failure is the one to report)."""
    try:
        uploads.join()
    except BaseException:  # noqa: BLE001 - already failing; the parts go with the abort
        pass
    with _kvstore.cleaning_up():  # a store that failed: all of it within one bound
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
        names = [_dataobjects.segment_name(process, n) for n in range(len(sizes))]
        self.objects: list[Upload]
        if in_parts(root):
            self.objects = [_made(parted_object(root, name), root) for name in names]
            self.part_bytes = [part_bytes_for(root, size) for size in sizes]
            self.uploads = _Uploads(f"{root.url}/p{process}.*")
        else:  # each segment one part, put whole (its size is ``segment_bytes_for``'s)
            self.objects = [WholeObject(root, name) for name in names]
            self.part_bytes = [max(1, size) for size in sizes]
            self.uploads = _Uploads(f"{root.url}/p{process}.*", WHOLE_UPLOADS)
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
        obj = self.objects[n]
        if isinstance(obj, WholeObject):  # our buffer freed as soon as tensorstore has it
            obj.put_made(lambda: _assemble(nbytes, got), nbytes)
        elif self.parts_of(n) == 1:
            obj.put(_assemble(nbytes, got))
        else:
            obj.part(i + 1, _assemble(nbytes, got))

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


def _made(obj: Parted | None, root: Location) -> Parted:
    if obj is None:  # (in_parts said yes: credentials that went away meanwhile)
        raise CheckpointError(f"'{root.url}' takes no upload in parts (S3 needs boto3, GCS a token)")
    return obj


def _assemble(nbytes: int, got: list[tuple[int, memoryview]]) -> bytearray:
    """A part's bytes: the pieces of the entries that reach it, zeros between them."""
    buffer = bytearray(nbytes)
    for at, view in got:
        buffer[at:at + len(view)] = view
    return buffer


def _within(parts: list[memoryview], lo: int, hi: int) -> Iterator[tuple[int, memoryview]]:
    """``(position - lo, view)`` for the bytes of ``parts`` (concatenated) in ``[lo, hi)``;
    bytes past their end (an entry's padding) are none of them."""
    pos = 0
    for part in parts:
        a, b = max(lo, pos), min(hi, pos + len(part))
        if a < b:
            yield a - lo, part[a - pos:b - pos]
        pos += len(part)
