"""How often to save: a pure function from measured saves and a mean time between
failures to the Young–Daly interval and the time each choice is expected to lose.

The model (first order, for C ≪ τ ≪ M):

* ``C``: the cost of one save to the training loop, the *blocking* seconds of a save
  (the snapshot; an async save's writes overlap training). Median of the window.
* ``R``: the durability window, the *total* seconds from ``save`` to the commit.
  Median of the window. A failure in it loses the save being written as well.
* ``M``: the mean time between failures of the job (the caller's number).
* ``τ``: the interval between saves, in seconds.

Fraction of the time lost ≈ ``C/τ + (τ/2 + R)/M``: the saves themselves, plus on each
failure (one per ``M`` on average) the work since the last durable save, half an
interval on average plus the durability window. It is smallest at the Young–Daly
interval ``τ* = sqrt(2·C·M)``.

The window is the last ``WINDOW`` saves by step. The interval and the step rate are
measured from consecutive saves in it: the median time between commits, the median
step delta, and the median of the per-pair step rates (a pair spanning a restart is
one slow outlier, which the median ignores).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from .._errors import CheckpointError

WINDOW = 10  # the saves the advice is measured on: the most recent ones, by step


class SaveSample(NamedTuple):
    """One committed save as the cadence model sees it."""

    step: int
    commit_time: float  # seconds, the manager's clock
    blocking_seconds: float
    total_seconds: float


class CadenceAdvice(NamedTuple):
    """What ``CheckpointManager.advise_interval`` returns.

    Attributes:
      interval_s: the advised interval in seconds: Young–Daly ``sqrt(2·C·M)`` rounded
        to whole steps (at least one), i.e. ``interval_steps / steps per second``.
      interval_steps: the advised ``save_interval_steps``.
      current_interval_s: the median time between consecutive commits in the window.
      current_interval_steps: the median step delta between consecutive saves.
      lost_fraction_now: the expected fraction of time lost at the current interval.
      lost_fraction_advised: the same at the advised interval.
      save_cost_s: ``C``, the median blocking seconds of a save.
      mtbf_s: ``M``, the mean time between failures passed in.
      samples: how many saves the window held.

    Example:
      >>> advice = mgr.advise_interval(mtbf_s=6 * 3600)
      >>> mgr = jaxckpt.CheckpointManager("/ckpts", save_interval_steps=advice.interval_steps)
    """

    interval_s: float
    interval_steps: int
    current_interval_s: float
    current_interval_steps: int
    lost_fraction_now: float
    lost_fraction_advised: float
    save_cost_s: float
    mtbf_s: float
    samples: int


def lost_fraction(interval_s: float, cost_s: float, durability_s: float, mtbf_s: float) -> float:
    """The first-order fraction of time lost: ``C/τ + (τ/2 + R)/M``.

    Example:
      >>> lost_fraction(100.0, cost_s=2.0, durability_s=10.0, mtbf_s=3600.0)
      0.0366...
    """
    return cost_s / interval_s + (interval_s / 2 + durability_s) / mtbf_s


def advise(saves: Sequence[SaveSample], mtbf_s: float, *, window: int = WINDOW) -> CadenceAdvice:
    """The Young–Daly save interval for the measured saves (see the module docstring).

    Args:
      saves: committed saves, any order; the last ``window`` by step are used.
      mtbf_s: the job's mean time between failures, in seconds.
      window: how many of the most recent saves to measure.

    Raises:
      ValueError: ``mtbf_s`` or ``window`` is not a positive number.
      CheckpointError: fewer than 2 saves, or no two consecutive saves whose commit
        time and step both advance (no interval to measure).

    Example:
      >>> saves = [SaveSample(s, 10.0 * s, 2.0, 5.0) for s in range(0, 500, 100)]
      >>> advise(saves, mtbf_s=10_000.0).interval_steps  # sqrt(2·2·10⁴) = 200 s, 10 steps/s
      2000
    """
    if isinstance(mtbf_s, bool) or not isinstance(mtbf_s, (int, float)) or not 0 < mtbf_s < math.inf:
        raise ValueError(f"mtbf_s must be a positive number of seconds, got {mtbf_s!r}")
    if isinstance(window, bool) or not isinstance(window, int) or window < 2:
        raise ValueError(f"window must be an int >= 2, got {window!r}")
    recent = sorted(saves, key=lambda s: s.step)[-window:]
    if len(recent) < 2:
        raise CheckpointError(
            f"advise_interval needs at least 2 committed saves with timings, got {len(recent)}")
    pairs = [(b.commit_time - a.commit_time, b.step - a.step) for a, b in zip(recent, recent[1:])]
    pairs = [(dt, ds) for dt, ds in pairs if dt > 0 and ds > 0]
    if not pairs:
        raise CheckpointError(
            "advise_interval: no two consecutive saves whose commit time and step both advance; "
            "cannot measure the interval between saves")
    cost = float(statistics.median(s.blocking_seconds for s in recent))
    durability = float(statistics.median(s.total_seconds for s in recent))
    current_s = float(statistics.median(dt for dt, _ in pairs))
    current_steps = int(round(statistics.median(ds for _, ds in pairs)))
    steps_per_s = float(statistics.median(ds / dt for dt, ds in pairs))
    steps = max(1, round(math.sqrt(2 * cost * mtbf_s) * steps_per_s))
    interval_s = steps / steps_per_s
    return CadenceAdvice(
        interval_s=interval_s,
        interval_steps=steps,
        current_interval_s=current_s,
        current_interval_steps=current_steps,
        lost_fraction_now=lost_fraction(current_s, cost, durability, mtbf_s),
        lost_fraction_advised=lost_fraction(interval_s, cost, durability, mtbf_s),
        save_cost_s=cost,
        mtbf_s=float(mtbf_s),
        samples=len(recent),
    )


def advise_history(records: Iterable[Any], mtbf_s: float, *, window: int, where: Any) -> CadenceAdvice:
    """``advise`` over a manager's history records (those with timings); a refusal names
    the manager's directory ``where``."""
    saves = [
        SaveSample(r.step, r.commit_time, r.blocking_seconds, r.total_seconds)
        for r in records
        if None not in (r.commit_time, r.blocking_seconds, r.total_seconds)
    ]
    try:
        return advise(saves, mtbf_s, window=window)
    except CheckpointError as e:
        raise CheckpointError(f"{e} (in '{where}')") from None
