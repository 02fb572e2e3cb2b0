"""Format 3's data objects: each writing process's byte stream of entries, cut into
segment objects ``p<k>.<n>``, written and read by byte range.

An entry is a chunk's payload (C order, little endian, the storage dtype; the caller
gives those bytes) followed by its crc32c (Castagnoli, 4 bytes little endian): the
bytes of a zarr3 chunk file with codecs ``bytes`` + ``crc32c``. Stream bytes
``[n * S, (n + 1) * S)`` are object ``p<k>.<n>`` (``S``: ``segment_bytes``); the last
segment is shorter, and an entry may straddle two segments. Where entries go in the
stream (runs, offsets, the 64-byte alignment) is decided by the caller; this module
takes a stream offset and writes or reads the entry there.

Every function takes ``root``: the ``Location`` of the data objects themselves
(``<checkpoint>/data`` on a local disk, ``d/<token>/data`` under an object-store
checkpoint), so the attempt prefixes of ``_commit`` stay the caller's business.

* Local disk (``root.local``): ``StreamWriter`` creates every segment file at its
  final size up front (``ftruncate``: the gaps between entries read as zeros), writes
  each entry with one ``os.pwritev`` straight from the payload's buffer and the 4-byte
  checksum (no concatenation copy), from any number of threads at once (distinct
  entries), and ``close`` fsyncs every segment file and the directory. ``read_entry``
  reads an entry with ``os.preadv`` (one call per segment it lies in) straight into
  the caller's buffer and checks its crc32c (a hardware crc32c that releases the GIL).
* Object stores and ``memory://``: ``read_entry`` issues one ranged read per segment
  the entry lies in (tensorstore's ``KvStore.read(key, byte_range=...)``, concurrent),
  copies the payload into the caller's buffer and checks the crc32c (a restore runs
  its entries on ``_reader.DIRECT_READ_THREADS`` threads).
* S3 (boto3, the ``s3`` extra): ``StreamWriter`` uploads each segment as one multipart
  upload (``uploads.SegmentParts``). tensorstore's s3 kvstore has no multipart upload (its
  ``write`` sends a value with one PUT), so this part goes through boto3
  (``s3.ObjectUpload``). A part (``PART_BYTES``, 64 MiB; S3's minimum of 5 MiB for
  every part but the last) collects views of the entries that reach it as they arrive
  (from any thread, in any order: no copy yet) and, once all of its bytes are owned,
  is copied into one part buffer and uploaded at once, ``UPLOAD_THREADS`` parts in
  flight; ``close`` completes the uploads. A segment of one part is one PUT. A failure
  aborts the multipart uploads begun (best effort; a crashed process leaves them to the
  bucket's lifecycle rule for incomplete multipart uploads). Every wait is bounded
  (``_upload_bound``: the I/O bound; boto3's timeouts end each request within it).
  ``upload_file`` puts a local data object (a copy to the persistent tier) the same way,
  each part read from the file just before it goes.
* GCS (``gcs.composing``: a token for the compose request, ``GOOGLE_AUTH_TOKEN_FOR_TESTING``
  or google-auth's credentials, the ``gcs`` extra): the same ``SegmentParts``, each
  part a temporary object ``p<k>.<n>.part<i>`` written through tensorstore's ``write``;
  ``close`` composes each segment's parts into it (one JSON API ``compose`` request per
  32 parts; tensorstore has no compose), checks its size and crc32c, and deletes the
  parts. A failure deletes the parts written (best effort); a crashed process leaves
  them under its attempt's data prefix, which the clean-up of dead attempts deletes.
  (GCS's XML API also has S3-style multipart uploads, with no temporary objects; the
  local GCS emulator the tests run against has no XML API, so that route is not taken.)
* ``memory://``, S3 without boto3, GCS without a token (no upload in parts: each object
  goes up whole with one PUT through tensorstore's kvstore, which takes the whole
  value): the same ``SegmentParts``, each segment one part (``uploads.WholeObject``),
  assembled once all of its bytes are written and put at once, ``uploads.WHOLE_UPLOADS``
  at a time. The save makes its segments small there (``uploads.segment_bytes_for``:
  ``uploads.WHOLE_OBJECT_BYTES``), so what is assembled at once stays within a constant,
  whatever the stream's length.

Counted (``_storage.io_stats``) per entry, like ``chunkfiles`` counts per chunk: the
payload bytes (not the checksum) and one write or read. Fault points: ``write`` before
each entry is written, ``read`` before each entry is read, both with key
``p<k>@<offset>`` (process ``k``, the entry's stream offset).
"""

from __future__ import annotations

import ctypes
import os
import stat
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import crc32c
import numpy as np

from .. import _storage
from .._errors import CheckpointError, CorruptCheckpointError
from . import kvstore as _kvstore
from . import s3 as _s3
from . import uploads as _uploads
from .location import Location

CRC_BYTES = 4
ALIGN = 64  # entries start at multiples of this in their stream (docs/format.md, "Version 3")
GATHER_ENTRIES = 256  # entries in one gathered write: 3 buffers each, under IOV_MAX (1024)
GATHER_BELOW_BYTES = 1 << 20  # only entries smaller than this are gathered (a big one's writeback starts at once)
_ZEROS = memoryview(bytes(ALIGN))  # the padding between gathered entries


def segment_name(process: int, n: int) -> str:
    """The name of segment ``n`` of process ``process``'s stream: ``p<k>.<n>``."""
    return f"p{process}.{n}"


def segment_sizes(length: int, segment_bytes: int) -> list[int]:
    """The sizes of the segments of a stream of ``length`` bytes: ``segment_bytes`` each,
    the last one shorter; none for an empty stream.

    >>> segment_sizes(10, 4)
    [4, 4, 2]
    """
    _check_segment_bytes(segment_bytes)
    return [min(segment_bytes, length - start) for start in range(0, length, segment_bytes)]


def pieces(offset: int, nbytes: int, segment_bytes: int) -> Iterator[tuple[int, int, int]]:
    """``(segment, start in it, stop in it)`` for stream bytes ``[offset, offset + nbytes)``,
    in stream order: one piece, or more where the range crosses segment boundaries.

    >>> list(pieces(6, 4, 8))
    [(0, 6, 8), (1, 0, 2)]
    """
    _check_segment_bytes(segment_bytes)
    end = offset + nbytes
    while offset < end:
        n, start = divmod(offset, segment_bytes)
        stop = min(segment_bytes, start + end - offset)
        yield n, start, stop
        offset += stop - start


def _check_segment_bytes(segment_bytes: int) -> None:
    if segment_bytes < 1:
        raise ValueError(f"segment_bytes must be at least 1, got {segment_bytes}")


def _bytes_of(array: np.ndarray, what: str) -> memoryview:
    if not array.flags.c_contiguous:
        raise ValueError(f"{what} must be C-contiguous (its bytes are the entry's, in place)")
    return memoryview(array.reshape(-1).view(np.uint8))


def _split(parts: list[memoryview], sizes: list[int]) -> list[list[memoryview]]:
    """``parts`` (buffers in order) cut into consecutive groups of ``sizes`` bytes."""
    out: list[list[memoryview]] = []
    i, used = 0, 0
    for size in sizes:
        group: list[memoryview] = []
        while size:
            take = min(size, len(parts[i]) - used)
            group.append(parts[i][used:used + take])
            size -= take
            used += take
            if used == len(parts[i]):
                i, used = i + 1, 0
        out.append(group)
    return out


# --- writing ----------------------------------------------------------------------


class StreamWriter:
    """Writes one process's stream of entries into its segment objects ``p<k>.<n>``.

    The stream's length is known up front (the layout is a pure function of the global
    tree): locally every segment file is created at its final size when the writer is
    made. ``write_entry`` may be called from several threads at once for distinct
    entries; ``close`` makes everything durable (locally: fsync of every segment file
    and of the directory; on an object store: the uploads). Leaving a ``with`` block by
    an exception releases the files without syncing or uploading: the attempt is
    abandoned.

    Example::

        with StreamWriter(root.child("data"), 0, length, 1 << 30) as w:
            w.write_entry(0, chunk)
            w.write_entry(round_up(chunk.nbytes + 4, 64), other)
    """

    def __init__(self, root: Location, process: int, length: int, segment_bytes: int):
        self.root, self.process, self.length = root, process, length
        self.segment_bytes = segment_bytes
        self.sizes = segment_sizes(length, segment_bytes)
        self._fds: list[int] = []
        self._parts: _uploads.SegmentParts | None = None
        self._closed = False
        if root.local is None:
            if self.sizes:
                self._parts = _uploads.SegmentParts(root, process, self.sizes, segment_bytes, length)
            return
        os.makedirs(root.local, exist_ok=True)
        try:
            for n, size in enumerate(self.sizes):
                path = os.path.join(root.local, segment_name(process, n))
                self._fds.append(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))
                os.ftruncate(self._fds[-1], size)
        except BaseException:
            self._release()
            raise

    def write_entry(self, offset: int, payload: np.ndarray) -> None:
        """Write ``payload``'s bytes (C-contiguous; little endian is the caller's to give)
        and their crc32c at stream offset ``offset``. Fault point ``write``, key
        ``p<k>@<offset>``."""
        view = _bytes_of(payload, "an entry's payload")
        self._begin(offset, len(view))
        trailer = memoryview(crc32c.crc32c(view).to_bytes(CRC_BYTES, "little"))
        if self._parts is not None:
            self._parts.add(offset, [view, trailer])
            return
        self._put(offset, [view, trailer])

    def write_entries(self, entries: Sequence[tuple[int, np.ndarray]]) -> None:
        """``write_entry`` of each ``(offset, payload)``. Locally, small entries (under
        ``GATHER_BELOW_BYTES``) that follow one another in the stream (each at the aligned
        end of the one before) go to the disk in one gathered write of up to
        ``GATHER_ENTRIES`` (payloads, checksums and the zeros between them): a thousand
        small leaves are a few system calls, not two thousand; a big entry is written at
        once. Each entry is still checked, counted and a fault point (then one at a time)."""
        if not self._fds or _storage.faults_armed():
            for offset, payload in entries:
                self.write_entry(offset, payload)
            return
        group: list[memoryview] = []
        start = end = count = 0
        for offset, payload in entries:
            view = _bytes_of(payload, "an entry's payload")
            self._begin(offset, len(view))
            trailer = memoryview(crc32c.crc32c(view).to_bytes(CRC_BYTES, "little"))
            gap, small = offset - end, len(view) < GATHER_BELOW_BYTES
            if group and small and 0 <= gap < ALIGN and count < GATHER_ENTRIES:
                group.extend([_ZEROS[:gap], view, trailer])
                count += 1
            else:
                if group:
                    self._put(start, group)
                group, start, count = [view, trailer], offset, 1
            end = offset + len(view) + CRC_BYTES
            if not small:
                self._put(start, group)
                group = []
        if group:
            self._put(start, group)

    @property
    def blockwise(self) -> bool:
        """Whether ``write_entry_blocks`` writes block by block (not on an object store,
        whose parts keep views of what they are given until they go: it joins the blocks)."""
        return self._parts is None

    def write_entry_blocks(self, offset: int, blocks: Iterable[np.ndarray], nbytes: int) -> None:
        """The entry ``write_entry`` writes of the blocks' bytes one after the other
        (``nbytes`` in all), written as the blocks come: each block (C-contiguous) is
        needed only until the next one is asked for, so a chunk made of copies (a cast,
        a strided view, ``BLOCK_BYTES`` at a time) costs a block of memory, not the
        chunk. Where not ``blockwise``, the blocks are joined first."""
        if not self.blockwise:
            joined = np.empty(nbytes, np.uint8)
            for at, view in self._blocks(offset, blocks, nbytes):
                joined[at:at + len(view)] = np.frombuffer(view, np.uint8)
            self.write_entry(offset, joined)
            return
        self._begin(offset, nbytes)
        crc = 0
        for at, view in self._blocks(offset, blocks, nbytes):
            crc = crc32c.crc32c(view, crc)
            self._put(offset + at, [view])
        self._put(offset + nbytes, [memoryview(crc.to_bytes(CRC_BYTES, "little"))])

    def _blocks(self, offset: int, blocks: Iterable[np.ndarray], nbytes: int) -> Iterator[tuple[int, memoryview]]:
        """``(position in the payload, bytes)`` of each block, checked to make ``nbytes`` in all."""
        at = 0
        for block in blocks:
            view = _bytes_of(block, "a block of an entry")
            if at + len(view) > nbytes:
                raise ValueError(f"the blocks of entry p{self.process}@{offset} hold more than {nbytes} bytes")
            yield at, view
            at += len(view)
        if at != nbytes:
            raise ValueError(f"the blocks of entry p{self.process}@{offset} hold {at} bytes, not {nbytes}")

    def _begin(self, offset: int, nbytes: int) -> None:
        """An entry of ``nbytes`` payload bytes at ``offset``: checked, the fault point, counted."""
        end = offset + nbytes + CRC_BYTES
        if offset < 0 or end > self.length:
            raise ValueError(f"entry [{offset}, {end}) lies outside stream p{self.process} "
                             f"of {self.length} bytes")
        if self._closed:
            raise ValueError(f"stream p{self.process} is closed")
        _storage.fault("write", f"p{self.process}@{offset}")
        _storage.count(bytes_written=nbytes, writes=1)

    def _put(self, position: int, parts: list[memoryview]) -> None:
        """``parts``' bytes at stream ``position``: into the segment files."""
        spans = list(pieces(position, sum(map(len, parts)), self.segment_bytes))
        groups = _split(parts, [stop - start for _, start, stop in spans])
        for (n, start, stop), group in zip(spans, groups):
            _pwrite_all(self._fds[n], group, start)
            if _sync_file_range is not None:
                # Start the entry's writeback now, as a file per chunk's fsync in its
                # own thread does: the final fsync then waits for little, not the lot.
                _sync_file_range(self._fds[n], start, stop - start, SYNC_FILE_RANGE_FLAGS)

    def close(self) -> None:
        """Make the stream durable: locally fsync every segment file and the directory,
        on an object store upload every segment. Then release the files."""
        if self._closed:
            return
        try:
            if self._fds:
                for fd in self._fds:
                    os.fsync(fd)
                _kvstore.fsync_dir(self.root.local)
            if self._parts is not None:
                self._parts.close()
                self._parts = None  # complete: nothing to abort
        finally:
            self._release()

    def _release(self) -> None:
        self._closed = True
        fds, self._fds = self._fds, []
        parts, self._parts = self._parts, None
        for fd in fds:
            os.close(fd)
        if parts is not None:  # not completed: its multipart uploads go (best effort)
            parts.abort()

    def __enter__(self) -> StreamWriter:
        return self

    def __exit__(self, kind: Any, *_: Any) -> None:
        if kind is None:
            self.close()
        else:
            self._release()


def advance(parts: list[memoryview], done: int) -> None:
    """Drop the first ``done`` bytes of ``parts`` (what a vectored call moved), in place."""
    while parts and done >= len(parts[0]):
        done -= len(parts[0])
        parts.pop(0)
    if parts and done:
        parts[0] = parts[0][done:]


def _pwrite_all(fd: int, parts: list[memoryview], position: int) -> None:
    """Write ``parts`` (in order) at ``position``: one gathered ``pwritev`` per round,
    again from where a short write stopped (Linux writes at most ~2 GiB per call)."""
    parts = [p for p in parts if len(p)]
    while parts:
        if _pwritev is not None:
            done = _pwritev(fd, parts, position)
        else:
            done = os.pwrite(fd, parts[0], position)
        position += done
        advance(parts, done)


_pwritev = getattr(os, "pwritev", None)


def _libc_sync_file_range() -> Any:
    """Linux's ``sync_file_range(2)`` through ctypes (Python's ``os`` has no binding), or
    ``None`` elsewhere. A hint: its result is not checked (``close``'s fsync is the promise)."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _libc_sync_file_range()
# SYNC_FILE_RANGE_WRITE: start the range's writeback, without waiting for it. A 1 GiB save
# (256 entries of 4 MiB, 4 threads) measured 0.41-0.46 s with it, 0.47-0.65 s also waiting
# for each range (| WAIT_BEFORE | WAIT_AFTER), 0.58-0.77 s without the call (the final
# fsync then writes the lot), format 1's chunk files 0.50-0.64 s in the same runs.
SYNC_FILE_RANGE_FLAGS = 2
_preadv = getattr(os, "preadv", None)


def write_segment(root: Location, process: int, n: int, data: bytes | bytearray) -> None:
    """Write segment ``n`` of process ``process``'s stream whole (one PUT on an object
    store; locally write, fsync, rename). Not counted in ``io_stats``: its entries were."""
    _kvstore.write_blob(root, segment_name(process, n), data)


# --- reading ----------------------------------------------------------------------


def read_entry(root: Location, process: int, offset: int, payload_nbytes: int, dest: np.ndarray,
               segment_bytes: int) -> None:
    """Read the entry at stream offset ``offset`` of process ``process``'s stream into
    ``dest`` (preallocated, C-contiguous, ``payload_nbytes`` bytes) and check its crc32c.

    Locally the payload is read straight into ``dest`` (``preadv``, no staging copy);
    from an object store each segment's part arrives as one ranged read and is copied
    in. Raises ``CorruptCheckpointError`` naming the data object(s), the byte range and
    the stream offset for a missing object, one that ends early, or a checksum mismatch;
    ``CheckpointError`` when the store fails; ``OSError`` when the file system refuses.
    Fault point ``read``, key ``p<k>@<offset>``.
    """
    view = _bytes_of(dest, "dest")
    if len(view) != payload_nbytes:
        raise ValueError(f"dest holds {len(view)} bytes, the entry's payload {payload_nbytes}")
    _storage.fault("read", f"p{process}@{offset}")
    _storage.count(bytes_read=payload_nbytes, reads=1)
    trailer = bytearray(CRC_BYTES)
    spans = list(pieces(offset, payload_nbytes + CRC_BYTES, segment_bytes))
    groups = _split([view, memoryview(trailer)], [stop - start for _, start, stop in spans])
    where = _Where(root, process, offset, spans)
    if root.local is not None:
        for (n, start, stop), group in zip(spans, groups):
            _pread_all(where, n, start, stop, group)
    else:
        _read_ranges(where, spans, groups)
    stored = int.from_bytes(trailer, "little")
    computed = crc32c.crc32c(view)
    if stored != computed:
        raise CorruptCheckpointError(f"DATA_LOSS: {where}: digest mismatch, stored digest is "
                                     f"0x{stored:08x} but computed digest is 0x{computed:08x}")


def check_entry(root: Location, process: int, offset: int, payload_nbytes: int, segment_bytes: int) -> None:
    """On a local disk, before a buffer for the entry is allocated: the data objects it
    lies in exist, are regular files and hold its bytes (a manifest may promise an entry
    of any size; the objects' sizes give that lie away before memory is spent on it).
    Raises ``read_entry``'s ``CorruptCheckpointError``; nothing on object stores."""
    if root.local is None:
        return
    where = _Where(root, process, offset, [])
    # one object at a time: the first that does not hold its part ends it, however many the entry spans
    for n, start, stop in pieces(offset, payload_nbytes + CRC_BYTES, segment_bytes):
        try:
            st = os.stat(where.object(n))
        except (FileNotFoundError, NotADirectoryError):
            raise where.error("NOT_FOUND", n, "is missing") from None
        if not stat.S_ISREG(st.st_mode):
            raise where.error("DATA_LOSS", n, "is not a regular file")
        if st.st_size < stop:
            raise where.error("DATA_LOSS", n, f"ended early: it has {st.st_size} bytes, the entry "
                                              f"needs bytes [{start}, {stop})")


def read_run(root: Location, process: int, spans: list[tuple[int, int, int]], parts: list[memoryview]) -> bool:
    """Fill ``parts`` (buffers in order, ``spans``' bytes in all) from an object store with
    one ranged read per data object of ``spans`` (``pieces``), all issued before the
    first is awaited: a run of consecutive entries in one request each. Whether every
    range came back whole (``OUT_OF_RANGE``, a missing object, a short answer: ``False``,
    the caller reads each entry alone to name what is wrong); a store that fails raises
    ``CheckpointError``. Checksums are the caller's."""
    kv = _kvstore._kvstore(root)
    futures = [_kvstore.track(kv.read(segment_name(process, n), byte_range=slice(start, stop)))
               for n, start, stop in spans]
    whole = True
    for future, (n, start, stop), group in zip(futures, spans, _split(parts, [b - a for _, a, b in spans])):
        try:
            result = _kvstore.wait(future, root, "reading", segment_name(process, n), nbytes=stop - start)
        except CheckpointError as e:
            if "OUT_OF_RANGE" not in str(e):
                raise
            whole = False
            continue
        value = memoryview(result.value) if result.state == "value" else memoryview(b"")
        if len(value) != stop - start:
            whole = False
            continue
        for part in group:
            part[:] = value[:len(part)]
            value = value[len(part):]
    return whole


class _Where:
    """An entry's place, for error messages: its stream offset and the byte ranges of
    the data objects it lies in."""

    def __init__(self, root: Location, process: int, offset: int, spans: list[tuple[int, int, int]]):
        self.root, self.process, self.offset, self.spans = root, process, offset, spans

    def object(self, n: int) -> str:
        """The data object of segment ``n``: its local path or its URL."""
        name = segment_name(self.process, n)
        return os.path.join(self.root.local, name) if self.root.local is not None else f"{self.root.url}/{name}"

    def __str__(self) -> str:
        ranges = " and ".join(f"{self.object(n)} bytes [{start}, {stop})" for n, start, stop in self.spans)
        return f"entry at offset {self.offset} of stream p{self.process} (data object {ranges})"

    def error(self, code: str, n: int, what: str) -> CorruptCheckpointError:
        """``code: data object <object> <what> (entry at offset ... of stream p<k>)``."""
        return CorruptCheckpointError(f"{code}: data object {self.object(n)} {what} "
                                      f"(entry at offset {self.offset} of stream p{self.process})")


def _pread_all(where: _Where, n: int, start: int, stop: int, group: list[memoryview]) -> None:
    path = where.object(n)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except (FileNotFoundError, NotADirectoryError):
        raise where.error("NOT_FOUND", n, "is missing") from None
    except IsADirectoryError:
        raise where.error("DATA_LOSS", n, "is not a regular file") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise where.error("DATA_LOSS", n, "is not a regular file")
        if st.st_size < stop:
            raise where.error("DATA_LOSS", n, f"ended early: it has {st.st_size} bytes, the entry "
                                              f"needs bytes [{start}, {stop})")
        position = start
        parts = [p for p in group if len(p)]
        while parts:
            got = preadv_into(fd, parts, position)
            if not got:
                raise where.error("DATA_LOSS", n, f"ended early: no bytes at {position}, the entry "
                                                  f"needs bytes [{start}, {stop})")
            position += got
            advance(parts, got)
    finally:
        os.close(fd)


def preadv_into(fd: int, parts: list[memoryview], position: int) -> int:
    if _preadv is not None:
        return _preadv(fd, parts, position)
    data = os.pread(fd, len(parts[0]), position)  # no preadv here: a copy, still correct
    parts[0][:len(data)] = data
    return len(data)


def _read_ranges(where: _Where, spans: list[tuple[int, int, int]], groups: list[list[memoryview]]) -> None:
    """One ranged read per segment, all issued before the first is awaited."""
    kv = _kvstore._kvstore(where.root)
    futures = [_kvstore.track(kv.read(segment_name(where.process, n), byte_range=slice(start, stop)))
               for n, start, stop in spans]
    for future, (n, start, stop), group in zip(futures, spans, groups):
        name = segment_name(where.process, n)
        try:
            result = _kvstore.wait(future, where.root, "reading", name, nbytes=stop - start)
        except CheckpointError as e:
            text = str(e)
            if "OUT_OF_RANGE" not in text:
                raise
            raise where.error("DATA_LOSS", n, f"ended early: the entry needs bytes [{start}, {stop}); "
                                              f"the store says {text[text.index('OUT_OF_RANGE'):]}") from None
        if result.state != "value":
            raise where.error("NOT_FOUND", n, "is missing")
        value = memoryview(result.value)
        if len(value) != stop - start:
            raise where.error("DATA_LOSS", n, f"ended early: {len(value)} bytes came back for bytes "
                                              f"[{start}, {stop})")
        for part in group:
            part[:] = value[:len(part)]
            value = value[len(part):]


def stored_sizes(root: Location) -> dict[str, int | None]:
    """The objects under ``root`` (a stream directory) with their sizes in bytes: one
    listing (``None`` for a size the store does not list: GCS through tensorstore, whose
    listing gives names only). Locally a directory listing and a ``stat`` per entry."""
    if root.local is not None:
        try:
            names = os.listdir(root.local)
        except (FileNotFoundError, NotADirectoryError):
            return {}
        return {n: os.stat(os.path.join(root.local, n)).st_size for n in names}
    if root.kvstore["driver"] == "s3":
        listed = _s3.sizes(root)
        if listed is not None:
            return dict(listed)
    kv = _kvstore._kvstore(root)
    names = [k.decode() if isinstance(k, bytes) else k
             for k in _kvstore.wait(_kvstore.track(kv.list()), root, "listing", "")]
    if root.kvstore["driver"] == "memory":  # in this process's memory: reading is free
        return {n: len(_kvstore.read_blob(root, n) or b"") for n in names}
    return dict.fromkeys(names)
