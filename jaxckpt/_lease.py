"""The writer's lease on a manager directory: one writing ``CheckpointManager`` at a time.

A writing manager (process 0 of its job) holds ``<directory>/.jaxckpt-writer.json``:
its owner (host, pid, a random token, start time) and a renewal counter, rewritten
every ``RENEW_S`` by a background thread. Another manager may take the directory over,
and clean the attempts left in it, only when the holder is provably gone:

* it ran on this host and its pid no longer exists, or
* its lease was not renewed for ``LEASE_S``, observed on the newcomer's own clock (so
  hosts' clocks never need to agree), or it was last renewed long ago by its own clock.

A live holder is refused with an error that names it. Readers
(``CheckpointManager(..., read_only=True)``) take no lease and never write or delete.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from typing import Any

from . import _storage
from ._errors import CheckpointError
from ._location import Location

LEASE_FILE = ".jaxckpt-writer.json"
LEASE_S = 15.0  # a lease not renewed for this long has expired
RENEW_S = 3.0
_SKEW_S = 60.0  # a lease whose own timestamp is this much older than LEASE_S is expired at once


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
    """A held lease. ``release()`` gives it up; ``lost`` tells if another writer took it."""

    def __init__(self, directory: Location, owner: dict[str, Any]):
        self.directory, self.owner = directory, owner
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew_loop, name="jaxckpt-lease", daemon=True)
        self._thread.start()

    @classmethod
    def acquire(cls, directory: Location, lease_s: float | None = None) -> Lease:
        """Take the directory's lease, waiting out a holder whose liveness is unknown.

        Raises ``CheckpointError`` naming the holder when it is alive.
        """
        lease_s = LEASE_S if lease_s is None else lease_s
        token = uuid.uuid4().hex
        owner = {"host": _host(), "pid": os.getpid(), "token": token, "started": time.time(),
                 "renewed": time.time(), "count": 0, "lease_s": lease_s}
        watched: tuple[bytes | None, float] | None = None
        known: dict[str, Any] = {}  # the last readable lease (one read may catch a rewrite)
        while True:
            data = _storage.read_blob(directory, LEASE_FILE)
            holder = _parse(data)
            known = holder or known
            if holder is None:
                if _create(directory, owner):
                    return cls(directory, owner)
                continue  # someone else created it just now: look at theirs
            verdict = _judge(holder, lease_s)
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

    def _renew_loop(self) -> None:
        while not self._stop.wait(RENEW_S):
            try:
                self.renew()
            except Exception as e:  # noqa: BLE001 - a failed renewal is reported when it matters
                self.lost = f"renewing the writer lease failed: {e}"

    def renew(self) -> None:
        holder = _parse(_storage.read_blob(self.directory, LEASE_FILE))
        if not holder or holder.get("token") != self.owner["token"]:
            who = describe_owner(holder) if holder else "nobody (the lease file is gone)"
            self.lost = f"the writer lease of '{self.directory}' was taken over by {who}"
            self._stop.set()
            return
        self.owner["renewed"] = time.time()
        self.owner["count"] += 1
        _storage.write_blob(self.directory, LEASE_FILE, json.dumps(self.owner).encode())

    def release(self) -> None:
        if self._stop.is_set() and self.lost is None and not self._thread.is_alive():
            return
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join()
        if self.lost is None:
            holder = _parse(_storage.read_blob(self.directory, LEASE_FILE))
            if holder and holder.get("token") == self.owner["token"]:
                _storage.delete_blob(self.directory, LEASE_FILE)
        self.lost = self.lost or "released"


def _judge(holder: dict[str, Any], lease_s: float) -> str:
    """``alive``, ``gone`` or ``unknown`` (watch it for a lease period)."""
    if not holder:
        return "unknown"  # unreadable: being rewritten, or garbage; expires like any other
    pid, host = holder.get("pid"), holder.get("host")
    if host == _host() and isinstance(pid, int) and not isinstance(pid, bool):
        return "alive" if _pid_alive(pid) else "gone"
    renewed = holder.get("renewed")
    if isinstance(renewed, (int, float)) and time.time() - renewed > lease_s + _SKEW_S:
        return "gone"
    return "unknown"


def _remove_if_unchanged(directory: Location, data: bytes | None) -> None:
    """Remove the lease file judged dead, unless it changed since it was read."""
    if directory.local is None:
        if _storage.read_blob(directory, LEASE_FILE) == data:
            _storage.delete_blob(directory, LEASE_FILE)
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
        _storage.write_blob(directory, LEASE_FILE, data)
        return _parse(_storage.read_blob(directory, LEASE_FILE)) == owner
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
