"""A training loop that is preempted by a real SIGTERM, for tests/test_preemption.py.

Usage: preempt_worker.py JSON_ARGS

``args``: ``path`` (the manager's directory), ``ready`` (a file this process creates
when it finished step ``pause_at`` and blocks reading a line from stdin: the test sends
SIGTERM, then the line, so the signal arrives at a known point), ``pause_at``,
``interval`` (``save_interval_steps``), ``sleep`` (seconds per step, so processes run at
different speeds), ``max_steps``, ``prev`` (single process: install a Python SIGTERM
handler first, which must still be called and be put back at close), and for a real
multi-process job ``port``, ``nproc``, ``pid`` (gloo CPU collectives on 127.0.0.1) and
``target`` (the process that gets the signal).

The loop is the documented recipe: train, ``reached_preemption(step)`` → save that step
with ``force=True``, wait, leave; otherwise the regular ``save``. Prints one line
``RESULT <json>`` and exits 0. The caller sets ``XLA_FLAGS`` (the number of CPU devices).
"""

import json
import os
import signal
import sys
import time
import traceback

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt

args = json.loads(sys.argv[1])
multi = "nproc" in args
pid = args.get("pid", 0)
if multi:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{args['port']}", num_processes=args["nproc"], process_id=pid,
                               initialization_timeout=60)


def reached(mgr, step):
    return mgr.reached_preemption(step)


def initial_state():
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
    w0 = np.arange(16 * 32, dtype=np.float32).reshape(16, 32)
    return {"w": jax.make_array_from_callback(w0.shape, NamedSharding(mesh, P("x")), lambda i: w0[i]),
            "n": jax.device_put(np.int32(0), NamedSharding(mesh, P()))}


def train(mgr, result):
    train_step = jax.jit(lambda s: {"w": s["w"] + 1.0, "n": s["n"] + 1}, donate_argnums=0)
    try:  # JAX's sync manager alone would say True to -1 (its "unset" sync point)
        result["negative"] = reached(mgr, -1)
    except jaxckpt.CheckpointError as e:
        result["negative"] = str(e)
    state = initial_state()
    for step in range(1, args["max_steps"] + 1):
        state = train_step(state)
        time.sleep(args.get("sleep", 0.0))
        if reached(mgr, step):
            t0 = time.monotonic()
            mgr.save(step, state, force=True)
            mgr.wait_until_finished()
            result["preempted"] = step
            result["save_s"] = time.monotonic() - t0
            break
        mgr.save(step, state)
        if step == args["pause_at"] and pid == args.get("target", 0):
            with open(args["ready"], "w") as f:
                f.write(str(os.getpid()))
            sys.stdin.readline()  # the SIGTERM comes first, then this line
            result["go"] = time.monotonic()
    result["last_step"] = step
    if "go" in result:
        result["after_go_s"] = time.monotonic() - result.pop("go")


def main():
    result = {"pid": pid, "preempted": None}
    prev_calls = []
    if args.get("prev"):
        def previous(signum, frame):
            prev_calls.append(signum)
        signal.signal(signal.SIGTERM, previous)
    with jaxckpt.CheckpointManager(args["path"], save_interval_steps=args["interval"], timeout_s=30) as mgr:
        train(mgr, result)
        result["mode"] = mgr._preemption.mode
        result["steps"] = mgr.all_steps()
    if args.get("prev"):
        result["prev_calls"] = prev_calls
        result["restored_handler"] = signal.getsignal(signal.SIGTERM) is previous
    else:
        result["handler"] = repr(signal.getsignal(signal.SIGTERM))
    print("RESULT " + json.dumps(result), flush=True)


try:
    main()
except BaseException:
    print("RESULT " + json.dumps({"pid": pid, "crash": traceback.format_exc()}), flush=True)
sys.stdout.flush()
if multi:
    jax.distributed.shutdown()  # waits for every process, so the coordinator outlives them
os._exit(0)
