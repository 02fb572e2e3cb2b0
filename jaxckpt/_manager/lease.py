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
no lease and never write or delete; their marks (``marks``) are judged by the same
rules. The identity a lease records, the judging of its holder and the leases this
process holds live in the core (``_owner``): a save's claim reads them too.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from typing import Any

from .. import _owner, _storage, _untrusted
from .._errors import CheckpointError
from .._owner import LEASE_FILE
from .._storage import kvstore as _kvstore
from .._storage.location import Location

_log = logging.getLogger("jaxckpt")

LEASE_S = 15.0  # a lease not renewed for this long has expired
RENEW_S = 3.0


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
        self._released = False
        self._thread = threading.Thread(target=self._renew_loop, name="jaxckpt-lease", daemon=True)
        self._thread.start()
        _owner.hold(directory, owner["token"])

    @classmethod
    def acquire(cls, directory: Location, lease_s: float | None = None) -> Lease:
        """Take the directory's lease, waiting out a holder whose liveness is unknown.

        Raises ``CheckpointError`` naming the holder when it is alive.
        """
        lease_s = LEASE_S if lease_s is None else lease_s
        token = uuid.uuid4().hex
        owner = {"host": _owner.host(), "pid": os.getpid(), **_owner.identity(os.getpid()), "token": token,
                 "started": time.time(), "renewed": time.time(), "count": 0, "lease_s": lease_s}
        watched: tuple[bytes | None, float] | None = None
        known: dict[str, Any] = {}  # the last readable lease (one read may catch a rewrite)
        while True:
            data = _kvstore.read_blob(directory, LEASE_FILE)
            holder = _untrusted.load_record(data)
            known = holder or known
            if holder is None:
                if _create(directory, owner):
                    return cls(directory, owner)
                continue  # someone else created it just now: look at theirs
            verdict = _owner.judge(holder, lease_period(holder, lease_s))
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
                with _kvstore.until(self._stop):  # a release does not wait for the store's answer
                    self.renew()
            except Exception as e:  # noqa: BLE001 - retried at the next renewal; lost after a lease period
                if self._stop.is_set():
                    return  # released meanwhile: nothing to retry
                self._failure = f"the last renewal failed: {type(e).__name__}: {e}"
                _log.warning("jaxckpt: renewing the writer lease of '%s' failed (retrying every %g s): %s",
                             self.directory, self.renew_s, e)
            if self.lost is not None:
                return

    def renew(self) -> None:
        began, now = time.monotonic(), time.time()
        _storage.fault("renew", LEASE_FILE)
        holder = _untrusted.load_record(_kvstore.read_blob(self.directory, LEASE_FILE))
        if not holder or holder.get("token") != self.owner["token"]:
            who = describe_owner(holder) if holder else "nobody (the lease file is gone)"
            self._lost = f"the writer lease of '{self.directory}' was taken over by {who}"
            self._stop.set()
            return
        owner = dict(self.owner, renewed=now, count=self.owner["count"] + 1)
        _kvstore.write_blob(self.directory, LEASE_FILE, json.dumps(owner).encode())
        self.owner, self._renewed_at, self._failure = owner, began, None

    def release(self) -> None:
        """Give the lease up: stop renewing, then remove the lease file if it is still ours.
        Done once, whatever happens: a failed removal (the store is gone) is raised here and
        never tried again (not at exit either); the file left is judged by its holder's
        liveness, as a crashed writer's is. After a store failed, all of it ends within
        the clean-up's bound (``kvstore.cleaning_up``)."""
        if self._released:
            return
        self._released = True
        self._stop.set()
        try:
            with _kvstore.cleaning_up():
                if threading.current_thread() is not self._thread:
                    # a renewal in flight finishes first: it must not write the file back after
                    # us. Past the clean-up's bound it is left to finish alone, and the file too.
                    self._thread.join(_kvstore.cleanup_wait(self.directory.url))
                    if self._thread.is_alive():
                        raise CheckpointError(f"Releasing the writer lease of '{self.directory}' failed: a renewal "
                                              "of it is still waiting for the store")
                if self.lost is None:
                    holder = _untrusted.load_record(_kvstore.read_blob(self.directory, LEASE_FILE))
                    if holder and holder.get("token") == self.owner["token"]:
                        _kvstore.delete_blob(self.directory, LEASE_FILE)
        finally:
            _owner.unhold(self.directory, self.owner["token"])
            self._lost = self._lost or "released"


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
        return _untrusted.load_record(_kvstore.read_blob(directory, LEASE_FILE)) == owner
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
