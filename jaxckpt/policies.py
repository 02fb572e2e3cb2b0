"""When a ``CheckpointManager`` saves: ``CheckpointManager(..., save_policy=...)``.

A policy is a small object with one method, ``should_save(facts) -> bool``, and one
attribute, ``local``:

* ``local = True``: the answer is a function of ``facts.step`` alone (and of
  ``facts.preempted``, which the job agrees on by itself), so every process asks its
  own policy at every call and gets the same answer: ``every_steps``, ``at_steps``,
  ``on_preemption``.
* ``local = False``: the answer depends on time or on measurements, which differ
  between processes. Only process 0 asks, a few steps ahead of its own, and publishes
  the answers through the job's key-value store; every process reads them there
  (``jaxckpt._manager.decisions``): ``every_seconds``, ``continuous``, ``goodput``. Such a
  save happens at the first call at or after the step decided, the same call in every
  process; its timing is process 0's clock only. With several processes such a policy is
  asked at *some* steps (at most 64 for each half second of steps), with ``facts.now`` the
  time that step is expected at: a condition on the step belongs in a local policy.

``any_of(*policies)`` saves when any of them does (its local members are asked by
every process, the others by process 0). Write your own by subclassing ``SavePolicy``::

    class HourlyOnceWarm(jaxckpt.policies.SavePolicy):
        local = False  # depends on the clock
        def should_save(self, facts):
            return facts.now - facts.started >= 600 and facts.since_last_s() >= 3600

    save_policy = jaxckpt.policies.any_of(HourlyOnceWarm(), jaxckpt.policies.at_steps([TOTAL_STEPS - 1]))

``Facts`` is what a policy is asked with. docs/training.md says which policy to pick.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from typing import Any, NamedTuple

# Until the run's history holds a restart, ``goodput`` assumes one failure per this many
# seconds of a run (one day: the order of a large job's mean time between failures,
# e.g. Meta's Llama 3 report, 419 interruptions in 54 days on 16k GPUs). Each restart
# the history shows pulls the estimate toward the run's own rate.
PRIOR_MTBF_S = 24 * 3600.0


class Facts(NamedTuple):
    """What a policy decides from.

    Attributes:
      step: the step asked about.
      now: process 0's clock (the manager's ``clock``), seconds; asked ahead, the time
        that step is expected at.
      started: when this manager was made, on the same clock.
      last_save_step: the last step this manager saved (``None``: none yet).
      last_save_time: when that save started (``started`` when there is none).
      committed: whether every save this manager started has committed.
      blocking_s: the blocking seconds of recent saves (the loop's cost), oldest first.
      total_s: their seconds from ``save`` to the commit, oldest first.
      run_s: seconds since the run's first manager started (from its history).
      restarts: how many times the run was started again (its history's managers, less one).
      preempted: whether the job reached its preemption step at ``step`` (``on_preemption``).
    """

    step: int
    now: float = 0.0
    started: float = 0.0
    last_save_step: int | None = None
    last_save_time: float = 0.0
    committed: bool = True
    blocking_s: tuple[float, ...] = ()
    total_s: tuple[float, ...] = ()
    run_s: float = 0.0
    restarts: int = 0
    preempted: bool = False

    def since_last_s(self) -> float:
        """Seconds since the last save started (since the manager was made: none yet)."""
        return self.now - self.last_save_time


class SavePolicy:
    """The base of every save policy (see the module docstring)."""

    local: bool = False

    def should_save(self, facts: Facts) -> bool:
        """Whether to save at ``facts.step`` (the one method a manager calls)."""
        raise NotImplementedError

    def members(self) -> tuple[SavePolicy, ...]:
        """The policies this one combines (``any_of``); itself otherwise."""
        return (self,)

    def last_at_or_before(self, step: int) -> int | None:
        """A local policy: the last step at or before ``step`` it saves at (``None``: none,
        or not known). Process 0 counts it as a save when it decides the others ahead."""
        return None

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({fields})"


def _positive(name: str, value: Any, integer: bool = False) -> Any:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a positive {'int' if integer else 'number'}, got {value!r}")
    return value


class every_steps(SavePolicy):  # noqa: N801 - a policy reads as a function call
    """Save every ``n`` steps: at steps divisible by ``n`` (``save_interval_steps=n``)."""

    local = True

    def __init__(self, n: int):
        self.n = _positive("every_steps(n)", n, integer=True)

    def should_save(self, facts: Facts) -> bool:
        """See the class."""
        return facts.step % self.n == 0

    def last_at_or_before(self, step: int) -> int | None:
        """See ``SavePolicy``."""
        return step - step % self.n if step >= 0 else None


class at_steps(SavePolicy):  # noqa: N801
    """Save at exactly these steps."""

    local = True

    def __init__(self, steps: Iterable[int]):
        steps = list(steps)
        if not steps or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in steps):
            raise ValueError(f"at_steps needs non-negative int steps, got {steps!r}")
        self.steps = frozenset(steps)

    def should_save(self, facts: Facts) -> bool:
        """See the class."""
        return facts.step in self.steps

    def last_at_or_before(self, step: int) -> int | None:
        """See ``SavePolicy``."""
        return max((s for s in self.steps if s <= step), default=None)

    def __repr__(self) -> str:
        return f"at_steps({sorted(self.steps)!r})"


class on_preemption(SavePolicy):  # noqa: N801
    """Save at the step the job agrees to stop at after a preemption notice
    (``CheckpointManager.reached_preemption``). Call ``save`` every step with it."""

    local = True

    def should_save(self, facts: Facts) -> bool:
        """See the class."""
        return facts.preempted


class every_seconds(SavePolicy):  # noqa: N801
    """Save when ``s`` seconds of process 0's clock have passed since the last save
    started (or since the manager was made)."""

    def __init__(self, s: float):
        self.s = _positive("every_seconds(s)", s)

    def should_save(self, facts: Facts) -> bool:
        """See the class."""
        return facts.since_last_s() >= self.s


class continuous(SavePolicy):  # noqa: N801
    """Save again as soon as the previous save has committed, at most one save per
    ``min_interval_s`` seconds."""

    def __init__(self, min_interval_s: float = 0.0):
        if isinstance(min_interval_s, bool) or not isinstance(min_interval_s, (int, float)) or not (
                0 <= min_interval_s < math.inf):
            raise ValueError(f"continuous(min_interval_s) must be a number >= 0, got {min_interval_s!r}")
        self.min_interval_s = min_interval_s

    def should_save(self, facts: Facts) -> bool:
        """See the class."""
        return facts.committed and (facts.last_save_step is None or facts.since_last_s() >= self.min_interval_s)


class goodput(SavePolicy):  # noqa: N801
    """Save at the interval that loses the least time: Young–Daly, from the run's own
    measured save costs and failure rate, re-evaluated at every decision.

    Time lost per second of the run ≈ ``C/τ + (τ/2 + R)/M`` (``jaxckpt._manager.cadence``):
    ``C`` the median blocking seconds of the recent saves, ``R`` their median seconds to
    the commit, ``M`` the mean time between failures, ``τ`` the interval. The interval
    is ``τ* = sqrt(2·C·M)``, at least ``R`` (a save does not start before the previous
    one can commit) and at least ``C / max_overhead`` when given (at most that share of
    the time spent saving). ``M`` is ``mtbf_s`` when given, else learned from the
    run's history: ``(run seconds + PRIOR_MTBF_S) / (restarts + 1)`` (one day until the
    run has restarted; every restart counts as a failure). The first save is at once (it
    measures ``C``); the next waits for it to commit."""

    def __init__(self, mtbf_s: float | None = None, max_overhead: float | None = None):
        self.mtbf_s = None if mtbf_s is None else _positive("goodput(mtbf_s)", mtbf_s)
        if max_overhead is not None and (isinstance(max_overhead, bool) or not isinstance(max_overhead, (int, float))
                                         or not 0 < max_overhead <= 1):
            raise ValueError(f"goodput(max_overhead) must be a share of the time in (0, 1], got {max_overhead!r}")
        self.max_overhead = max_overhead

    def mtbf(self, facts: Facts) -> float:
        """``M``: given, or learned from the run's restarts (see the class)."""
        if self.mtbf_s is not None:
            return float(self.mtbf_s)
        return (max(0.0, facts.run_s) + PRIOR_MTBF_S) / (facts.restarts + 1)

    def interval_s(self, facts: Facts) -> float | None:
        """``τ`` for these facts (``None``: no save measured yet)."""
        if not facts.blocking_s:
            return None
        cost = float(statistics.median(facts.blocking_s))
        window = float(statistics.median(facts.total_s)) if facts.total_s else 0.0
        tau = max(math.sqrt(2 * cost * self.mtbf(facts)), window)
        if self.max_overhead is not None:
            tau = max(tau, cost / self.max_overhead)
        return tau

    def should_save(self, facts: Facts) -> bool:
        """See the class."""
        tau = self.interval_s(facts)
        if tau is None:  # nothing measured: the first save now, then none until one commits
            return facts.last_save_step is None
        return facts.since_last_s() >= tau


class any_of(SavePolicy):  # noqa: N801
    """Save when any of ``policies`` does."""

    def __init__(self, *policies: SavePolicy):
        if not policies or not all(isinstance(p, SavePolicy) for p in policies):
            raise ValueError(f"any_of needs save policies, got {policies!r}")
        self.policies = tuple(q for p in policies for q in p.members())
        self.local = all(p.local for p in self.policies)

    def members(self) -> tuple[SavePolicy, ...]:
        """The policies combined (an ``any_of`` among them flattened)."""
        return self.policies

    def should_save(self, facts: Facts) -> bool:
        """See the class."""
        return any(p.should_save(facts) for p in self.policies)

    def __repr__(self) -> str:
        return f"any_of({', '.join(map(repr, self.policies))})"


__all__ = ["PRIOR_MTBF_S", "Facts", "SavePolicy", "any_of", "at_steps", "continuous", "every_seconds",
           "every_steps", "goodput", "on_preemption"]
