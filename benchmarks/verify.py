#!/usr/bin/env python
"""How fast ``jaxckpt.verify`` reads a checkpoint, against reading its files raw.

    python benchmarks/verify.py                   # 1 GiB, 5 reps, medians
    python benchmarks/verify.py --size-gib 0.25 --reps 3
    python benchmarks/verify.py --budget-mib 128  # verify with a bigger read budget

Saves one checkpoint like ``run.py``'s big case (8 float32 leaves of (rows, 4096),
sharded over 4 CPU devices: 32 MiB chunks at 1 GiB), then times, interleaved and in
alternating order, ``jaxckpt.verify`` (every chunk read and its crc32c checked, the
layout checked) and a raw read of every file under the checkpoint (plain ``readinto``
by 4 threads into reused buffers, no checksum). Both read from a warm page cache:
dropping it needs root, so neither touches the disk; the ratio is the cost of
verify's checksums, planning and threading over a bare ``read``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

NDEV = 4
THREADS = 4
GiB = 1 << 30
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_ROOT = os.path.join(REPO, "bench_out")  # gitignored; same disk as the repo

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           f" --xla_force_host_platform_device_count={NDEV}").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, REPO)

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt import _verify


def save_big(path: str, size_bytes: int) -> int:
    """8 float32 leaves of (rows, 4096) sharded over the 4 devices; returns data bytes."""
    cols = 4096
    rows = max(4, (size_bytes // 8 // (4 * cols)) // 4 * 4)
    sharding = NamedSharding(Mesh(np.array(jax.devices()[:NDEV]), ("data",)), P("data", None))
    rng = np.random.default_rng(0)
    tree = {f"w{i}": jax.device_put(rng.standard_normal((rows, cols), dtype=np.float32), sharding)
            for i in range(8)}
    jaxckpt.save(path, {"params": tree})
    return 8 * rows * cols * 4


def raw_read(path: str) -> int:
    """Every file under ``path`` read with ``readinto`` by 4 threads (file i to thread
    i mod 4), each into one reused buffer; returns the bytes read."""
    files = sorted(os.path.join(d, f) for d, _, names in os.walk(path) for f in names)
    biggest = max(os.path.getsize(f) for f in files)
    done = [0] * THREADS

    def work(t: int) -> None:
        view = memoryview(np.empty(biggest, np.uint8))
        for f in files[t::THREADS]:
            with open(f, "rb", buffering=0) as fh:
                while n := fh.readinto(view):
                    done[t] += n

    threads = [threading.Thread(target=work, args=(t,)) for t in range(THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return sum(done)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--budget-mib", type=int, default=None, help="verify's read budget (default: the library's)")
    args = ap.parse_args()
    if args.budget_mib is not None:
        _verify.SCAN_BUDGET_BYTES = args.budget_mib << 20
    os.makedirs(OUT_ROOT, exist_ok=True)
    work = tempfile.mkdtemp(prefix="verify-", dir=OUT_ROOT)
    try:
        path = os.path.join(work, "ckpt")
        data = save_big(path, int(args.size_gib * GiB))
        raw_read(path)  # warm the page cache for both
        times: dict[str, list[float]] = {"verify": [], "raw": []}
        for rep in range(args.reps):
            for name in (("verify", "raw") if rep % 2 == 0 else ("raw", "verify")):
                t0 = time.perf_counter()
                if name == "verify":
                    report = jaxckpt.verify(path)
                    assert report.ok, report.problems
                else:
                    raw_read(path)
                times[name].append(time.perf_counter() - t0)
        v, r = statistics.median(times["verify"]), statistics.median(times["raw"])
        print(f"checkpoint: {data / GiB:.2f} GiB of data in 8 leaves, {report.chunks} chunks, "
              f"{NDEV} CPU devices, {os.cpu_count()} CPUs, read budget {_verify.SCAN_BUDGET_BYTES >> 20} MiB; "
              f"warm page cache for both")
        print(f"verify: {data / v / GiB:6.2f} GiB/s  (median {v:.3f} s of {args.reps}: "
              + ", ".join(f"{t:.3f}" for t in times["verify"]) + ")")
        print(f"raw:    {data / r / GiB:6.2f} GiB/s  (median {r:.3f} s of {args.reps}: "
              + ", ".join(f"{t:.3f}" for t in times["raw"]) + ")")
        print(f"verify / raw: {r / v:.2f}x  (target >= 0.7x)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
