"""One process of a real multi-process JAX job whose manager keeps a local directory per
host (tests/test_host_groups.py).

Usage: mp_hosts_worker.py PORT NPROC PID NDEV SCENARIO JSON_ARGS
Prints one line `RESULT <json>`.
"""

import json
import os
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

MESH = jax.sharding.Mesh(np.array(jax.devices()), ("x",))


def host_values(i):
    return {"w": np.arange(64 * 256, dtype=np.float32).reshape(64, 256) + i,
            "b": np.arange(1000, dtype=np.int32) * i}


def state(i, sharded):
    out = {}
    for k, v in host_values(i).items():
        spec = P("x", None) if sharded and k == "w" else P(*[None] * v.ndim)
        out[k] = jax.make_array_from_callback(v.shape, NamedSharding(MESH, spec), lambda idx, v=v: v[idx])
    out["step"] = i
    return out


def check(back, i):
    for k, full in host_values(i).items():
        for shard in back[k].addressable_shards:
            got = np.asarray(shard.data)
            assert got.dtype == full.dtype and got.tobytes() == full[shard.index].tobytes(), (k, i)
    assert back["step"] == i, back["step"]
    return i


def listing(local):
    return sorted(n for n in os.listdir(local) if n.isdigit()) if os.path.isdir(local) else []


def main():
    local = os.path.join(args["path"], f"host{pid}")
    sharded = args.get("sharded", False)
    out = {"pid": pid}
    with jaxckpt.CheckpointManager(local, timeout_s=20) as mgr:
        out["groups"] = [list(g) for g in mgr._groups.groups]
        out["steps_at_start"] = mgr.all_steps()
        out["on_disk_at_start"] = listing(local)
        if args.get("steal") == pid:  # another writer takes this host's directory over
            lease = os.path.join(local, ".jaxckpt-writer.json")
            with open(lease) as f:
                owner = json.load(f)
            with open(lease, "w") as f:
                json.dump(dict(owner, token="someone-else", pid=1), f)
            mgr._lease.renew()  # what the renewal thread does within its period
        try:
            for i in args.get("save", []):
                mgr.save(i, state(i, sharded))
            mgr.wait_until_finished()
        except jaxckpt.CheckpointError as e:
            out["save_error"] = str(e)
        if "restore" in args:
            try:
                back = mgr.restore(args["restore"], state(0, sharded))
                out["restored"] = check(back, back["step"])
            except jaxckpt.CheckpointError as e:
                out["error"] = f"{type(e).__name__}: {e}"
            out["steps_after_restore"] = mgr.all_steps()
            out["on_disk_after_restore"] = listing(local)
        for i in args.get("then_save", []):
            mgr.save(i, state(i, sharded))
        mgr.wait_until_finished()
        out["steps"] = mgr.all_steps()
    out["on_disk"] = listing(local)
    print("RESULT " + json.dumps(out), flush=True)


try:
    main()
except BaseException:
    print("RESULT " + json.dumps({"pid": pid, "crash": traceback.format_exc()}), flush=True)
sys.stdout.flush()
jax.distributed.shutdown()
os._exit(0)
