"""Which committed steps to delete: a pure function of the steps, their metrics and
commit times, and the policy.

Two kinds of rule:

* *limits* say how many to keep: ``max_to_keep`` (the latest N) and ``keep_best``
  (the best N by ``best_metric``). Without any limit nothing is ever deleted.
* *protections* keep steps whatever the limits say: the latest committed step (always),
  every ``keep_period``-th step, and one step per ``keep_time_interval``.

A step survives when any rule keeps it.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple


class StepInfo(NamedTuple):
    """A committed step: its number, commit time (seconds since the epoch) and metrics."""

    step: int
    time: float
    metrics: Mapping[str, Any] | None = None


def step_infos(infos: Mapping[int, Mapping[str, Any]]) -> list[StepInfo]:
    """One ``StepInfo`` per step from its manifest's info: its commit time (its creation
    time in a manifest that has none) and its metrics."""
    return [StepInfo(s, float(i.get("commit_time", i.get("created_unix", 0.0))), i.get("metrics"))
            for s, i in infos.items()]


class RetentionPolicy(NamedTuple):
    max_to_keep: int | None = None
    keep_period: int | None = None
    keep_time_interval: float | None = None  # seconds
    best_metric: str | None = None
    best_mode: str = "min"
    keep_best: int | None = None

    @classmethod
    def make(cls, *, max_to_keep=None, keep_period=None, keep_time_interval=None, best_metric=None,
             best_mode="min", keep_best=None) -> RetentionPolicy:
        """Validate arguments (``ValueError`` on nonsense) and normalise the interval to seconds."""
        for name, v in (("max_to_keep", max_to_keep), ("keep_period", keep_period), ("keep_best", keep_best)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name} must be a positive int or None, got {v!r}")
        if isinstance(keep_time_interval, datetime.timedelta):
            keep_time_interval = keep_time_interval.total_seconds()
        if keep_time_interval is not None and not keep_time_interval > 0:
            raise ValueError(f"keep_time_interval must be positive, got {keep_time_interval!r}")
        if best_mode not in ("min", "max"):
            raise ValueError(f"best_mode must be 'min' or 'max', got {best_mode!r}")
        if keep_best is not None and best_metric is None:
            raise ValueError("keep_best needs best_metric (the metric to rank steps by)")
        return cls(max_to_keep, keep_period, keep_time_interval, best_metric, best_mode, keep_best)


def metric_value(info: StepInfo, metric: str | None) -> float | None:
    if metric is None or not info.metrics or metric not in info.metrics:
        return None
    v = info.metrics[metric]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
        return None
    return float(v)


def best_steps(steps: Sequence[StepInfo], metric: str, mode: str, n: int | None = None) -> list[int]:
    """Steps that report ``metric``, best first (ties: the later step first)."""
    scored = [(metric_value(s, metric), s.step) for s in steps]
    scored = [(v, st) for v, st in scored if v is not None]
    sign = 1.0 if mode == "min" else -1.0
    scored.sort(key=lambda t: (sign * t[0], -t[1]))
    ranked = [st for _, st in scored]
    return ranked if n is None else ranked[:n]


def steps_to_keep(steps: Sequence[StepInfo], policy: RetentionPolicy) -> set[int]:
    if not steps:
        return set()
    by_step = sorted(steps, key=lambda s: s.step)
    all_steps = {s.step for s in by_step}
    if policy.max_to_keep is None and policy.keep_best is None:
        return all_steps
    keep = {by_step[-1].step}
    if policy.max_to_keep is not None:
        keep.update(s.step for s in by_step[-policy.max_to_keep:])
    if policy.keep_best is not None:
        keep.update(best_steps(by_step, policy.best_metric, policy.best_mode, policy.keep_best))
    if policy.keep_period is not None:
        keep.update(s.step for s in by_step if s.step % policy.keep_period == 0)
    if policy.keep_time_interval is not None:
        last = None
        for s in sorted(by_step, key=lambda s: (s.time, s.step)):
            if last is None or s.time >= last + policy.keep_time_interval:
                keep.add(s.step)
                last = s.time
    return keep


def steps_to_delete(steps: Sequence[StepInfo], policy: RetentionPolicy) -> list[int]:
    """Committed steps the policy no longer keeps, ascending."""
    keep = steps_to_keep(steps, policy)
    return sorted(s.step for s in steps if s.step not in keep)
