"""Time to resume, phase by phase (issue 34, item 1; first part: one process, local disk).

From a fresh process to its first training step: ``import`` (jax and the library),
the manager's start (``CheckpointManager(...)`` / orbax's ``CheckpointManager``), the
restore, placement (``block_until_ready`` of every restored array) and the first step (a
jitted step over the restored state, compiled there). Each run is a fresh process; cold
runs drop the page cache first (``sync; echo 3 > /proc/sys/vm/drop_caches``, root only;
else ``POSIX_FADV_DONTNEED`` on every file of the step). States: 1 GiB in 4 float32
leaves, and 1,000 leaves of 4 KiB. jaxckpt and orbax (``StandardCheckpointer``'s
format through ``CheckpointManager``) in the same run, interleaved. The limit of the read
itself, in the same run: ``--readers`` threads reading the step's files (cold), as
parallel reads of the same bytes reach on this disk. Medians of ``--reps``.

    python benchmarks/time_to_step.py [--dir /tmp] [--reps 3] [--readers 8] [--smoke]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]

PHASES = ("import", "manager start", "restore", "placement", "first step")


def state_spec(kind: str, smoke: bool) -> list[tuple[str, int]]:
    """(leaf name, float32 elements) of a state."""
    if kind == "1 GiB":
        n = (1 << 20 if smoke else 1 << 28) // 4
        return [(f"w{k}", n) for k in range(4)]
    return [(f"l{k:04d}", 1024) for k in range(1000 if not smoke else 50)]


def make(lib: str, kind: str, path: str, smoke: bool) -> None:
    """Save step 1 of the state with ``lib`` into ``path`` (a process of its own)."""
    import jax
    import numpy as np

    state = {name: jax.numpy.asarray(np.arange(n, dtype=np.float32) + k)
             for k, (name, n) in enumerate(state_spec(kind, smoke))}
    if lib == "jaxckpt":
        import jaxckpt

        with jaxckpt.CheckpointManager(path, async_save=False) as mgr:
            mgr.save(1, state)
    else:
        import orbax.checkpoint as ocp

        with ocp.CheckpointManager(path) as mgr:
            mgr.save(1, args=ocp.args.StandardSave(state))
            mgr.wait_until_finished()


def resume(lib: str, kind: str, path: str, smoke: bool, t0: float) -> dict[str, float]:
    """One resume, phase by phase (seconds); ``t0``: when the process was spawned."""
    out = {}
    t = time.time()
    import jax
    import numpy as np

    if lib == "jaxckpt":
        import jaxckpt
    else:
        import orbax.checkpoint as ocp
    out["import"] = time.time() - t0  # the interpreter's start included
    spec = state_spec(kind, smoke)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = {name: jax.ShapeDtypeStruct((n,), np.float32, sharding=sharding) for name, n in spec}
    t = time.perf_counter()
    if lib == "jaxckpt":
        mgr = jaxckpt.CheckpointManager(path, read_only=True)
    else:
        mgr = ocp.CheckpointManager(path)
    out["manager start"] = time.perf_counter() - t
    t = time.perf_counter()
    if lib == "jaxckpt":
        back = mgr.restore(1, target)
    else:
        back = mgr.restore(1, args=ocp.args.StandardRestore(target))
    out["restore"] = time.perf_counter() - t
    t = time.perf_counter()
    jax.block_until_ready(back)
    out["placement"] = time.perf_counter() - t
    t = time.perf_counter()
    step = jax.jit(lambda s: jax.tree.map(lambda x: x * 0.5 + 1, s))
    jax.block_until_ready(step(back))
    out["first step"] = time.perf_counter() - t
    for k, (name, n) in enumerate(spec[:3]):  # checked after the clock stopped
        assert np.array_equal(np.asarray(back[name])[:1000], np.arange(min(n, 1000), dtype=np.float32) + k), name
    mgr.close()
    return out


def drop_cache(path: str) -> str:
    """Empty the page cache of ``path``'s files: all of it (root), else per file."""
    try:
        subprocess.run(["sync"], check=True)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        for root, _, files in os.walk(path):
            for name in files:
                fd = os.open(os.path.join(root, name), os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
        return "fadvise"


def read_limit(path: str, readers: int) -> float:
    """Seconds for ``readers`` threads to read every file under ``path`` (cold), 8 MiB at a time."""
    files = [os.path.join(r, n) for r, _, ns in os.walk(path) for n in ns]
    drop_cache(path)

    def read(name: str) -> int:
        total = 0
        with open(name, "rb", buffering=0) as f:
            while chunk := f.read(8 << 20):
                total += len(chunk)
        return total

    t = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(readers) as pool:
        list(pool.map(read, files))
    return time.perf_counter() - t


def spawn(mode: str, lib: str, kind: str, path: str, smoke: bool) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    args = json.dumps({"mode": mode, "lib": lib, "kind": kind, "path": path, "smoke": smoke, "t0": time.time()})
    p = subprocess.run([sys.executable, __file__, "--worker", args], capture_output=True, text=True, env=env,
                       timeout=900)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        raise SystemExit(f"{mode} {lib} {kind} failed:\n{p.stderr[-3000:]}")
    return json.loads(lines[-1][7:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=None)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--readers", type=int, default=8)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--worker", default=None)
    opts = parser.parse_args()
    if opts.worker:
        a = json.loads(opts.worker)
        if a["mode"] == "make":
            make(a["lib"], a["kind"], a["path"], a["smoke"])
            print("RESULT {}")
        else:
            print("RESULT " + json.dumps(resume(a["lib"], a["kind"], a["path"], a["smoke"], a["t0"])))
        return
    if opts.smoke:
        opts.reps = 1
    scratch = tempfile.mkdtemp(prefix="jaxckpt-time-to-step-", dir=opts.dir)
    rows: dict[tuple[str, str, str], list[dict[str, float]]] = {}
    limits: dict[str, list[float]] = {}
    try:
        for kind in ("1 GiB", "1000 leaves"):
            paths = {lib: os.path.join(scratch, f"{lib}-{kind.replace(' ', '')}") for lib in ("jaxckpt", "orbax")}
            for lib, path in paths.items():
                spawn("make", lib, kind, path, opts.smoke)
            for _ in range(opts.reps):
                for cache in ("cold", "warm"):
                    for lib, path in paths.items():
                        if cache == "cold":
                            how = drop_cache(path)
                        rows.setdefault((kind, cache, lib), []).append(spawn("resume", lib, kind, path, opts.smoke))
                limits.setdefault(kind, []).append(read_limit(os.path.join(paths["jaxckpt"], "1"), opts.readers))
        print(f"page cache dropped with {how}; medians of {opts.reps}; read limit: {opts.readers} threads, cold")
        print("| state | cache | phase | jaxckpt [s] | orbax [s] | jaxckpt / orbax |")
        print("|---|---|---|---:|---:|---:|")
        for kind in ("1 GiB", "1000 leaves"):
            for cache in ("cold", "warm"):
                for phase in (*PHASES, "total"):
                    med = {}
                    for lib in ("jaxckpt", "orbax"):
                        runs = rows[kind, cache, lib]
                        med[lib] = statistics.median(sum(r.values()) if phase == "total" else r[phase] for r in runs)
                    print(f"| {kind} | {cache} | {phase} | {med['jaxckpt']:.3f} | {med['orbax']:.3f} | "
                          f"{med['jaxckpt'] / med['orbax']:.2f}x |")
            print(f"| {kind} | cold | read limit ({opts.readers} readers) | {statistics.median(limits[kind]):.3f} | | |")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
