"""``CheckpointManager``: numbered steps under one directory, saved asynchronously, kept
by retention, restored by step or the latest committed one.

The class holds the user-facing methods and the save and restore flow; the policies and
mechanisms it calls live beside it in this wing: host groups and per-host agreement
(``hosts``, ``hostcopy``), the persistent tier and which tier a step is read from
(``tiers``), taking the directory over and deleting (``cleanup``), the writer lease
(``lease``), pins and reader marks (``marks``), retention, history, cadence and
preemption. Its notebook view is in ``jaxckpt._html``.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import functools
import logging
import operator
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from .. import _checkpoint, _commit, _distributed, _restore, _snapshot
from .._errors import CheckpointError
from .._storage import location as _location
from . import arguments as _arguments
from . import cadence as _cadence
from . import cleanup as _cleanup
from . import decisions as _decisions
from . import dedup as _dedup
from . import history as _history
from . import hosts as _hosts
from . import lossy as _lossy
from . import marks as _marks
from . import peerrepair as _peerrepair
from . import preemption as _preemption
from . import prefetch as _prefetch
from . import retention as _retention
from . import steplist as _steplist
from . import tiers as _tiers
from . import views as _views

_log = logging.getLogger("jaxckpt")


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
      save_interval_steps: ``save`` skips steps not divisible by this (unless ``force``):
        ``save_policy=jaxckpt.policies.every_steps(N)``.
      save_policy: when ``save`` saves (``jaxckpt.policies``: by steps, time, continuous,
        preemption, goodput; the same steps in every process, docs/training.md).
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
        bigger than the budget is staged on its own. A restore's read buffers keep to it
        too (``jaxckpt.restore``'s ``max_staging_bytes``). ``None``: everything at once.
      peer_copies: a local directory per host: each host's part of every step is also kept
        on this many partner hosts (a ring), to restore a lost host from (docs/storage.md).
      compression: as ``jaxckpt.save`` takes it; encoded in the background part of a save.
      quantize: as ``jaxckpt.save``; past ``Quantize.max_lossy_resumes`` lossy resumes: exact.
      dedup: a leaf whose bytes the previous step holds is referred to, not written again
        (the same ``jax.Array`` off CPU, or an equal blake3 hash); docs/dedup.md.
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

    def __init__(self, directory: Any, *, max_to_keep: int | None = None, keep_period: int | None = None,
                 keep_time_interval: Any = None, best_metric: str | None = None, best_mode: str = "min",
                 keep_best: int | None = None, save_interval_steps: int = 1, async_save: bool = True,
                 max_pending: int = 1, timeout_s: float = _distributed.DEFAULT_TIMEOUT_S,
                 clock: Callable[[], float] = time.time, read_only: bool = False,
                 persistent_directory: Any = None, persistent_interval_steps: int | None = None,
                 persistent_max_to_keep: int | None = None, verify_before_delete: bool = False,
                 max_staging_bytes: int | None = None, peer_copies: int = 0, compression: Any = None,
                 quantize: Any = None, save_policy: Any = None, dedup: bool = False):
        policy = _retention.RetentionPolicy.make(
            max_to_keep=max_to_keep, keep_period=keep_period, keep_time_interval=keep_time_interval,
            best_metric=best_metric, best_mode=best_mode, keep_best=keep_best)
        _arguments.check_positive(save_interval_steps=save_interval_steps, max_pending=max_pending)
        self._dir = _location.resolve(directory)
        self._policy = _decisions.make(save_policy, save_interval_steps)
        self._async, self._verify = async_save, bool(verify_before_delete)
        self._staging = _snapshot.staging_budget(max_staging_bytes)
        self._restore_budget = max_staging_bytes  # a restore's read buffers too
        self._codecs = _lossy.Codecs(compression, quantize)
        self._dedup = _dedup.make(dedup, self, peer_copies=peer_copies, persistent=persistent_directory,
                                  codecs=self._codecs, read_only=read_only, staging=max_staging_bytes,
                                  max_pending=max_pending)
        self._timeout, self._clock, self._read_only = timeout_s, clock, read_only
        self._lock = threading.RLock()
        self._saves = _Saves(self._lock, max_pending, self._dir, self._after_write)
        self._pins = _marks.StepPins(self._lock)  # steps read here (restores, copies): retention waits
        self._partial = _hosts.PartialSteps(self._dir)  # per-host: committed here, lacking on some host
        self._closed, self._advice = False, None  # the last advise_interval()
        self._preemption = _preemption.PreemptionWatch()  # installs nothing until used
        self._record = _decisions.Record(clock, self.history, self._saves.all_done)  # the policy's facts
        self._decider = _decisions.Decider(self._policy, self._record.facts, self._preemption.reached, timeout_s, self)
        # the processes sharing each directory; the writer lease (the first process of a group)
        self._groups, self._lease = _hosts.HostGroups.everyone(), None
        _cleanup.check_directory(self._dir)
        self._persistent = _tiers.make_persistent(persistent_directory, persistent_interval_steps,
                                                  persistent_max_to_keep, timeout_s, read_only)
        if read_only:  # jaxckpt's steps, or an orbax run's (_formats.orbaxrun)
            local = _steplist.listed(self._dir)
        else:
            self._groups, self._lease, local = _cleanup.start_writer(
                self._dir, self._persistent, timeout_s, self._partial, owner=self)
        self._steps = _tiers.Listing(self._lock, self._dir, local, self._persistent)
        self._peers = _peerrepair.start(peer_copies, self._groups, self._lease, self._persistent, self._sources())
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxckpt-save")
        if async_save and not read_only:  # its thread starts now, not in the first save's blocking part
            self._executor.submit(int)
        self._deleter, self._prefetch = _cleanup.Deleter(self._dir, self._dedup), _prefetch.Prefetch()
        self._retention = _cleanup.Retainer(policy, self._steps, self._pins, self._deleter, self._groups.leads,
                                            self._lock)
        ref = weakref.ref(self)
        self._atexit = lambda: (m := ref()) is not None and _finish_at_exit(m)
        atexit.register(self._atexit)

    # --- queries ---------------------------------------------------------------------

    @property
    def directory(self) -> str:
        return str(self._dir)

    def all_steps(self) -> list[int]:
        """Committed steps (of either tier), ascending."""
        return self._steps.all()

    def latest_step(self) -> int | None:
        """The newest committed step (of either tier), or ``None``: right after an async
        ``save`` still the previous one (``None`` in a new run) until the new step commits."""
        return self._steps.latest()

    def step_tiers(self) -> dict[int, tuple[str, ...]]:
        """Which tiers hold each committed step: "local", "persistent" (and "peer-copies-missing", last)."""
        return self._steps.tiers(self._peers.missing if self._peers is not None else ())

    def metrics(self, step: int) -> dict[str, Any] | None:
        """The metrics saved with ``step`` (``None`` if it had none)."""
        return self._steps.manifest(step).info.get("metrics")

    def info(self, step: int) -> dict[str, Any]:
        """What the manifest of ``step`` records: versions, times, bytes, save stats; for a
        compressed step also ``stored_bytes`` (what its arrays take as stored) and ``codecs``."""
        return _views.step_info(self._steps.manifest(step))

    def best_step(self) -> int | None:
        """The committed step with the best ``best_metric`` (``None`` if none reports it)."""
        policy = self._retention.policy
        if policy.best_metric is None:
            raise CheckpointError("best_step() needs best_metric= in the CheckpointManager")
        ranked = _retention.best_steps(self._retention.infos(), policy.best_metric, policy.best_mode, 1)
        return ranked[0] if ranked else None

    def reached_preemption(self, step: int) -> bool:
        """``True`` at the one step, the same in every process, at which a preempted job
        must save and exit: after SIGTERM (or JAX's preemption notice) reached any
        process. Call it every step, in every process, with consecutive steps; it costs
        well under a microsecond. See docs/multihost.md, "Preemption". Process-wide: its
        first call from the main thread installs a SIGTERM handler (unless JAX's
        preemption notifier is in use), which passes the signal on to the one before it;
        ``close()`` puts that one back.

        Example:
          >>> if mgr.reached_preemption(step):
          ...     mgr.save(step, state, force=True)
          ...     mgr.wait_until_finished()
          ...     sys.exit(0)
        """
        self._check_open()
        return self._preemption.reached(step)

    def should_save(self, step: int) -> bool:
        """True when ``save(step, ...)`` would save (``save_policy``, not yet saved): the
        same answer in every process."""
        step = operator.index(step)  # numpy and jax ints too
        with self._lock:
            busy = step in self._steps.local or self._saves.in_flight(step)
        return not busy and self._decider.due(step)

    @property
    def staging_bytes(self) -> int:
        """Host bytes held by snapshots whose writes have not finished."""
        return self._saves.staging_bytes()

    def reload(self) -> None:
        """Rescan the directory (steps written by another manager). With per-host
        directories this lists what this host's directory holds."""
        self._steps.reload()

    # --- history and cadence -----------------------------------------------------------

    def history(self) -> _history.History:
        """One record per step committed in this directory, steps deleted since included.

        The run's log (``history.jsonl``, written after each commit) merged with the
        manifests of the steps still committed; a read-only manager rescans first.

        Example:
          >>> hist = mgr.history()
          >>> [(r.step, r.metrics["loss"], r.exists) for r in hist]
          [(100, 0.9, False), (200, 0.7, True), (300, 0.6, True)]
        """
        if self._read_only:
            self.reload()
        return _history.load(self._dir, self._steps.infos())

    def advise_interval(self, mtbf_s: float, *, window: int = _cadence.WINDOW) -> _cadence.CadenceAdvice:
        """How often to save, from this run's measured save cost and ``mtbf_s`` (seconds).

        Young–Daly: the interval ``sqrt(2·C·M)``, ``C`` the median blocking seconds of the
        last ``window`` saves, ``M`` the mean time between failures (the model of the time
        lost: ``jaxckpt._manager.cadence``; shown by the notebook view). To act on it:
        ``save_policy=jaxckpt.policies.goodput()``. Raises ``CheckpointError`` with fewer
        than 2 saves with timings in the history.

        Example:
          >>> advice = mgr.advise_interval(mtbf_s=6 * 3600)
          >>> advice.interval_steps, f"{advice.lost_fraction_advised:.1%}"
          (1200, '0.9%')
        """
        self._advice = _cadence.advise_history(self.history(), mtbf_s, window=window, where=self._dir)
        return self._advice

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
            save failed (chained to the original exception); a tracer (inside ``jax.jit``).
        """
        t_start = time.perf_counter()
        _arguments.refuse_tracers(step, state, metrics, self._dir)  # (under jax.jit: before anything starts)
        step = _check_step(self, step, force)
        if not force and not self._decider.due(step):
            return False
        self._record.saved(step)
        metrics = _arguments.check_metrics(metrics)
        self._saves.wait_for_slot()
        op_id = _distributed.next_id()  # in program order, the same in every process
        dedup = self._dedup.start(step, state, self._steps, self._groups) if self._dedup else None
        snap = _snapshot.snapshot(state, copy_host_arrays=self._async,
                                  group=self._groups.mine if self._groups.per_host else (), budget=self._staging,
                                  groups=self._groups.groups if self._groups.per_host else (),
                                  **self._codecs.save_options())
        blocking = time.perf_counter() - t_start
        job = functools.partial(self._write, step, snap, metrics, t_start, blocking, op_id, dedup)
        self._saves.start(step, job, snap, self._executor if self._async else None,
                          then=self._peers.submit if self._peers is not None else None)
        return True

    def _write(self, step: int, snap: _snapshot.Snapshot, metrics: dict | None, t_start: float,
               blocking: float, op_id: int, dedup: Any = None) -> Any:
        final = self._dir.child(_commit.step_name(step))
        metrics = _arguments.metrics_to_json(metrics)
        check = functools.partial(_cleanup.check_lease, self._lease, self._dir)

        def info() -> dict[str, Any]:  # process 0, right before the commit
            check()
            return {"step": step, "metrics": metrics,
                    "blocking_seconds": round(max(blocking, snap.staged_at() - t_start), 6),
                    "staging_bytes": snap.nbytes_local, "total_seconds": round(time.perf_counter() - t_start, 6),
                    "commit_time": self._clock(), "started": self._record.started}

        save = functools.partial(_checkpoint.save_snapshot, info=info, check=check, timeout_s=self._timeout, op_id=op_id)
        manifest = _save(self, step, final, snap, save, dedup, op_id)
        if self._peers is not None:
            return manifest  # listed once its peer copies are made: _after_write
        _list(self, step, manifest)

    def _after_write(self, step: int, result: Any) -> None:
        """Settling ``step`` (the same call in every process): the outcome of its peer copies
        (made in the background after its commit), then listed."""
        _list(self, step, self._peers.settle(step, result))

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
        step = _arguments.step_to_restore(step, self._dir)
        read = functools.partial(_restore.restore, target=target, shardings=shardings, partial=partial,
                                 allow_narrowing=allow_narrowing, key_map=key_map, missing=missing,
                                 max_staging_bytes=self._restore_budget)
        read = self._codecs.counting(read)  # with quantize: count the lossy resumes
        # the settling below may run retention: it must not take the step asked for (a
        # delete retention deferred meanwhile runs after the next save, as always)
        with self._pins.hold(step if step in self._steps.local else None):
            self._saves.settle_all()
            if not self._groups.per_host:
                return _marks.restore_here(self, step, read)
            if self._peers is not None:  # a part some host lost: back from its peer copy first
                _peerrepair.repair(self._peers, step, self._sources(), self._steps.local)
            return _hosts.restore_agreed(self._sources(), step, read)

    def prefetch(self, step: int | None = None) -> concurrent.futures.Future:
        """Read ``step``'s data (default: the latest) into the page cache in the background,
        so that a restore after the job has built and compiled its step reads memory. Local
        directories only (elsewhere it reads nothing); bounded memory; ``close()`` stops it.
        Returns a future of the bytes read (``jaxckpt._manager.prefetch``).

        Example:
          >>> mgr.prefetch()  # then build the model and compile the step
          >>> state = mgr.restore(target=abstract_state)
        """
        self._check_open()
        with self._lock:
            where, step = self._steps.locate(step)
            return self._prefetch.start(where.local, self._steps.manifest(step))

    def _sources(self) -> _hosts.Sources:
        return _hosts.Sources(self._dir, self._groups, self._timeout, self._read_only, self._steps,
                              self._partial, self._pins)

    # --- deleting and attempts ---------------------------------------------------------

    def delete(self, step: int) -> None:
        """Delete a committed step now, from every tier (the writer only; call it in every process).

        The step stops being listed at once; on a local disk its directory is renamed
        to a hidden attempt name before its data is deleted, so a half-deleted step is
        never listed by anyone. Its peer copies and its persistent copy go with it (a
        step saved again later is a new step, never mixed with these). Its history
        record stays (with ``exists=False``).

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
        _delete(self, step)

    def attempts(self) -> list[dict[str, Any]]:
        """The hidden, uncommitted attempts in the directory (read-only managers too).

        Each is a save in progress or left by a crash (``.<step>.jaxckpt-tmp-*``), or a
        step being deleted (``.<step>.jaxckpt-old-*``); a persistent copy's temporary file
        (``.jaxckpt-upload-*``, kind ``"upload"``, step ``None``, ``writer`` its maker); on
        an object store, a data prefix under a step that its manifest does not name
        (``<step>/d/<token>``, kind ``"data"``). A writing manager removes those of a
        writer that is gone when it starts.

        Returns:
          One dict per attempt, by name: ``step``, ``name``, ``kind`` (``"tmp"``,
          ``"old"``, ``"upload"`` or ``"data"``), ``bytes`` and ``mtime`` (local disks;
          ``None`` elsewhere), ``writer`` (who holds the directory's writer lease, or
          ``None``) and ``writer_alive`` (``False`` when no writer holds it or the holder
          is provably gone: its attempts are dead).

        Example:
          >>> [(a["name"], a["writer_alive"]) for a in mgr.attempts()]
          [('.7.jaxckpt-tmp-3f2a9c1d0b4e', False)]
        """
        return _cleanup.attempts(self._dir)

    # --- lifecycle -------------------------------------------------------------------

    def wait_until_finished(self) -> None:
        """Block until every pending save settled; raise the first failure among them."""
        first: BaseException | None = None
        try:
            self._saves.settle_all()
        except CheckpointError as e:
            first = e
        self._peers is not None and self._peers.drain()  # copies sent apart from any save (after a repair)
        if self._persistent is not None:  # copies first: finishing one may queue local deletes
            failure = self._persistent.first_failure()
            first = first or failure
        self._deleter.wait()
        if first is not None:
            raise first

    def close(self) -> None:
        """Wait for pending saves, then release the background thread and the lease. Raises
        the first failed save's error (a failed release is a note on it), else a failed release."""
        if self._closed:
            return
        try:
            self.wait_until_finished()
        except BaseException as e:
            _shut(self, e)
            raise
        _shut(self, None)

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"CheckpointManager for '{self._dir}' is closed")

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        mode = ", read_only=True" if self._read_only else ""
        best = f", best={self.best_step()}" if self._retention.policy.best_metric is not None else ""
        return f"CheckpointManager({str(self._dir)!r}{mode}, steps={self.all_steps()}{best})"

    def _repr_html_(self) -> str:
        """The notebook view: directory, mode, steps (stored sizes, the best marked), totals, advice."""
        return _views.html(self)


def _save(mgr: CheckpointManager, step: int, final: Any, snap: _snapshot.Snapshot, save: Callable[..., Any],
          dedup: Any, op_id: int) -> Any:
    """``save(final, snap)``, deduplicated when the manager is (``dedup``: this save's part),
    then ``verify_before_delete``'s read back. A deduplicated step that fails it may read
    damaged bytes of another step: the next save refers to nothing (``Dedup.distrust``)."""
    if dedup is None:
        manifest = save(final, snap)
    else:
        try:
            manifest = save(final, snap, dedup=dedup)
        except BaseException:
            dedup.release()
            raise
        if mgr._dedup.committed(step, manifest, dedup) and mgr._groups.leads:
            mgr._deleter.sweep()  # after its first commit: the pool entries of attempts that died
    if mgr._verify:
        try:
            _cleanup.verify_or_delete(mgr._dir, step, op_id, mgr._timeout, mgr._groups)
        except CheckpointError:
            if mgr._dedup is not None:
                mgr._dedup.distrust()
            raise
    return manifest


def _delete(mgr: CheckpointManager, step: int) -> None:
    """``delete``: with dedup, after the saves in flight (their refs are named by the step
    they compare with, which may be this one), no sweep of the pool meanwhile, one after."""
    if mgr._dedup is not None:
        mgr.wait_until_finished()
    with mgr._dedup.exclusive if mgr._dedup is not None else contextlib.nullcontext():
        _cleanup.delete_everywhere(mgr, step)
    if mgr._dedup is not None:
        mgr._dedup.forget(step)
        if mgr._groups.leads:
            mgr._deleter.sweep()


def _list(self: CheckpointManager, step: int, manifest: Any) -> None:
    """List ``step``, committed: its history record, its persistent copy, retention, peer copies."""
    final = self._dir.child(_commit.step_name(step))
    self._steps.add(step, manifest)
    self._record.committed(manifest.info)
    if _distributed.process_index() == 0:
        _history.record(self._dir, step, manifest.info)
    if self._groups.per_host:
        self._partial.drop(step, set(self._steps.durable()), self._deleter if self._groups.leads else None)
    if self._persistent is not None and self._persistent.wants(step):
        pin = contextlib.ExitStack()  # retention keeps the local copy until the persistent one is done
        pin.enter_context(self._pins.hold(step))
        self._persistent.submit(step, final, manifest, self._groups.groups,
                                functools.partial(self._retention.copied, step, pin))
    self._retention.run(f"after step {step}")
    if self._peers is not None:
        self._peers.prune(self._steps.local)


def _check_step(mgr: CheckpointManager, step: Any, force: bool) -> int:
    """Refuse a save this manager can never do right. Depends only on the listed
    steps and this manager's own saves: the same in every process (with per-host
    directories, until a ``reload`` lists what each host's directory holds)."""
    mgr._check_open()
    if mgr._read_only:
        raise CheckpointError(f"CheckpointManager for '{mgr._dir}' is read-only: save() is not allowed")
    # A lost writer lease is not checked here: only the process holding it knows, and
    # raising in it alone would skip its operation counter. The commit refuses it instead
    # (``cleanup.check_lease`` in ``_write``), and every process learns that outcome.
    with mgr._lock:
        return _arguments.new_step(step, force, mgr._dir, mgr._steps.local, mgr._saves.submitted)


def _shut(mgr: CheckpointManager, failure: BaseException | None) -> None:
    """The rest of ``close``: whatever it raises (``failure``, what is being raised already)
    is not reported again at exit, and a failed release only adds a note to ``failure``.
    After a store failed, the release ends within the clean-up's bound (``kvstore.cleaning_up``)."""
    mgr._closed = True
    atexit.unregister(mgr._atexit)
    mgr._preemption.close()  # gives the SIGTERM handler back
    mgr._decider.close()
    mgr._prefetch.stop()
    mgr._executor.shutdown(wait=True)
    if mgr._peers is not None:
        mgr._peers.close()
    mgr._deleter.close()
    _cleanup.release_leases(mgr._lease, mgr._persistent, failure)


def _finish_at_exit(mgr: CheckpointManager) -> None:
    try:
        mgr.close()
    except BaseException as e:  # noqa: BLE001 - at exit, report instead of raising
        print(f"jaxckpt: a pending save failed at exit: {e}", file=sys.stderr)


class _Pending:
    def __init__(self, step: int, future: concurrent.futures.Future, staging_bytes: int):
        self.step, self.future, self.staging_bytes = step, future, staging_bytes


class _Saves:
    """A manager's saves in flight, in submission order, settled in that order only.

    Which saves a call settles depends only on how many were submitted, never on which
    happen to be done already, so every process raises a failure at the same call.
    Shares the manager's lock (``should_save`` asks about committed and pending steps at
    once)."""

    def __init__(self, lock: Any, max_pending: int, directory: Any, after: Callable[[int, Any], None]):
        self._lock, self._max_pending, self._dir = lock, max_pending, directory
        # a job that returned something: the rest of the save, where it is settled. Weak: the
        # manager holds this object, so a strong bound method would keep an unclosed manager
        # alive until the cyclic collector ran its finalizers (a lease release) at any later time
        self._after = weakref.WeakMethod(after) if hasattr(after, "__self__") else lambda: after
        self._pending: list[_Pending] = []  # in submission order; popped in that order only
        self.submitted: set[int] = set()  # steps saved by this manager and not known to have failed

    def in_flight(self, step: int) -> bool:
        with self._lock:
            return any(p.step == step for p in self._pending)

    def all_done(self) -> bool:
        """Whether every save submitted is done (committed, or failed)."""
        with self._lock:
            return all(p.future.done() for p in self._pending)

    def staging_bytes(self) -> int:
        with self._lock:
            return sum(p.staging_bytes for p in self._pending if not p.future.done())

    def start(self, step: int, job: Callable[[], None], snap: _snapshot.Snapshot,
              executor: concurrent.futures.Executor | None, then: Callable[[int, Any], Any] | None = None) -> None:
        """Run the save of ``step`` (``job``, which writes ``snap``; the snapshot is closed
        after it): here (``executor=None``: a failure is raised now) or in the background,
        its staging continued here in waves (``max_staging_bytes``). ``then(step, written)``:
        what runs after the job (peer copies, on a thread of their own), given the job's
        future or a callable giving its result; its future's result is settled instead."""
        job = functools.partial(_closing, job, snap)
        with self._lock:
            self.submitted.add(step)
        if executor is None:
            try:
                result = job()
                if then is not None:
                    result = then(step, lambda: result).result()
                if result is not None:
                    self._after()(step, result)
            except BaseException as e:
                raise self._failure(step, e) from e
            finally:
                with self._lock:
                    self.submitted.discard(step)
            return
        try:
            future = executor.submit(job)
            if then is not None:
                future = then(step, future)
        except RuntimeError as e:  # the executor was shut down by a concurrent close()
            snap.close()
            with self._lock:
                self.submitted.discard(step)
            raise CheckpointError(f"CheckpointManager for '{self._dir}' was closed during save({step})") from e
        with self._lock:
            self._pending.append(_Pending(step, future, snap.nbytes_local))
        snap.stage_rest()  # with max_staging_bytes: the waves left, as the writer frees room

    def wait_for_slot(self) -> None:
        """Settle the oldest saves until fewer than ``max_pending`` are in flight."""
        while True:
            with self._lock:
                if len(self._pending) < self._max_pending:
                    return
                oldest = self._pending.pop(0)
            self._settle(oldest)

    def settle_all(self) -> None:
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

    def _settle(self, pending: _Pending) -> None:
        """Wait for one save; raise its failure as a ``CheckpointError``."""
        concurrent.futures.wait([pending.future])
        error = pending.future.exception()
        if error is None and pending.future.result() is not None:
            try:
                self._after()(pending.step, pending.future.result())
            except BaseException as e:  # noqa: BLE001 - the save's failure, as a job's
                error = e
        with self._lock:  # committed (now in the manager's steps) or failed (may be retried)
            self.submitted.discard(pending.step)
        if error is not None:
            raise self._failure(pending.step, error) from error

    def _failure(self, step: int, error: BaseException) -> CheckpointError:
        return CheckpointError(f"Saving step {step} to '{self._dir}' failed: {error}")


def _closing(job: Callable[[], Any], snap: _snapshot.Snapshot) -> Any:
    try:
        return job()
    finally:
        snap.close()
