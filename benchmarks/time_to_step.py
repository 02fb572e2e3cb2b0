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
                                      [--part phases|steps|memory|jobs] [--procs 4] [--no-s3]

``TIME_TO_STEP_ROOT=/path/to/an/older/checkout`` runs the workers on that jaxckpt (the
"before" of a change), the benchmark itself from here.
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
LIBS = ("jaxckpt", "jaxckpt+prefetch", "orbax", "limit")


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
    """One resume, phase by phase (seconds); ``t0``: when the process was spawned.
    ``jaxckpt+prefetch``: ``mgr.prefetch()`` right after the start, the step compiled
    from the target's shapes while it reads (its "first step" row: that compile, then the
    run), then the restore."""
    if lib == "limit":
        return phase_limits(kind, path, smoke, t0)
    out = {}
    t = time.time()
    import jax
    import numpy as np

    if lib.startswith("jaxckpt"):
        import jaxckpt
    else:
        import orbax.checkpoint as ocp
    out["import"] = time.time() - t0  # the interpreter's start included
    spec = state_spec(kind, smoke)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = {name: jax.ShapeDtypeStruct((n,), np.float32, sharding=sharding) for name, n in spec}
    t = time.perf_counter()
    if lib.startswith("jaxckpt"):
        mgr = jaxckpt.CheckpointManager(path, read_only=True)
    else:
        mgr = ocp.CheckpointManager(path)
    out["manager start"] = time.perf_counter() - t
    step = jax.jit(lambda s: jax.tree.map(lambda x: x * 0.5 + 1, s))
    compiled = None
    if lib == "jaxckpt+prefetch":
        t = time.perf_counter()
        prefetched = mgr.prefetch(1)
        compiled = step.lower(target).compile()
        out["first step"] = time.perf_counter() - t
    t = time.perf_counter()
    if lib.startswith("jaxckpt"):
        back = mgr.restore(1, target)
    else:
        back = mgr.restore(1, args=ocp.args.StandardRestore(target))
    out["restore"] = time.perf_counter() - t
    t = time.perf_counter()
    jax.block_until_ready(back)
    out["placement"] = time.perf_counter() - t
    t = time.perf_counter()
    jax.block_until_ready((compiled or step)(back))
    out["first step"] = out.get("first step", 0.0) + time.perf_counter() - t
    for k, (name, n) in enumerate(spec[:3]):  # checked after the clock stopped
        assert np.array_equal(np.asarray(back[name])[:1000], np.arange(min(n, 1000), dtype=np.float32) + k), name
    if compiled is not None:
        assert prefetched.result(timeout=600) > 0
    mgr.close()
    return out


def phase_limits(kind: str, path: str, smoke: bool, t0: float) -> dict[str, float]:
    """Each phase's limit, in a fresh process like ``resume``'s (the harness drops the
    cache the same way): ``import``: jax alone; ``manager start``: one listing of the
    directory and one read of the step's manifest; ``restore``: threads
    reading every file of the step into memory (``--readers``); ``placement``: ``jax.device_put`` of
    arrays of the target's shapes already in memory (one batched call) and their
    ``block_until_ready``; ``first step``: the same jitted step over them, compiled there."""
    out = {}
    import jax
    import numpy as np

    out["import"] = time.time() - t0
    jax.devices()
    t = time.perf_counter()
    os.listdir(path)
    with open(os.path.join(path, "1", "manifest.json"), "rb") as f:
        f.read()
    out["manager start"] = time.perf_counter() - t
    files = [os.path.join(r, n) for r, _, ns in os.walk(os.path.join(path, "1")) for n in ns]

    def read(name: str) -> bytes:
        with open(name, "rb", buffering=0) as f:
            return f.read()

    t = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(int(os.environ.get("TIME_TO_STEP_READERS", "8"))) as pool:
        blobs = list(pool.map(read, files))
    out["restore"] = time.perf_counter() - t
    spec = state_spec(kind, smoke)
    flat = np.frombuffer(max(blobs, key=len), dtype=np.uint8)
    host, at = {}, 0
    for name, n in spec:  # views of the bytes read, no copy: the placement is the device's
        if at + 4 * n > flat.size:
            at = 0
        host[name] = flat[at:at + 4 * n].view(np.float32)
        at += 4 * n
    del blobs
    t = time.perf_counter()
    placed = jax.block_until_ready(jax.device_put(host, jax.devices()[0]))
    out["placement"] = time.perf_counter() - t
    step = jax.jit(lambda s: jax.tree.map(lambda x: x * 0.5 + 1, s))
    t = time.perf_counter()
    jax.block_until_ready(step(placed))
    out["first step"] = time.perf_counter() - t
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


# --- the manager's start against the number of steps (issue 34, item 2) -------------

STEP_COUNTS = (1, 100, 10000)


def make_steps(lib: str, path: str, n: int, s3: dict | None) -> None:
    """A run directory of ``n`` committed steps of a one-leaf state (4 KiB), with the
    history of ``n`` commits: step 1 saved, the others its copies (each jaxckpt manifest
    rewritten to record its own step, with its own checksum), on local disk or uploaded
    to the local S3 server."""
    import dataclasses

    import jax
    import numpy as np

    state = {"w": jax.numpy.arange(1024, dtype=jax.numpy.float32)}
    if lib == "jaxckpt":
        import jaxckpt
        from jaxckpt import _manifest

        with jaxckpt.CheckpointManager(path, async_save=False) as mgr:
            mgr.save(1, state)
        with open(os.path.join(path, "1", "manifest.json"), "rb") as f:
            man = _manifest.parse(f.read(), path)
        with open(os.path.join(path, "history.jsonl")) as f:
            line = json.loads(f.readline())
        with open(os.path.join(path, "history.jsonl"), "w") as f:
            for s in range(1, n + 1):
                f.write(json.dumps(dict(line, step=s)) + "\n")
        for s in range(2, n + 1):
            shutil.copytree(os.path.join(path, "1", "data"), os.path.join(path, str(s), "data"))
            with open(os.path.join(path, str(s), "manifest.json"), "wb") as f:
                f.write(dataclasses.replace(man, info=dict(man.info, step=s)).to_bytes())
    else:
        import orbax.checkpoint as ocp

        with ocp.CheckpointManager(path) as mgr:
            mgr.save(1, args=ocp.args.StandardSave(state))
            mgr.wait_until_finished()
        for s in range(2, n + 1):
            shutil.copytree(os.path.join(path, "1"), os.path.join(path, str(s)))
    if s3 is not None:
        upload(path, s3)
    del np


def upload(path: str, s3: dict) -> None:
    """Every file under ``path`` to the bucket's ``s3["path"]`` prefix, 16 at a time."""
    import boto3

    client = boto3.client("s3", endpoint_url=s3["endpoint"], region_name="us-east-1")
    files = [os.path.join(r, n) for r, _, ns in os.walk(path) for n in ns]

    def put(name: str) -> None:
        with open(name, "rb") as f:
            client.put_object(Bucket=s3["bucket"], Key=s3["path"] + "/" + os.path.relpath(name, path), Body=f.read())

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(put, files))


def start_only(lib: str, how: str, path: str, s3: dict | None) -> dict[str, float]:
    """One fresh process: the manager's start, ``latest_step()``, the restore of it."""
    import jax
    import numpy as np

    where = f"s3://{s3['bucket']}/{s3['path']}" if s3 is not None else path
    jax.devices()  # the backend's start is the import's, not the manager's
    t = time.perf_counter()
    if lib == "jaxckpt":
        import jaxckpt

        mgr = jaxckpt.CheckpointManager(where, read_only=how == "read-only")
    else:
        import orbax.checkpoint as ocp

        mgr = ocp.CheckpointManager(path)
    started = time.perf_counter() - t
    latest = mgr.latest_step()
    listed = time.perf_counter() - t
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = {"w": jax.ShapeDtypeStruct((1024,), np.float32, sharding=sharding)}
    back = mgr.restore(latest, target) if lib == "jaxckpt" else mgr.restore(
        latest, args=ocp.args.StandardRestore(target))
    restored = time.perf_counter() - t
    assert np.array_equal(np.asarray(back["w"]), np.arange(1024, dtype=np.float32))
    mgr.close()
    return {"manager start": started, "latest_step": listed, "restored": restored, "latest": latest}


def steps_main(opts: argparse.Namespace, scratch: str) -> None:
    """The manager's start over 1, 100, 10,000 steps: local disk (jaxckpt's writer and
    read-only managers, orbax's) and the local S3 server (jaxckpt's), fresh processes."""
    server, endpoint = start_moto() if not opts.no_s3 else (None, None)
    rows: dict[tuple, list[dict[str, float]]] = {}
    try:
        for n in (STEP_COUNTS if not opts.smoke else (1, 20)):
            cases = [("jaxckpt", "writer", None), ("jaxckpt", "read-only", None), ("orbax", "writer", None)]
            if server is not None:
                s3 = {"bucket": "steps", "path": f"run{n}", "endpoint": endpoint}
                cases += [("jaxckpt", "writer", s3), ("jaxckpt", "read-only", s3)]
            made: dict[tuple, str] = {}
            for lib, how, s3 in cases:
                key = (lib, s3 is not None)
                if key not in made:
                    made[key] = os.path.join(scratch, f"{lib}-{n}-{'s3' if s3 else 'disk'}")
                    spawn("make-steps", lib, json.dumps([n, s3]), made[key], opts.smoke)
            for _ in range(opts.reps):
                for lib, how, s3 in cases:
                    r = spawn("start", lib, json.dumps([how, s3]), made[lib, s3 is not None], opts.smoke)
                    rows.setdefault((n, lib, how, "S3" if s3 else "disk"), []).append(r)
    finally:
        if server is not None:
            server.terminate()
    print(f"medians of {opts.reps}; a fresh process each; seconds from the manager's construction")
    print("| steps | store | manager | start [s] | + latest_step() [s] | + restore of it [s] | latest |")
    print("|---:|---|---|---:|---:|---:|---:|")
    for (n, lib, how, store), runs in rows.items():
        med = {k: statistics.median(r[k] for r in runs) for k in ("manager start", "latest_step", "restored")}
        print(f"| {n:,} | {store} | {lib} {how} | {med['manager start']:.3f} | {med['latest_step']:.3f} | "
              f"{med['restored']:.3f} | {runs[0]['latest']} |")


# --- a restore's host memory within a budget (issue 34, item 2) --------------------

MEMORY_BUDGETS = (None, 256 << 20, 64 << 20)


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def memory_one(lib: str, how: str, path: str, smoke: bool) -> dict[str, float]:
    """One fresh process: the restore of 1 GiB (16 float32 leaves) onto a bfloat16 target
    (a cast: the read buffers are not the arrays) or a float32 one; the peak resident
    memory during the restore above what the process held before it (the peak reset
    through ``/proc/self/clear_refs``), and the state's own size."""
    import jax
    import numpy as np

    budget, dtype = json.loads(how)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    n = (1 << 28 if not smoke else 1 << 18) // 16
    dt = jax.numpy.bfloat16 if dtype == "bfloat16" else np.float32
    target = {f"w{k:02d}": jax.ShapeDtypeStruct((n,), dt, sharding=sharding) for k in range(16)}
    if lib == "jaxckpt":
        import jaxckpt
    else:
        import orbax.checkpoint as ocp

        mgr = ocp.CheckpointManager(path)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5\n")
    before = _rss_kib("VmRSS")
    t = time.perf_counter()
    if lib == "jaxckpt":
        back = jaxckpt.restore(os.path.join(path, "1"), target, max_staging_bytes=budget)
    else:
        back = mgr.restore(1, args=ocp.args.StandardRestore(target))
    jax.block_until_ready(back)
    seconds = time.perf_counter() - t
    peak = _rss_kib("VmHWM")
    assert np.array_equal(np.asarray(back["w03"][:1000]), (np.arange(1000, dtype=np.float32) + 3).astype(dt))
    return {"seconds": seconds, "peak_mib": (peak - before) / 1024, "state_mib": sum(
        x.nbytes for x in jax.tree.leaves(back)) / (1 << 20)}


def make_memory(lib: str, path: str, smoke: bool) -> None:
    import jax
    import numpy as np

    n = (1 << 28 if not smoke else 1 << 18) // 16
    state = {f"w{k:02d}": jax.numpy.asarray(np.arange(n, dtype=np.float32) + k) for k in range(16)}
    if lib == "jaxckpt":
        import jaxckpt

        with jaxckpt.CheckpointManager(path, async_save=False) as mgr:
            mgr.save(1, state)
    else:
        import orbax.checkpoint as ocp

        with ocp.CheckpointManager(path) as mgr:
            mgr.save(1, args=ocp.args.StandardSave(state))
            mgr.wait_until_finished()


def memory_main(opts: argparse.Namespace, scratch: str) -> None:
    paths = {lib: os.path.join(scratch, f"{lib}-memory") for lib in ("jaxckpt", "orbax")}
    for lib, path in paths.items():
        spawn("make-memory", lib, "", path, opts.smoke)
    cases = [("jaxckpt", b, d) for d in ("bfloat16", "float32") for b in MEMORY_BUDGETS]
    cases += [("orbax", None, d) for d in ("bfloat16", "float32")]
    rows: dict[tuple, list[dict[str, float]]] = {}
    for _ in range(opts.reps):
        for lib, budget, dtype in cases:
            rows.setdefault((lib, budget, dtype), []).append(
                spawn("memory", lib, json.dumps([budget, dtype]), paths[lib], opts.smoke))
    print(f"medians of {opts.reps}; a fresh process each, warm page cache; 1 GiB saved as 16 float32 leaves")
    print("| target | restore | max_staging_bytes | peak host memory above the start [MiB] | "
          "restored state [MiB] | seconds |")
    print("|---|---|---:|---:|---:|---:|")
    for (lib, budget, dtype), runs in rows.items():
        med = {k: statistics.median(r[k] for r in runs) for k in ("peak_mib", "seconds", "state_mib")}
        print(f"| {dtype} | {lib} | {'-' if budget is None else f'{budget >> 20} MiB'} | {med['peak_mib']:.0f} | "
              f"{med['state_mib']:.0f} | {med['seconds']:.3f} |")


# --- several processes, and the local S3 server (issue 34, item 1) ------------------

JOB_LIBS = ("jaxckpt", "orbax")


def job_spec(kind: str, nproc: int, smoke: bool) -> list[tuple[str, int]]:
    """``state_spec`` with each leaf's length a multiple of ``nproc`` (sharded over them)."""
    return [(name, n - n % nproc) for name, n in state_spec(kind, smoke)]


def job_where(path: str, s3: dict | None) -> str:
    return f"s3://{s3['bucket']}/{s3['path']}" if s3 is not None else path


def job_worker(a: dict) -> dict:
    """One process of an ``nproc``-process job (jax.distributed over gloo, one CPU device
    each; no distributed runtime for one process): ``make`` saves step 1, ``resume``
    times the phases as ``resume`` does (the import row includes the runtime's start),
    every leaf sharded over the processes, each process reading only its own part."""
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    import jax

    nproc, pid = a["nproc"], a["pid"]
    if nproc > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(f"127.0.0.1:{a['port']}", num_processes=nproc, process_id=pid,
                                   initialization_timeout=120)
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    if a["lib"] == "jaxckpt":
        import jaxckpt
    else:
        import orbax.checkpoint as ocp
    out: dict = {"import": time.time() - a["t0"]}
    spec = job_spec(a["kind"], nproc, a["smoke"])
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
    sharding = NamedSharding(mesh, P("d"))
    where = job_where(a["path"], a["s3"])

    def values(k: int, n: int, index: tuple) -> np.ndarray:
        lo, hi = index[0].start or 0, index[0].stop or n
        return np.arange(lo, hi, dtype=np.float32) + k

    if a["mode"] == "job-make":
        state = {name: jax.make_array_from_callback((n,), sharding, lambda idx, k=k, n=n: values(k, n, idx))
                 for k, (name, n) in enumerate(spec)}
        if a["lib"] == "jaxckpt":
            with jaxckpt.CheckpointManager(where, async_save=False) as mgr:
                mgr.save(1, state)
        else:
            with ocp.CheckpointManager(where) as mgr:
                mgr.save(1, args=ocp.args.StandardSave(state))
                mgr.wait_until_finished()
        return {}
    target = {name: jax.ShapeDtypeStruct((n,), np.float32, sharding=sharding) for name, n in spec}
    t = time.perf_counter()
    mgr = jaxckpt.CheckpointManager(where, read_only=True) if a["lib"] == "jaxckpt" else ocp.CheckpointManager(where)
    out["manager start"] = time.perf_counter() - t
    step = jax.jit(lambda s: jax.tree.map(lambda x: x * 0.5 + 1, s))
    t = time.perf_counter()
    back = mgr.restore(1, target) if a["lib"] == "jaxckpt" else mgr.restore(
        1, args=ocp.args.StandardRestore(target))
    out["restore"] = time.perf_counter() - t
    t = time.perf_counter()
    jax.block_until_ready(back)
    out["placement"] = time.perf_counter() - t
    t = time.perf_counter()
    jax.block_until_ready(step(back))
    out["first step"] = time.perf_counter() - t
    out["end"] = time.time() - a["t0"]
    for k, (name, n) in enumerate(spec[:3]):  # checked after the clock stopped
        for sh in back[name].addressable_shards:
            assert np.array_equal(np.asarray(sh.data), values(k, n, sh.index)), (name, sh.index)
    mgr.close()
    if nproc > 1:
        jax.distributed.shutdown()
    return out


def run_job(mode: str, lib: str, kind: str, path: str, smoke: bool, nproc: int,
            s3: dict | None) -> list[dict[str, float]]:
    """An ``nproc``-process job of ``job_worker``; each process's result."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=os.environ.get("TIME_TO_STEP_ROOT", ROOT), JAX_PLATFORMS="cpu",
               AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_REGION="us-east-1")
    if s3 is not None:
        env["AWS_ENDPOINT_URL"] = s3["endpoint"]
    t0 = time.time()
    procs = [subprocess.Popen(
        [sys.executable, __file__, "--worker", json.dumps(
            {"mode": mode, "lib": lib, "kind": kind, "path": path, "smoke": smoke, "t0": t0, "nproc": nproc,
             "pid": i, "port": port, "s3": s3})], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for i in range(nproc)]
    results = []
    for i, p in enumerate(procs):
        out, err = p.communicate(timeout=1800)
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        if not lines:
            for q in procs:
                q.kill()
            raise SystemExit(f"{mode} {lib} {kind} process {i} failed ({p.returncode}):\n{err[-3000:]}")
        results.append(json.loads(lines[-1][7:]))
    return results


def s3_read_limit(s3: dict, threads: int, ranged: bool) -> float:
    """Seconds for ``threads`` boto3 GETs at once of every object under ``s3["path"]``:
    whole objects, or (``ranged``) in ranged GETs of 4 MiB, the most a format-3 restore
    asks in one (its chunks; moto copies the whole object for each ranged GET, S3 does
    not): what parallel reads of the same bytes reach on this server."""
    import boto3

    client = boto3.client("s3", endpoint_url=s3["endpoint"], region_name="us-east-1")
    objects = [(o["Key"], o["Size"]) for page in client.get_paginator("list_objects_v2").paginate(
        Bucket=s3["bucket"], Prefix=s3["path"] + "/") for o in page.get("Contents", ())]
    step = 4 << 20
    gets = [(key, f"bytes={lo}-{min(lo + step, size) - 1}") for key, size in objects for lo in range(0, size, step)
            ] if ranged else [(key, None) for key, _ in objects]

    def get(item: tuple[str, str | None]) -> int:
        key, span = item
        extra = {"Range": span} if span else {}
        return len(client.get_object(Bucket=s3["bucket"], Key=key, **extra)["Body"].read())

    t = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(get, gets))
    return time.perf_counter() - t


def jobs_main(opts: argparse.Namespace, scratch: str) -> None:
    """The phases for ``--procs`` processes on local disk (jaxckpt and orbax, cold and
    warm) and on the local S3 server (jaxckpt: orbax 0.12's S3 path fails here, see
    benchmarks/RESULTS.md); per phase the slowest process, total: from spawning the
    processes to the last one's first step."""
    nproc = opts.procs
    server, endpoint = start_moto() if not opts.no_s3 else (None, None)
    rows: dict[tuple, list[list[dict]]] = {}
    limits: dict[tuple, list[float]] = {}
    try:
        for kind in opts.states:
            tag = kind.replace(" ", "")
            made = {}
            for lib in JOB_LIBS:
                made[lib, "disk"] = (os.path.join(scratch, f"{lib}-{tag}"), None)
            if server is not None:
                made["jaxckpt", "S3"] = (os.path.join(scratch, f"s3-{tag}"),
                                         {"bucket": "steps", "path": f"phases-{tag}", "endpoint": endpoint})
            for (lib, store), (path, s3) in made.items():
                run_job("job-make", lib, kind, path, opts.smoke, nproc, s3)
            for _ in range(opts.reps):
                for (lib, store), (path, s3) in made.items():
                    for cache in (("cold", "warm") if store == "disk" else ("-",)):
                        if cache == "cold":
                            how = drop_cache(path)
                        rows.setdefault((kind, store, cache, lib), []).append(
                            run_job("resume", lib, kind, path, opts.smoke, nproc, s3))
                limits.setdefault((kind, "disk"), []).append(
                    read_limit(os.path.join(made["jaxckpt", "disk"][0], "1"), opts.readers))
                if server is not None:
                    limits.setdefault((kind, "S3"), []).append(s3_read_limit(made["jaxckpt", "S3"][1], 16, False))
                    limits.setdefault((kind, "S3 ranged"), []).append(
                        s3_read_limit(made["jaxckpt", "S3"][1], 16, True))
    finally:
        if server is not None:
            server.terminate()
    print(f"{nproc} processes; page cache dropped with {how}; medians of {opts.reps}; a phase: its slowest "
          f"process; total: spawn to the last process's first step; read limit: {opts.readers} threads (disk, "
          "cold), 16 boto3 GETs at once of whole objects and of 4 MiB ranges (S3)")
    print("| state | store | cache | phase | jaxckpt [s] | orbax [s] | jaxckpt / orbax |")
    print("|---|---|---|---|---:|---:|---:|")
    for (kind, store, cache, lib), jobs in rows.items():
        if lib != "jaxckpt":
            continue
        for phase in (*PHASES, "total"):
            med = {}
            for other in JOB_LIBS:
                runs = rows.get((kind, store, cache, other))
                if runs is not None:
                    med[other] = statistics.median(max(r["end" if phase == "total" else phase] for r in job)
                                                   for job in runs)
            ob = med.get("orbax")
            print(f"| {kind} | {store} | {cache} | {phase} | {med['jaxckpt']:.3f} | "
                  f"{'-' if ob is None else f'{ob:.3f}'} | {'-' if ob is None else f'{med[lib] / ob:.2f}x'} |")
        if cache != "warm":
            print(f"| {kind} | {store} | | read limit | {statistics.median(limits[kind, store]):.3f} | | |")
        if store == "S3":
            print(f"| {kind} | {store} | | read limit, 4 MiB ranges | "
                  f"{statistics.median(limits[kind, 'S3 ranged']):.3f} | | |")


def start_moto(env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """The local S3 server (moto) on a free port of 127.0.0.1, with a bucket ``steps``
    (``env``: added to the server's environment, e.g. its request recording)."""
    import socket

    import boto3

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "moto_server"), "-H", "127.0.0.1",
                             "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=dict(os.environ, **(env or {})))
    endpoint = f"http://127.0.0.1:{port}"
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    for _ in range(600):
        try:
            client.create_bucket(Bucket="steps")
            return proc, endpoint
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(0.05)
    proc.terminate()
    raise RuntimeError("moto_server did not start")


def spawn(mode: str, lib: str, kind: str, path: str, smoke: bool) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=os.environ.get("TIME_TO_STEP_ROOT", ROOT), JAX_PLATFORMS="cpu", AWS_ACCESS_KEY_ID="bench",
               AWS_SECRET_ACCESS_KEY="bench", AWS_REGION="us-east-1")
    if mode in ("make-steps", "start") and json.loads(kind)[1] is not None:  # the server's endpoint, as users give it
        env["AWS_ENDPOINT_URL"] = json.loads(kind)[1]["endpoint"]
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
    parser.add_argument("--part", choices=("phases", "steps", "memory", "jobs"), default="phases",
                        help="phases: the path to the first step; steps: the start over 1/100/10,000 steps; "
                             "memory: a restore's host memory with and without max_staging_bytes; "
                             "jobs: the phases for --procs processes and on the local S3 server")
    parser.add_argument("--no-s3", action="store_true", help="steps, jobs: local disk only")
    parser.add_argument("--procs", type=int, default=4, help="jobs: processes in the job")
    parser.add_argument("--states", nargs="+", default=["1 GiB", "1000 leaves"], choices=("1 GiB", "1000 leaves"),
                        help="jobs: the states measured (moto fails to complete one process's 1 GiB upload)")
    parser.add_argument("--worker", default=None)
    opts = parser.parse_args()
    if opts.worker:
        a = json.loads(opts.worker)
        if a["mode"] == "make":
            make(a["lib"], a["kind"], a["path"], a["smoke"])
            print("RESULT {}")
        elif a["mode"] == "make-memory":
            make_memory(a["lib"], a["path"], a["smoke"])
            print("RESULT {}")
        elif a["mode"] == "memory":
            print("RESULT " + json.dumps(memory_one(a["lib"], a["kind"], a["path"], a["smoke"])))
        elif a["mode"] == "make-steps":
            make_steps(a["lib"], a["path"], *json.loads(a["kind"]))
            print("RESULT {}")
        elif a["mode"] in ("job-make", "resume") and "nproc" in a:
            print("RESULT " + json.dumps(job_worker(a)), flush=True)
        elif a["mode"] == "start":
            print("RESULT " + json.dumps(start_only(a["lib"], *json.loads(a["kind"])[:1], a["path"],
                                                    json.loads(a["kind"])[1])))
        else:
            print("RESULT " + json.dumps(resume(a["lib"], a["kind"], a["path"], a["smoke"], a["t0"])))
        return
    if opts.smoke:
        opts.reps = 1
    os.environ["TIME_TO_STEP_READERS"] = str(opts.readers)  # the workers' phase_limits
    scratch = tempfile.mkdtemp(prefix="jaxckpt-time-to-step-", dir=opts.dir)
    if opts.part in ("steps", "memory", "jobs"):
        try:
            {"steps": steps_main, "memory": memory_main, "jobs": jobs_main}[opts.part](opts, scratch)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        return
    rows: dict[tuple[str, str, str], list[dict[str, float]]] = {}
    limits: dict[str, list[float]] = {}
    try:
        for kind in ("1 GiB", "1000 leaves"):
            paths = {lib: os.path.join(scratch, f"{lib}-{kind.replace(' ', '')}") for lib in ("jaxckpt", "orbax")}
            for lib, path in paths.items():
                spawn("make", lib, kind, path, opts.smoke)
            for _ in range(opts.reps):
                for cache in ("cold", "warm"):
                    for lib in LIBS:
                        path = paths["jaxckpt" if lib == "limit" else lib.split("+")[0]]
                        if cache == "cold":
                            how = drop_cache(path)
                        rows.setdefault((kind, cache, lib), []).append(spawn("resume", lib, kind, path, opts.smoke))
                limits.setdefault(kind, []).append(read_limit(os.path.join(paths["jaxckpt"], "1"), opts.readers))
        print(f"page cache dropped with {how}; medians of {opts.reps}; read limit: {opts.readers} threads, cold; "
              "limit: each phase's floor in a fresh process (phase_limits)")
        print("| state | cache | phase | jaxckpt [s] | jaxckpt + prefetch [s] | orbax [s] | limit [s] | "
              "jaxckpt / orbax | jaxckpt / limit |")
        print("|---|---|---|---:|---:|---:|---:|---:|---:|")
        for kind in ("1 GiB", "1000 leaves"):
            for cache in ("cold", "warm"):
                for phase in (*PHASES, "restore + placement", "total"):
                    med = {}
                    for lib in LIBS:
                        runs = rows[kind, cache, lib]
                        med[lib] = statistics.median(
                            sum(r.values()) if phase == "total" else r["restore"] + r["placement"]
                            if phase == "restore + placement" else r[phase] for r in runs)
                    ratio = f"{med['jaxckpt'] / med['limit']:.2f}x" if med["limit"] > 0 else "-"
                    print(f"| {kind} | {cache} | {phase} | {med['jaxckpt']:.3f} | {med['jaxckpt+prefetch']:.3f} | "
                          f"{med['orbax']:.3f} | {med['limit']:.3f} | {med['jaxckpt'] / med['orbax']:.2f}x | "
                          f"{ratio} |")
            print(f"| {kind} | cold | read limit ({opts.readers} readers) | {statistics.median(limits[kind]):.3f} "
                  "| | | | | |")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
