"""The per-step cost of deciding not to save (issue 33): ``should_save(step)`` and
``save(step, state)`` on steps that do not save, for each policy, against orbax's
``CheckpointManager.should_save`` in the same run.

One process (no agreement needed), then a real 2-process JAX job (jax.distributed,
gloo): there the policies that are not local are decided by process 0 ahead and read by
process 1 from the key-value store on a background thread; both processes' costs are
reported (orbax agrees on each decision in its own way; its multi-process figure is
measured in the same job where it runs). Medians of ``--reps`` runs of ``--calls`` calls.

    python benchmarks/policy_cost.py [--calls 20000] [--reps 5] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]

POLICIES = ["save_interval_steps", "every_seconds", "continuous", "goodput", "any_of"]


def make(name):
    from jaxckpt import policies

    return {"save_interval_steps": None, "every_seconds": policies.every_seconds(1e9),
            "continuous": policies.continuous(1e9), "goodput": policies.goodput(mtbf_s=1e12),
            "any_of": policies.any_of(policies.every_steps(10**9), policies.every_seconds(1e9))}[name]


def measure(calls: int, reps: int, path: str, lag: float = 0.0) -> dict[str, float]:
    """Nanoseconds a call, medians, this process: ours per policy, and orbax's. In a job,
    every timed run starts at a barrier; ``lag``: this process starts it that much later
    (process 1 runs behind process 0, as a process in a loop with collectives is never
    far ahead: it finds the decisions published; ahead of process 0 it would wait)."""
    import numpy as np

    import jaxckpt

    def start(tag: str) -> None:
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(tag)
            time.sleep(lag)

    import jax
    from jax.experimental import multihost_utils

    state = {"x": np.zeros(4)}
    out: dict[str, float] = {}
    for name in POLICIES:
        kw = {"save_interval_steps": 10**9} if name == "save_interval_steps" else {"save_policy": make(name)}
        with jaxckpt.CheckpointManager(os.path.join(path, name), **kw) as mgr:
            mgr.save(0, state, force=True)
            mgr.wait_until_finished()
            step = 1
            for call in ("should_save", "save"):
                runs = []
                for rep in range(reps):
                    start(f"{name}{call}{rep}")
                    t = time.perf_counter()
                    if call == "should_save":
                        for s in range(step, step + calls):
                            mgr.should_save(s)
                    else:
                        for s in range(step, step + calls):
                            mgr.save(s, state)
                    runs.append((time.perf_counter() - t) / calls * 1e9)
                    step += calls
                out[f"{name}.{call}"] = statistics.median(runs)
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(save_interval_steps=10**9)
    with ocp.CheckpointManager(os.path.join(path, "orbax"), options=options) as mgr:
        runs, step = [], 1
        for rep in range(reps):
            start(f"orbax{rep}")
            t = time.perf_counter()
            for s in range(step, step + calls):
                mgr.should_save(s)
            runs.append((time.perf_counter() - t) / calls * 1e9)
            step += calls
        out["orbax.should_save"] = statistics.median(runs)
    return out


def worker(port: int, nproc: int, pid: int, args: dict) -> None:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid, initialization_timeout=60)
    out = measure(args["calls"], args["reps"], os.path.join(args["path"], f"p{pid}"), lag=0.5 * pid)
    print("RESULT " + json.dumps(out), flush=True)
    jax.distributed.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--worker", nargs=4)
    opts = parser.parse_args()
    if opts.worker:
        port, nproc, pid, args = opts.worker
        worker(int(port), int(nproc), int(pid), json.loads(args))
        return
    if opts.smoke:
        opts.calls, opts.reps = 200, 1
    path = tempfile.mkdtemp(prefix="jaxckpt-policy-cost-")
    one = measure(opts.calls, opts.reps, os.path.join(path, "single"))
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    port, args = free_port(), json.dumps({"calls": opts.calls, "reps": opts.reps, "path": os.path.join(path, "mp")})
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(port), "2", str(i), args],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for i in range(2)]
    two = []
    for p in procs:
        out, err = p.communicate(timeout=900)
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        if not lines:
            raise SystemExit(f"a process failed:\n{err[-3000:]}")
        two.append(json.loads(lines[-1][7:]))
    print(f"ns a call on a step that does not save (median of {opts.reps} x {opts.calls} calls)")
    print("| policy | call | 1 process | 2 processes: process 0 | process 1 |")
    print("|---|---|---:|---:|---:|")
    for key in [*(f"{n}.{c}" for n in POLICIES for c in ("should_save", "save")), "orbax.should_save"]:
        name, call = key.split(".")
        print(f"| {name} | {call} | {one[key]:.0f} | {two[0][key]:.0f} | {two[1][key]:.0f} |")
    ref = one["orbax.should_save"]
    print(f"ratio to orbax's should_save, 1 process: save_interval_steps {one['save_interval_steps.should_save'] / ref:.2f}x,"
          f" goodput {one['goodput.should_save'] / ref:.2f}x; 2 processes (process 1): "
          f"every_seconds {two[1]['every_seconds.should_save'] / two[1]['orbax.should_save']:.3f}x")


if __name__ == "__main__":
    main()
