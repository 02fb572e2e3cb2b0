"""One process of a real multi-process JAX job whose manager keeps a local directory per
host with peer copies (tests/test_peers.py). One CPU device per process.

Usage: mp_peers_worker.py PORT NPROC PID SCENARIO JSON_ARGS
Prints one line `RESULT <json>`. With "tmpfs" in the arguments, the process first moves
into a mount namespace of its own where its host directory is a RAM disk of that many
bytes (``unshare -rm``: a full RAM disk without root or a shared /dev/shm).
"""

import json
import os
import shlex
import sys
import traceback

port, nproc, pid, scenario = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
args = json.loads(sys.argv[5])
local = os.path.join(args["path"], f"host{pid}")
if args.get("tmpfs") and not os.environ.get("MP_PEERS_IN_NS"):
    os.makedirs(local, exist_ok=True)
    inner = " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])
    os.execvp("unshare", ["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size={args['tmpfs']} none "
                          f"{shlex.quote(local)} && MP_PEERS_IN_NS=1 exec {inner}"])
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid, initialization_timeout=60)

import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt import _storage

MESH = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
ROWS = args.get("rows", 64)


def values(i):
    """Sharded over the processes: each host's part exists only in its directory."""
    w = np.random.default_rng(i).standard_normal((ROWS * nproc, 256)).astype(np.float32)
    return {"w": w, "b": np.arange(1000, dtype=np.int32) * i}


def state(i):
    out = {}
    for k, v in values(i).items():
        spec = P("x", None) if k == "w" else P(None)
        out[k] = jax.make_array_from_callback(v.shape, NamedSharding(MESH, spec), lambda idx, v=v: v[idx])
    out["step"] = i
    return out


def check(back):
    i = back["step"]
    for k, full in values(i).items():
        for shard in back[k].addressable_shards:
            got = np.asarray(shard.data)
            assert got.dtype == full.dtype and got.tobytes() == full[shard.index].tobytes(), (k, i)
    return i


def listing(root):
    return sorted(n for n in os.listdir(root) if n.isdigit()) if os.path.isdir(root) else []


def peer_listing():
    top = os.path.join(local, ".jaxckpt-peers")
    return {n: listing(os.path.join(top, n)) for n in sorted(os.listdir(top))} if os.path.isdir(top) else {}


def fail_peer_write(op, key):
    if op == "peer":
        raise OSError(28, "No space left on device (injected)")


def main():
    out = {"pid": pid}
    options = dict(max_to_keep=args.get("keep", 2), timeout_s=20, peer_copies=args.get("copies", 1),
                   async_save=args.get("async", True))
    if "durable" in args:
        options.update(persistent_directory=args["durable"], persistent_interval_steps=args.get("every", 2))
    with jaxckpt.CheckpointManager(local, **options) as mgr:
        out["steps_at_start"] = mgr.all_steps()
        out["latest_at_start"] = mgr.latest_step()
        if "restore" in args:
            try:
                out["restored"] = check(mgr.restore(args["restore"], state(0)))
            except jaxckpt.CheckpointError as e:
                out["error"] = f"{type(e).__name__}: {e}"
            out["tiers_after_restore"] = {str(k): list(v) for k, v in mgr.step_tiers().items()}
            out["on_disk_after_restore"] = listing(local)
        for i in args.get("save", []):
            if args.get("fail_peer") == [pid, i]:
                _storage.fault_hook = fail_peer_write
            try:
                mgr.save(i, state(i))
                mgr.wait_until_finished()
            except jaxckpt.CheckpointError as e:
                out.setdefault("save_errors", {})[str(i)] = str(e)
            _storage.fault_hook = None
        out["steps"] = mgr.all_steps()
    out["on_disk"] = listing(local)
    out["peers"] = peer_listing()
    top = os.path.join(local, ".jaxckpt-peers")
    out["peer_attempts"] = sorted(n for d in (os.listdir(top) if os.path.isdir(top) else [])
                                  for n in os.listdir(os.path.join(top, d)) if n.startswith("."))
    print("RESULT " + json.dumps(out), flush=True)


try:
    main()
except BaseException:
    print("RESULT " + json.dumps({"pid": pid, "crash": traceback.format_exc()}), flush=True)
sys.stdout.flush()
jax.distributed.shutdown()
os._exit(0)
