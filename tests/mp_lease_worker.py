"""One process of a real multi-process JAX job, for tests/test_lease_identity.py.

Usage: mp_lease_worker.py PORT NPROC PID NDEV JSON_ARGS
Prints one line `RESULT <json>`: what each call of the scenario returned or raised.

The scenario: a writing manager (process 0 holds its lease) commits step 1; another
writer then takes the lease file over. Every process must raise at the same call (the
next save, or with async saves the wait where its failure surfaces), a delete must be
refused in every process, and a plain ``jaxckpt.save`` afterwards must still work in
both (the operation counters still agree).
"""

# ruff: noqa: E402 - jax is configured (devices, collectives) before the imports that use it
import json
import os
import sys
import time
import traceback

port, nproc, pid, ndev = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
args = json.loads(sys.argv[5])
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={ndev}"

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid,
                           initialization_timeout=60)

import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt import _distributed
from jaxckpt._manager import lease as _lease

INTRUDER = {"host": "other-host", "pid": 4242, "token": "intruder", "started": 0.0, "count": 0,
            "lease_s": 15.0}


def state(mesh, value):
    host = np.arange(16 * 32, dtype=np.float32).reshape(16, 32) + value
    return host, {"w": jax.make_array_from_callback(host.shape, NamedSharding(mesh, P("x")),
                                                    lambda idx: host[idx])}


def call(results, name, fn):
    """Run one call; record what it returned or raised (type and message)."""
    try:
        results[name] = {"returned": repr(fn())}
    except Exception as e:  # noqa: BLE001 - reported to the test
        results[name] = {"raised": type(e).__name__, "message": str(e)}


def take_over(path, mgr):
    """Process 0: another writer rewrites the lease file; wait until the holder sees it."""
    with open(os.path.join(path, _lease.LEASE_FILE), "w") as f:
        json.dump(dict(INTRUDER, renewed=time.time()), f)
    deadline = time.monotonic() + 10
    while mgr._lease.lost is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return mgr._lease.lost


def main():
    _lease.RENEW_S = 0.05  # the holder sees the take-over within a few renewals
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
    path, other = args["path"], args["other"]
    _, state1 = state(mesh, 1)
    result = {"pid": pid}
    mgr = jaxckpt.CheckpointManager(path, async_save=args["async"], timeout_s=20)
    mgr.save(1, state1)
    mgr.wait_until_finished()
    if pid == 0:
        result["lost"] = take_over(path, mgr)
    # both processes go on only once the lease is known lost in process 0
    _distributed._client().wait_at_barrier("lease_taken_over", 30_000)
    _, state2 = state(mesh, 2)
    call(result, "save", lambda: mgr.save(2, state2))
    call(result, "wait", mgr.wait_until_finished)
    call(result, "delete", lambda: mgr.delete(1))
    result["steps"] = mgr.all_steps()
    call(result, "close", mgr.close)
    # a plain save afterwards: the operation counters of the processes still agree
    host3, state3 = state(mesh, 3)
    call(result, "plain_save", lambda: jaxckpt.save(other, state3, timeout_s=20))
    back = jaxckpt.restore(other, state3)
    result["plain_restored"] = back["w"].dtype == np.float32 and all(
        np.asarray(s.data).tobytes() == host3[s.index].tobytes() for s in back["w"].addressable_shards)
    return result


if __name__ == "__main__":
    try:
        out = main()
    except Exception:  # noqa: BLE001 - reported to the test
        out = {"pid": pid, "crash": traceback.format_exc()}
    print("RESULT " + json.dumps(out), flush=True)
