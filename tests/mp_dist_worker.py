"""One process of a real multi-process JAX job, for tests/test_distributed_mp.py (the
agreement layer, ``jaxckpt/_distributed.py``: clean-up of an operation's keys, stalls).

Usage: mp_dist_worker.py PORT NPROC PID NDEV SCENARIO JSON_ARGS
Prints one line `RESULT <json>`.
"""

import json
import os
import sys
import threading
import time
import traceback

port, nproc, pid, ndev, scenario = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
args = json.loads(sys.argv[6])
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={ndev}"

import jax  # noqa: E402 - after XLA_FLAGS / jax.distributed

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid,
                           initialization_timeout=60)

import numpy as np  # noqa: E402 - after XLA_FLAGS / jax.distributed
from jax.sharding import NamedSharding  # noqa: E402 - after XLA_FLAGS / jax.distributed
from jax.sharding import PartitionSpec as P  # noqa: E402 - after XLA_FLAGS / jax.distributed

import jaxckpt  # noqa: E402 - after XLA_FLAGS / jax.distributed
from jaxckpt import _distributed, _storage

HOLD_S = 60  # the longest a fault hook holds a thread (every wait in a test is bounded)


def host_state(step, leaves=1):
    """Distinct values per step and leaf, 1.5 MiB per leaf (chunk files, not packed; rows split over 2 or 3 processes)."""
    return {f"w{i}": np.arange(384 * 1024, dtype=np.float32).reshape(384, 1024) * (step + 1) + i
            for i in range(leaves)}


def device_state(mesh, step, leaves=1):
    sharding = NamedSharding(mesh, P("x", None))
    return {k: jax.make_array_from_callback(v.shape, sharding, lambda idx, v=v: v[idx])
            for k, v in host_state(step, leaves).items()}


def same(back, step, leaves=1):
    """Bit-exact, every addressable shard of every leaf."""
    want = host_state(step, leaves)
    return sorted(back) == sorted(want) and all(
        np.asarray(s.data).tobytes() == want[k][s.index].tobytes()
        for k, arr in back.items() for s in arr.addressable_shards)


def op_names():
    return sorted({k.split("/op/")[1].split("/")[0] for k in _distributed.op_keys()})


def run_shared_lane(mesh):
    """A manager's async saves and plain ``jaxckpt.save`` calls on the main thread,
    interleaved; process ``delayed`` holds its save thread right before it reads each
    manager save's outcome until its own plain save of the same round returned.
    Process 0 lets its manager finish first, so its save thread has left the manager's
    save when the plain save is agreed (the moment d7c90e7 deleted the older keys)."""
    released = threading.Event()
    held = []

    def hook(name, phase):
        if phase == "outcome" and threading.current_thread() is not threading.main_thread():
            held.append(f"{name}/{phase}")
            released.wait(HOLD_S)
    if pid == args["delayed"]:
        _distributed.wait_hook = hook
    errors, plain_committed = [], []
    rounds = args["rounds"]
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, P("x", None)))
              for k, v in host_state(0).items()}
    with jaxckpt.CheckpointManager(args["path"], timeout_s=args["timeout"]) as mgr:
        try:
            for step in range(1, rounds + 1):
                released.clear()
                mgr.save(step, device_state(mesh, step))  # settles the previous round's save
                if pid == 0:
                    mgr.wait_until_finished()
                plain = os.path.join(args["plain"], str(step))
                jaxckpt.save(plain, device_state(mesh, 100 + step), timeout_s=args["timeout"])
                plain_committed.append(os.path.exists(os.path.join(plain, "manifest.json")))
                released.set()
            mgr.wait_until_finished()
        except jaxckpt.CheckpointError as e:  # the processes' operations no longer line up: stop
            released.set()
            errors.append(str(e))
            return {"errors": errors, "steps": mgr.all_steps(), "plain_committed": plain_committed}
        steps = mgr.all_steps()
        restored = [same(mgr.restore(s, target), s) for s in steps]
    restored += [same(jaxckpt.restore(os.path.join(args["plain"], str(s)), target), 100 + s)
                 for s in range(1, rounds + 1)]
    # one more collective operation: every process has left all the others by the time
    # process 0 heard from everyone in it, so only its own keys are left
    jaxckpt.save(os.path.join(args["plain"], "last"), device_state(mesh, 0), timeout_s=args["timeout"])
    return {"errors": errors, "steps": steps, "plain_committed": plain_committed, "held": held,
            "restored": restored, "ops": op_names()}


def run_hang(mesh):
    """Process ``bad`` hangs alive in its first chunk write for ``hang`` seconds: its
    heartbeat thread keeps beating, it reads and writes nothing. The stall bound is set
    through the environment after import (it is read per call)."""
    os.environ["JAXCKPT_STALL_S"] = str(args["stall"])
    if pid == args["bad"]:
        hung = []

        def hook(op, key):
            if op == args.get("point", "write") and not hung:
                hung.append(key)
                time.sleep(args["hang"])
        _storage.fault_hook = hook
    t0 = time.monotonic()
    try:
        jaxckpt.save(args["path"], device_state(mesh, 1), timeout_s=args["timeout"])
        error = None
    except jaxckpt.CheckpointError as e:
        error = str(e)
    return {"error": error, "seconds": time.monotonic() - t0,
            "committed": os.path.exists(os.path.join(args["path"], "manifest.json"))}


def run_slow_chain(mesh):
    """Process ``slow`` writes its chunks one at a time, each taking ``sleep`` seconds,
    longer in all than the stall bound: it makes progress. Process 0 waits for it (no
    I/O of its own) and the others wait for process 0: nobody is stalled."""
    os.environ["JAXCKPT_STALL_S"] = str(args["stall"])
    writes = []
    if pid == args["slow"]:
        one_at_a_time = threading.Lock()

        def hook(op, key):
            if op == "write":
                with one_at_a_time:
                    writes.append(key)
                    time.sleep(args["sleep"])
        _storage.fault_hook = hook
    leaves = args["leaves"]
    t0 = time.monotonic()
    try:
        jaxckpt.save(args["path"], device_state(mesh, 1, leaves), timeout_s=args["timeout"])
        error = None
    except jaxckpt.CheckpointError as e:
        error = str(e)
    seconds = time.monotonic() - t0
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, P("x", None)))
              for k, v in host_state(1, leaves).items()}
    restored = error is None and same(jaxckpt.restore(args["path"], target), 1, leaves)
    return {"error": error, "seconds": seconds, "writes": len(writes), "restored": restored}


def run_slow_encode(mesh):
    """Process ``slow`` encodes its compressed chunks one at a time, each taking ``sleep``
    seconds (the first ``hang`` seconds, if given: stuck), through a slowed codec (the
    module function the writer calls), longer in all than the stall bound. Process 0
    waits for it with no I/O of its own."""
    from jaxckpt._storage import codecs as _tscodecs

    os.environ["JAXCKPT_STALL_S"] = str(args["stall"])
    encodes = []
    if pid == args["slow"]:
        one_at_a_time = threading.Lock()
        real = _tscodecs.encode

        def slow(*a):
            with one_at_a_time:
                time.sleep(args["hang"] if args.get("hang") and not encodes else args["sleep"])
                encodes.append(1)
            return real(*a)
        _tscodecs.encode = slow
    leaves = args["leaves"]
    t0 = time.monotonic()
    try:
        jaxckpt.save(args["path"], device_state(mesh, 1, leaves), timeout_s=args["timeout"], compression="zstd")
        error = None
    except jaxckpt.CheckpointError as e:
        error = str(e)
    seconds = time.monotonic() - t0
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, P("x", None)))
              for k, v in host_state(1, leaves).items()}
    restored = error is None and same(jaxckpt.restore(args["path"], target), 1, leaves)
    return {"error": error, "seconds": seconds, "encodes": len(encodes), "restored": restored,
            "committed": os.path.exists(os.path.join(args["path"], "manifest.json"))}


def main():
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
    run = {"shared_lane": run_shared_lane, "hang": run_hang, "slow_chain": run_slow_chain,
           "slow_encode": run_slow_encode}[scenario]
    result = {"pid": pid, **run(mesh)}
    print("RESULT " + json.dumps(result), flush=True)


try:
    main()
except BaseException:
    print("RESULT " + json.dumps({"pid": pid, "crash": traceback.format_exc()}), flush=True)
sys.stdout.flush()
jax.distributed.shutdown()  # waits for every process, so the coordinator outlives them
os._exit(0)
