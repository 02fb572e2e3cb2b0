"""One process of a real multi-process JAX job saving format 3 (JAXCKPT_FORMAT=3) into a
local directory per host, with a persistent tier (tests/test_format3_hosts.py).

Usage: mp_f3hosts_worker.py PORT NPROC PID NDEV SCENARIO JSON_ARGS
JSON_ARGS: ``hosts`` (each process's host name: processes of one host share its
directory), ``runs`` (per run a ``local`` root and a ``durable`` persistent directory),
``save`` (steps), ``options`` (more manager options), ``segment_bytes``, ``hostcopy`` (a local root: replicated state saved, host a's directory
wiped, then restored). Prints one line `RESULT <json>`.
"""

import json
import os
import shutil
import sys
import traceback

port, nproc, pid, ndev, scenario = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
args = json.loads(sys.argv[6])
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={ndev}"

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid, initialization_timeout=60)

import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt import _snapshot

if args.get("segment_bytes"):  # small data objects: streams of several, entries straddling them
    _snapshot.SEGMENT_BYTES = args["segment_bytes"]
MESH = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
N = len(jax.devices())


def values(i):
    """Step i's arrays (the test computes the same)."""
    return {"w": np.arange(16 * N * 96, dtype=np.float32).reshape(16 * N, 96) + i,
            "r": np.arange(50_000, dtype=np.int32) * i, "b": np.full(8, i, np.int8)}


def state(i, w_spec=("x", None)):
    out = {k: jax.make_array_from_callback(v.shape, NamedSharding(MESH, P(*w_spec) if k == "w" else P()),
                                           lambda idx, v=v: v[idx]) for k, v in values(i).items()}
    out.update(host=np.arange(5, dtype=np.float64) * i, step=i)
    return out


def check(back, i):
    for k, full in values(i).items():
        for shard in back[k].addressable_shards:
            got = np.asarray(shard.data)
            assert got.dtype == full.dtype and got.tobytes() == full[shard.index].tobytes(), (k, i)
    assert back["host"].tobytes() == (np.arange(5, dtype=np.float64) * i).tobytes()
    assert back["step"] == i, back["step"]
    return i


def run(local, durable):
    out = {}
    with jaxckpt.CheckpointManager(local, persistent_directory=durable, persistent_interval_steps=2,
                                   timeout_s=30, **args.get("options", {})) as mgr:
        out["groups"] = [list(g) for g in mgr._groups.groups]
        for i in args["save"]:
            mgr.save(i, state(i))
        mgr.wait_until_finished()
        out["tiers"] = {str(s): list(t) for s, t in mgr.step_tiers().items()}
        out["restored"] = check(mgr.restore(None, state(0)), args["save"][-1])
        # columns cut across every host's rows: a host lacks the others' (its local read
        # fails), so every process reads the persistent copy
        out["restored_columns"] = check(mgr.restore(2, state(0, (None, "x"))), 2)
    return out


def hostcopy(local):
    """Replicated state (every host holds all of it); host a is replaced (its directory
    wiped): the restore copies host b's step to it first."""
    from jax.experimental import multihost_utils

    with jaxckpt.CheckpointManager(local, timeout_s=30, **args.get("options", {})) as mgr:
        mgr.save(7, state(7, (None, None)))
    multihost_utils.sync_global_devices("saved")
    if pid == 0:
        shutil.rmtree(local)
    multihost_utils.sync_global_devices("wiped")
    with jaxckpt.CheckpointManager(local, timeout_s=30, **args.get("options", {})) as mgr:
        out = {"steps_at_start": mgr.all_steps()}
        out["restored"] = check(mgr.restore(None, state(0, (None, None))), 7)
        out["steps"] = mgr.all_steps()
    return out


def main():
    host = args["hosts"][pid]
    out = {"pid": pid, "runs": [run(os.path.join(r["local"], host), r["durable"]) for r in args["runs"]]}
    if args.get("hostcopy"):
        out["hostcopy"] = hostcopy(os.path.join(args["hostcopy"], host))
    print("RESULT " + json.dumps(out), flush=True)


try:
    main()
except BaseException:
    print("RESULT " + json.dumps({"pid": pid, "crash": traceback.format_exc()}), flush=True)
sys.stdout.flush()
jax.distributed.shutdown()
os._exit(0)
