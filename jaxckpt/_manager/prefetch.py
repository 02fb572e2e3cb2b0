"""``CheckpointManager.prefetch``: a step's bytes read into the page cache in the
background, while the job does something else (builds its model, compiles its step), so
that the restore after it reads from memory (issue 34, item 3).

Local directories only: an object store's bytes have no cache here to warm, and holding
them in memory would be a second copy of the state; there the prefetch reads nothing.
What is read: the data files of the step's checkpoint (with per-process streams, this
process's own when the job has as many processes as the save had; every file
otherwise), each a regular file inside the checkpoint (``lstat``: no link followed, no
FIFO opened), ``READERS`` at a time, each through one buffer of ``BUFFER_BYTES``: the
memory it takes is bounded whatever the state's size. ``close()`` stops it between two
reads.
"""

from __future__ import annotations

import concurrent.futures
import os
import stat
import threading

from .. import _distributed, _manifest

READERS = 4  # files read at once
BUFFER_BYTES = 8 << 20  # each reader's buffer: what one read takes


class Prefetch:
    """The prefetches of one manager: started one at a time, each on a thread of its own."""

    def __init__(self) -> None:
        self._stop = threading.Event()

    def start(self, root: str | None, man: _manifest.Manifest) -> concurrent.futures.Future:
        """Read ``man``'s data files under checkpoint directory ``root`` (``None``: not
        local) in the background; the future's result is the bytes read."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if root is None:
            future.set_result(0)
            return future
        files = data_files(root, man)
        thread = threading.Thread(target=self._run, args=(files, future), name="jaxckpt-prefetch", daemon=True)
        thread.start()
        return future

    def stop(self) -> None:
        self._stop.set()

    def _run(self, files: list[str], future: concurrent.futures.Future) -> None:
        try:
            with concurrent.futures.ThreadPoolExecutor(READERS, thread_name_prefix="jaxckpt-prefetch") as pool:
                future.set_result(sum(pool.map(self._read, files)))
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on it
            future.set_exception(e)

    def _read(self, path: str) -> int:
        """Read one file to its end (never more than its size at the start)."""
        if self._stop.is_set():
            return 0
        try:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode):
                return 0  # a link, a FIFO, a device: not the checkpoint's data
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
        except OSError:
            return 0  # gone (deleted meanwhile): the restore says what is missing
        try:
            buf = memoryview(bytearray(min(BUFFER_BYTES, max(st.st_size, 1))))
            done = 0
            while done < st.st_size and not self._stop.is_set():
                n = os.preadv(fd, [buf[: min(len(buf), st.st_size - done)]], done)
                if n <= 0:
                    break
                done += n
            return done
        finally:
            os.close(fd)


def data_files(root: str, man: _manifest.Manifest) -> list[str]:
    """The data files of the checkpoint at ``root`` that this process's restore reads:
    its own streams' objects when the process count is the save's, else all of them."""
    data = os.path.join(root, man.data) if man.data else root
    mine = f"p{_distributed.process_index()}."
    own = man.segment_bytes and man.process_count == _distributed.process_count()
    out = []
    for sub in sorted(_manifest.DATA_DIRS):
        top = os.path.join(data, sub)
        if not os.path.isdir(top) or os.path.islink(top):
            continue
        for dirpath, dirnames, names in os.walk(top):  # os.walk follows no link into a directory
            dirnames.sort()
            out += [os.path.join(dirpath, n) for n in sorted(names) if not own or n.startswith(mine)]
    return out

