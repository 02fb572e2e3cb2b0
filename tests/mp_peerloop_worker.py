"""One process of a real multi-process JAX job that trains while peer copies move
(tests/test_peer_background.py): a jitted step with a ``psum`` over every device each
step, a ``multihost_utils`` barrier every few steps, and ``mgr.save`` every
``every`` steps with ``peer_copies``. ``per_host`` processes share each host directory.

Usage: mp_peerloop_worker.py PORT NPROC PID JSON_ARGS; prints one line `RESULT <json>`.
With ``"kill": K``, process K dies (``os._exit``) in the middle of the last save's copy,
as it receives its second block; the others then call ``wait_until_finished()`` and
``save()`` once more, and report what each raised or warned.
"""

import json
import logging
import os
import sys
import time
import traceback

port, nproc, pid = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
args = json.loads(sys.argv[4])
per_host = args.get("per_host", 1)
local = os.path.join(args["path"], f"host{pid // per_host}")
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid, initialization_timeout=60)

import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt import _storage
from jaxckpt._manager import peerlink

peerlink.BLOCK_BYTES = args.get("block", 64 << 10)  # several blocks per copy at this size
MESH = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
ROWS = args.get("rows", 256)  # rows of 256 int32 per process
SHARDED = NamedSharding(MESH, P("x", None))


def _total(x):
    return jax.lax.psum(x.sum(dtype=np.int32), "x")  # a collective over every process


@jax.jit
def train_step(w):
    total = jax.shard_map(_total, mesh=MESH, in_specs=P("x", None), out_specs=P())(w)
    return (w + total % 5 + 1) % 1000003


def start():
    return np.arange(ROWS * nproc * 256, dtype=np.int32).reshape(ROWS * nproc, 256)


def expected(step):
    w = start()
    for _ in range(step):
        w = (w + w.sum(dtype=np.int32) % 5 + 1) % 1000003
    return w


class Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.seen = []

    def emit(self, record):
        self.seen.append(record.getMessage())


sent = {}
_offer_send = peerlink.Offer.send


def counting_send(self, stream):
    sent[self.tag] = sent.get(self.tag, 0) + self.total
    return _offer_send(self, stream)


peerlink.Offer.send = counting_send
last_copy = {"on": False, "hits": 0}


def kill_hook(op, key):
    if op == "peer" and last_copy["on"]:
        last_copy["hits"] += 1
        if last_copy["hits"] == 2:
            os._exit(9)


def main():
    out = {"pid": pid, "blocking": [], "saved": []}
    seen = Warnings()
    logging.getLogger("jaxckpt").addHandler(seen)
    if args.get("kill") == pid:
        _storage.fault_hook = kill_hook
    w = jax.make_array_from_callback((ROWS * nproc, 256), SHARDED, lambda idx: start()[idx])
    steps, every = args.get("steps", 200), args.get("every", 10)
    mgr = jaxckpt.CheckpointManager(local, max_to_keep=args.get("keep", 2), timeout_s=args.get("timeout", 10),
                                    peer_copies=args.get("copies", 1), max_pending=args.get("max_pending", 1))
    t_loop = time.perf_counter()
    for step in range(1, steps + 1):
        w = train_step(w)
        if step % 5 == 0:
            multihost_utils.sync_global_devices(f"loop{step}")
        if step % every == 0:
            t = time.perf_counter()
            mgr.save(step, {"w": w, "step": step})
            out["blocking"].append(time.perf_counter() - t)
            out["saved"].append(step)
            if step + every > steps:
                last_copy["on"] = True
    out["loop_s"] = time.perf_counter() - t_loop
    full = expected(steps)
    out["values_ok"] = all(np.asarray(s.data).tobytes() == full[s.index].tobytes() for s in w.addressable_shards)
    for call in ("wait", "save"):
        t = time.perf_counter()
        try:
            if call == "wait":
                mgr.wait_until_finished()
            else:
                mgr.save(steps + every, {"w": w, "step": steps + every})
                mgr.wait_until_finished()
            out[call] = "ok"
        except jaxckpt.CheckpointError as e:
            out[call] = f"{type(e).__name__}: {e}"
        out[f"{call}_s"] = time.perf_counter() - t
        if "kill" not in args:
            break
    out["steps"] = mgr.all_steps()
    out["tiers"] = {str(k): list(v) for k, v in mgr.step_tiers().items()}
    out["sent"] = sent
    out["warnings"] = seen.seen
    print("RESULT " + json.dumps(out), flush=True)
    if "kill" in args:  # a peer is dead: JAX's shutdown would wait for it, and process 0 runs the
        # coordination service the others need until they reported: it waits for their files
        open(os.path.join(args["path"], f"reported{pid}"), "w").close()
        deadline = time.monotonic() + 60
        while pid == 0 and time.monotonic() < deadline and not all(
                os.path.exists(os.path.join(args["path"], f"reported{p}")) for p in range(nproc) if p != args["kill"]):
            time.sleep(0.1)
        os._exit(0)
    mgr.close()


try:
    main()
except BaseException:
    print("RESULT " + json.dumps({"pid": pid, "crash": traceback.format_exc()}), flush=True)
sys.stdout.flush()
jax.distributed.shutdown()
os._exit(0)
