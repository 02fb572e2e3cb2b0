"""What the storage layer counts and where tests can break it.

``io_stats`` counts the array bytes and calls each process reads and writes (so tests
check that a restore reads only what it needs); ``fault_hook``, when a test sets it, is
called before each chunk write is issued and can fail it like an I/O error would.
"""

from __future__ import annotations

import threading
from typing import Any

_stats_lock = threading.Lock()
_stats = {"bytes_read": 0, "bytes_written": 0, "reads": 0, "writes": 0}

# A hook for tests: called with ("write", key) before each chunk write is issued; an
# exception it raises fails that write like an I/O error would.
fault_hook: Any = None


def count(**kw: int) -> None:
    with _stats_lock:
        for k, v in kw.items():
            _stats[k] += v


def fault(op: str, key: str) -> None:
    """A fault point: run the test's hook, if one is set."""
    if fault_hook is not None:
        fault_hook(op, key)


def io_stats() -> dict[str, int]:
    """Array bytes and calls read/written by the storage layer since the process started
    (or the last ``reset_io_stats``). Counts this process only."""
    with _stats_lock:
        return dict(_stats)



def reset_io_stats() -> None:
    with _stats_lock:
        for k in _stats:
            _stats[k] = 0

