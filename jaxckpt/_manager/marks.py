"""Restores hold a step against the writer's retention: in other processes by a reader
mark on disk (``ReaderMark``), in the manager's own process by a count (``StepPins``).

A manager's ``restore`` (a read-only evaluator, a notebook, another job) marks the step
while it reads: ``<directory>/.jaxckpt-readers/<step>-<token>.json`` with its host, its
pid and what identifies that process beyond its pid (``_owner.identity``), and a
renewal time, rewritten every ``RENEW_S`` while the read lasts and removed after.
Before the writer deletes a step it makes the step invisible (no new reader can find
it), then looks for marks of that step: a live one puts the step back and defers the
delete; a dead one is removed. A mark is judged like the writer's lease (``_lease``):
dead when its pid is gone on this host or is now another process (a restarted
container: the start time and boot id the mark records differ), or when its renewal
time is older than its ``lease_s`` (this host: one clock) or ``lease_s`` + 60 s (another
host, whose clock may differ). A reader marks first and looks for the step after, so a
reader and a delete never both proceed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from .. import _commit, _owner, _storage, _untrusted
from .._errors import CheckpointNotFoundError
from .._storage import kvstore as _kvstore
from .._storage.location import Location
from . import lease as _lease

_log = logging.getLogger("jaxckpt")

READERS_DIR = ".jaxckpt-readers"
RENEW_S = 3.0
LEASE_S = 15.0


class ReaderMark:
    """Held while a restore reads ``step`` of manager ``directory``."""

    def __init__(self, directory: Location, step: int):
        self.directory = directory.child(READERS_DIR)
        self.key = f"{step}-{uuid.uuid4().hex[:12]}.json"
        now = time.time()
        self.owner = {"host": socket.gethostname(), "pid": os.getpid(), **_owner.identity(os.getpid()),
                      "started": now, "renewed": now, "lease_s": LEASE_S}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> ReaderMark:
        if self.directory.local is not None:
            os.makedirs(self.directory.local, exist_ok=True)
        _kvstore.write_blob(self.directory, self.key, json.dumps(self.owner).encode())
        self._thread = threading.Thread(target=self._renew, name="jaxckpt-reader", daemon=True)
        self._thread.start()
        return self

    def _renew(self) -> None:
        while not self._stop.wait(RENEW_S):
            self.owner["renewed"] = time.time()
            try:
                _storage.fault("renew", self.key)
                _kvstore.write_blob(self.directory, self.key, json.dumps(self.owner).encode())
            except Exception as e:  # noqa: BLE001 - the mark stays, just older
                _log.warning("jaxckpt: renewing the reader mark %s failed: %s", self.key, e)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            _kvstore.delete_blob(self.directory, self.key)
        except Exception as e:  # noqa: BLE001 - a stale mark only delays a delete until it expires
            _log.warning("jaxckpt: removing the reader mark %s failed: %s", self.key, e)


def live_readers(directory: Location, step: int) -> list[dict[str, Any]]:
    """The live marks of ``step``; dead ones are removed on the way."""
    where = directory.child(READERS_DIR)
    prefix = f"{step}-"
    try:
        names = [n for n in _kvstore.list_children(where) if n.startswith(prefix) and n.endswith(".json")]
    except Exception:  # noqa: BLE001 - no readers directory yet
        return []
    live = []
    for name in names:
        owner = _untrusted.load_record(_kvstore.read_blob(where, name))
        if owner is None:
            continue  # removed as we looked
        if owner and _owner.judge(owner, _lease.lease_period(owner, LEASE_S)) == "gone":
            _kvstore.delete_blob(where, name)
            continue
        live.append(owner)
    return live


def delete_unless_read(directory: Location, step: int, token: str) -> bool:
    """Delete committed ``step`` unless a live reader marks it; ``True`` when it is gone
    (``_commit.delete_step`` hides it first, then asks)."""
    return _commit.delete_step(directory, step, token, held=lambda: bool(live_readers(directory, step)))


class StepPins:
    """The steps this manager's own process is reading (a restore, a copy to the
    persistent tier): a count per step, under the manager's lock, that its retention and
    ``delete`` respect. ``hold`` is the one way to take and give back a pin."""

    def __init__(self, lock: Any):
        self._lock = lock  # the manager's: a step is chosen and pinned under one lock
        self._count: dict[int, int] = {}

    @contextlib.contextmanager
    def hold(self, step: int | None) -> Iterator[None]:
        """Pin ``step`` while the block runs (``None``: nothing to pin)."""
        if step is None:
            yield
            return
        with self._lock:
            self._count[step] = self._count.get(step, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                self._count[step] -= 1

    def held(self, step: int) -> bool:
        with self._lock:
            return bool(self._count.get(step))


def restore_here(mgr: Any, step: int | None, read: Callable[[Location], Any]) -> Any:
    """Manager ``mgr``'s restore of ``step`` from one directory (shared, or an object
    store) or its tier: chosen and pinned under the manager's lock; a read-only manager
    marks the step first (a writer elsewhere waits for it), then reads the manifest once,
    the restore's; a writer restores its own step on an object store from the manifest it
    holds, as it committed it."""
    with contextlib.ExitStack() as pinned:
        with mgr._lock:  # chosen and pinned at once: retention cannot take it in between
            where, step = mgr._steps.locate(step)
            pinned.enter_context(mgr._pins.hold(step))
        own = where == mgr._dir.child(_commit.step_name(step)) and not mgr._steps.foreign(step)
        if not mgr._read_only or not own:
            if own and where.local is None:  # not read again: a round trip
                pinned.enter_context(_commit.known_manifest(where, mgr._steps.manifest(step)))
            return read(where)  # a writer's own restores are held by its pins; orbax's writer marks nothing
        with ReaderMark(mgr._dir, step):
            man = _commit.manifest_if_any(where)  # read after the mark: the restore reads this one
            if man is None:
                raise CheckpointNotFoundError(f"Step {step} in '{mgr._dir}' was deleted")
            with _commit.known_manifest(where, man):
                return read(where)
