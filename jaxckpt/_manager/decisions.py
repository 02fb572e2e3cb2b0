"""A manager's save decisions (``save_policy``), the same in every process, with no
collective and no key-value round trip on the training loop's thread.

Local policies (``jaxckpt.policies``: a function of the step) are asked by every process
at every call. The others (time, measurements) are asked by process 0 only, ahead:

* Process 0, at a call of step ``s`` (its clock measures the loop's seconds a step),
  once fewer than ``MIN_LEAD`` steps (or ``LEAD_S`` of them) are decided ahead of it,
  decides a batch: the steps up to ``s`` and about ``BATCH_S`` seconds of steps more.
  Steps the loop skipped are one decision, at ``s``; ahead, the policy is asked at most
  ``MAX_ASKS`` times a batch, each with process 0's facts (``Facts``: its clock, its
  saves) and the time that step is expected at. A batch ends at its save. It is
  published as one key ``<prefix>/<first step>`` holding the batch's last step and the
  step that saves. A background thread writes it (``key_value_set``), so the loop never
  waits on the store; it deletes the batch ``KEEP`` batches older.
* The other processes read the batches in order on a background thread of their own
  (a blocking get of the next batch's key, 1 s at a time). A call at step ``s`` needs the
  steps up to ``s`` decided: known already in the steady state, else it waits for them,
  at most ``max(timeout_s, the stall bound)`` (rule 8: ``CheckpointError`` naming process
  0 and the step).
* A step that saves saves at the first call at or after it (``prev < k <= s``, ``prev``
  the step of the previous call): the same call in every process, whatever steps the
  loop skips. Process 0's clock alone times a save: skewed clocks elsewhere cannot split
  a decision. The last process to close the manager deletes its keys.

One process: no store, the policy is asked at the call itself (no lead). ``due(step)`` is
asked by ``should_save`` and ``save``; asking twice for one step gives one answer.
"""

from __future__ import annotations

import collections
import json
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from .. import _distributed
from .. import policies as _policies
from .._errors import CheckpointError

_log = logging.getLogger("jaxckpt")

MIN_LEAD = 4  # steps process 0 decides ahead of its own, at least
RATE_STEPS = 256  # the loop's rate is measured over BATCH_S, or over this many steps if sooner
MIN_BATCH = 16  # steps a batch decides, at least (before the rate is known: these)
LEAD_S = 0.1  # ... and about this many seconds of the loop's steps
BATCH_S = 0.5  # a batch decides about this many seconds of the loop's steps at once
MAX_BATCH = 1 << 20  # steps in a batch, at most
MAX_ASKS = 64  # times process 0 asks the policy for a batch, at most
KEEP = 1024  # batches process 0 keeps in the store (a process further behind fails, named)
_POLL_MS = 1000


def make(save_policy: Any, save_interval_steps: int) -> _policies.SavePolicy:
    """The policy a manager saves by: ``save_policy``, or ``every_steps(save_interval_steps)``;
    both at once is refused."""
    if save_policy is None:
        return _policies.every_steps(save_interval_steps)
    if save_interval_steps != 1:
        raise CheckpointError(f"save_policy={save_policy!r} and save_interval_steps={save_interval_steps} "
                              "both say when to save: give one (save_interval_steps=N is every_steps(N))")
    if not isinstance(save_policy, _policies.SavePolicy):
        raise CheckpointError(f"save_policy must be a jaxckpt.policies.SavePolicy, got {save_policy!r}")
    return save_policy


WINDOW = 10  # the recent saves whose costs a policy sees


class Record:
    """What a manager knows for its policy's facts (``Facts``), kept as it saves: cheap
    to read at every decision. ``history()`` (the run's history) is read once, when a
    policy first needs the run's restarts."""

    def __init__(self, clock: Callable[[], float], history: Callable[[], Any], committed: Callable[[], bool]):
        # weak: the manager holds this record; a strong bound method would keep an unclosed
        # manager alive until the cyclic collector ran
        history = weakref.WeakMethod(history) if hasattr(history, "__self__") else (lambda h=history: h)
        self.clock, self._history, self._committed = clock, history, committed
        self.started = clock()
        self.last: tuple[int | None, float] = (None, self.started)
        self._blocking: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self._total: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self._costs: tuple[tuple[float, ...], tuple[float, ...]] = ((), ())
        self._run: tuple[float, int] | None = None  # the run's first start and its restarts

    def saved(self, step: int) -> None:
        """A save of ``step`` starts (``save`` returned True)."""
        self.last = (step, self.clock())

    def committed(self, info: dict[str, Any]) -> None:
        """A save committed, with its manifest info (its measured seconds)."""
        blocking, total = info.get("blocking_seconds"), info.get("total_seconds")
        if isinstance(blocking, (int, float)) and isinstance(total, (int, float)):
            self._blocking.append(float(blocking))
            self._total.append(float(total))
            self._costs = (tuple(self._blocking), tuple(self._total))

    def facts(self, step: int) -> _policies.Facts:
        now = self.clock()
        if self._run is None:
            self._run = self._restarts()
        return _policies.Facts(step, now, self.started, self.last[0], self.last[1], self._committed(), *self._costs,
                               now - self._run[0], self._run[1])

    def _restarts(self) -> tuple[float, int]:
        """The run's first start and how many times it started again before this manager
        (the distinct ``started`` of its history's records; none: this one only)."""
        try:
            history = self._history()
            records = history() if history is not None else []
            starts = {r.started for r in records if r.started is not None and r.started != self.started}
        except Exception as e:  # noqa: BLE001 - a history that cannot be read: this run only
            _log.warning("jaxckpt: reading the run's history for its restarts failed: %s", e)
            starts = set()
        return min(starts | {self.started}), len(starts)


class Decider:
    """One manager's decisions (see the module docstring). ``facts(step)`` gives process
    0's facts for a step (``Record.facts``); ``preempted(step)`` the job's preemption
    agreement (``reached_preemption``); ``owner`` the manager (closed with it)."""

    def __init__(self, policy: _policies.SavePolicy, facts: Callable[[int], _policies.Facts],
                 preempted: Callable[[int], bool], timeout_s: float | None, owner: Any = None):
        members = policy.members()
        self.policy = policy
        self._local = [p for p in members if p.local]
        self._planned = [p for p in members if not p.local]
        self._facts, self._preempted = facts, preempted
        self._watch_preemption = any(isinstance(p, _policies.on_preemption) for p in self._local)
        self._bound = max(timeout_s or 0.0, _distributed.stall_s())
        self._multi = bool(self._planned) and _distributed.process_count() > 1
        # the manager's own keys: an id taken in program order, the same in every process
        self._prefix = f"jaxckpt/policy/{_distributed.next_id()}" if self._multi else ""
        self._planner = _distributed.process_index() == 0
        self._prev: int | None = None  # the previous call's step, and its answer
        self._answer = False
        self._cond = threading.Condition()
        self._saving: set[int] = set()  # decided steps that save
        self._known = -1  # every step up to this one is decided (here, or read from process 0)
        self._first: int | None = None  # the first batch's first step (the first call's)
        self._out: list[tuple[str, str | None]] = []  # process 0: keys to write (None: delete)
        self._batches: list[int] = []  # process 0: the batches' first steps, for deletion
        self._error: BaseException | None = None
        self._closed = False
        self._thread: threading.Thread | None = None
        self.next_step: int | None = None  # the next decided step that saves (the notebook view)
        # process 0: the rate (when it was last measured, at which step), the seconds a step,
        # and from them how many steps it decides ahead and in a batch
        self._rate: tuple[float | None, int] = (None, 0)
        self._step_s, self._lead, self._batch = 0.0, MIN_LEAD, 0
        if owner is not None:  # its manager dropped unclosed: the thread stops and the keys go
            weakref.finalize(owner, self.close)

    # --- the loop's side ----------------------------------------------------------------

    def due(self, step: int) -> bool:
        """Whether ``step`` saves (the same answer in every process)."""
        if step == self._prev:
            return self._answer
        local = any(p.should_save(_policies.Facts(step, preempted=self._preempted(step) if self._watch_preemption
                                                  else False)) for p in self._local)
        planned = False
        if self._planned and not self._multi:
            planned = any(p.should_save(self._facts(step)) for p in self._planned)
        elif self._planned:
            planned = self._due_planned(step)
        self._prev, self._answer = step, local or planned
        return self._answer

    def _due_planned(self, step: int) -> bool:
        if self._first is None:
            self._first = step
            self._known = step - 1
            self._start_thread()
        if self._planner:
            self._rated(step)
            if step + self._lead > self._known:  # (the first call: the lead only, its rate unknown)
                self._plan_until(step, step + self._lead + (0 if step == self._first else max(MIN_BATCH, self._batch)))
        else:
            self._wait_for(step)
        low = self._prev + 1 if self._prev is not None else self._first
        with self._cond:
            hit = [k for k in self._saving if low <= k <= step]
            self._saving.difference_update(k for k in list(self._saving) if k <= step)
            later = sorted(self._saving)
        self.next_step = later[0] if later else None
        return bool(hit)

    def _rated(self, step: int) -> None:
        """Process 0: the loop's seconds a step (``_step_s``) on the manager's clock (the
        one the policies read), measured over at least ``BATCH_S``, and from it the lead
        and the batch in steps."""
        now = self._facts(step).now
        last_t, last_step = self._rate
        if last_t is None or now < last_t:  # the first call, or the clock went back (NTP): measure anew
            self._rate = (now, step)
        elif (now - last_t >= BATCH_S or step - last_step >= RATE_STEPS) and step > last_step and now > last_t:
            self._step_s = (now - last_t) / (step - last_step)
            self._rate = (now, step)
            self._lead = max(MIN_LEAD, int(LEAD_S / self._step_s))
            self._batch = min(MAX_BATCH, int(BATCH_S / self._step_s))

    def _plan_until(self, step: int, last: int) -> None:
        """Process 0, at the call of ``step``: decide every step up to ``last``, in batches
        that end at a save. Steps the loop already passed (it skipped them) are one
        decision, at ``step``; ahead, the policy is asked at most ``MAX_ASKS`` times a
        batch, each with the time that step is expected at (the rate so far), and a save
        decided but not made, or a local member's save before it, counted as made then."""
        now = self._facts(step).now
        while self._known < last:
            first, saves = self._known + 1, []
            ahead = range(max(first, step), last + 1, max(1, (last + 1 - max(first, step)) // MAX_ASKS))
            for k in ahead:
                facts = self._facts(k)._replace(now=now + (k - step) * self._step_s)
                local = max((j for p in self._local if (j := p.last_at_or_before(k)) is not None), default=None)
                pending = max([j for j in (max(self._saving, default=None), local) if j is not None], default=None)
                if pending is not None and (facts.last_save_step is None or facts.last_save_step < pending):
                    facts = facts._replace(last_save_step=pending, committed=False,
                                           last_save_time=now + (pending - step) * self._step_s)
                if any(p.should_save(facts) for p in self._planned):
                    saves.append(k)
                    break
            end = saves[0] if saves else last
            with self._cond:
                self._saving.update(saves)
                self._known = end
                self._out.append((f"{self._prefix}/{first}", json.dumps({"to": end, "save": saves})))
                self._batches.append(first)
                if len(self._batches) > KEEP:
                    self._out.append((f"{self._prefix}/{self._batches.pop(0)}", None))
                self._cond.notify_all()

    def _wait_for(self, step: int) -> None:
        deadline = None
        with self._cond:
            while self._known < step:
                if self._error is not None:
                    raise CheckpointError(f"the save decision for step {step} from process 0: {self._error}")
                now = time.monotonic()
                deadline = deadline or now + self._bound
                if now >= deadline:
                    raise CheckpointError(
                        f"process 0's save decision for step {step} (save_policy={self.policy!r}) did not arrive "
                        f"within {self._bound:g}s: is process 0 alive, and calling save()/should_save() at the "
                        f"same steps? (a process more than {KEEP} decisions behind it cannot catch up)")
                self._cond.wait(min(1.0, deadline - now))

    def describe(self) -> str:
        """The policy and its next save, as the notebook view shows them."""
        if self.next_step is not None:
            upcoming = f"step {self.next_step} (decided by process 0)"
        else:
            upcoming = self._next_local() or self._next_planned()
        return f"save_policy={self.policy!r}; next save: {upcoming}"

    def _next_local(self) -> str:
        start = 0 if self._prev is None else self._prev + 1
        for step in range(start, start + 100_000):  # a bounded look ahead
            if any(p.should_save(_policies.Facts(step)) for p in self._local
                   if not isinstance(p, _policies.on_preemption)):
                return f"step {step}"
        return ""

    def _next_planned(self) -> str:
        if not self._planned:
            return "none within 100000 steps"
        facts = self._facts(0 if self._prev is None else self._prev)
        waits = []
        for p in self._planned:
            every = getattr(p, "s", None) or getattr(p, "min_interval_s", None)
            if isinstance(p, _policies.goodput):
                every = p.interval_s(facts)
                if every is None:
                    return ("at the first call (goodput measures its cost)" if facts.last_save_step is None
                            else f"once step {facts.last_save_step}'s save commits and its cost is measured")
            if every is not None:
                waits.append(max(0.0, every - facts.since_last_s()))
        return f"in about {min(waits):.3g} s" if waits else "when the policy says"

    # --- the background thread ------------------------------------------------------

    def _start_thread(self) -> None:
        target = self._publish if self._planner else self._read
        self._thread = threading.Thread(target=target, name="jaxckpt-decisions", daemon=True)
        self._thread.start()

    def _publish(self) -> None:
        client = _distributed.kv_client()
        while True:
            with self._cond:
                while not self._out and not self._closed:
                    self._cond.wait()
                if not self._out:
                    return
                key, value = self._out.pop(0)
            try:
                if value is None:
                    client.key_value_delete(key)
                else:
                    client.key_value_set(key, value)
            except Exception as e:  # noqa: BLE001 - the others' wait names it; the runtime may be going down
                _log.warning("jaxckpt: publishing a save decision (%s) failed: %s", key, e)

    def _read(self) -> None:
        client = _distributed.kv_client()
        start = self._first
        while True:
            with self._cond:
                if self._closed:
                    return
            asked = time.monotonic()
            try:
                batch = json.loads(client.blocking_key_value_get(f"{self._prefix}/{start}", _POLL_MS))
                last, saves = int(batch["to"]), [int(j) for j in batch["save"]]
            except (ValueError, KeyError, TypeError) as e:
                with self._cond:
                    self._error = e
                    self._cond.notify_all()
                return
            except Exception:  # noqa: BLE001 - not published yet (a timeout): ask again, unless it is gone
                if time.monotonic() - asked < 0.05:  # failed at once (the store refusing): no busy loop
                    time.sleep(0.2)
                if self._passed(client, start):
                    with self._cond:
                        self._error = CheckpointError(
                            f"its decision for the steps from {start} was deleted: this process fell more "
                            f"than {KEEP} decisions behind process 0")
                        self._cond.notify_all()
                    return
                continue
            with self._cond:
                self._saving.update(saves)
                self._known = last
                self._cond.notify_all()
            start = last + 1

    def _passed(self, client: Any, start: int) -> bool:
        """Whether process 0 published a batch after the one starting at ``start`` while
        that one is not there (deleted: batches are published in order)."""
        try:
            firsts = [int(k.rsplit("/", 1)[1]) for k, _ in client.key_value_dir_get(self._prefix + "/")]
        except Exception:  # noqa: BLE001 - the store is not answering: the wait's bound decides
            return False
        return bool(firsts) and start not in firsts and max(firsts) > start

    def close(self) -> None:
        """Stop the thread (process 0 writes what it decided first). The last process of
        the job to close deletes the manager's keys: before, another may still read them."""
        with self._cond:
            if self._closed:  # once (close, then the finalizer)
                return
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None and self._planner:
            self._thread.join(10)
        if not self._multi or self._first is None:
            return
        try:
            client = _distributed.kv_client()
            if client.key_value_increment(f"{self._prefix}-closed", 1) == _distributed.process_count():
                client.key_value_delete(f"{self._prefix}/")
                client.key_value_delete(f"{self._prefix}-closed")
        except Exception as e:  # noqa: BLE001 - the runtime going down: the keys go with it
            _log.debug("jaxckpt: deleting the save decisions' keys failed: %s", e)
