"""The storage wing: where bytes live. ``location`` (paths, URLs and kvstore specs),
``kvstore`` (contexts and kvstores, small blobs, listing and deleting, bounded waits),
``s3`` (boto3's one-level listings and batched deletes), ``bounds`` (the I/O bound and the
retries and timeouts that fit it), ``zarr`` (tensorstore array specs and handles) and
``chunkfiles`` (direct local chunk files). This module, the wing's face: what the storage
layer counts and where tests can break it.

``io_stats`` counts the array bytes and calls each process reads and writes (so tests
check that a restore reads only what it needs); ``fault_hook``, when a test sets it, is
called at every fault point (``fault(op, key)``: before each chunk write is issued, at
each phase of a commit or a delete) and can fail it like an I/O error would.

``JAXCKPT_FAULT=<point>[@<key>][:<n>]`` in a process's environment (read at import)
kills that process with SIGKILL at the ``n``-th hit (default: the first) of fault point
``<point>`` (with key ``<key>``, if given): a crash at an exact place, for crash tests
(``JAXCKPT_FAULT=write:3``, ``JAXCKPT_FAULT=manifest:partial``). Unset, a fault point
costs two ``is None`` checks.

The fault points (``grep -rn "_storage.fault(" jaxckpt``), in the order a save meets them:

* ``data:start`` (each process, before any of its data), ``encode`` (before each
  compressed chunk is encoded, twice unless kept, see ``_writer._Encoder``; key
  ``<leaf path>@<flat chunk index>``), ``write`` (before each chunk
  write; key: the array's data key, ``0``, ``packed/p0``, ...), ``copy`` (each file a
  persistent-tier copy writes), ``peer`` (each wave of a peer copy a partner host
  writes, key the copy's directory; ``_manager/peers``);
* ``commit:before-manifest``, ``manifest:partial`` (local: half of the manifest's bytes
  written), ``commit:after-manifest``;
* local: ``commit:between-renames`` (an overwrite without ``RENAME_EXCHANGE``: the old
  copy moved aside, the new one not yet in place), ``commit:after-rename``; object
  stores: ``commit:after-old-delete``;
* deleting: ``delete:after-rename`` (``_commit.delete_step``, local: renamed aside),
  ``delete:middle`` (any local tree ``_kvstore.delete_tree`` removes that holds a
  manifest, the replaced copy of an overwrite and every deleted step included: its
  manifest removed, its data not yet), ``delete:after-manifest`` (object stores);
* restoring: ``read`` (before each chunk read: key the local chunk file's path from a
  direct read, ``""`` from a tensorstore read).
* in the background: ``renew`` (before each renewal of the writer lease, key
  ``.jaxckpt-writer.json``, or of a reader mark, key its file name): a failure there is
  a failed renewal.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

_stats_lock = threading.Lock()
_stats = {"bytes_read": 0, "bytes_written": 0, "reads": 0, "writes": 0}
# Every counted read or write, never reset: peers see it in this process's heartbeat and
# tell a slow process (it moves) from one that hangs alive (it does not).
_progress = 0

# A hook for tests: called with ("write", key) before each chunk write is issued; an
# exception it raises fails that write like an I/O error would.
fault_hook: Any = None


def count(**kw: int) -> None:
    global _progress
    with _stats_lock:
        _progress += 1
        for k, v in kw.items():
            _stats[k] += v


FAULT_ENV = "JAXCKPT_FAULT"


def parse_kill_point(spec: str | None) -> tuple[str, str, int] | None:
    """``"<point>[@<key>][:<n>]"`` -> ``(point, key, n)``; ``None`` for an empty spec."""
    if not spec:
        return None
    head, _, last = spec.rpartition(":")
    nth = 1
    if head and last.isdigit():
        spec, nth = head, int(last)
    point, _, key = spec.partition("@")
    if nth < 1 or not point:
        raise ValueError(f"{FAULT_ENV}={spec!r}: expected <point>[@<key>][:<n>], n >= 1")
    return point, key, nth


_kill_at = parse_kill_point(os.environ.get(FAULT_ENV))
_kill_hits = 0


def fault(op: str, key: str) -> None:
    """A fault point: run the test's hook, if one is set; die here if ``JAXCKPT_FAULT``
    names this point."""
    if fault_hook is not None:
        fault_hook(op, key)
    if _kill_at is not None:
        _maybe_kill(op, key)


def faults_armed() -> bool:
    """Whether a fault point may act (a test's hook, or ``JAXCKPT_FAULT``): then writers
    that gather several items into one call take them one at a time, so each point
    falls between the items it names, as without gathering."""
    return fault_hook is not None or _kill_at is not None


def _maybe_kill(op: str, key: str) -> None:
    global _kill_hits
    point, part, nth = _kill_at
    if op != point or (part and part != key):
        return
    with _stats_lock:
        _kill_hits += 1
        hit = _kill_hits
    if hit == nth:
        os.kill(os.getpid(), signal.SIGKILL)


def io_stats() -> dict[str, int]:
    """Array bytes and calls read/written by the storage layer since the process started
    (or the last ``reset_io_stats``). Counts this process only."""
    with _stats_lock:
        return dict(_stats)


def progress() -> int:
    """How many reads and writes this process counted since it started; only grows
    (``reset_io_stats`` leaves it alone)."""
    return _progress


def reset_io_stats() -> None:
    with _stats_lock:
        for k in _stats:
            _stats[k] = 0


# Named in docs/storage.md for users who set curl's process-wide timeouts themselves.
from .bounds import http_timeouts as http_timeouts  # noqa: E402
