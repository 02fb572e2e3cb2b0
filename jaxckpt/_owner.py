"""Who writes: this process's identity, the leases it holds, and whether another
process that wrote a record (a writer's lease, a reader's mark, an attempt's claim) is
still alive.

A record names its process by host and pid, plus what tells that process apart from a
later one given the same pid on the same host (``identity``): a restarted container
gets the same hostname and often the same pid, and the process's start time, in clock
ticks since boot, and the kernel's boot id tell them apart. ``judge`` reads a record
with the rules the writer's lease states (``_manager/lease.py``): on this host the pid
must run, still be that process and keep renewing; elsewhere only a renewal long ago
by the record's own clock says it is gone.

The leases this process holds are kept here too (``hold``, ``held_token_above``): an
attempt started under one records its token in its claim (``_claims``), which is part
of every save, so the core must see them without importing the manager.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any

from ._storage.location import Location

LEASE_FILE = ".jaxckpt-writer.json"  # a manager directory's writer lease (``_manager/lease.py``)
SKEW_S = 60.0  # a lease whose own timestamp is this much older than its period is expired at once
BOOT_ID_FILE = "/proc/sys/kernel/random/boot_id"


def host() -> str:
    return socket.gethostname()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def boot_id() -> str | None:
    try:
        with open(BOOT_ID_FILE) as f:
            return f.read().strip() or None
    except OSError:
        return None


def start_ticks(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (field 22 of
    ``/proc/<pid>/stat``); ``None`` where ``/proc`` does not tell."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # field 2, the command name, is in parentheses and may hold spaces and ')': fields
    # 3 onwards follow the last ')'
    fields = stat[stat.rfind(b")") + 1:].split()
    try:
        return int(fields[22 - 3])
    except (IndexError, ValueError):
        return None


def identity(pid: int) -> dict[str, Any]:
    """What tells process ``pid`` apart from a later process given the same pid on this
    host: ``boot_id`` (a reboot) and ``start_ticks`` (a restart), each only where
    ``/proc`` tells it. Recorded in leases, reader marks and claims."""
    found: dict[str, Any] = {}
    boot, ticks = boot_id(), start_ticks(pid)
    if boot is not None:
        found["boot_id"] = boot
    if ticks is not None:
        found["start_ticks"] = ticks
    return found


def judge(holder: dict[str, Any], lease_s: float) -> str:
    """Whether the process that wrote record ``holder`` (a lease, a mark, a claim) is
    ``alive``, ``gone`` or ``unknown`` (watch it for a lease period, ``lease_s``)."""
    if not holder:
        return "unknown"  # unreadable: being rewritten, or garbage; expires like any other
    pid, where, renewed = holder.get("pid"), holder.get("host"), holder.get("renewed")
    if not isinstance(renewed, (int, float)) or isinstance(renewed, bool):
        renewed = None
    if where == host() and isinstance(pid, int) and not isinstance(pid, bool) and pid > 0:
        return _judge_on_this_host(holder, pid, renewed, lease_s)
    if renewed is not None and time.time() - renewed > lease_s + SKEW_S:
        return "gone"
    return "unknown"


def _judge_on_this_host(holder: dict[str, Any], pid: int, renewed: float | None, lease_s: float) -> str:
    """A holder on this host is alive while its pid runs, is still the process that
    wrote the record, and renews it."""
    if not pid_alive(pid):
        return "gone"
    now = identity(pid)
    # A restarted container (same hostname, same pid) or a reboot: another process now.
    # Leases of older versions, or without /proc, lack these fields: pid and age decide.
    if any(key in holder and key in now and holder[key] != now[key] for key in ("boot_id", "start_ticks")):
        return "gone"
    if renewed is not None and time.time() - renewed > lease_s:
        return "gone"  # one host, one clock: not renewed for a lease period, which its holder gives up
    return "alive"


# The leases this process holds, by directory: an attempt started under one records its
# token, so a later writer knows the attempt's writer was the lease holder it replaced.
_held: dict[str, str] = {}
_held_lock = threading.Lock()


def _key(directory: Location) -> str:
    return os.path.realpath(directory.local) if directory.local is not None else str(directory)


def hold(directory: Location, token: str) -> None:
    """Record that this process holds the lease ``token`` on ``directory``."""
    with _held_lock:
        _held[_key(directory)] = token


def unhold(directory: Location, token: str) -> None:
    """Forget lease ``token`` on ``directory`` (if it is still the one recorded)."""
    with _held_lock:
        if _held.get(_key(directory)) == token:
            del _held[_key(directory)]


def held_token_above(target: Location) -> str | None:
    """The token of the lease this process holds on the directory that holds ``target``
    (a step of a manager directory), if any."""
    if target.local is not None:
        key = os.path.realpath(os.path.dirname(target.local.rstrip(os.sep)))
    else:
        key = str(target).rstrip("/").rsplit("/", 1)[0]
    with _held_lock:
        return next((t for k, t in _held.items() if k.rstrip("/") == key.rstrip("/")), None)
