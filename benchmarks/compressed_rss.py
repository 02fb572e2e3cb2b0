#!/usr/bin/env python
"""Peak host memory of a compressed save, with a raw save as the baseline (issue 30, defect 3).

    python benchmarks/compressed_rss.py                          # 256 and 512 MiB, raw / zstd / zstd+budget
    python benchmarks/compressed_rss.py --sizes 256 512 1024 --reps 1
    python benchmarks/compressed_rss.py --smoke                  # 16 MiB, one rep of each mode

The state is ``--leaves`` numpy float32 leaves of random values (``--size-mib`` in all):
zstd shrinks them by a few percent only, so the encoded bytes are about the state's size,
the worst case for memory held by encoding. Each run is a fresh interpreter: a tiny
warm-up save (imports, tensorstore, threads), then the state is allocated and touched,
then one blocking save:

* ``raw``: ``jaxckpt.save(path, state)``;
* ``zstd``: ``jaxckpt.save(path, state, compression="zstd")``;
* ``zstd+budget``: ``CheckpointManager(..., async_save=False, compression="zstd",
  max_staging_bytes=--budget-mib).save(0, state)`` (c1abc6a refuses this: ``refused``).

Peak RSS is ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` after the save minus its value
once the state is allocated; ``encoded peak`` is the writer's own count of encoded bytes
held at once (``_writer.ENCODED.peak``; ``-`` where the library has no such count).
Medians of ``--reps`` runs; ``os.sync()`` before each.
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
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_ROOT = os.path.join(REPO, "bench_out")  # gitignored; same disk as the repo
MARK = "@@COMPRESSED "
MiB = 1 << 20
MODES = ("raw", "zstd", "zstd+budget")


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def worker(args: argparse.Namespace) -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import numpy as np

    import jaxckpt
    from jaxckpt import _writer

    jaxckpt.save(os.path.join(args.dir, "warmup"), {"w": np.ones(2 * MiB // 4, np.float32)}, compression="zstd")
    rng = np.random.default_rng(0)
    n = args.size_mib * MiB // args.leaves // 4
    state = {f"w{i:02d}": rng.standard_normal(n, dtype=np.float32) for i in range(args.leaves)}
    counter = getattr(_writer, "ENCODED", None)
    if counter is not None:
        counter.reset()
    base = _rss_mib()
    path = os.path.join(args.dir, "run")
    t0 = time.perf_counter()
    refused = None
    if args.mode == "raw":
        jaxckpt.save(path, state)
    elif args.mode == "zstd":
        jaxckpt.save(path, state, compression="zstd")
    else:
        try:
            with jaxckpt.CheckpointManager(path, async_save=False, compression="zstd",
                                           max_staging_bytes=args.budget_mib * MiB) as mgr:
                mgr.save(0, state)
        except jaxckpt.CheckpointError as e:
            refused = str(e)
    seconds = time.perf_counter() - t0
    peak = _rss_mib()
    stored = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
    print(MARK + json.dumps({"mode": args.mode, "size_mib": args.size_mib, "peak_above_mib": peak - base,
                             "seconds": seconds, "stored_mib": stored / MiB, "refused": refused,
                             "encoded_peak_mib": counter.peak / MiB if counter is not None else None}))


def spawn(mode: str, size_mib: int, leaves: int, budget_mib: int) -> dict:
    os.makedirs(OUT_ROOT, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="compressed_rss-", dir=OUT_ROOT)
    os.sync()
    try:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--dir", tmp, "--mode", mode,
               "--size-mib", str(size_mib), "--leaves", str(leaves), "--budget-mib", str(budget_mib)]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith(MARK)]
        if out.returncode or not lines:
            raise RuntimeError(f"worker failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
        return json.loads(lines[-1][len(MARK):])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[256, 512], help="state sizes, MiB")
    ap.add_argument("--leaves", type=int, default=8)
    ap.add_argument("--budget-mib", type=int, default=64, help="max_staging_bytes of the zstd+budget mode")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="16 MiB, one rep")
    ap.add_argument("--json", help="write the per-run results here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="raw", help=argparse.SUPPRESS)
    ap.add_argument("--size-mib", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    if args.smoke:
        args.sizes, args.reps = [16], 1
    print(f"{args.leaves} numpy float32 leaves of random values, blocking save, medians of {args.reps} fresh "
          f"processes; budget {args.budget_mib} MiB")
    print(f"{'state':>9} {'mode':>12} {'peak RSS above baseline':>24} {'encoded peak':>13} {'stored':>9} "
          f"{'time':>7}")
    runs = []
    for size in args.sizes:
        for mode in args.modes:
            rs = [spawn(mode, size, args.leaves, args.budget_mib) for _ in range(args.reps)]
            runs += rs
            if rs[0]["refused"]:
                print(f"{size:>5} MiB {mode:>12}   refused: {rs[0]['refused']}", flush=True)
                continue

            def med(key: str, rs: list = rs) -> float:
                return statistics.median(r[key] for r in rs)

            enc = f"{med('encoded_peak_mib'):.0f} MiB" if rs[0]["encoded_peak_mib"] is not None else "-"
            print(f"{size:>5} MiB {mode:>12} {med('peak_above_mib'):>20.0f} MiB {enc:>13} "
                  f"{med('stored_mib'):>5.0f} MiB {med('seconds'):>6.2f}s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)


if __name__ == "__main__":
    main()
