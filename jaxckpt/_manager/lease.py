"""The writer's lease on a manager directory: one writing ``CheckpointManager`` at a time.

A writing manager (process 0 of its job) holds ``<directory>/.jaxckpt-writer.json``:
its owner (host, pid, what identifies that process beyond its pid, a random token,
start time) and a renewal counter, rewritten every ``RENEW_S`` by a background thread.
Another manager may take the directory over, and clean the attempts left in it, only
when the holder is provably gone:

* it ran on this host and its pid no longer exists, or that pid is now another process
  (a restarted container gets the same hostname and often the same pid: the process's
  start time, in clock ticks since boot, and the kernel's boot id tell them apart), or
  its last renewal is older than its lease period (one host: one clock);
* it ran elsewhere and its lease was not renewed for ``LEASE_S``, observed on the
  newcomer's own clock (so hosts' clocks never need to agree), or it was last renewed
  long ago by its own clock.

The holder keeps its lease through failed renewals (a storage hiccup) and counts it
lost only when another writer holds the file or no renewal succeeded for a whole lease
period, after which a newcomer on its host may take it over. A live holder is refused
with an error that names it. Readers (``CheckpointManager(..., read_only=True)``) take
no lease and never write or delete; their marks (``_readers``) are judged by the same
rules.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any

from .. import _storage
from .._errors import CheckpointError
from .._storage import kvstore as _kvstore
from .._storage.location import Location

_log = logging.getLogger("jaxckpt")

LEASE_FILE = ".jaxckpt-writer.json"
LEASE_S = 15.0  # a lease not renewed for this long has expired
RENEW_S = 3.0
_SKEW_S = 60.0  # a lease whose own timestamp is this much older than LEASE_S is expired at once
_BOOT_ID = "/proc/sys/kernel/random/boot_id"


def _host() -> str:
    return socket.gethostname()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _boot_id() -> str | None:
    try:
        with open(_BOOT_ID) as f:
            return f.read().strip() or None
    except OSError:
        return None


def _start_ticks(pid: int) -> int | None:
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
    ``/proc`` tells it. Recorded in leases and reader marks."""
    found: dict[str, Any] = {}
    boot, ticks = _boot_id(), _start_ticks(pid)
    if boot is not None:
        found["boot_id"] = boot
    if ticks is not None:
        found["start_ticks"] = ticks
    return found


def lease_period(holder: dict[str, Any], default: float) -> float:
    """The lease period a holder recorded (it gives its lease up after that long without a
    renewal), or ``default`` for a lease without a sane one (older versions, garbage)."""
    lease_s = holder.get("lease_s")
    if isinstance(lease_s, bool) or not isinstance(lease_s, (int, float)) or not 0 < lease_s < 1e9:
        return float(default)
    return float(lease_s)


def describe_owner(owner: dict[str, Any]) -> str:
    started = owner.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, (int, float)) else "?"
    return f"pid {owner.get('pid')} on host {owner.get('host')!r} (since {when})"


def _parse(data: bytes | None) -> dict[str, Any] | None:
    if data is None:
        return None
    try:
        owner = json.loads(data)
    except (ValueError, RecursionError):
        return {}
    return owner if isinstance(owner, dict) else {}


class Lease:
    """A held lease. ``release()`` gives it up; ``lost`` tells why it is no longer ours."""

    def __init__(self, directory: Location, owner: dict[str, Any]):
        self.directory, self.owner = directory, owner
        self.lease_s = float(owner["lease_s"])
        # a short lease period renews more often, so that a few renewals fit in one
        self.renew_s = min(RENEW_S, self.lease_s / 4)
        self._lost: str | None = None
        self._renewed_at = time.monotonic()  # when the last renewal that succeeded began
        self._failure: str | None = None  # why the renewals fail, while they do
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew_loop, name="jaxckpt-lease", daemon=True)
        self._thread.start()
        with _held_lock:
            _held[_key(directory)] = owner["token"]

    @classmethod
    def acquire(cls, directory: Location, lease_s: float | None = None) -> Lease:
        """Take the directory's lease, waiting out a holder whose liveness is unknown.

        Raises ``CheckpointError`` naming the holder when it is alive.
        """
        lease_s = LEASE_S if lease_s is None else lease_s
        token = uuid.uuid4().hex
        owner = {"host": _host(), "pid": os.getpid(), **identity(os.getpid()), "token": token,
                 "started": time.time(), "renewed": time.time(), "count": 0, "lease_s": lease_s}
        watched: tuple[bytes | None, float] | None = None
        known: dict[str, Any] = {}  # the last readable lease (one read may catch a rewrite)
        while True:
            data = _kvstore.read_blob(directory, LEASE_FILE)
            holder = _parse(data)
            known = holder or known
            if holder is None:
                if _create(directory, owner):
                    return cls(directory, owner)
                continue  # someone else created it just now: look at theirs
            verdict = _judge(holder, lease_period(holder, lease_s))
            if verdict == "unknown" and watched is not None and watched[0] != data:
                verdict = "alive"  # renewed while we watched
            if verdict == "alive":
                raise CheckpointError(
                    f"'{directory}' is being written by another CheckpointManager: "
                    f"{describe_owner(holder or known)}. Stop it first, or open this directory with "
                    "CheckpointManager(..., read_only=True) to list and restore without writing. "
                    f"(If you are sure that writer is gone, delete '{directory.url}/{LEASE_FILE}'.)")
            if verdict == "unknown":
                now = time.monotonic()
                if watched is None:
                    watched = (data, now)
                if now - watched[1] <= lease_s:
                    time.sleep(min(0.5, lease_s / 10))
                    continue
            # gone: move the dead lease aside (only one contender wins the rename), then claim
            _remove_if_unchanged(directory, data)

    @property
    def lost(self) -> str | None:
        """Why the lease is no longer ours (another writer holds it, no renewal succeeded
        for a whole lease period, or it was released); ``None`` while it is held.

        One failed renewal loses nothing: the next one retries. After a lease period
        without a renewal a newcomer on this host judges the holder gone, so the holder
        gives the lease up one renewal interval before that (it commits nothing a
        newcomer may be cleaning), for good, whether or not the storage comes back.
        """
        if self._lost is None:
            silent = time.monotonic() - self._renewed_at
            if silent > self.lease_s - self.renew_s:
                self._lost = (f"the writer lease of '{self.directory}' was not renewed for {silent:.1f} s "
                              f"({self._failure or 'renewals stalled'}); after its lease period "
                              f"({self.lease_s:g} s) another writer may take the directory over")
                self._stop.set()
        return self._lost

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.renew_s):
            try:
                self.renew()
            except Exception as e:  # noqa: BLE001 - retried at the next renewal; lost after a lease period
                self._failure = f"the last renewal failed: {type(e).__name__}: {e}"
                _log.warning("jaxckpt: renewing the writer lease of '%s' failed (retrying every %g s): %s",
                             self.directory, self.renew_s, e)
            if self.lost is not None:
                return

    def renew(self) -> None:
        began, now = time.monotonic(), time.time()
        _storage.fault("renew", LEASE_FILE)
        holder = _parse(_kvstore.read_blob(self.directory, LEASE_FILE))
        if not holder or holder.get("token") != self.owner["token"]:
            who = describe_owner(holder) if holder else "nobody (the lease file is gone)"
            self._lost = f"the writer lease of '{self.directory}' was taken over by {who}"
            self._stop.set()
            return
        owner = dict(self.owner, renewed=now, count=self.owner["count"] + 1)
        _kvstore.write_blob(self.directory, LEASE_FILE, json.dumps(owner).encode())
        self.owner, self._renewed_at, self._failure = owner, began, None

    def release(self) -> None:
        if self._lost == "released":
            return
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join()
        with _held_lock:
            if _held.get(_key(self.directory)) == self.owner["token"]:
                del _held[_key(self.directory)]
        if self.lost is None:
            holder = _parse(_kvstore.read_blob(self.directory, LEASE_FILE))
            if holder and holder.get("token") == self.owner["token"]:
                _kvstore.delete_blob(self.directory, LEASE_FILE)
        self._lost = self._lost or "released"


# The leases this process holds, by directory: an attempt started under one records its
# token, so a later writer knows the attempt's writer was the lease holder it replaced.
_held: dict[str, str] = {}
_held_lock = threading.Lock()


def _key(directory: Location) -> str:
    return os.path.realpath(directory.local) if directory.local is not None else str(directory)


def held_token(directory: Location) -> str | None:
    """The token of the lease this process holds on ``directory``, if any."""
    with _held_lock:
        return _held.get(_key(directory))


def held_token_above(target: Location) -> str | None:
    """The token of the lease this process holds on the directory that holds ``target``
    (a step of a manager directory), if any."""
    if target.local is not None:
        key = os.path.realpath(os.path.dirname(target.local.rstrip(os.sep)))
    else:
        key = str(target).rstrip("/").rsplit("/", 1)[0]
    with _held_lock:
        return next((t for k, t in _held.items() if k.rstrip("/") == key.rstrip("/")), None)


def _judge(holder: dict[str, Any], lease_s: float) -> str:
    """``alive``, ``gone`` or ``unknown`` (watch it for a lease period)."""
    if not holder:
        return "unknown"  # unreadable: being rewritten, or garbage; expires like any other
    pid, host, renewed = holder.get("pid"), holder.get("host"), holder.get("renewed")
    if not isinstance(renewed, (int, float)) or isinstance(renewed, bool):
        renewed = None
    if host == _host() and isinstance(pid, int) and not isinstance(pid, bool) and pid > 0:
        return _judge_on_this_host(holder, pid, renewed, lease_s)
    if renewed is not None and time.time() - renewed > lease_s + _SKEW_S:
        return "gone"
    return "unknown"


def _judge_on_this_host(holder: dict[str, Any], pid: int, renewed: float | None, lease_s: float) -> str:
    """A holder on this host is alive while its pid runs, is still the process that
    wrote the lease, and renews it."""
    if not _pid_alive(pid):
        return "gone"
    now = identity(pid)
    # A restarted container (same hostname, same pid) or a reboot: another process now.
    # Leases of older versions, or without /proc, lack these fields: pid and age decide.
    if any(key in holder and key in now and holder[key] != now[key] for key in ("boot_id", "start_ticks")):
        return "gone"
    if renewed is not None and time.time() - renewed > lease_s:
        return "gone"  # one host, one clock: not renewed for a lease period, which its holder gives up
    return "alive"


def _remove_if_unchanged(directory: Location, data: bytes | None) -> None:
    """Remove the lease file judged dead, unless it changed since it was read."""
    if directory.local is None:
        if _kvstore.read_blob(directory, LEASE_FILE) == data:
            _kvstore.delete_blob(directory, LEASE_FILE)
        return
    path = os.path.join(directory.local, LEASE_FILE)
    aside = f"{path}.dead-{uuid.uuid4().hex}"
    try:
        os.rename(path, aside)  # atomic: of two contenders, one moves it
    except FileNotFoundError:
        return
    with open(aside, "rb") as f:
        moved = f.read()
    if moved != data:  # a contender's fresh lease: put it back
        try:
            os.link(aside, path)
        except FileExistsError:
            pass
    os.remove(aside)


def _create(directory: Location, owner: dict[str, Any]) -> bool:
    """Create the lease file only if it does not exist (atomically on a local disk)."""
    data = json.dumps(owner).encode()
    if directory.local is None:
        # Object stores here have no create-if-absent: write, then read back who won.
        _kvstore.write_blob(directory, LEASE_FILE, data)
        return _parse(_kvstore.read_blob(directory, LEASE_FILE)) == owner
    path = os.path.join(directory.local, LEASE_FILE)
    tmp = f"{path}.{owner['token']}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, path)  # fails if the lease exists: exactly one creator wins
        return True
    except FileExistsError:
        return False
    finally:
        os.remove(tmp)
