"""What ``reached_preemption(step)`` costs per training step, in microseconds.

    .venv/bin/python benchmarks/preemption_cost.py [--calls N] [--nproc 2]

Single process without jax.distributed (our SIGTERM flag), then a real job of
``--nproc`` processes with jax.distributed (gloo on 127.0.0.1; JAX's preemption sync
manager), each timing ``--calls`` consecutive steps. For scale it also prints an empty
Python method call and one ``key_value_try_get`` on the coordination service (what a
check over the key-value store would cost per step).
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def per_call_us(fn, calls):
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for step in range(calls):
            fn(step)
        best = min(best, time.perf_counter() - t0)
    return best / calls * 1e6


def reached_fn(mgr):
    return mgr.reached_preemption, "mgr.reached_preemption"


class _Empty:
    def m(self, step):
        return False


def single(calls):
    import jaxckpt

    with tempfile.TemporaryDirectory() as d, jaxckpt.CheckpointManager(d) as mgr:
        fn, name = reached_fn(mgr)
        us = per_call_us(fn, calls)
    base = per_call_us(_Empty().m, calls)
    print(f"1 process, no jax.distributed: {name}: {us:.3f} us/call (an empty method call: {base:.3f} us)")


def worker(port, nproc, pid, calls):
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid)
    from jax._src import distributed

    import jaxckpt

    with tempfile.TemporaryDirectory() as d:
        with jaxckpt.CheckpointManager(d, timeout_s=30) as mgr:
            fn, name = reached_fn(mgr)
            us = per_call_us(fn, calls)
    client = distributed.global_state.client
    client.key_value_set(f"bench/{pid}", "1")
    t0 = time.perf_counter()
    for _ in range(500):
        client.key_value_try_get(f"bench/{pid}")
    kv_us = (time.perf_counter() - t0) / 500 * 1e6
    print("RESULT " + json.dumps({"pid": pid, "name": name, "us": us, "kv_us": kv_us}), flush=True)
    jax.distributed.shutdown()


def multi(nproc, calls):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(port), str(nproc), str(i), str(calls)],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
             for i in range(nproc)]
    for p in procs:
        out, _ = p.communicate(timeout=300)
        r = json.loads([ln for ln in out.splitlines() if ln.startswith("RESULT ")][-1][7:])
        print(f"{nproc} processes, jax.distributed, process {r['pid']}: {r['name']}: {r['us']:.3f} us/call "
              f"(one key_value_try_get: {r['kv_us']:.0f} us)")


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        port, nproc, pid, calls = sys.argv[2:6]
        worker(port, int(nproc), int(pid), int(calls))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=1_000_000)
    ap.add_argument("--nproc", type=int, default=2)
    a = ap.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    single(a.calls)
    if a.nproc > 1:
        multi(a.nproc, a.calls)


if __name__ == "__main__":
    main()
