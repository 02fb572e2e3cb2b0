"""``CheckpointManager.prefetch``: a step's bytes read into the page cache in the
background, while the job does something else (builds its model, compiles its step), so
that the restore after it reads from memory (issue 34, item 3).

Local directories only: an object store's bytes have no cache here to warm, and holding
them in memory would be a second copy of the state; there the prefetch reads nothing.
What is read: the data files the step's manifest names, each up to the size the
manifest implies (with per-process streams, this process's own when the job has as
many processes as the save had; every one otherwise), each a regular file inside the
checkpoint (``lstat``: no link followed, no FIFO opened), ``READERS`` at a time, each
through one buffer of ``BUFFER_BYTES``; one prefetch at a time: the memory and threads
it takes are bounded whatever the state's size and however often it is called.
``close()`` stops it between two reads and waits for it.
"""

from __future__ import annotations

import concurrent.futures
import os
import stat
import threading

from .. import _distributed, _manifest, _reader, _verify

READERS = 4  # files read at once
BUFFER_BYTES = 8 << 20  # each reader's buffer: what one read takes


SMALL_FILE_BYTES = 1 << 20  # a file the manifest gives no size for (a zarr.json): read up to this


class Prefetch:
    """The prefetches of one manager, one at a time: a call for the step being read gives
    its future again; a call for another step stops the one running (its future: the
    bytes it had read) and starts anew. ``stop()`` (the manager's ``close()``) stops it
    and waits for its threads, which stop between two reads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: tuple[str, threading.Event, threading.Thread, concurrent.futures.Future] | None = None

    def start(self, root: str | None, man: _manifest.Manifest) -> concurrent.futures.Future:
        """Read ``man``'s data files under checkpoint directory ``root`` (``None``: not
        local) in the background; the future's result is the bytes read."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if root is None:
            future.set_result(0)
            return future
        with self._lock:
            if self._running is not None and self._running[0] == root and not self._running[3].done():
                return self._running[3]
            self._stop_running()
            files = data_files(root, man)
            halt = threading.Event()
            thread = threading.Thread(target=self._run, args=(files, halt, future), name="jaxckpt-prefetch",
                                      daemon=True)
            self._running = (root, halt, thread, future)
            thread.start()
        return future

    def _stop_running(self) -> None:
        if self._running is not None:
            _, halt, thread, _ = self._running
            halt.set()
            thread.join()  # each reader stops after its read in progress (at most BUFFER_BYTES)
            self._running = None

    def stop(self) -> None:
        with self._lock:
            self._stop_running()

    def _run(self, files: list[tuple[str, int]], halt: threading.Event, future: concurrent.futures.Future) -> None:
        try:
            with concurrent.futures.ThreadPoolExecutor(READERS, thread_name_prefix="jaxckpt-prefetch") as pool:
                future.set_result(sum(pool.map(lambda f: _read(*f, halt), files)))
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on it
            future.set_exception(e)


def _read(path: str, limit: int, halt: threading.Event) -> int:
    """Read one file up to ``limit`` bytes (and never past its size at the start)."""
    if halt.is_set():
        return 0
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode):
            return 0  # a link, a FIFO, a device: not the checkpoint's data
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return 0  # gone (deleted meanwhile): the restore says what is missing
    try:
        size = min(st.st_size, limit)
        buf = memoryview(bytearray(min(BUFFER_BYTES, max(size, 1))))
        done = 0
        while done < size and not halt.is_set():
            n = os.preadv(fd, [buf[: min(len(buf), size - done)]], done)
            if n <= 0:
                break
            done += n
        return done
    finally:
        os.close(fd)


def data_files(root: str, man: _manifest.Manifest) -> list[tuple[str, int]]:
    """The data files the manifest of the checkpoint at ``root`` names, with the bytes to
    read of each (the size it implies): with per-process streams, this process's own
    objects when the process count is the save's, else all. Only paths inside the
    checkpoint's data root (no directory link followed out of it)."""
    data = os.path.realpath(os.path.join(root, man.data) if man.data else root)
    mine = f"p{_distributed.process_index()}."
    own = man.segment_bytes and man.process_count == _distributed.process_count()
    out = []
    for rel, (size, _) in sorted(_verify.expected_files(man).items()):
        if own and rel.startswith(_reader.STREAM_DIR + "/") and not os.path.basename(rel).startswith(mine):
            continue
        path = os.path.join(data, rel)
        if not os.path.realpath(path).startswith(data + os.sep):
            continue
        out.append((path, SMALL_FILE_BYTES if size is None else size))
    return out
