"""One process of a real multi-process JAX job saving by ``save_policy`` with a clock of
its own (tests/test_policies.py): each process's clock runs at its own rate from its own
offset (skewed hosts), and each process steps at its own pace; every save is recorded.

Usage: mp_policy_worker.py PORT NPROC PID JSON_ARGS
JSON_ARGS: ``path``, ``policies`` (name -> [kind, args...]), ``steps``, ``batch_s``, ``sigterm``
(``[pid, step]``: that process gets SIGTERM before that step). Prints `RESULT <json>`.
"""

import gc
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


TICK = [0]  # the steps the loop has taken: with "fake_step_s" the clock is that many of them


def clock():
    if args.get("fake_step_s"):
        jump = args.get("clock_jump")  # [tick, seconds]: process 0's clock set back (NTP) at that tick
        back = jump[1] if jump and pid == 0 and TICK[0] >= jump[0] else 0.0
        return OFFSET + TICK[0] * args["fake_step_s"] - back
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


class Counted(policies.SavePolicy):
    """every_seconds(s) counting how often it is asked (on process 0)."""

    def __init__(self, s):
        self.inner, self.asks = policies.every_seconds(s), 0

    def should_save(self, facts):
        self.asks += 1
        return self.inner.should_save(facts)


def run(name, spec, path=None):
    saved, asked = [], []
    path = path or os.path.join(args["path"], name)
    policy = Counted(spec[1]) if spec[0] == "counted" else make(spec)
    steps = args.get("step_list") or range(args["steps"])
    if args.get("unclosed"):  # made, used and dropped without close(): its keys must still go
        mgr = jaxckpt.CheckpointManager(path, save_policy=policy, clock=clock, timeout_s=60)
        for step in steps:
            mgr.should_save(step)
        del mgr
        gc.collect()
        multihost_utils.sync_global_devices(f"{name}dropped")
        time.sleep(0.5)
        keys = jax._src.distributed.global_state.client.key_value_dir_get("jaxckpt/policy/")
        return {"keys_left": len(keys)}
    with jaxckpt.CheckpointManager(path, save_policy=policy, clock=clock, timeout_s=60) as mgr:
        if args.get("lag") and pid == 1:
            time.sleep(args["lag"])  # behind process 0 from the start: it may close first
        for i, step in enumerate(steps):
            TICK[0] = i + 1
            step = np.int64(step) if args.get("numpy_steps") else step
            if not args.get("fake_step_s") and not args.get("fast"):
                time.sleep(0.004 + 0.002 * pid)  # each process at its own pace
            if args.get("sigterm") == [pid, step] and name == "preemption":
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(1.5)  # JAX's listener notices within 1 s
            if i % 3 == 0:
                asked.append(mgr.should_save(step))
            if mgr.save(step, {"x": np.full(1000, i, np.int32), "step": int(step)}):
                saved.append(int(step))
            if i % 10 == 9 and not args.get("no_barriers"):  # the loop's own collective now and then
                multihost_utils.sync_global_devices(f"{name}{i}")
        mgr.wait_until_finished()
        listed = mgr.all_steps()
        batches = len(mgr._decider._batches)
    return {"saved": saved, "asked": asked, "steps": listed, "asks": getattr(policy, "asks", None),
            "batches": batches}


def main():
    out = {"pid": pid}
    for name, spec in args["policies"].items():
        if args.get("managers"):  # that many managers one after the other, a barrier before each
            out[name] = []
            for m in range(args["managers"]):
                multihost_utils.sync_global_devices(f"m{m}")
                out[name].append(run(name, spec, os.path.join(args["path"], f"{name}{m}")))
            continue
        out[name] = run(name, spec)
    print("RESULT " + json.dumps(out), flush=True)


try:
    main()
except BaseException:
    print("RESULT " + json.dumps({"pid": pid, "crash": traceback.format_exc()}), flush=True)
sys.stdout.flush()
jax.distributed.shutdown()
os._exit(0)
