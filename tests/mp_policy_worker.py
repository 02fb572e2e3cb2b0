"""One process of a real multi-process JAX job saving by ``save_policy`` with a clock of
its own (tests/test_policies.py): each process's clock runs at its own rate from its own
offset (skewed hosts), and each process steps at its own pace; every save is recorded.

Usage: mp_policy_worker.py PORT NPROC PID JSON_ARGS
JSON_ARGS: ``path``, ``policies`` (name -> [kind, args...]), ``steps``, ``batch_s``, ``sigterm``
(``[pid, step]``: that process gets SIGTERM before that step). Prints `RESULT <json>`.
"""

import json
import os
import signal
import sys
import time
import traceback

port, nproc, pid = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
args = json.loads(sys.argv[4])
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid, initialization_timeout=60)

import numpy as np
from jax.experimental import multihost_utils

import jaxckpt
from jaxckpt import policies
from jaxckpt._manager import decisions

# a batch of decisions covers this many seconds of steps (0.5 s by default): the test's
# second-long loops need a finer one to see several time-based saves
decisions.BATCH_S = args.get("batch_s", decisions.BATCH_S)

RATE, OFFSET = 1.0 + 0.25 * pid, 3600.0 * pid - 1e5 * (pid % 2)  # skewed: rate and offset per host
T0 = time.time()


def clock():
    return OFFSET + T0 + (time.time() - T0) * RATE


def make(spec):
    kind, *rest = spec
    if kind == "any_of":
        return policies.any_of(*map(make, rest))
    if kind == "on_preemption":
        return policies.on_preemption()
    if kind == "at_steps":
        return policies.at_steps(rest[0])
    if kind == "goodput":
        return policies.goodput(**rest[0])
    return getattr(policies, kind)(*rest)


def run(name, spec):
    saved, asked = [], []
    path = os.path.join(args["path"], name)
    with jaxckpt.CheckpointManager(path, save_policy=make(spec), clock=clock, timeout_s=60) as mgr:
        for step in range(args["steps"]):
            time.sleep(0.004 + 0.002 * pid)  # each process at its own pace
            if args.get("sigterm") == [pid, step] and name == "preemption":
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(1.5)  # JAX's listener notices within 1 s
            if step % 3 == 0:
                asked.append(mgr.should_save(step))
            if mgr.save(step, {"x": np.full(1000, step, np.int32), "step": step}):
                saved.append(step)
            if step % 10 == 9:  # the loop's own collective now and then, as training has
                multihost_utils.sync_global_devices(f"{name}{step}")
        mgr.wait_until_finished()
        steps = mgr.all_steps()
    return {"saved": saved, "asked": asked, "steps": steps}


def main():
    out = {"pid": pid}
    for name, spec in args["policies"].items():
        out[name] = run(name, spec)
    print("RESULT " + json.dumps(out), flush=True)


try:
    main()
except BaseException:
    print("RESULT " + json.dumps({"pid": pid, "crash": traceback.format_exc()}), flush=True)
sys.stdout.flush()
jax.distributed.shutdown()
os._exit(0)
