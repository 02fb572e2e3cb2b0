#!/usr/bin/env python
"""GPU check: async save blocking time against the device-to-host copy limit.

On a machine with a GPU (or TPU)::

    python benchmarks/gpu_check.py                  # 4 GiB, 3 reps, ~1-2 min on an H200
    python benchmarks/gpu_check.py --gib 8 --reps 5 --dir /local/nvme/tmp
    python benchmarks/gpu_check.py --gib 0.25       # CPU: runs too (tests use 0.05)

A state of ``--leaves`` float32 arrays (``--gib`` in all) lives on the accelerator,
sharded ``P('data', None)`` over every local device. Per rep, each on freshly generated
arrays (a jax array caches its host copy, so no measurement sees another's transfer):

* ``jax.device_get`` of all leaves (pageable host memory): the device-to-host limit;
* ``copy_to_host_async`` of every shard, then ``np.asarray`` of each: the same, issued
  all at once;
* ``jax.device_put`` onto the same sharding with ``memory_kind="pinned_host"``: the
  DMA bandwidth into pinned host memory (skipped where there is no such memory);
* ``jaxckpt.CheckpointManager(dir, async_save=True).save(step, state)``: the blocking
  part (until ``save`` returns) and the total until ``wait_until_finished`` returns;
* ``mgr.restore(step, target)`` until ``block_until_ready``, the files in the page
  cache, then again with the step's pages dropped (fsync + ``POSIX_FADV_DONTNEED``);
* ``jax.device_put`` of the same bytes from host numpy arrays: the host-to-device limit.

Prints progress on stderr and a markdown table on stdout: medians over the reps, except
that the async save rows take the first save (a fresh manager: thread pools, first
transfers) on rows of its own and the median of saves 2..N on the main rows. Exit
status 1 on any failure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run import drop_page_cache  # noqa: E402 - the benchmarks' one page-cache drop

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 1 << 30
MiB = 1 << 20
COLS = 4096
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[gpu_check {time.perf_counter() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def leaf_shapes(nbytes: int, leaves: int, ndev: int) -> list[tuple[int, int]]:
    """``leaves`` float32 (rows, 4096) arrays, rows a multiple of 8 x the device count."""
    step = 8 * ndev
    rows = max(step, nbytes // leaves // (4 * COLS) // step * step)
    return [(rows, COLS)] * leaves


class Check:
    def __init__(self, args):
        import jax
        import numpy as np
        from jax.sharding import Mesh, NamedSharding
        from jax.sharding import PartitionSpec as P

        import jaxckpt

        self.jax, self.np, self.jaxckpt = jax, np, jaxckpt
        self.devices = jax.local_devices()
        mesh = Mesh(np.array(self.devices), ("data",))
        self.sharding = NamedSharding(mesh, P("data", None))
        self.shapes = leaf_shapes(int(args.gib * GiB), args.leaves, len(self.devices))
        self.nbytes = sum(4 * r * c for r, c in self.shapes)
        self.target = [jax.ShapeDtypeStruct(s, np.float32, sharding=self.sharding)
                       for s in self.shapes]
        self._make = jax.jit(
            lambda key: [jax.random.uniform(jax.random.fold_in(key, i), s, np.float32)
                         for i, s in enumerate(self.shapes)],
            out_shardings=[self.sharding] * len(self.shapes))
        self.seed = 0
        try:
            self.pinned = self.sharding.with_memory_kind("pinned_host")
            kinds = {m.kind for d in self.devices for m in d.addressable_memories()}
            if "pinned_host" not in kinds:
                self.pinned = None
        except Exception:  # noqa: BLE001 - no memory kinds in this jax/backend
            self.pinned = None

    def fresh(self):
        """A new state on the devices (new arrays: no cached host copies)."""
        self.seed += 1
        state = self._make(self.jax.random.key(self.seed))
        self.jax.block_until_ready(state)
        return state

    def timed(self, fn) -> tuple[float, object]:
        t0 = time.perf_counter()
        out = fn()
        return time.perf_counter() - t0, out


def run(args) -> dict:
    c = Check(args)
    jax, np = c.jax, c.np
    dev = c.devices[0]
    log(f"{len(c.devices)} x {dev.device_kind} ({dev.platform}), state {c.nbytes / GiB:.3f} GiB "
        f"in {len(c.shapes)} leaves {c.shapes[0]}, {args.reps} rep(s)")
    base = args.dir or os.path.join(REPO, "bench_out")
    os.makedirs(base, exist_ok=True)
    work = tempfile.mkdtemp(prefix="gpu_check-", dir=base)
    samples: dict = {k: [] for k in ("d2h_get", "d2h_async", "d2h_pinned", "block", "total",
                                     "block_self", "restore", "restore_cold", "h2d")}
    mgr = c.jaxckpt.CheckpointManager(os.path.join(work, "mgr"), async_save=True)
    try:
        for rep in range(args.reps):
            step = rep + 1
            # device-to-host limits
            state = c.fresh()
            dt, host = c.timed(lambda s=state: jax.device_get(s))
            samples["d2h_get"].append(dt)
            log(f"rep {rep}: device_get {dt:.3f}s ({c.nbytes / GiB / dt:.2f} GiB/s)")
            del state
            state = c.fresh()
            shards = [s.data for x in state for s in x.addressable_shards]

            def copy_async(shards=shards):
                for s in shards:
                    s.copy_to_host_async()
                return [np.asarray(s) for s in shards]

            dt, got = c.timed(copy_async)
            samples["d2h_async"].append(dt)
            log(f"rep {rep}: copy_to_host_async + np.asarray {dt:.3f}s")
            del state, shards, got
            if c.pinned is not None:
                state = c.fresh()
                try:
                    dt, got = c.timed(lambda s=state: jax.block_until_ready(
                        jax.device_put(s, [c.pinned] * len(s))))
                    samples["d2h_pinned"].append(dt)
                    log(f"rep {rep}: device_put to pinned_host {dt:.3f}s")
                    del got
                except Exception as e:  # noqa: BLE001 - report, go on without it
                    log(f"rep {rep}: pinned_host transfer unavailable ({type(e).__name__}: {e})")
                    c.pinned = None
                del state
            # async save
            state = c.fresh()
            t0 = time.perf_counter()
            mgr.save(step, state)
            t1 = time.perf_counter()
            mgr.wait_until_finished()
            t2 = time.perf_counter()
            samples["block"].append(t1 - t0)
            samples["total"].append(t2 - t0)
            info = mgr.info(step) or {}
            if info.get("blocking_seconds") is not None:
                samples["block_self"].append(info["blocking_seconds"])
            log(f"rep {rep}: async save blocking {(t1 - t0) * 1e3:.1f} ms, committed after "
                f"{t2 - t0:.3f}s")
            # restore, warm then cold
            for key in ("restore", "restore_cold"):
                if key == "restore_cold":
                    drop_page_cache(os.path.join(work, "mgr", str(step)))
                t0 = time.perf_counter()
                restored = mgr.restore(step, c.target)
                jax.block_until_ready(restored)
                samples[key].append(time.perf_counter() - t0)
                log(f"rep {rep}: {key.replace('_', ' ')} {samples[key][-1]:.3f}s")
                check = range(len(state)) if args.gib <= 0.25 else [0]
                for i in check:
                    if not np.array_equal(np.asarray(restored[i]), np.asarray(state[i])):
                        raise AssertionError(f"restored leaf {i} differs from the saved one")
                del restored
            del state
            # host-to-device limit: the host copies from device_get
            dt, got = c.timed(lambda h=host: jax.block_until_ready(
                jax.device_put(h, [c.sharding] * len(h))))
            samples["h2d"].append(dt)
            log(f"rep {rep}: device_put from numpy {dt:.3f}s ({c.nbytes / GiB / dt:.2f} GiB/s)")
            del got, host
            mgr.delete(step)
    finally:
        mgr.close()
        shutil.rmtree(work, ignore_errors=True)
    return {"device": f"{len(c.devices)} x {dev.device_kind}", "platform": dev.platform,
            "bytes": c.nbytes, "leaves": len(c.shapes), "shape": list(c.shapes[0]),
            "reps": args.reps, "samples": samples,
            "versions": {"jax": jax.__version__, "jaxckpt": getattr(c.jaxckpt, "__version__", None)}}


def table(res: dict) -> str:
    s = dict(res["samples"])
    n = res["bytes"]
    for k in ("block", "total", "block_self"):  # the first save (fresh manager) apart
        s[k + "_first"] = s[k][:1]
        s[k] = s[k][1:] or s[k]
    med = {k: statistics.median(v) for k, v in s.items() if v}
    d2h = min(med[k] for k in ("d2h_get", "d2h_async") if k in med)

    def row(label, key, limit=None, limit_label="", rate=True):
        v = med.get(key)
        if v is None:
            return f"| {label} | n/a | | | |"
        gibs = f"{n / GiB / v:.2f}" if v > 0 and rate else ""
        if limit is None:
            return f"| {label} | {v:.4f} | {gibs} | | |"
        return f"| {label} | {v:.4f} | {gibs} | {limit_label} {limit:.4f} | {v / limit:.2f} |"

    later = "saves 2..N in the same manager" if res["reps"] > 1 else "the one save"
    lines = [
        f"GPU check: {res['device']} ({res['platform']}), {n / GiB:.3f} GiB float32 in "
        f"{res['leaves']} leaves {tuple(res['shape'])} sharded P('data', None); median of "
        f"{res['reps']} (async save rows: {later}); jax {res['versions']['jax']}",
        "",
        "| metric | time [s] | GiB/s | limit [s] | ratio |",
        "|---|---:|---:|---:|---:|",
        row("async save: blocking (`mgr.save` returns)", "block", d2h, "D2H", rate=False),
        row("async save: blocking, first save (fresh manager)", "block_first", d2h, "D2H",
            rate=False),
        row("async save: total to commit", "total"),
        row("async save: total to commit, first save", "total_first"),
        row("restore (`mgr.restore`, page cache warm)", "restore", med.get("h2d"), "H2D"),
        row("restore, page cache dropped", "restore_cold", med.get("h2d"), "H2D"),
        row("D2H limit: `jax.device_get` (pageable)", "d2h_get"),
        row("D2H limit: `copy_to_host_async` + `np.asarray` per shard", "d2h_async"),
        row("D2H: `device_put` to `pinned_host`", "d2h_pinned"),
        row("H2D limit: `jax.device_put` from numpy", "h2d"),
    ]
    if "block_self" in med:
        lines.append("")
        lines.append(f"jaxckpt's own record of the blocking part (manifest `blocking_seconds`): "
                     f"{med['block_self'] * 1e3:.1f} ms")
    ratio = med["block"] / d2h
    lines.append("")
    lines.append(f"D2H limit = the faster of the two pageable copies. Target: blocking <= 1.2x "
                 f"the D2H limit: {'met' if ratio <= 1.2 else 'NOT met'} ({ratio:.2f}x)")
    if "d2h_pinned" in med:
        pinned = med["block"] / med["d2h_pinned"]
        lines.append(f"Target (issue 34): blocking <= 1.2x the pinned-host transfer of the same bytes: "
                     f"{'met' if pinned <= 1.2 else 'NOT met'} ({pinned:.2f}x)")
    if res["platform"] == "cpu":
        lines.append("CPU devices: np.asarray of a shard is a zero-copy view, so the D2H "
                     "'copies' move no bytes and these ratios compare fixed costs; the point of "
                     "this check is a GPU.")
    return "\n".join(lines)


def pinned_probe(args, reps: int) -> str:
    """A candidate snapshot for the async save (issue 34): ``device_put`` of every leaf to
    its ``pinned_host`` sharding, blocked on (what a save would wait for), then
    ``np.asarray`` of each pinned shard (what the writer thread would do in the
    background), and the process's RSS after each rep (does a pinned arena grow?)."""
    import psutil

    c = Check(args)
    jax, np = c.jax, c.np
    if c.pinned is None:
        return "pinned probe: no pinned_host memory on this backend"
    proc = psutil.Process()
    block, host, rss, zero_copy = [], [], [], None
    for rep in range(reps):
        state = c.fresh()
        t0 = time.perf_counter()
        pinned = jax.block_until_ready(jax.device_put(state, [c.pinned] * len(state)))
        t1 = time.perf_counter()
        del state
        shards = [s.data for x in pinned for s in x.addressable_shards]
        views = [np.asarray(s) for s in shards]
        t2 = time.perf_counter()
        if zero_copy is None:
            zero_copy = all(v.__array_interface__["data"][0] == s.unsafe_buffer_pointer()
                            for v, s in zip(views, shards))
        block.append(t1 - t0)
        host.append(t2 - t1)
        del views, shards, pinned
        rss.append(proc.memory_info().rss)
        log(f"pinned probe rep {rep}: put+block {t1 - t0:.4f}s, np.asarray {t2 - t1:.4f}s, "
            f"rss {rss[-1] / GiB:.2f} GiB")
    later = slice(1, None) if reps > 1 else slice(None)
    mb, mh = statistics.median(block[later]), statistics.median(host[later])
    return "\n".join([
        f"pinned probe ({reps} reps, medians of reps 2..N; {c.nbytes / GiB:.3f} GiB):",
        f"- `device_put` to `pinned_host` + block: {mb:.4f} s ({c.nbytes / GiB / mb:.1f} GiB/s), "
        f"first rep {block[0]:.4f} s",
        f"- then `np.asarray` of every pinned shard: {mh:.4f} s (zero-copy: {zero_copy})",
        f"- RSS after rep 1 / rep {reps}: {rss[0] / GiB:.2f} / {rss[-1] / GiB:.2f} GiB",
    ])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=4.0, help="state size in GiB (default 4)")
    ap.add_argument("--leaves", type=int, default=8, help="number of arrays (default 8)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions (default 3)")
    ap.add_argument("--dir", help="where checkpoints go (default: bench_out/ in the repo)")
    ap.add_argument("--json", metavar="FILE", help="also write every sample as JSON")
    ap.add_argument("--pinned-probe", type=int, default=0, metavar="N",
                    help="also probe a pinned-host snapshot for N reps (blocking, host view, RSS)")
    args = ap.parse_args(argv)
    if args.gib <= 0 or args.reps < 1 or args.leaves < 1:
        ap.error("--gib, --reps and --leaves must be positive")
    try:
        res = run(args)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        return 1
    print(table(res))
    if args.pinned_probe:
        try:
            print("\n" + pinned_probe(args, args.pinned_probe))
        except Exception:  # noqa: BLE001 - the main table stands without it
            traceback.print_exc()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
