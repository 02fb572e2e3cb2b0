"""Goodput of save policies over failure traces (issue 33, item 4).

1. **Save costs, measured here** for a 1 GiB and a 10 GiB state (float32 numpy leaves of
   256 MiB, one process, a local directory under ``--dir``): ``R``, the seconds from
   ``save`` to the commit (``async_save=False``: the write and commit), and ``C``, the
   blocking seconds of an async save, which copies the state to host buffers of its own
   before returning (measured as that copy: ``np.copyto`` into a fresh buffer, 1 GiB at
   a time). Medians of ``--reps``.
2. **Simulation**: a run of ``--days`` of wall time with failures drawn from a trace,
   exponential or heavy tailed (Weibull, shape 0.5: many short gaps, a few long ones),
   of mean ``M`` from 10 minutes to a day, ``--traces`` traces each. Between failures
   the run computes, each save blocks it ``C`` and becomes durable ``R`` after it
   starts; a failure loses the work since the start of the last durable save (the
   restart's own time is left out: the same for every policy). Goodput: durable work
   over wall time. Policies: every 100 and every 1000 steps (``--step-s`` seconds a
   step), every 15 minutes, ``continuous`` (the next save when the last commits) and
   ``goodput``: Young–Daly ``max(sqrt(2·C·M), R)`` with ``M`` learned as
   ``jaxckpt.policies.goodput`` learns it (``(run seconds + 1 day) / (restarts + 1)``),
   and with ``M`` given (the oracle). Every policy sees the same traces.

    python benchmarks/goodput_sim.py [--dir /tmp] [--reps 3] [--traces 200] [--plot PNG] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]

import numpy as np  # noqa: E402

GIB = 1 << 30
MTBFS = [600.0, 3600.0, 6 * 3600.0, 24 * 3600.0]
PRIOR_MTBF_S = 24 * 3600.0  # jaxckpt.policies.PRIOR_MTBF_S


def measure(gib: int, reps: int, root: str) -> tuple[float, float]:
    """``(C, R)`` for a state of ``gib`` GiB (see the module docstring)."""
    import jaxckpt

    leaves = gib * 4
    state = {f"w{k}": np.full(GIB // 4 // 4, k, np.float32) for k in range(leaves)}
    copies, totals = [], []
    for rep in range(reps):
        t = time.perf_counter()
        for v in state.values():  # what an async save's blocking part does: a copy of its own
            np.copyto(np.empty_like(v), v)
        copies.append(time.perf_counter() - t)
        path = os.path.join(root, f"state{gib}-{rep}")
        with jaxckpt.CheckpointManager(path, async_save=False) as mgr:
            t = time.perf_counter()
            mgr.save(0, state)
            totals.append(time.perf_counter() - t)
        shutil.rmtree(path)
    return statistics.median(copies), statistics.median(totals)


def failures(kind: str, mtbf: float, horizon: float, rng: np.random.Generator) -> list[float]:
    """Gaps between failures summing past ``horizon``, of mean ``mtbf``."""
    gaps: list[float] = []
    while sum(gaps) < horizon:
        if kind == "exponential":
            gaps.extend(rng.exponential(mtbf, 64).tolist())
        else:  # Weibull shape 0.5: mean = scale * Gamma(1 + 1/k) = scale * 2
            gaps.extend((rng.weibull(0.5, 64) * mtbf / math.gamma(3.0)).tolist())
    return gaps


def run(policy: str, cost: float, window: float, gaps: list[float], horizon: float, step_s: float,
        mtbf: float) -> float:
    """Goodput of one policy over one trace."""
    durable, wall, restarts = 0.0, 0.0, 0
    for gap in gaps:
        gap = min(gap, horizon - wall)
        if gap <= 0:
            break
        tau = interval(policy, cost, window, step_s, mtbf, wall, restarts)
        durable += segment(gap, tau, cost, window)
        wall += gap
        restarts += 1
    return durable / horizon


def interval(policy: str, cost: float, window: float, step_s: float, mtbf: float, run_s: float,
             restarts: int) -> float:
    """Seconds of compute between saves."""
    if policy == "every 100 steps":
        return 100 * step_s
    if policy == "every 1000 steps":
        return 1000 * step_s
    if policy == "every 15 min":
        return 900.0
    if policy == "continuous":
        return max(window - cost, step_s)
    m = mtbf if policy == "goodput (M given)" else (run_s + PRIOR_MTBF_S) / (restarts + 1)
    return max(math.sqrt(2 * cost * m), window, step_s) - cost


def segment(gap: float, tau: float, cost: float, window: float) -> float:
    """Durable work of a stretch of ``gap`` seconds between failures: cycles of ``tau``
    compute then ``cost`` blocked; save k captures ``k * tau`` of work and is durable
    ``window`` after it starts (at ``k * (tau + cost) - cost``); the stretch keeps the
    newest save durable by its end (the run's end counts as a failure too: a small
    effect over a month of them)."""
    cycle = tau + cost
    k = math.floor((gap - window + cost) / cycle) if gap >= window - cost else 0
    return max(0, k) * tau


def simulate(costs: dict[int, tuple[float, float]], traces: int, days: float, step_s: float,
             seed: int = 0) -> dict[tuple[int, str, float], dict[str, float]]:
    policies = ["every 100 steps", "every 1000 steps", "every 15 min", "continuous", "goodput",
                "goodput (M given)"]
    horizon = days * 86400.0
    out = {}
    for gib, (cost, window) in costs.items():
        for kind in ("exponential", "weibull 0.5"):
            for mtbf in MTBFS:
                rng = np.random.default_rng(seed)
                runs = [failures(kind, mtbf, horizon, rng) for _ in range(traces)]
                out[gib, kind, mtbf] = {p: statistics.mean(run(p, cost, window, g, horizon, step_s, mtbf)
                                                           for g in runs) for p in policies}
    return out


def report(costs, table) -> None:
    for gib, (cost, window) in costs.items():
        print(f"{gib} GiB: C (blocking) {cost:.2f} s, R (save to commit) {window:.2f} s")
    names = list(next(iter(table.values())))
    print("| state | failures | MTBF | " + " | ".join(names) + " | goodput vs best fixed |")
    print("|---|---|---:|" + "---:|" * len(names) + "---:|")
    for (gib, kind, mtbf), row in table.items():
        fixed = max(v for k, v in row.items() if not k.startswith("goodput"))
        cells = " | ".join(f"{100 * row[n]:.2f}%" for n in names)
        print(f"| {gib} GiB | {kind} | {_human(mtbf)} | {cells} | {100 * (row['goodput'] - fixed):+.2f} pt |")


def _human(s: float) -> str:
    return f"{s / 3600:g} h" if s >= 3600 else f"{s / 60:g} min"


def plot(table, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({k[0] for k in table})
    kinds = sorted({k[1] for k in table})
    fig, axes = plt.subplots(len(sizes), len(kinds), figsize=(10, 3.6 * len(sizes)), squeeze=False)
    for i, gib in enumerate(sizes):
        for j, kind in enumerate(kinds):
            ax = axes[i][j]
            for name in next(iter(table.values())):
                ys = [100 * (1 - table[gib, kind, m][name]) for m in MTBFS]
                ax.plot([m / 3600 for m in MTBFS], ys, marker="o", label=name)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("MTBF [h]")
            ax.set_ylabel("time lost [%]")
            ax.set_title(f"{gib} GiB state, {kind} failures")
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=None)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--sizes", default="1,10")
    parser.add_argument("--traces", type=int, default=200)
    parser.add_argument("--days", type=float, default=30.0)
    parser.add_argument("--step-s", type=float, default=1.0)
    parser.add_argument("--costs", default=None, help="JSON {gib: [C, R]}: skip the measurement")
    parser.add_argument("--plot", default=None)
    parser.add_argument("--smoke", action="store_true")
    opts = parser.parse_args()
    if opts.smoke:
        opts.reps, opts.sizes, opts.traces, opts.days = 1, "0", 3, 2.0
    if opts.costs:
        costs = {int(k): tuple(v) for k, v in json.loads(opts.costs).items()}
    else:
        root = tempfile.mkdtemp(prefix="jaxckpt-goodput-", dir=opts.dir)
        try:
            costs = {int(g): measure(int(g), opts.reps, root) if int(g) else (0.01, 0.05)
                     for g in opts.sizes.split(",")}
        finally:
            shutil.rmtree(root, ignore_errors=True)
    table = simulate(costs, opts.traces, opts.days, opts.step_s)
    report(costs, table)
    if opts.plot:
        plot(table, opts.plot)


if __name__ == "__main__":
    main()
