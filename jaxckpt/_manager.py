"""``CheckpointManager``: the one stateful class. Steps under one directory, async
commits, retention, discovery of the latest committed step.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from . import _checkpoint, _commit, _distributed, _retention, _snapshot, _storage
from ._errors import CheckpointError, CheckpointNotFoundError
from ._manifest import Manifest


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
      timeout_s: how long processes wait for each other at a commit (multi-process).
      clock: returns the time in seconds; inject a fake one in tests.

    The latest committed step is always kept. Deletion happens only after a newer step
    committed, in the background, and never touches a step being restored.

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
    ):
        self._policy = _retention.RetentionPolicy.make(
            max_to_keep=max_to_keep, keep_period=keep_period, keep_time_interval=keep_time_interval,
            best_metric=best_metric, best_mode=best_mode, keep_best=keep_best)
        if not isinstance(save_interval_steps, int) or save_interval_steps < 1:
            raise ValueError(f"save_interval_steps must be a positive int, got {save_interval_steps!r}")
        if not isinstance(max_pending, int) or max_pending < 1:
            raise ValueError(f"max_pending must be a positive int, got {max_pending!r}")
        self._dir = _storage.resolve(directory)
        self._interval = save_interval_steps
        self._async = async_save
        self._max_pending = max_pending
        self._timeout = timeout_s
        self._clock = clock
        self._lock = threading.RLock()
        self._pending: list[_Pending] = []
        self._error: tuple[int, BaseException] | None = None
        self._reading: dict[int, int] = {}  # step -> restores in progress
        self._deferred_delete: set[int] = set()
        self._closed = False
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxckpt-save")
        if self._dir.local is not None and _distributed.process_index() == 0:
            import os

            os.makedirs(self._dir.local, exist_ok=True)
        if _distributed.process_index() == 0:
            for name in _commit.stale_attempts(self._dir):
                _storage.delete_tree(self._dir.child(name))
        self._steps: dict[int, Manifest] = dict(_commit.discover_steps(self._dir))
        _distributed.agree(f"manager{_distributed.next_id()}/start '{self._dir}'", None, self._timeout)
        ref = weakref.ref(self)
        self._atexit = lambda: (m := ref()) is not None and m._finish_at_exit()
        atexit.register(self._atexit)

    # --- queries ---------------------------------------------------------------------

    @property
    def directory(self) -> str:
        return str(self._dir)

    def all_steps(self) -> list[int]:
        """Committed steps, ascending."""
        with self._lock:
            return sorted(self._steps)

    def latest_step(self) -> int | None:
        """The newest committed step, or ``None``."""
        with self._lock:
            return max(self._steps) if self._steps else None

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
        found = _commit.discover_steps(self._dir)
        with self._lock:
            self._steps = dict(found)

    def _manifest(self, step: int) -> Manifest:
        with self._lock:
            if step not in self._steps:
                raise CheckpointNotFoundError(f"No committed step {step} in '{self._dir}'")
            return self._steps[step]

    def _step_infos(self) -> list[_retention.StepInfo]:
        with self._lock:
            return [
                _retention.StepInfo(s, float(m.info.get("commit_time", m.info.get("created_unix", 0.0))),
                                    m.info.get("metrics"))
                for s, m in self._steps.items()
            ]

    # --- save ------------------------------------------------------------------------

    def save(self, step: int, state: Any, *, metrics: Mapping[str, Any] | None = None,
             force: bool = False) -> bool:
        """Save ``state`` as ``step``; return ``False`` if the interval skips it.

        Returns once the state is snapshotted: the caller may donate or overwrite its
        arrays right away. With ``async_save`` the write and commit continue in the
        background.

        Raises:
          CheckpointError: ``step`` is already committed or in flight, or an earlier
            background save failed (chained to the original exception).
        """
        t_start = time.perf_counter()
        self._check_open()
        self._raise_background_error()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointError(f"step must be a non-negative int, got {step!r}")
        with self._lock:
            if step in self._steps:
                raise CheckpointError(f"Step {step} is already committed in '{self._dir}'")
            if any(p.step == step for p in self._pending if not p.future.done()):
                raise CheckpointError(f"Step {step} is already being saved to '{self._dir}'")
        if not force and step % self._interval != 0:
            return False
        metrics = dict(metrics) if metrics is not None else None
        if metrics is not None:
            metrics = _checkpoint._check_metadata(metrics)
        self._wait_for_slot()
        snap = _snapshot.snapshot(state, copy_host_arrays=self._async)
        op_id = _distributed.next_id()  # in program order, the same in every process
        blocking = time.perf_counter() - t_start
        job = lambda: self._write(step, snap, metrics, t_start, blocking, op_id)
        if not self._async:
            job()
            return True
        future = self._executor.submit(job)
        with self._lock:
            self._pending.append(_Pending(step, future, snap.nbytes_local))
        return True

    def _wait_for_slot(self) -> None:
        while True:
            with self._lock:
                live = [p for p in self._pending if not p.future.done()]
                self._pending = live
                if len(live) < self._max_pending:
                    return
                oldest = live[0]
            concurrent.futures.wait([oldest.future])
            self._raise_background_error()

    def _write(self, step: int, snap: _snapshot.Snapshot, metrics: dict | None, t_start: float,
               blocking: float, op_id: int) -> None:
        try:
            final = self._dir.child(_commit.step_name(step))
            info = {
                "step": step,
                "metrics": metrics,
                "blocking_seconds": round(blocking, 6),
                "staging_bytes": snap.nbytes_local,
            }
            manifest = _checkpoint.save_snapshot(final, snap, extra_info=info, timeout_s=self._timeout,
                                                 total_since=t_start, clock=self._clock, op_id=op_id)
            with self._lock:
                self._steps[step] = manifest
            self._apply_retention()
        except BaseException as e:
            with self._lock:
                if self._error is None:
                    self._error = (step, e)
            if not self._async:
                self._raise_background_error()
            raise

    def _apply_retention(self) -> None:
        doomed = _retention.steps_to_delete(self._step_infos(), self._policy)
        with self._lock:
            doomed = set(doomed) | {s for s in self._deferred_delete if s in self._steps}
            busy = {s for s in doomed if self._reading.get(s)}
            self._deferred_delete = busy
            doomed -= busy
            for s in doomed:
                self._steps.pop(s, None)
        if _distributed.process_index() == 0:
            for s in sorted(doomed):
                _commit.delete_step(self._dir, s, _commit.new_token())

    def _raise_background_error(self) -> None:
        with self._lock:
            err, self._error = self._error, None
        if err is not None:
            step, exc = err
            raise CheckpointError(f"Saving step {step} to '{self._dir}' failed: {exc}") from exc

    # --- restore ---------------------------------------------------------------------

    def restore(self, step: int | None = None, target: Any = None, *, shardings: Any = None,
                partial: bool = False) -> Any:
        """Restore ``step`` (default: the latest committed one); see ``jaxckpt.restore``.

        Raises:
          CheckpointNotFoundError: no committed step (or not this one).
        """
        with self._lock:
            if step is None:
                if not self._steps:
                    raise CheckpointNotFoundError(f"No committed step in '{self._dir}'")
                step = max(self._steps)
            elif step not in self._steps:
                raise CheckpointNotFoundError(
                    f"No committed step {step} in '{self._dir}' (committed: {sorted(self._steps)})")
            self._reading[step] = self._reading.get(step, 0) + 1
        try:
            return _checkpoint.restore(self._dir.child(_commit.step_name(step)), target,
                                       shardings=shardings, partial=partial)
        finally:
            with self._lock:
                self._reading[step] -= 1

    # --- lifecycle -------------------------------------------------------------------

    def wait_until_finished(self) -> None:
        """Block until every pending save committed; raise the first background error."""
        while True:
            with self._lock:
                futures = [p.future for p in self._pending]
            if not futures:
                break
            concurrent.futures.wait(futures)
            with self._lock:
                self._pending = [p for p in self._pending if not p.future.done()]
        self._raise_background_error()

    def close(self) -> None:
        """Wait for pending saves, then release the background thread."""
        if self._closed:
            return
        try:
            self.wait_until_finished()
        finally:
            self._closed = True
            self._executor.shutdown(wait=True)
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
        return f"CheckpointManager({str(self._dir)!r}, steps={self.all_steps()})"
