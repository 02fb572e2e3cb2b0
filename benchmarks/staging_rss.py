#!/usr/bin/env python
"""Peak host memory of an async save with and without a staging budget (issue 12, item 7).

    python benchmarks/staging_rss.py                       # 1 GiB, no budget and 256 MiB, 3 reps
    python benchmarks/staging_rss.py --size-mib 256 --budgets 0 64 --reps 1

The state is ``--leaves`` numpy float32 leaves (``--size-mib`` in all; 16 x 64 MiB by
default): host arrays, which an async save copies (on CPU; on GPU/TPU the device shards
are what a save copies to the host). Each configuration runs in a fresh interpreter: a
tiny warm-up save (imports, tensorstore, threads), then the state is allocated and
touched, then ``CheckpointManager(..., max_staging_bytes=budget).save(0, state)``
(budget 0: no ``max_staging_bytes`` at all) and ``wait_until_finished()``.

If the manager does not take ``max_staging_bytes`` yet, the budgeted runs do what it
would, directly: ``_snapshot.snapshot(..., budget=StagingBudget(budget))``,
``_checkpoint.save_snapshot`` on a background thread, ``snap.stage_rest()``. The
``path`` column says which ran.

Peak RSS is ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` at the end minus its value once
the state is allocated (the baseline); ``blocking`` is how long ``save`` blocked (the
snapshot, and with a budget every wave but the last written); ``total`` until committed;
``accounted``: the budget's own peak of staged-but-not-written bytes. Medians of
``--reps`` runs; the page cache's dirty pages are written back (``os.sync()``) before
each. Times depend on the disk (every run writes the state with fsync); the RSS does not.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_ROOT = os.path.join(REPO, "bench_out")  # gitignored; same disk as the repo
MARK = "@@STAGING "
MiB = 1 << 20


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _save_direct(directory: str, state: dict, budget: int) -> tuple[float, float, int]:
    """What ``CheckpointManager(max_staging_bytes=budget).save`` + ``wait_until_finished`` do."""
    from jaxckpt import _checkpoint, _snapshot

    staging = _snapshot.StagingBudget(budget)
    errors: list[BaseException] = []
    t0 = time.perf_counter()
    snap = _snapshot.snapshot(state, copy_host_arrays=True, budget=staging)

    def write() -> None:
        try:
            _checkpoint.save_snapshot(os.path.join(directory, "0"), snap)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    writer = threading.Thread(target=write, name="jaxckpt-save")
    writer.start()
    snap.stage_rest()
    blocking = time.perf_counter() - t0
    writer.join()
    if errors:
        raise errors[0]
    return blocking, time.perf_counter() - t0, staging.peak


def _save_manager(directory: str, state: dict, budget: int) -> tuple[float, float, int]:
    import jaxckpt

    kw = {"max_staging_bytes": budget} if budget else {}
    mgr = jaxckpt.CheckpointManager(directory, **kw)
    try:
        t0 = time.perf_counter()
        mgr.save(0, state)
        blocking = time.perf_counter() - t0
        mgr.wait_until_finished()
        total = time.perf_counter() - t0
    finally:
        mgr.close()
    staging = getattr(mgr, "_staging", None)
    return blocking, total, staging.peak if staging is not None else -1


def worker(args: argparse.Namespace) -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import numpy as np

    import jaxckpt

    with jaxckpt.CheckpointManager(os.path.join(args.dir, "warmup")) as mgr:
        mgr.save(0, {"w": np.ones(2 * MiB // 4, np.float32), "s": np.arange(3)})
    path = "manager"
    if args.budget:
        try:
            jaxckpt.CheckpointManager(os.path.join(args.dir, "probe"), max_staging_bytes=args.budget).close()
        except TypeError:
            path = "direct"
    n = args.size_mib * MiB // args.leaves // 4
    state = {f"w{i:02d}": np.full(n, i, np.float32) for i in range(args.leaves)}  # touched: resident
    base = _rss_mib()
    save = _save_direct if path == "direct" else _save_manager
    blocking, total, accounted = save(os.path.join(args.dir, "run"), state, args.budget)
    peak = _rss_mib()
    print(MARK + json.dumps({"path": path, "budget": args.budget, "base_mib": base, "peak_above_mib": peak - base,
                             "blocking_s": blocking, "total_s": total, "accounted_mib": accounted / MiB}))


def spawn(budget: int, size_mib: int, leaves: int) -> dict:
    os.makedirs(OUT_ROOT, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="staging_rss-", dir=OUT_ROOT)
    os.sync()  # the last run's dirty pages written back: they would slow this one's allocations
    try:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--dir", tmp, "--budget", str(budget),
               "--size-mib", str(size_mib), "--leaves", str(leaves)]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith(MARK)]
        if out.returncode or not lines:
            raise RuntimeError(f"worker failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
        return json.loads(lines[-1][len(MARK):])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--leaves", type=int, default=16)
    ap.add_argument("--budgets", type=int, nargs="+", default=[0, 256], help="MiB; 0: no budget")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", help="write the per-run results here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    ap.add_argument("--budget", type=int, default=0, help=argparse.SUPPRESS)  # bytes
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    print(f"{args.size_mib} MiB state: {args.leaves} numpy float32 leaves of {args.size_mib / args.leaves:g} MiB, "
          f"async save, medians of {args.reps} fresh processes")
    print(f"{'budget':>10} {'path':>8} {'peak RSS above baseline':>24} {'accounted':>10} {'blocking':>9} "
          f"{'total':>7}")
    runs = {}
    for budget_mib in args.budgets:
        runs[budget_mib] = rs = [spawn(budget_mib * MiB, args.size_mib, args.leaves) for _ in range(args.reps)]

        def med(key: str, rs: list = rs) -> float:
            return statistics.median(r[key] for r in rs)

        label = f"{budget_mib} MiB" if budget_mib else "none"
        accounted = f"{med('accounted_mib'):.0f} MiB" if budget_mib else "-"
        print(f"{label:>10} {rs[0]['path']:>8} {med('peak_above_mib'):>20.0f} MiB {accounted:>10} "
              f"{med('blocking_s'):>8.2f}s {med('total_s'):>6.2f}s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)


if __name__ == "__main__":
    main()
