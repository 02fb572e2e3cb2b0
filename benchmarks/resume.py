"""Time to resume after a lost host (issue 24): N real JAX processes (jax.distributed,
gloo, one CPU device each), each with a local directory of its own on the RAM disk
(``/dev/shm``), a state of ``--mib`` MiB sharded over the processes (each host's part
exists only on it), the local S3 server (moto) as the persistent tier.

Resume: a fresh job (every process started anew, as after a restart) opens the manager
and restores the latest step; time from spawning the processes to the last one restored
(and the manager start plus restore alone, the slowest process), for

* (a) all local: every host's directory intact;
* (b) from the peer: the last host's directory emptied (a replacement machine), the
  manager with ``peer_copies=1``: its part is sent back from its partner's copy;
* (b') the same, with the start sending back the newest step only (as before it sent
  back every retained step it can: ``max_to_keep=2`` here, so (b) sends two);
* (c) from the bucket: the same host emptied, ``peer_copies=0``: every process reads the
  persistent tier (the status quo before peer copies).

The four are interleaved repetition by repetition (a, b, b', c, a, ...). Each restore
is checked bit for bit against the saved values after its time is taken.

Save cost: ``--saves`` saves of the same state with a pause between them (the training
step, ``--gap`` s), ``peer_copies`` 0 and 1, with ``async_save=False`` (the save blocks
until committed: its copy included) and ``async_save=True`` (the copy of step k runs in
the background after its commit; the save of step k + 1 waits for it only when it is not
done, ``max_pending=1``); per save the time the loop spent inside ``save()`` (slowest
process), medians.

    python benchmarks/resume.py [--procs 4] [--mib 512] [--reps 3] [--saves 4] [--gap 1]
                                [--part all|resume|save] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# this folder's scripts are not modules: benchmarks/compression.py would shadow the
# `compression` package that jax's import chain asks for
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(port: int, nproc: int, pid: int, args: dict) -> None:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid,
                               initialization_timeout=120)
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxckpt

    if os.environ.get("RESUME_LOG"):  # the library's debug lines (timings), one file per process
        import logging

        logging.getLogger("jaxckpt").addHandler(logging.FileHandler(f"{os.environ['RESUME_LOG']}.{pid}"))
        logging.getLogger("jaxckpt").setLevel(logging.DEBUG)
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
    sharding = NamedSharding(mesh, P("d", None))
    rows = args["mib"] * (1 << 20) // 8 // 4096  # 8 float32 leaves of (rows, 1024)
    rows -= rows % nproc

    def shard(k: int, i: int, index: tuple) -> np.ndarray:  # leaf k of step i, the rows of index
        lo, hi = index[0].start or 0, index[0].stop or rows
        return (np.arange(lo * 1024, hi * 1024, dtype=np.float32).reshape(hi - lo, 1024) + 7 * i + k)

    def state(i: int) -> dict:
        leaves = {f"w{k}": jax.make_array_from_callback((rows, 1024), sharding, lambda idx, k=k: shard(k, i, idx))
                  for k in range(8)}
        return {"params": leaves, "step": i}

    if args.get("newest_only"):  # case (b'): the start sends back the newest step only (before eb7a684)
        from jaxckpt._manager import peerrepair

        plan = peerrepair.plan_repair
        peerrepair.plan_repair = lambda *a, **k: plan(*a, **k)._replace(older=())
    local = os.path.join(args["path"], f"host{pid}")
    options = dict(max_to_keep=2, timeout_s=120, peer_copies=args["peers"], async_save=args.get("async", True))
    if args.get("durable"):
        options.update(persistent_directory=args["durable"], persistent_interval_steps=1, persistent_max_to_keep=1)
    out: dict = {"pid": pid}
    if args["mode"] == "save":
        with jaxckpt.CheckpointManager(local, **options) as mgr:
            inside = []
            for i in range(1, args["saves"] + 1):
                s = state(i)
                t = time.perf_counter()
                mgr.save(i, s)
                inside.append(time.perf_counter() - t)
                time.sleep(args["gap"])  # the training step
            t = time.perf_counter()
            mgr.wait_until_finished()
            out.update(inside=inside, wait=time.perf_counter() - t)
    else:
        abstract = {"params": {f"w{k}": jax.ShapeDtypeStruct((rows, 1024), np.float32, sharding=sharding)
                               for k in range(8)}, "step": 0}
        t = time.perf_counter()
        with jaxckpt.CheckpointManager(local, **options) as mgr:
            back = mgr.restore(target=abstract)
            out["restore_s"] = time.perf_counter() - t
            out["done_at"] = time.time()
            out["step"] = back["step"]
            for k in range(8):
                for sh in back["params"][f"w{k}"].addressable_shards:
                    assert np.array_equal(np.asarray(sh.data), shard(k, back["step"], sh.index)), (k, sh.index)
    print("RESULT " + json.dumps(out), flush=True)
    jax.distributed.shutdown()


def run_job(nproc: int, args: dict, env: dict) -> tuple[float, dict[int, dict]]:
    port = free_port()
    start = time.time()
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(port), str(nproc), str(i), json.dumps(args)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for i in range(nproc)]
    results = {}
    for i, p in enumerate(procs):
        out, err = p.communicate(timeout=1800)
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        if not lines:
            raise SystemExit(f"process {i} failed ({p.returncode}):\n{err[-3000:]}")
        results[i] = json.loads(lines[-1][7:])
    return start, results


def start_moto() -> tuple[subprocess.Popen, dict]:
    import boto3

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    port = free_port()
    server = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "moto_server"), "-H", "127.0.0.1",
                               "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1")
    for _ in range(200):
        try:
            client.create_bucket(Bucket="resume")
            break
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(0.05)
    spec = {"driver": "s3", "bucket": "resume", "path": "run", "endpoint": f"http://127.0.0.1:{port}",
            "aws_region": "us-east-1"}
    return server, spec


def save_cost(opts: argparse.Namespace, env: dict, scratch: str) -> dict[tuple[int, bool], list[float]]:
    """Per (peers, async): the time inside each save() after the first (slowest process)."""
    out: dict[tuple[int, bool], list[float]] = {}
    for rep in range(opts.reps):
        for peers in (0, 1):
            for asynchronous in (False, True):
                path = os.path.join(scratch, f"save-{rep}-{peers}-{int(asynchronous)}")
                _, res = run_job(opts.procs, {"mode": "save", "path": path, "mib": opts.mib, "peers": peers,
                                              "async": asynchronous, "saves": opts.saves, "gap": opts.gap}, env)
                inside = [max(res[p]["inside"][i] for p in res) for i in range(1, opts.saves)]
                out.setdefault((peers, asynchronous), []).extend(inside)
                shutil.rmtree(path)
    return out


def resume(opts: argparse.Namespace, env: dict, scratch: str, durable: dict) -> dict[str, list[tuple[float, float]]]:
    path = os.path.join(scratch, "resume")
    base = {"path": path, "mib": opts.mib, "durable": durable}
    run_job(opts.procs, dict(base, mode="save", peers=1, saves=2, gap=0), env)
    lost = os.path.join(path, f"host{opts.procs - 1}")
    shutil.copytree(lost, lost + ".kept")  # (a) needs the host's directory as the save left it
    out: dict[str, list[tuple[float, float]]] = {}
    for _ in range(opts.reps):
        for case, peers, wipe in (("a", 1, False), ("b", 1, True), ("n", 1, True), ("c", 0, True)):
            shutil.rmtree(lost, ignore_errors=True)
            if not wipe:
                shutil.copytree(lost + ".kept", lost)
            start, res = run_job(opts.procs, dict(base, mode="resume", peers=peers, newest_only=case == "n"), env)
            assert all(r["step"] == 2 for r in res.values()), res
            out.setdefault(case, []).append((max(r["done_at"] for r in res.values()) - start,
                                             max(r["restore_s"] for r in res.values())))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--saves", type=int, default=4)
    parser.add_argument("--gap", type=float, default=1.0)
    parser.add_argument("--part", choices=("all", "resume", "save"), default="all")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--worker", nargs=4)
    opts = parser.parse_args()
    if opts.worker:
        port, nproc, pid, args = opts.worker
        worker(int(port), int(nproc), int(pid), json.loads(args))
        return
    if opts.smoke:
        opts.procs, opts.mib, opts.reps, opts.saves, opts.gap = 2, 8, 1, 2, 0.0
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    scratch = tempfile.mkdtemp(prefix="jaxckpt-resume-", dir=shm)
    server, durable = start_moto()
    try:
        print(f"{opts.procs} processes, {opts.mib} MiB sharded over them, local directories in {scratch}, "
              f"the bucket on moto; {opts.reps} repetitions")
        if opts.part != "save":
            report_resume(resume(opts, dict(env, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing"),
                                 scratch, durable))
        if opts.part != "resume":
            report_save(save_cost(opts, env, scratch))
    finally:
        server.terminate()
        server.wait(10)
        shutil.rmtree(scratch, ignore_errors=True)


def report_resume(times: dict[str, list[tuple[float, float]]]) -> None:
    names = {"a": "(a) all local", "b": "(b) one host from its peer (both retained steps sent back)",
             "n": "(b') the same, the newest step only sent back", "c": "(c) one host lost, from the bucket"}
    print("| resume | spawn to restored [s] | manager start + restore [s] | each run (spawn to restored) |")
    print("|---|---:|---:|---|")
    for case, runs in times.items():
        print(f"| {names[case]} | {statistics.median(r[0] for r in runs):.2f} | "
              f"{statistics.median(r[1] for r in runs):.2f} | {', '.join(f'{r[0]:.2f}' for r in runs)} |")


def report_save(cost: dict[tuple[int, bool], list[float]]) -> None:
    print("| save | peer_copies=0 [s] | peer_copies=1 [s] | extra [s] | each save, peer_copies=0 / 1 |")
    print("|---|---:|---:|---:|---|")
    for asynchronous, label in ((False, "async_save=False (inside save: write, commit, copy)"),
                                (True, "async_save=True (inside save: the previous step's copy)")):
        a, b = cost[(0, asynchronous)], cost[(1, asynchronous)]
        each = f"{', '.join(f'{x:.2f}' for x in a)} / {', '.join(f'{x:.2f}' for x in b)}"
        print(f"| {label} | {statistics.median(a):.2f} | {statistics.median(b):.2f} | "
              f"{statistics.median(b) - statistics.median(a):+.2f} | {each} |")


if __name__ == "__main__":
    main()
