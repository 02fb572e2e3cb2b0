"""Read once per job (issue 14 items 6 and 2): a fully replicated state (or, with
``--layout columns``, a row-sharded one restored as column blocks) restored in N real JAX
processes (jax.distributed, gloo, one CPU device each), with the exchange on (each
replicated chunk read by one process, handed to the others by an all-gather) and off
(every process reads everything). Repetitions interleaved; per repetition the slowest
process's restore time and the job's total bytes read (the library's own count and the
kernel's ``rchar``); medians printed with the ratios. ``--cold`` drops the checkpoint's
pages (``POSIX_FADV_DONTNEED``) before every restore; ``--s3`` puts the checkpoint on a
local S3 server (moto, a Python server on the same cores) through ``s3://`` and
``AWS_ENDPOINT_URL``, where every read is a request to one shared service.

``--memory`` (issue 19, defect 7) measures what one restore holds instead: one large
int32 leaf saved as one chunk (by one process) and 16 small ones, restored replicated
in N processes with the exchange on; per process the peak RSS (and the RSS before the
restore), and the largest wave: its row width, the gathered rows (``nproc`` x width,
the all-gather's output on the device) and the wave's buffers (own row on host and
device plus the gathered rows, ``(nproc + 2)`` x width; on CPU device memory is host
memory). ``--wave-mib`` sets ``_exchange.WAVE_BYTES`` (default: the library's).

    python benchmarks/read_once.py [--procs 4] [--mib 1024] [--reps 3] [--cold | --s3] [--smoke]
                                   [--layout replicated|columns] [--formats 1,3]

``--formats`` saves (and restores) the state once per format listed (``JAXCKPT_FORMAT``
in the workers; format 3: issue 22), one after the other, each printed on its own.
    python benchmarks/read_once.py --memory [--procs 4] [--mib 512] [--wave-mib 512]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from run import drop_page_cache  # noqa: E402 - the benchmarks' one page-cache drop


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def worker(port: int, nproc: int, pid: int, path: str, mib: int, reps: int, cold: bool, layout: str) -> None:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid,
                               initialization_timeout=120)
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxckpt
    from jaxckpt import _exchange, _storage

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
    everywhere = NamedSharding(mesh, P())
    rows = mib * (1 << 20) // 8 // 4096  # 8 float32 leaves of (rows, 1024)
    shape = (rows, 1024)
    saved_as, restored_as = everywhere, everywhere
    if layout == "columns":  # saved as row blocks, restored as column blocks: no replicas
        saved_as, restored_as = NamedSharding(mesh, P("d", None)), NamedSharding(mesh, P(None, "d"))
    tree = {f"w{i}": jax.make_array_from_callback(
        shape, saved_as, lambda idx, i=i: np.full(shape, i, np.float32)[idx]) for i in range(8)}
    jaxckpt.save(path, tree, timeout_s=120)
    del tree
    target = {f"w{i}": jax.ShapeDtypeStruct(shape, np.float32, sharding=restored_as) for i in range(8)}
    held = 8 * len({str(i) for i in restored_as.addressable_devices_indices_map(shape).values()}) * (
        int(np.prod(restored_as.shard_shape(shape))) * 4)
    out = []
    for rep in range(reps):
        for mode in ("once", "each") if rep % 2 == 0 else ("each", "once"):
            _exchange.READ_ONCE = "1" if mode == "once" else "0"
            if cold and pid == 0 and "://" not in path:
                drop_page_cache(path)
            multihost_utils.sync_global_devices(f"r{rep}{mode}")
            _storage.reset_io_stats()
            before = rchar()
            t0 = time.perf_counter()
            back = jaxckpt.restore(path, target)
            jax.block_until_ready(back)
            seconds = time.perf_counter() - t0
            kernel = rchar() - before
            ok = all(float(np.asarray(back[f"w{i}"].addressable_data(0))[-1, -1]) == i for i in range(8))
            del back
            out.append({"rep": rep, "mode": mode, "seconds": seconds, "read": _storage.io_stats()["bytes_read"],
                        "rchar": kernel, "ok": ok, "held": held})
    print("RESULT " + json.dumps(out), flush=True)


def run(nproc: int, mib: int, reps: int, cold: bool, s3: bool = False, layout: str = "replicated",
        fmt: str = "") -> dict:
    d = tempfile.mkdtemp(prefix="jaxckpt-readonce-")
    path = os.path.join(d, "ckpt")
    port = free_port()
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    if fmt:
        env["JAXCKPT_FORMAT"] = fmt
    moto = None
    if s3:
        from s3 import start_moto  # also sets dummy AWS credentials

        moto, endpoint = start_moto()
        env.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                   AWS_REGION="us-east-1")
        path = "s3://jaxckpt-bench/readonce"
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(port), str(nproc), str(i), path,
                               str(mib), str(reps), str(int(cold)), layout],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for i in range(nproc)]
    results = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=1800)
            lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
            if not lines:
                raise SystemExit(f"a worker failed:\n{stderr[-3000:]}")
            results.append(json.loads(lines[-1][7:]))
    finally:
        if moto is not None:
            moto.terminate()
        subprocess.run(["rm", "-rf", d], check=False)
    table: dict[str, dict[str, list[float]]] = {"once": {}, "each": {}}
    for rows in zip(*results):  # one repetition of one mode, every process
        mode = rows[0]["mode"]
        assert all(r["ok"] for r in rows), rows
        for key, value in (("seconds", max(r["seconds"] for r in rows)),
                           ("read", sum(r["read"] for r in rows)), ("rchar", sum(r["rchar"] for r in rows)),
                           ("worst", max(r["read"] / r["held"] for r in rows))):
            table[mode].setdefault(key, []).append(value)
    return {mode: {k: statistics.median(v) for k, v in cols.items()} for mode, cols in table.items()}


def memory_state_shape(mib: int) -> tuple[int, int]:
    return mib * (1 << 20) // 4 // 1024, 1024


def memory_save(path: str, mib: int) -> None:
    """One process saves the large leaf (one chunk: no other process shares its writes)
    and 16 small ones."""
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    import numpy as np

    import jaxckpt

    rows, cols = memory_state_shape(mib)
    tree = {"big": np.arange(rows * cols, dtype=np.int32).reshape(rows, cols)}
    tree.update({f"small{i}": np.full(4096, i, np.float32) for i in range(16)})
    jaxckpt.save(path, tree)


def vm_rss() -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS:")).split()[1]) << 10


def memory_worker(port: int, nproc: int, pid: int, path: str, mib: int, wave: int) -> None:
    """Restore the ``memory_save`` state replicated on every process, exchange on; print
    the peak RSS and the widths of the waves' rows."""
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid,
                               initialization_timeout=120)
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxckpt
    from jaxckpt import _exchange

    _exchange.READ_ONCE = "1"
    if wave:
        _exchange.WAVE_BYTES = wave
    widths: list[int] = []
    gather = _exchange.all_gather

    def recorded(row, lengths):  # the same hook before and after the change
        widths.append(int(row.shape[1]))
        return gather(row, lengths)
    _exchange.all_gather = recorded
    everywhere = NamedSharding(jax.sharding.Mesh(np.array(jax.devices()), ("d",)), P())
    rows, cols = memory_state_shape(mib)
    target = {"big": jax.ShapeDtypeStruct((rows, cols), np.int32, sharding=everywhere)}
    target.update({f"small{i}": jax.ShapeDtypeStruct((4096,), np.float32, sharding=everywhere) for i in range(16)})
    before = vm_rss()
    t0 = time.perf_counter()
    back = jax.block_until_ready(jaxckpt.restore(path, target))
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
    big = np.asarray(back["big"].addressable_data(0))
    ok = all(np.array_equal(big[r:r + 4096].ravel(), np.arange(r * cols, min(r + 4096, rows) * cols, dtype=np.int32))
             for r in range(0, rows, 4096))
    ok &= all(float(np.asarray(back[f"small{i}"].addressable_data(0))[-1]) == i for i in range(16))
    print("RESULT " + json.dumps({"before": before, "peak": peak, "widths": widths, "ok": bool(ok),
                                  "seconds": seconds}), flush=True)


def run_memory(nproc: int, mib: int, wave: int) -> list[dict]:
    d = tempfile.mkdtemp(prefix="jaxckpt-readonce-mem-")
    path = os.path.join(d, "ckpt")
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    try:
        subprocess.run([sys.executable, __file__, "--memory-save", path, str(mib)], env=env, check=True, timeout=1800)
        port = free_port()
        procs = [subprocess.Popen([sys.executable, __file__, "--memory-worker", str(port), str(nproc), str(i), path,
                                   str(mib), str(wave)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env=env) for i in range(nproc)]
        results = []
        for p in procs:
            stdout, stderr = p.communicate(timeout=1800)
            lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
            if not lines:
                raise SystemExit(f"a worker failed:\n{stderr[-3000:]}")
            results.append(json.loads(lines[-1][7:]))
    finally:
        subprocess.run(["rm", "-rf", d], check=False)
    return results


def print_memory(nproc: int, mib: int, wave: int, results: list[dict]) -> None:
    m = 1 << 20
    print(f"one {mib} MiB int32 leaf saved as one chunk + 16 x 16 KiB leaves, restored replicated on {nproc} "
          f"processes x 1 CPU device, exchange on, WAVE_BYTES {wave / m if wave else 'default'} MiB:")
    for pid, r in enumerate(results):
        w = max(r["widths"], default=0)
        print(f"  process {pid}: peak RSS {r['peak'] / m:8.1f} MiB (before the restore {r['before'] / m:6.1f}, "
              f"+{(r['peak'] - r['before']) / m:7.1f})   waves {len(r['widths']):4d}   widest row {w / m:7.2f} MiB   "
              f"gathered {nproc * w / m:8.1f} MiB   wave buffers {(nproc + 2) * w / m:8.1f} MiB   "
              f"restore {r['seconds']:.2f} s   values {'ok' if r['ok'] else 'WRONG'}")
    print(f"  job: peak RSS {sum(r['peak'] for r in results) / m:.1f} MiB in all, "
          f"{sum(r['peak'] - r['before'] for r in results) / m:.1f} MiB over the RSS before the restore")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        port, nproc, pid, path, mib, reps, cold, layout = sys.argv[2:10]
        worker(int(port), int(nproc), int(pid), path, int(mib), int(reps), cold == "1", layout)
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--memory-save":
        memory_save(sys.argv[2], int(sys.argv[3]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--memory-worker":
        port, nproc, pid, path, mib, wave = sys.argv[2:8]
        memory_worker(int(port), int(nproc), int(pid), path, int(mib), int(wave))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cold", action="store_true")
    ap.add_argument("--s3", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="2 processes, 8 MiB, 1 repetition (CI)")
    ap.add_argument("--layout", choices=["replicated", "columns"], default="replicated",
                    help="replicated: saved and restored replicated on every process; columns: saved as "
                         "row blocks, restored as column blocks (each process reads parts of every chunk)")
    ap.add_argument("--formats", default="",
                    help="comma list of formats to save (JAXCKPT_FORMAT), e.g. 1,3: one run each; "
                         "default: the environment's")
    ap.add_argument("--memory", action="store_true",
                    help="peak RSS and wave buffers of one restore of a leaf saved as one chunk (see above)")
    ap.add_argument("--wave-mib", type=float, default=0, help="--memory: _exchange.WAVE_BYTES in MiB")
    args = ap.parse_args()
    if args.memory:
        wave = int(args.wave_mib * (1 << 20))
        print_memory(args.procs, args.mib, wave, run_memory(args.procs, args.mib, wave))
        return
    if args.smoke:
        args.procs, args.mib, args.reps = 2, 8, 1
    for fmt in [f.strip() for f in args.formats.split(",") if f.strip()] or [""]:
        report(args, fmt, run(args.procs, args.mib, args.reps, args.cold, args.s3, args.layout, fmt))


def report(args: argparse.Namespace, fmt: str, res: dict) -> None:
    state = args.mib << 20
    where = "local S3 server (moto)" if args.s3 else f"local disk, {'cold' if args.cold else 'warm'} page cache"
    what = ("fully replicated" if args.layout == "replicated" else
            "row blocks restored as column blocks,")
    saved = f", saved in format {fmt}" if fmt else ""
    print(f"{what} {args.mib} MiB state (8 leaves){saved}, {args.procs} processes x 1 CPU device, "
          f"{where}, medians of {args.reps}:")
    for mode, label in (("each", "exchange off"), ("once", "exchange on (read once)")):
        r = res[mode]
        kernel = "n/a (network)" if args.s3 else f"{r['rchar'] / state:.2f}x"
        print(f"  {label:26s} restore {r['seconds']:.3f} s   bytes read (job) {r['read'] / state:.2f}x the state"
              f"   rchar {kernel}   most read by a process {r['worst']:.2f}x the bytes it holds")
    print(f"  time once/each: {res['once']['seconds'] / res['each']['seconds']:.2f}x   "
          f"bytes once/each: {res['once']['read'] / res['each']['read']:.2f}x")


if __name__ == "__main__":
    main()
