"""One process of a real multi-process JAX job, for tests/test_dedup.py: a manager with
``dedup=True`` saves steps whose "base" is sharded over every process's devices (each
process writes its own rows) and stays the same array, and whose "head" changes.

Usage: mp_dedup_worker.py PORT NPROC PID JSON_ARGS (``path``, ``steps``, ``max_to_keep``,
``delete``: steps to delete after saving, ``reshard``: the base re-made from host values
at every step, the same bytes in new arrays). Prints one line ``RESULT <json>``.
"""

import json
import os
import sys

port, nproc, pid = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
args = json.loads(sys.argv[4])
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import jax  # noqa: E402 - after XLA_FLAGS

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid, initialization_timeout=60)

import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxckpt  # noqa: E402

BASE = np.arange(512 * 256, dtype=np.float32).reshape(512, 256)


def head(step):
    return np.full((8, 4), step, np.float32)


def main():
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
    sharded = NamedSharding(mesh, P("x", None))
    make = lambda v, sh: jax.make_array_from_callback(v.shape, sh, lambda idx: v[idx])  # noqa: E731
    base = make(BASE, sharded)
    out = {"referred": {}, "steps": None}
    if "ops" in args:  # a scripted run: ["save", step, values, force] / ["delete", step]
        out.update(run_ops(args, make, sharded))
        print("RESULT " + json.dumps(out), flush=True)
        os._exit(0)
    with jaxckpt.CheckpointManager(args["path"], max_to_keep=args.get("max_to_keep"), dedup=True) as mgr:
        for step in args["steps"]:
            b = make(BASE, sharded) if args.get("reshard") else base
            mgr.save(step, {"base": b, "head": make(head(step), NamedSharding(mesh, P()))}, force=True)
            mgr.wait_until_finished()
            out["referred"][step] = mgr.info(step)["dedup"]["referred_bytes"]
        for step in args.get("delete", []):
            mgr.delete(step)
        mgr.wait_until_finished()
        mgr._deleter.wait()
        out["steps"] = mgr.all_steps()
        ok = True
        for step in out["steps"]:
            got = mgr.restore(step, shardings={"base": sharded, "head": NamedSharding(mesh, P())})
            ok &= all(np.array_equal(np.asarray(s.data), BASE[s.index]) for s in got["base"].addressable_shards)
            ok &= all(np.array_equal(np.asarray(s.data), head(step)[s.index]) for s in got["head"].addressable_shards)
        out["exact"] = bool(ok)
    print("RESULT " + json.dumps(out), flush=True)
    os._exit(0)


def run_ops(args, make, sharded):
    """Saves of base values ``"A"`` (arange), ``"B"`` (reversed) as one array object each,
    kept across saves, and deletes; then every listed step restored and compared."""
    values = {"A": BASE, "B": BASE[::-1].copy()}
    arrays, expected, out = {}, {}, {}
    with jaxckpt.CheckpointManager(args["path"], max_to_keep=args.get("max_to_keep"), dedup=True) as mgr:
        for op in args["ops"]:
            if op[0] == "save":
                _, step, which, force = op
                arrays.setdefault(which, make(values[which], sharded))
                mgr.save(step, {"base": arrays[which]}, force=force)
                expected[step] = values[which]
            else:
                mgr.delete(op[1])
            mgr.wait_until_finished()
        mgr._deleter.wait()
        out["steps"] = mgr.all_steps()
        out["exact"] = all(all(np.array_equal(np.asarray(s.data), expected[step][s.index])
                               for s in mgr.restore(step, shardings={"base": sharded})["base"].addressable_shards)
                           for step in out["steps"])
    return out


main()
