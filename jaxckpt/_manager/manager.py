"""``CheckpointManager``: the one stateful class. Steps under one directory, async
commits, retention, discovery of the latest committed step.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import functools
import html
import json
import logging
import os
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from .. import _checkpoint, _commit, _distributed, _html, _restore, _snapshot, _tasks, _verify
from .._errors import CheckpointError, CheckpointNotFoundError
from .._manifest import Manifest
from .._storage import kvstore as _kvstore
from .._storage import location as _location
from . import cadence as _cadence
from . import history as _history
from . import hostcopy as _hostcopy
from . import lease as _lease
from . import marks as _marks
from . import preemption as _preemption
from . import retention as _retention
from . import tiers as _tiers

_log = logging.getLogger("jaxckpt")


_FALL_BACK = object()  # a local read that some process could not do


class _Pending:
    def __init__(self, step: int, future: concurrent.futures.Future, staging_bytes: int):
        self.step, self.future, self.staging_bytes = step, future, staging_bytes


class CheckpointManager:
    """Saves numbered steps under ``directory`` and keeps the right ones.

    ``save`` returns once the state is snapshotted into host buffers the manager owns;
    the writes and the commit run in a background thread (``async_save=True``). A
    background failure is raised from the next ``save``, ``wait_until_finished`` or
    ``close``. Only committed steps (a valid ``manifest.json``) are ever listed,
    restored or counted for retention.

    Args:
      directory: where steps live (``<directory>/<step>/``); path, URL or kvstore spec.
      max_to_keep: keep the latest N committed steps (``None``: no limit).
      keep_period: also keep every step divisible by this, forever.
      keep_time_interval: also keep one step per this many seconds (or a
        ``datetime.timedelta``) of commit time, forever.
      best_metric: the key of ``metrics`` that ranks steps (``best_step()``, ``keep_best``).
      best_mode: ``"min"`` or ``"max"``: which direction is better.
      keep_best: keep the best N steps by ``best_metric``.
      save_interval_steps: ``save`` skips steps not divisible by this (unless ``force``).
      async_save: write in the background (``False``: ``save`` blocks until committed).
      max_pending: saves in flight at once; a further ``save`` waits for the oldest.
      timeout_s: multi-process: how long processes wait for a peer that has not
        started the same save (a peer still writing is waited for while it is alive).
      clock: returns the time in seconds; inject a fake one in tests.
      persistent_directory: a second, durable tier (e.g. an ``s3://`` URL). Every
        ``persistent_interval_steps``-th committed step is copied there in the
        background from the committed local files, with its own manifest-last commit
        and retention (``persistent_max_to_keep``). ``restore()`` takes the newest step
        of either tier (the local copy when both have it). In a multi-process job
        ``directory`` may be each host's own local disk: each host keeps what its
        devices hold, and a step restores locally only when every process can read its
        part there (see docs/storage.md).
      verify_before_delete: read every new step back and check its checksums
        (``jaxckpt.verify``) before it counts: only then may retention delete older
        steps for it. A step that fails is deleted, never listed, and its save fails
        (raised by the next ``save``/``wait_until_finished``), naming the problems.
      max_staging_bytes: the most host memory the staged copies of saves in flight may
        take (device-to-host copies; numpy leaves, which an async save copies). A bigger
        save stages and writes in waves: ``save`` then returns once its last wave is
        staged. CPU jax arrays are staged as zero-copy views and do not count; a chunk
        bigger than the budget is staged on its own. ``None``: everything at once.
      read_only: list, restore and inspect only: never write, delete or clean. Any
        number of read-only managers (notebooks, evaluators) may watch a directory that
        a training run is writing.

    One writing manager per directory: it holds a lease (``.jaxckpt-writer.json``,
    renewed in the background) and a second writer is refused with an error naming the
    first. Attempts left by a writer that is provably gone (its pid no longer exists on
    this host, or its lease expired) are cleaned when the next writer starts.

    The latest committed step is always kept. Deletion happens only after a newer step
    committed, in the background, and never touches a step being restored.

    A background failure is raised by a later call at a point that is the same in every
    process (when the failed save is the oldest one a ``save`` must wait for, or by
    ``wait_until_finished``), so the processes of a job never drift apart.

    Example:
      >>> with jaxckpt.CheckpointManager("/ckpts", max_to_keep=3) as mgr:
      ...     for step in range(1000):
      ...         state = train_step(state)
      ...         mgr.save(step, state, metrics={"loss": float(loss)})
      >>> state = mgr.restore(target=abstract_state)
    """

    def __init__(
        self,
        directory: Any,
        *,
        max_to_keep: int | None = None,
        keep_period: int | None = None,
        keep_time_interval: Any = None,
        best_metric: str | None = None,
        best_mode: str = "min",
        keep_best: int | None = None,
        save_interval_steps: int = 1,
        async_save: bool = True,
        max_pending: int = 1,
        timeout_s: float = _distributed.DEFAULT_TIMEOUT_S,
        clock: Callable[[], float] = time.time,
        read_only: bool = False,
        persistent_directory: Any = None,
        persistent_interval_steps: int | None = None,
        persistent_max_to_keep: int | None = None,
        verify_before_delete: bool = False, max_staging_bytes: int | None = None,
    ):
        self._policy = _retention.RetentionPolicy.make(
            max_to_keep=max_to_keep, keep_period=keep_period, keep_time_interval=keep_time_interval,
            best_metric=best_metric, best_mode=best_mode, keep_best=keep_best)
        _check_positive(save_interval_steps=save_interval_steps, max_pending=max_pending)
        self._dir = _location.resolve(directory)
        self._interval = save_interval_steps
        self._async = async_save
        self._max_pending, self._staging = max_pending, _snapshot.staging_budget(max_staging_bytes)
        self._timeout, self._clock, self._read_only = timeout_s, clock, read_only
        self._verify = bool(verify_before_delete)
        self._lock = threading.RLock()
        self._pending: list[_Pending] = []  # in submission order; popped in that order only
        self._submitted: set[int] = set()  # steps saved by this manager and not known to have failed
        self._reading: dict[int, int] = {}  # step -> restores in progress
        self._deferred_delete: set[int] = set()
        self._scanning: set[int] | None = None  # steps committed while reload() scans
        self._partial: dict[int, Manifest] = {}  # per-host: committed here, lacking on some host
        self._closed = False
        self._lease: _lease.Lease | None = None
        self._advice: _cadence.CadenceAdvice | None = None  # the last advise_interval()
        self._preemption = _preemption.PreemptionWatch()  # installs nothing until used
        # The processes sharing each directory: one group when the directory is shared,
        # one per host when each host has a local directory of its own (see _find_groups).
        everyone = tuple(range(_distributed.process_count()))
        self._groups: tuple[tuple[int, ...], ...] = (everyone,)
        self._group = everyone
        self._check_directory()
        self._persistent = self._make_persistent(persistent_directory, persistent_interval_steps,
                                                 persistent_max_to_keep)
        if read_only:
            self._steps: dict[int, Manifest] = dict(_commit.discover_steps(self._dir))
        else:
            self._start_writer()
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxckpt-save")
        self._deleter = _Deleter(self._dir)
        ref = weakref.ref(self)
        self._atexit = lambda: (m := ref()) is not None and m._finish_at_exit()
        atexit.register(self._atexit)

    def _make_persistent(self, directory: Any, interval: int | None, max_to_keep: int | None) -> Any:
        if directory is None:
            if interval is not None or max_to_keep is not None:
                raise CheckpointError("persistent_interval_steps/persistent_max_to_keep need persistent_directory")
            return None
        if interval is None and self._read_only:
            interval = 1  # a reader only lists and restores
        if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
            raise CheckpointError(f"persistent_interval_steps must be a positive int, got {interval!r}")
        return _tiers.PersistentTier(_location.resolve(directory), interval, max_to_keep, self._timeout)

    def _check_directory(self) -> None:
        local = self._dir.local
        if local is not None and os.path.exists(local) and not os.path.isdir(local):
            raise CheckpointError(f"CheckpointManager directory '{self._dir}' is a file, not a directory")

    def _start_writer(self) -> None:
        """The first process of each directory's group takes the lease and cleans dead
        attempts; every process learns every outcome, and the steps every group holds."""
        name = f"manager{_distributed.next_id()}"
        with _distributed.Operation(name, str(self._dir), self._timeout) as op:
            self._groups = self._find_groups(op)
            self._group = next(g for g in self._groups if _distributed.process_index() in g)
            error: BaseException | None = None
            try:
                if self._leads():
                    self._lease = self._take_directory(self._dir)
                if self._persistent is not None and _distributed.process_index() == 0:
                    # the copies commit and retention deletes there: a writer like any other
                    self._persistent.lease = self._take_directory(self._persistent.dir)
            except BaseException as e:  # noqa: BLE001 - reported to every process
                error = e
            if error is not None:
                self._release_leases()
            op.post("started", error if error is not None else b"")
            if error is not None:
                raise error
            try:
                op.wait_for("started", self._others())
            except BaseException:
                self._release_leases()
                raise
            self._steps = self._agreed_steps(op)

    def _release_leases(self) -> None:
        for lease in (self._lease, self._persistent.lease if self._persistent is not None else None):
            if lease is not None:
                lease.release()

    def _take_directory(self, where: _location.Location) -> _lease.Lease:
        """Create ``where``, take its writer lease, clean what a gone writer left there."""
        if where.local is not None:
            try:
                os.makedirs(where.local, exist_ok=True)
            except OSError as e:
                raise CheckpointError(f"Cannot create manager directory '{where}': {e}") from e
        lease = _lease.Lease.acquire(where)
        weakref.finalize(self, lease.release)  # a manager dropped unclosed
        try:
            # Every attempt left here belongs to a writer that is gone: ours to clean.
            for attempt in _commit.stale_attempts(where):
                if _commit.attempt_alive(where, attempt, lease.owner["token"]):
                    _log.info("jaxckpt: keeping attempt %s in '%s': its writer (%s) is alive", attempt, where,
                              _lease.describe_owner(_commit.attempt_owner(where, attempt) or {}))
                    continue
                _log.info("jaxckpt: removing attempt %s left by a writer that is gone", attempt)
                _commit.remove_attempt(where, attempt)
            _commit.remove_dead_claims(where)
            # On an object store: data prefixes inside steps that no manifest names.
            for key in _commit.remove_dead_step_data(where, lease_token=lease.owner["token"]):
                _log.info("jaxckpt: removed data %s left by a writer that is gone", key)
        except BaseException:
            lease.release()
            raise
        return lease

    def _leads(self) -> bool:
        """Whether this process acts for its directory (lease, commits, deletes)."""
        return self._group[0] == _distributed.process_index()

    def _per_host(self) -> bool:
        return len(self._groups) > 1

    @staticmethod
    def _others() -> list[int]:
        me = _distributed.process_index()
        return [p for p in range(_distributed.process_count()) if p != me]

    def _find_groups(self, op: _distributed.Operation) -> tuple[tuple[int, ...], ...]:
        """Which processes share this directory. Each process drops a probe file in its
        directory; each then looks for every process's probe. A shared directory (or an
        object store) is one group; a local directory per host gives one group per host.
        """
        n = _distributed.process_count()
        if n == 1 or self._dir.local is None:
            return (tuple(range(n)),)
        token = op.broadcast("probe", _commit.new_token().encode() if _distributed.process_index() == 0 else None)
        probe = os.path.join(self._dir.local, f".jaxckpt-probe-{token.decode()}-")
        me = _distributed.process_index()
        try:
            os.makedirs(self._dir.local, exist_ok=True)
            with open(probe + str(me), "wb"):
                pass
            op.post("probed")
            op.wait_for("probed", self._others())
            mine = tuple(p for p in range(n) if os.path.exists(probe + str(p)))
            op.post("group", json.dumps(mine).encode())
            seen = {p: tuple(json.loads(d)) for p, d in op.wait_for("group", self._others()).items()}
        finally:
            with contextlib.suppress(OSError):
                os.remove(probe + str(me))
        seen[me] = mine
        groups = tuple(sorted(set(seen.values())))
        if any(p not in seen[p] or any(seen[q] != seen[p] for q in seen[p]) for p in seen):
            raise CheckpointError(f"The processes of this job see the manager directory '{self._dir}' "
                                  f"inconsistently (process -> processes sharing it: {seen})")
        return groups

    def _agreed_steps(self, op: _distributed.Operation) -> dict[int, Manifest]:
        """The committed steps: with per-host directories, those every host holds.

        A step that some host lacks (a replaced node, a disk mounted late) is left out of
        the listing but never deleted here: with replicated state another host's copy is
        complete, and a restore can still get it (``_hostcopy``). It is deleted once a
        newer step is committed everywhere or the persistent tier holds it (``_write``).
        """
        found = dict(_commit.discover_steps(self._dir))
        if not self._per_host():
            return found
        op.post("steps", json.dumps(sorted(found)).encode())
        views = {p: set(json.loads(d)) for p, d in op.wait_for("steps", self._others()).items()}
        views[_distributed.process_index()] = set(found)
        every = set.intersection(*views.values())
        partial = {s: m for s, m in found.items() if s not in every}
        if partial:
            lacking = {s: [p for p, v in sorted(views.items()) if s not in v] for s in partial}
            _log.warning("jaxckpt: steps %s in '%s' are not held by every host (lacking: %s); not listed, "
                         "kept until a newer step is committed everywhere or the persistent tier holds them",
                         sorted(partial), self._dir,
                         "; ".join(f"step {s}: process(es) {ps}" for s, ps in sorted(lacking.items())))
        with self._lock:
            self._partial = partial
        return {s: m for s, m in found.items() if s in every}

    def _drop_partial(self, committed: int) -> None:
        """After ``committed`` is committed everywhere: delete the partial steps it
        supersedes (older ones) and those the persistent tier holds (the same decision in
        every process of a group; its first process deletes)."""
        durable = set(self._persistent_steps())
        with self._lock:
            doomed = sorted(s for s in self._partial if s != committed and (s < committed or s in durable))
            self._partial.pop(committed, None)  # replaced by this commit
            for s in doomed:
                del self._partial[s]
        if doomed and self._leads():
            _log.info("jaxckpt: deleting steps %s in '%s' that some host lacked (step %d is committed "
                      "everywhere)", doomed, self._dir, committed)
            self._deleter.submit(doomed)

    # --- queries ---------------------------------------------------------------------

    @property
    def directory(self) -> str:
        return str(self._dir)

    def all_steps(self) -> list[int]:
        """Committed steps (of either tier), ascending."""
        with self._lock:
            return sorted(set(self._steps) | set(self._persistent_steps()))

    def latest_step(self) -> int | None:
        """The newest committed step (of either tier), or ``None``."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def step_tiers(self) -> dict[int, tuple[str, ...]]:
        """Which tiers hold each committed step: ``("local",)``, ``("persistent",)`` or both."""
        with self._lock:
            local, durable = set(self._steps), set(self._persistent_steps())
        return {s: tuple(t for t, held in (("local", s in local), ("persistent", s in durable)) if held)
                for s in sorted(local | durable)}

    def _persistent_steps(self) -> dict[int, Manifest]:
        return dict(self._persistent.steps) if self._persistent is not None else {}

    def metrics(self, step: int) -> dict[str, Any] | None:
        """The metrics saved with ``step`` (``None`` if it had none)."""
        return self._manifest(step).info.get("metrics")

    def info(self, step: int) -> dict[str, Any]:
        """What the manifest of ``step`` records: versions, times, bytes, save stats."""
        return dict(self._manifest(step).info)

    def best_step(self) -> int | None:
        """The committed step with the best ``best_metric`` (``None`` if none reports it)."""
        if self._policy.best_metric is None:
            raise CheckpointError("best_step() needs best_metric= in the CheckpointManager")
        ranked = _retention.best_steps(self._step_infos(), self._policy.best_metric, self._policy.best_mode, 1)
        return ranked[0] if ranked else None

    def reached_preemption(self, step: int) -> bool:
        """``True`` at the one step, the same in every process, at which a preempted job
        must save and exit: after SIGTERM (or JAX's preemption notice) reached any
        process. Call it every step, in every process, with consecutive steps; it costs
        well under a microsecond. See docs/multihost.md, "Preemption".

        Example:
          >>> if mgr.reached_preemption(step):
          ...     mgr.save(step, state, force=True)
          ...     mgr.wait_until_finished()
          ...     sys.exit(0)
        """
        self._check_open()
        return self._preemption.reached(step)

    def should_save(self, step: int) -> bool:
        """True when ``save(step, ...)`` would save (the interval fits, not yet saved)."""
        with self._lock:
            if step in self._steps or any(p.step == step for p in self._pending):
                return False
        return step % self._interval == 0

    @property
    def staging_bytes(self) -> int:
        """Host bytes held by snapshots whose writes have not finished."""
        with self._lock:
            return sum(p.staging_bytes for p in self._pending if not p.future.done())

    def reload(self) -> None:
        """Rescan the directory (steps written by another manager)."""
        with self._lock:
            self._scanning = set()
        try:
            found = _commit.discover_steps(self._dir)
        finally:
            with self._lock:
                ours, self._scanning = self._scanning, None
        if self._persistent is not None:
            durable = _commit.discover_steps(self._persistent.dir)
            with self._lock:
                self._persistent.steps = dict(durable)
        with self._lock:
            # a step this manager committed while the scan ran may be missing from it
            for s in ours or ():
                if s in self._steps and s not in found:
                    found[s] = self._steps[s]
            self._steps = dict(found)

    def _manifest(self, step: int) -> Manifest:
        with self._lock:
            man = self._steps.get(step) or self._persistent_steps().get(step)
        if man is None:
            raise CheckpointNotFoundError(f"No committed step {step} in '{self._dir}'")
        return man

    def _step_infos(self) -> list[_retention.StepInfo]:
        with self._lock:
            return [
                _retention.StepInfo(s, float(m.info.get("commit_time", m.info.get("created_unix", 0.0))),
                                    m.info.get("metrics"))
                for s, m in self._steps.items()
            ]

    # --- history and cadence -----------------------------------------------------------

    def history(self) -> _history.History:
        """One record per step committed in this directory, steps deleted since included.

        Reads the run's log (``history.jsonl``, written by the writing manager after
        each commit) and merges it with the manifests of the steps still committed, so
        steps saved before the log existed are listed too. A read-only manager rescans
        the directory first (its writer is another process).

        Example:
          >>> hist = mgr.history()
          >>> [(r.step, r.metrics["loss"], r.exists) for r in hist]
          [(100, 0.9, False), (200, 0.7, True), (300, 0.6, True)]
        """
        if self._read_only:
            self.reload()
        with self._lock:
            committed = {s: m.info for s, m in self._steps.items()}
        return _history.load(self._dir, committed)

    def advise_interval(self, mtbf_s: float, *, window: int = _cadence.WINDOW) -> _cadence.CadenceAdvice:
        """How often to save, from this run's measured save cost and ``mtbf_s``.

        Young–Daly: the interval ``sqrt(2·C·M)`` where ``C`` is the median blocking
        seconds of the last ``window`` saves and ``M`` the mean time between failures;
        see ``jaxckpt._manager.cadence`` for the model of the time lost. The result is also
        shown by the manager's notebook view.

        Args:
          mtbf_s: the job's mean time between failures, in seconds.
          window: how many of the most recent saves to measure (default 10).

        Raises:
          CheckpointError: fewer than 2 saves with timings in the history.

        Example:
          >>> advice = mgr.advise_interval(mtbf_s=6 * 3600)
          >>> advice.interval_steps, f"{advice.lost_fraction_advised:.1%}"
          (1200, '0.9%')
        """
        saves = [
            _cadence.SaveSample(r.step, r.commit_time, r.blocking_seconds, r.total_seconds)
            for r in self.history()
            if None not in (r.commit_time, r.blocking_seconds, r.total_seconds)
        ]
        try:
            advice = _cadence.advise(saves, mtbf_s, window=window)
        except CheckpointError as e:
            raise CheckpointError(f"{e} (in '{self._dir}')") from None
        self._advice = advice
        return advice

    # --- save ------------------------------------------------------------------------

    def save(self, step: int, state: Any, *, metrics: Mapping[str, Any] | None = None,
             force: bool = False) -> bool:
        """Save ``state`` as ``step``; return ``False`` if the interval skips it.

        Returns once the state is snapshotted: the caller may donate or overwrite its
        arrays right away. With ``async_save`` the write and commit continue in the
        background.

        Args:
          step: a non-negative int, newer than every step saved or committed so far
            (``force=True`` allows an older one, and ignores the interval).
          metrics: a dict of str to numbers or strings; jax and numpy scalars are
            accepted and read on the background thread (no device sync in the loop).

        Raises:
          CheckpointError: ``step`` is already committed or in flight, is older than the
            latest one, the manager is read-only or closed, or an earlier background
            save failed (chained to the original exception).
        """
        t_start = time.perf_counter()
        step = self._check_step(step, force)
        if not force and step % self._interval != 0:
            return False
        metrics = _check_metrics(metrics)
        self._wait_for_slot()
        op_id = _distributed.next_id()  # in program order, the same in every process
        snap = _snapshot.snapshot(state, copy_host_arrays=self._async,
                                  group=self._group if self._per_host() else (), budget=self._staging)
        blocking = time.perf_counter() - t_start
        def job() -> None:
            try:
                self._write(step, snap, metrics, t_start, blocking, op_id)
            finally:
                snap.close()

        with self._lock:
            self._submitted.add(step)
        if not self._async:
            try:
                job()
            except BaseException as e:
                raise self._failure(step, e) from e
            finally:
                with self._lock:
                    self._submitted.discard(step)
            return True
        try:
            future = self._executor.submit(job)
        except RuntimeError as e:  # the executor was shut down by a concurrent close()
            snap.close()
            with self._lock:
                self._submitted.discard(step)
            raise CheckpointError(f"CheckpointManager for '{self._dir}' was closed during save({step})") from e
        with self._lock:
            self._pending.append(_Pending(step, future, snap.nbytes_local))
        snap.stage_rest()  # with max_staging_bytes: the waves left, as the writer frees room
        return True

    def _check_step(self, step: Any, force: bool) -> int:
        """Refuse a save this manager can never do right. Depends only on state that is
        the same in every process (discovered steps and this manager's own saves)."""
        self._check_open()
        if self._read_only:
            raise CheckpointError(f"CheckpointManager for '{self._dir}' is read-only: save() is not allowed")
        # A lost writer lease is not checked here: only the process holding it knows, and
        # raising in it alone would skip its operation counter. The commit refuses it
        # instead (``info`` in ``_write``), and every process learns that outcome.
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise CheckpointError(f"step must be a non-negative int, got {step!r}")
        step = int(step)
        with self._lock:
            if step in self._steps:
                raise CheckpointError(f"Step {step} is already committed in '{self._dir}'")
            if step in self._submitted:
                raise CheckpointError(f"Step {step} is already being saved to '{self._dir}'")
            newest = max(set(self._steps) | self._submitted, default=None)
        if not force and newest is not None and step < newest:
            raise CheckpointError(
                f"Step {step} is older than step {newest} in '{self._dir}': it could never be "
                "restored as the latest; pass force=True to save it anyway")
        return step

    def _wait_for_slot(self) -> None:
        """Settle the oldest saves until fewer than ``max_pending`` are in flight.

        Which saves are settled depends only on how many were submitted, never on which
        happen to be done already, so every process raises a failure at the same call.
        """
        while True:
            with self._lock:
                if len(self._pending) < self._max_pending:
                    return
                oldest = self._pending.pop(0)
            self._settle(oldest)

    def _settle(self, pending: _Pending) -> None:
        """Wait for one save; raise its failure as a ``CheckpointError``."""
        concurrent.futures.wait([pending.future])
        error = pending.future.exception()
        with self._lock:  # committed (now in _steps) or failed (may be retried)
            self._submitted.discard(pending.step)
        if error is not None:
            raise self._failure(pending.step, error) from error

    def _failure(self, step: int, error: BaseException) -> CheckpointError:
        return CheckpointError(f"Saving step {step} to '{self._dir}' failed: {error}")

    def _write(self, step: int, snap: _snapshot.Snapshot, metrics: dict | None, t_start: float,
               blocking: float, op_id: int) -> None:
        final = self._dir.child(_commit.step_name(step))
        metrics = _metrics_to_json(metrics)

        def check() -> None:  # every process, before it reports its part written
            lost = self._lease.lost if self._lease is not None else None
            if lost:  # the save fails in every process (its agreement), at the same call
                raise CheckpointError(f"CheckpointManager for '{self._dir}' cannot commit: {lost}")

        def info() -> dict[str, Any]:  # process 0, right before the commit
            check()
            return {
                "step": step,
                "metrics": metrics,
                "blocking_seconds": round(max(blocking, snap.staged_at() - t_start), 6),
                "staging_bytes": snap.nbytes_local,
                "total_seconds": round(time.perf_counter() - t_start, 6),
                "commit_time": self._clock(),
            }

        manifest = _checkpoint.save_snapshot(final, snap, info=info, check=check, timeout_s=self._timeout,
                                             op_id=op_id)
        if self._verify:
            self._verify_step(step, final, op_id)
        with self._lock:
            self._steps[step] = manifest
            if self._scanning is not None:
                self._scanning.add(step)
        if _distributed.process_index() == 0:
            try:
                _history.append(self._dir, step, manifest.info)
            except Exception as e:  # noqa: BLE001 - the step is committed; the log is a convenience
                _log.warning("jaxckpt: recording step %d in the history of '%s' failed: %s", step, self._dir, e)
        if self._per_host():
            self._drop_partial(step)
        if self._persistent is not None and self._persistent.wants(step):
            self._pin(step)  # retention keeps the local copy until the persistent one is done
            self._persistent.submit(step, final, manifest, self._groups, functools.partial(self._unpin, step))
        try:
            self._apply_retention()
        except Exception as e:  # noqa: BLE001 - the step is committed; a failed delete is retried next time
            _log.warning("jaxckpt: retention in '%s' after step %d failed: %s", self._dir, step, e)

    def _verify_step(self, step: int, final: Any, op_id: int) -> None:
        """``verify_before_delete``: the first process of each directory reads its copy
        back; every process learns every verdict. A step that fails is deleted. The
        reading happens inside the agreement, so the peers judge a long verify by its
        progress (the stall bound), not by ``timeout_s``."""
        error: BaseException | None = None
        with _distributed.Operation(f"verify{op_id}", str(final), self._timeout) as op:
            if self._leads():
                try:
                    report = _verify.verify(final)
                    if not report.ok:  # one entry per damaged file, with the leaves it costs
                        shown = "; ".join(_damage(d) for d in report.damaged[:3])
                        more = f" (and {len(report.damaged) - 3} more)" if len(report.damaged) > 3 else ""
                        error = CheckpointError(f"step {step} failed verification after its commit: {shown}{more}")
                except CheckpointError as e:
                    error = e
            op.post("verified", error if error is not None else b"")
            try:
                op.wait_for("verified", self._others())
            except CheckpointError as e:
                error = error or e
        if error is None:
            return
        _log.error("jaxckpt: %s; deleting it", error)
        if self._leads():
            _commit.delete_step(self._dir, step, _commit.new_token())
        raise error

    def _pin(self, step: int) -> None:
        with self._lock:
            self._reading[step] = self._reading.get(step, 0) + 1

    def _unpin(self, step: int) -> None:
        with self._lock:
            self._reading[step] -= 1
            deferred = not self._reading[step] and step in self._deferred_delete
        if deferred:  # retention wanted it gone while it was being copied
            try:
                self._apply_retention()
            except Exception as e:  # noqa: BLE001 - retried after the next save
                _log.warning("jaxckpt: retention in '%s' after copying step %d failed: %s", self._dir, step, e)

    def _apply_retention(self) -> None:
        doomed = _retention.steps_to_delete(self._step_infos(), self._policy)
        with self._lock:
            doomed = set(doomed) | {s for s in self._deferred_delete if s in self._steps}
            busy = {s for s in doomed if self._reading.get(s)}
            self._deferred_delete = busy
            doomed -= busy
            for s in doomed:
                self._steps.pop(s, None)
        if self._leads() and doomed:  # each directory's first process deletes there
            self._deleter.submit(sorted(doomed))

    # --- restore ---------------------------------------------------------------------

    def restore(self, step: int | None = None, target: Any = None, *, shardings: Any = None,
                partial: bool = False, allow_narrowing: bool = False, key_map: Any = None,
                missing: str | None = None) -> Any:
        """Restore ``step`` (default: the latest committed one); see ``jaxckpt.restore``.

        Saves this manager has in flight are finished first, so a step just saved (or
        the latest, by default) is the one restored; a failure among them is raised here.

        Raises:
          CheckpointNotFoundError: no committed step (or not this one).
          CheckpointError: ``step`` is not an int (a target passed first: pass ``target=``).

        Example:
          >>> state = mgr.restore(target=abstract_state)       # the latest step
          >>> state = mgr.restore(100, target=abstract_state)  # step 100
        """
        step = self._step_to_restore(step)
        read = functools.partial(_restore.restore, target=target, shardings=shardings, partial=partial,
                                 allow_narrowing=allow_narrowing, key_map=key_map, missing=missing)
        held = step is not None and step in self._steps
        if held:  # the settling below may run retention: it must not take the step asked for
            self._pin(step)
        try:
            self._settle_pending()
            if self._per_host():
                return self._restore_agreed(step, read)
            return self._restore_pinned(step, read)
        finally:
            if held:  # a delete retention deferred meanwhile runs after the next save, as always
                with self._lock:
                    self._reading[step] -= 1

    def _step_to_restore(self, step: Any) -> int | None:
        """``restore`` takes the step first, where ``jaxckpt.restore`` takes the target
        second: a tree passed first (``mgr.restore(abstract_state)``) would otherwise fail
        deep inside as ``unhashable type``. Say which argument it belongs to."""
        if step is None:
            return None
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
            raise CheckpointError(
                f"Restoring from '{self._dir}': mgr.restore() takes the step first: got a "
                f"{type(step).__name__}; pass target=... (mgr.restore(target=abstract_state), or "
                "mgr.restore(step, target=abstract_state))")
        if step < 0:
            raise CheckpointError(f"step must be a non-negative int, got {step!r} (restoring from '{self._dir}')")
        return int(step)

    def _restore_pinned(self, step: int | None, read: Callable[[Any], Any]) -> Any:
        where, step = self._restore_location(step)
        try:
            if not self._read_only or where != self._dir.child(_commit.step_name(step)):
                return read(where)  # a writer's own restores are held by self._reading
            # Another process writes here: mark the step so its retention waits for us.
            with _marks.ReaderMark(self._dir, step):
                if not _commit.has_manifest(where):
                    raise CheckpointNotFoundError(f"Step {step} in '{self._dir}' was deleted")
                return read(where)
        finally:
            with self._lock:
                self._reading[step] -= 1

    def _read_pinned(self, where: Any, step: int, read: Callable[[Any], Any]) -> Any:
        with self._lock:
            self._reading[step] = self._reading.get(step, 0) + 1
        try:
            return read(where)
        finally:
            with self._lock:
                self._reading[step] -= 1

    def _restore_agreed(self, step: int | None, read: Callable[[Any], Any]) -> Any:
        """Per-host directories: the newest step (or ``step``) that every host holds
        locally or the persistent tier holds. Read locally only when every process read
        its part there; otherwise every process reads the persistent copy. A step that
        some hosts lack and the persistent tier does not hold is first copied to them
        from a host that holds all of it (``_hostcopy``); when none does, it is skipped
        (the latest) or named with the hosts that lack it (a step asked for)."""
        me = _distributed.process_index()
        with _distributed.Operation(f"restore{_distributed.next_id()}", str(self._dir), self._timeout,
                                    lane="restore") as op:
            held = sorted(_commit.discover_steps(self._dir))
            view = [held, sorted(self._persistent_steps()), socket.gethostname()]
            op.post("held", json.dumps(view).encode())
            views = {p: json.loads(d) for p, d in op.wait_for("held", self._others()).items()}
            views[me] = view
            everywhere = set.intersection(*(set(v[0]) for v in views.values()))
            durable = set(views[0][1])  # process 0's view of the persistent tier decides
            known = set().union(*(set(v[0]) for v in views.values())) | durable
            lacked: list[str] = []
            for s in [step] if step is not None else sorted(known, reverse=True):
                if s not in everywhere and s not in durable and s in known and self._copy_to_lacking(op, s, views):
                    everywhere.add(s)
                if s in everywhere:
                    result = self._read_local_agreed(op, s, read, s in durable)
                    if result is not _FALL_BACK:
                        return result
                if s in durable:
                    return self._read_pinned(self._persistent.dir.child(_commit.step_name(s)), s, read)
                if s in known:
                    lacked.append(self._lacking(s, views))
                    if step is None:
                        _log.warning("jaxckpt: %s; restoring an older step", lacked[-1])
        where = f" ({'; '.join(lacked)})" if lacked else ""
        if step is None:
            raise CheckpointNotFoundError(f"No committed step in '{self._dir}' held by every host{where}")
        if lacked:
            raise CheckpointError(f"Cannot restore step {step} from '{self._dir}': {lacked[0]}")
        raise CheckpointNotFoundError(
            f"No committed step {step} held by every host in '{self._dir}' (committed: {sorted(known)})")

    def _lacking(self, step: int, views: dict[int, list[Any]]) -> str:
        who = [f"process {p} on host {v[2]!r}" for p, v in sorted(views.items()) if step not in v[0]]
        return (f"step {step} is missing on {', '.join(who)}, no host holds all of it and the persistent "
                "tier does not hold it")

    def _copy_to_lacking(self, op: _distributed.Operation, step: int, views: dict[int, list[Any]]) -> bool:
        """Copy ``step`` to the hosts that lack it from one that holds all of it; the same
        answer in every process. The step is then listed like any other."""
        me = _distributed.process_index()
        holds = step in views[me][0]
        man = _hostcopy.copy_from_holders(op, step, self._dir, holds, self._leads(),
                                          self._leads() and not holds, self._read_only)
        if man is None:
            return False
        with self._lock:
            self._steps[step] = man
            self._partial.pop(step, None)
        return True

    def _read_local_agreed(self, op: _distributed.Operation, step: int, read: Callable[[Any], Any],
                           durable: bool) -> Any:
        """Read ``step`` from this host's directory; ``_FALL_BACK`` when some process
        could not (a host lost part of its copy) and the persistent tier has the step."""
        error: BaseException | None = None
        try:
            result = self._read_pinned(self._dir.child(_commit.step_name(step)), step, read)
        except CheckpointError as e:
            result, error = None, e
        op.post(f"local{step}", b"0" if error is not None else b"1")
        failed = sorted(p for p, ok in op.wait_for(f"local{step}", self._others()).items() if ok != b"1")
        failed = sorted(failed + ([_distributed.process_index()] if error is not None else []))
        if not failed:
            return result
        del result
        if durable:
            _log.warning("jaxckpt: process(es) %s could not read step %d from their local directory "
                         "(%s); every process reads the persistent tier", failed, step, error or "see there")
            return _FALL_BACK
        if error is not None:
            raise error
        raise CheckpointError(f"Step {step} could not be read from the local directory of process(es) "
                              f"{failed} and the persistent tier does not hold it")

    def _restore_location(self, step: int | None) -> tuple[Any, int]:
        """Where to read ``step`` (default: the newest of either tier): the local copy when
        there is one. Pins it against retention until the caller unpins."""
        with self._lock:
            durable = self._persistent_steps()
            known = set(self._steps) | set(durable)
            if step is None:
                if not known:
                    raise CheckpointNotFoundError(f"No committed step in '{self._dir}'")
                step = max(known)
            elif step not in known:
                raise CheckpointNotFoundError(
                    f"No committed step {step} in '{self._dir}' (committed: {sorted(known)})")
            self._reading[step] = self._reading.get(step, 0) + 1
            if step in self._steps:
                return self._dir.child(_commit.step_name(step)), step
            return self._persistent.dir.child(_commit.step_name(step)), step

    # --- deleting and attempts ---------------------------------------------------------

    def delete(self, step: int) -> None:
        """Delete a committed step now (the writer only; call it in every process).

        The step stops being listed at once; on a local disk its directory is renamed
        to a hidden attempt name before its data is deleted, so a half-deleted step is
        never listed by anyone. Its history record stays (with ``exists=False``).

        Raises:
          CheckpointNotFoundError: ``step`` is not committed.
          CheckpointError: the manager is read-only or closed, ``step`` is being restored,
            or the writer lease was lost. In a multi-process job every process raises
            (the step stays listed) when any of them refuses.

        Example:
          >>> mgr.delete(100)
          >>> 100 in mgr.all_steps()
          False
        """
        self._check_open()
        if self._read_only:
            raise CheckpointError(f"CheckpointManager for '{self._dir}' is read-only: delete() is not allowed")
        op_id = _distributed.next_id()  # before any verdict that one process may reach alone
        error: BaseException | None = None
        with self._lock:
            if step not in self._steps:
                error = CheckpointNotFoundError(
                    f"No committed step {step} in '{self._dir}' (committed: {sorted(self._steps)})")
            elif self._reading.get(step):
                error = CheckpointError(f"Step {step} in '{self._dir}' is being restored; delete it afterwards")
            else:
                del self._steps[step]
                self._deferred_delete.discard(step)
        unlisted = error is None
        if error is None and self._leads():
            try:
                error = self._delete_as_leader(step)
            except Exception as e:  # noqa: BLE001 - reported to every process, then raised
                error = e
        # Only the lease holder knows whether its lease is lost, only the first process of
        # a directory sees its reader marks: every process learns every verdict.
        with _distributed.Operation(f"delete{op_id}", str(self._dir), self._timeout) as op:
            op.post("deleted", error if error is not None else b"")
            try:
                op.wait_for("deleted", self._others())
            except CheckpointError as e:
                error = error or e
        if error is None:
            return
        if unlisted:
            try:
                manifest = self._manifest_on_disk(step)
            except CheckpointError:  # deleted here, refused for another host's directory
                raise error from None
            with self._lock:
                self._steps[step] = manifest
        raise error

    def _delete_as_leader(self, step: int) -> CheckpointError | None:
        """Delete ``step`` in this process's directory; the error refusing it, if any."""
        lost = self._lease.lost if self._lease is not None else None
        if lost:
            return CheckpointError(f"CheckpointManager for '{self._dir}' cannot delete step {step}: {lost}")
        if _marks.delete_unless_read(self._dir, step, _commit.new_token()):
            return None
        readers = _marks.live_readers(self._dir, step)
        who = ", ".join(_lease.describe_owner(r) for r in readers) or "another process"
        return CheckpointError(f"Step {step} in '{self._dir}' is being restored by {who}; delete it afterwards")

    def _manifest_on_disk(self, step: int) -> Manifest:
        return _commit.read_manifest(self._dir.child(_commit.step_name(step)))

    def attempts(self) -> list[dict[str, Any]]:
        """The hidden, uncommitted attempts in the directory (read-only managers too).

        Each is a save in progress or left by a crash (``.<step>.jaxckpt-tmp-*``), or a
        step being deleted (``.<step>.jaxckpt-old-*``); on an object store, a data prefix
        under a step that its manifest does not name (``<step>/d/<token>``, kind
        ``"data"``). A writing manager removes those of a writer that is gone when it
        starts.

        Returns:
          One dict per attempt, by name: ``step``, ``name``, ``kind`` (``"tmp"`` or
          ``"old"``), ``bytes`` and ``mtime`` (local disks; ``None`` elsewhere),
          ``writer`` (who holds the directory's writer lease, or ``None``) and
          ``writer_alive`` (``False`` when no writer holds it or the holder is provably
          gone: its attempts are dead).

        Example:
          >>> [(a["name"], a["writer_alive"]) for a in mgr.attempts()]
          [('.7.jaxckpt-tmp-3f2a9c1d0b4e', False)]
        """
        writer, gone = writer_lease(self._dir)
        token = None if gone or writer is None else writer.get("token")
        out = []
        for name in sorted(_commit.stale_attempts(self._dir)):
            stem = name[1:].split(_commit.TMP_MARK)[0].split(_commit.OLD_MARK)[0]
            size, mtime = _local_size_and_mtime(self._dir.child(name).local)
            owner = _commit.attempt_owner(self._dir, name)
            if owner is not None and owner.get("lease") is None:  # a plain save: judged by its own process
                who, alive = owner, _commit.attempt_alive(self._dir, name, token)
            elif owner is not None:  # a writer's: alive while the lease it was made under is held
                who, alive = writer, _commit.attempt_alive(self._dir, name, token)
            else:
                who, alive = writer, not gone or _commit.attempt_alive(self._dir, name, token)
            out.append({
                "step": _commit.parse_step_name(stem), "name": name,
                "kind": "tmp" if _commit.TMP_MARK in name else "old",
                "bytes": size, "mtime": mtime, "writer": who, "writer_alive": alive,
            })
        live: list[str] = []  # object stores: data prefixes of attempts (claimed) in progress
        dead = _commit.remove_dead_step_data(self._dir, dry_run=True, lease_token=token, live=live)
        for key, alive in sorted([(k, False) for k in dead] + [(k, True) for k in live]):
            out.append({"step": _commit.parse_step_name(key.split("/", 1)[0]), "name": key, "kind": "data",
                        "bytes": None, "mtime": None, "writer": writer, "writer_alive": alive})
        return out

    # --- lifecycle -------------------------------------------------------------------

    def _settle_pending(self) -> None:
        """Wait for every save in flight (oldest first); raise the first failure."""
        first: BaseException | None = None
        while True:
            with self._lock:
                if not self._pending:
                    break
                oldest = self._pending.pop(0)
            try:
                self._settle(oldest)
            except CheckpointError as e:
                first = first or e
        if first is not None:
            raise first

    def wait_until_finished(self) -> None:
        """Block until every pending save settled; raise the first failure among them."""
        first: BaseException | None = None
        try:
            self._settle_pending()
        except CheckpointError as e:
            first = e
        if self._persistent is not None:  # copies first: finishing one may queue local deletes
            for step, error in self._persistent.wait():
                first = first or CheckpointError(
                    f"Copying step {step} to the persistent tier '{self._persistent.dir}' failed: {error}")
        self._deleter.wait()
        if first is not None:
            raise first

    def close(self) -> None:
        """Wait for pending saves, then release the background thread and the lease."""
        if self._closed:
            return
        try:
            self.wait_until_finished()
        finally:
            self._closed = True
            self._preemption.close()  # gives the SIGTERM handler back
            self._executor.shutdown(wait=True)
            self._deleter.close()
            self._release_leases()
            atexit.unregister(self._atexit)

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"CheckpointManager for '{self._dir}' is closed")

    def _finish_at_exit(self) -> None:
        try:
            self.close()
        except BaseException as e:  # noqa: BLE001 - at exit, report instead of raising
            print(f"jaxckpt: a pending save failed at exit: {e}", file=sys.stderr)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        mode = ", read_only=True" if self._read_only else ""
        return f"CheckpointManager({str(self._dir)!r}{mode}, steps={self.all_steps()})"

    def _repr_html_(self) -> str:
        """The notebook view: directory, mode, committed steps, totals, cadence advice."""
        with self._lock:
            infos = {s: m.info for s, m in self._steps.items()}
        mode = "read-only" if self._read_only else "writer"
        return _render_html(str(self._dir), mode, infos, self._clock(), self._advice)


class _Deleter:
    """Retention's deletes, on a thread of their own: a slow delete (an object store
    deletes object by object) never holds up the next save. Each step is made
    invisible first; a step that a restore in another process is reading (see
    ``_readers``) is put back and tried again after the next save. A failure is logged
    and the step, still committed on disk, is found again by the next ``reload``/start."""

    def __init__(self, directory: Any):
        self._dir = directory
        self._worker = _tasks.Worker("jaxckpt-delete", self._delete)
        self._lock = threading.Lock()
        self._deferred: set[int] = set()  # being read elsewhere when we tried

    def submit(self, steps: list[int]) -> None:
        with self._lock:
            retry, self._deferred = self._deferred - set(steps), set()
        for step in sorted(set(steps) | retry):
            self._worker.submit(step)

    def _delete(self, step: int) -> None:
        try:
            if not _marks.delete_unless_read(self._dir, step, _commit.new_token()):
                _log.info("jaxckpt: step %d in '%s' is being restored elsewhere; deleting it later", step, self._dir)
                with self._lock:
                    self._deferred.add(step)
        except Exception as e:  # noqa: BLE001 - logged; the step is still committed on disk
            _log.warning("jaxckpt: deleting step %d in '%s' failed: %s", step, self._dir, e)

    def wait(self) -> None:
        """Until every submitted delete has run."""
        self._worker.wait()

    close = wait


def _damage(entry: dict[str, Any]) -> str:
    """One damaged file of a verify report: its problem and the leaves it costs."""
    leaves = entry.get("leaves") or []
    named = ", ".join(repr(p) for p in leaves[:3]) + (f" and {len(leaves) - 3} more" if len(leaves) > 3 else "")
    message = entry["message"] if entry["message"].startswith(entry["file"]) else f"{entry['file']}: {entry['message']}"
    return f"{message} (leaves {named})" if leaves else message


def _check_positive(**values: Any) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def _check_metrics(metrics: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Check metrics cheaply (types and shapes only: no device sync in the loop)."""
    if metrics is None:
        return None
    if not isinstance(metrics, Mapping):
        raise CheckpointError(f"metrics must be a dict of str to numbers, got {type(metrics).__name__}")
    out = {}
    for key, value in metrics.items():
        if not isinstance(key, str):
            raise CheckpointError(f"metrics key {key!r} is a {type(key).__name__}; metric names must be str")
        if isinstance(value, (jax.Array, np.ndarray, np.generic)):
            if value.size != 1:
                raise CheckpointError(f"metrics['{key}'] has shape {value.shape}; a metric must be a scalar")
            if not (jax.dtypes.issubdtype(value.dtype, np.number) or value.dtype == np.bool_):
                raise CheckpointError(f"metrics['{key}'] has dtype {value.dtype}; a metric must be a number")
        elif value is not None and not isinstance(value, (bool, int, float, str)):
            raise CheckpointError(
                f"metrics['{key}'] is a {type(value).__name__}; a metric must be a number, a str or None")
        out[key] = value
    return out


def _metrics_to_json(metrics: dict[str, Any] | None) -> dict[str, Any] | None:
    """Plain Python numbers for the manifest (runs on the background thread)."""
    if metrics is None:
        return None
    return {k: np.asarray(v).reshape(()).item() if hasattr(v, "dtype") else v for k, v in metrics.items()}


def writer_lease(directory: _location.Location) -> tuple[dict[str, Any] | None, bool]:
    """Who holds the directory's writer lease, and whether that holder is provably gone.

    Reads ``.jaxckpt-writer.json`` and nothing else (no waiting, no writing). ``(None,
    True)`` when no writer holds the directory. A holder whose liveness cannot be told
    yet (another host, recently renewed, or an unreadable lease) counts as alive.
    """
    holder = _lease._parse(_kvstore.read_blob(directory, _lease.LEASE_FILE))
    if holder is None:
        return None, True
    return holder, _lease._judge(holder, _lease.lease_period(holder, _lease.LEASE_S)) == "gone"


def _local_size_and_mtime(path: str | None) -> tuple[int | None, float | None]:
    """Bytes under a local directory (links not followed) and its mtime; ``None`` elsewhere."""
    if path is None:
        return None, None
    try:
        mtime = os.lstat(path).st_mtime
    except OSError:
        return None, None
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass  # deleted while we walked
    return total, mtime


# --- the notebook view ---------------------------------------------------------------

_HTML_ROWS = 200  # newest steps shown
_HTML_METRICS = 12  # metric columns shown
_TD = "padding:1px 8px"
_TR = "border-bottom:1px solid var(--jp-border-color2, #ccc)"
_TH = "padding:1px 8px;border-bottom:1px solid var(--jp-border-color1, #999)"


def _render_html(directory: str, mode: str, infos: Mapping[int, Mapping[str, Any]], now: float,
                 advice: _cadence.CadenceAdvice | None) -> str:
    """The manager as HTML that reads in light and dark JupyterLab themes (no fixed colours)."""
    esc = html.escape
    steps = sorted(infos, reverse=True)
    shown = steps[:_HTML_ROWS]
    names = list(dict.fromkeys(k for s in shown for k in _info_metrics(infos[s])))
    columns = ["step", "committed", "age", "size", "blocking s", "total s", *names[:_HTML_METRICS]]
    head = "".join(f"<th style='{_TH}'>{esc(c)}</th>" for c in columns)
    if len(names) > _HTML_METRICS:
        head += f"<th style='{_TH}'>… {len(names) - _HTML_METRICS} more metrics</th>"
    rows = "".join(_html_row(s, infos[s], names[:_HTML_METRICS], now) for s in shown)
    if len(steps) > len(shown):
        rows += (f"<tr><td colspan='{len(columns)}' style='{_TD};text-align:left'>… {len(steps) - len(shown)} "
                 "more (older steps not shown)</td></tr>")
    total_bytes = sum(_num(i.get("bytes")) or 0 for i in infos.values())
    blocking = sum(_num(i.get("blocking_seconds")) or 0.0 for i in infos.values())
    total_s = sum(_num(i.get("total_seconds")) or 0.0 for i in infos.values())
    summary = (f"{len(steps)} committed step{'s' if len(steps) != 1 else ''}, {_html.human_bytes(total_bytes)}; "
               f"saves blocked {blocking:.3g} s in all, {total_s:.3g} s from save to commit in all")
    table = (f"<table style='border-collapse:collapse;color:inherit;text-align:right'><thead><tr>{head}</tr></thead>"
             f"<tbody>{rows}</tbody></table>") if steps else "<div>no committed step yet</div>"
    return (
        "<div style='font-family:var(--jp-ui-font-family, inherit);color:var(--jp-ui-font-color1, inherit)'>"
        f"<div><b>CheckpointManager</b> <code>{esc(directory)}</code> ({esc(mode)})</div>"
        f"<div>{esc(summary)}</div>{table}<div style='margin-top:4px'>{_html_advice(advice)}</div></div>"
    )


def _html_row(step: int, info: Mapping[str, Any], names: list[str], now: float) -> str:
    esc = html.escape
    when = _num(info.get("commit_time"))
    when = _num(info.get("created_unix")) if when is None else when
    committed = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(when)) if when is not None else "?"
    age = _human_age(now - when) if when is not None else "?"
    size = _num(info.get("bytes"))
    metrics = _info_metrics(info)
    cells = [str(step), committed, age, _html.human_bytes(size) if size is not None else "?",
             _fmt(info.get("blocking_seconds")), _fmt(info.get("total_seconds")),
             *(_fmt(metrics.get(n)) for n in names)]
    return f"<tr style='{_TR}'>" + "".join(f"<td style='{_TD}'>{esc(c)}</td>" for c in cells) + "</tr>"


def _html_advice(advice: _cadence.CadenceAdvice | None) -> str:
    esc = html.escape
    if advice is None:
        return ("Cadence advice: call <code>mgr.advise_interval(mtbf_s=...)</code> with the job's mean "
                "time between failures.")
    text = (f"Cadence (MTBF {_human_age(advice.mtbf_s)}, save cost {advice.save_cost_s:.3g} s, "
            f"{advice.samples} recent saves): save every {advice.interval_steps} steps "
            f"(~{_human_age(advice.interval_s)}); now every {advice.current_interval_steps} steps "
            f"(~{_human_age(advice.current_interval_s)}). Expected time lost: "
            f"{advice.lost_fraction_now:.2%} now, {advice.lost_fraction_advised:.2%} advised.")
    return esc(text)


def _info_metrics(info: Mapping[str, Any]) -> dict[str, Any]:
    metrics = info.get("metrics")
    return metrics if isinstance(metrics, dict) else {}


def _num(v: Any) -> float | None:
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def _human_age(seconds: float) -> str:
    for limit, unit, div in ((120, "s", 1), (7200, "min", 60), (172800, "h", 3600)):
        if abs(seconds) < limit:
            return f"{seconds / div:.0f} {unit}" if unit == "s" else f"{seconds / div:.1f} {unit}"
    return f"{seconds / 86400:.1f} d"
