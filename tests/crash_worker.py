"""A process that saves checkpoints until a fault point kills it, for tests/test_crash.py.

Usage: crash_worker.py JSON_ARGS

``JAXCKPT_FAULT`` (read by ``jaxckpt._storage`` at import) names the fault point where
this process SIGKILLs itself. ``args``: ``scenario`` (``manager``: a CheckpointManager
saves steps 1..``steps``; ``overwrite``: ``jaxckpt.save(path, state(value),
overwrite=True)``; ``resume``: a fresh manager lists, restores the latest step, checks it
bit for bit and saves ``next``), ``path``, and for a real multi-process job ``port``,
``nproc``, ``pid`` (gloo CPU collectives on 127.0.0.1, 2 devices per process); ``format``:
the format to save (``JAXCKPT_FORMAT``: 1 for the layout of formats 1 and 2, 3), else the
default (the environment's).

Prints ``COMMITTED <step>`` as saves commit and one last line ``RESULT <json>`` when it
was not killed; it leaves with ``os._exit`` (jax's distributed shutdown would wait for a
dead peer).
"""

import json
import os
import sys
import traceback

import numpy as np

ROWS = 256  # big: 256 x 1024 float32 = 1 MiB, a chunk file per device (4 per step)


def host_state(step):
    """The values of ``step``'s state, as numpy (what a restore must give back exactly)."""
    big = (np.arange(ROWS * 1024, dtype=np.float32).reshape(ROWS, 1024) + np.float32(step) * 1e5)
    return {"big": big, "small": np.arange(12, dtype=np.int32) * 7 + step, "step": step}


def state(step):
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("x",))
    host = host_state(step)
    big = jax.make_array_from_callback(host["big"].shape, NamedSharding(mesh, P("x", None)),
                                       lambda idx: host["big"][idx])
    return {"big": big, "small": host["small"], "step": step}


def same(got, step):
    import jax

    want = host_state(step)
    big = got["big"]
    if isinstance(big, jax.Array):  # restored sharded: compare this process's shards
        ok = all(np.asarray(s.data).tobytes() == want["big"][s.index].tobytes() for s in big.addressable_shards)
    else:
        ok = np.asarray(big).tobytes() == want["big"].tobytes()
    small = np.asarray(got["small"])
    return bool(ok and small.dtype == want["small"].dtype and small.tobytes() == want["small"].tobytes()
                and got["step"] == step)


def run_manager(args):
    import jaxckpt
    from jaxckpt import _distributed

    _distributed.STALE_S = args.get("stale_s", _distributed.STALE_S)
    errors = []
    with jaxckpt.CheckpointManager(args["path"], max_to_keep=2, async_save=args.get("async", False),
                                   timeout_s=20) as mgr:
        for step in range(1, args["steps"] + 1):
            try:
                mgr.save(step, state(step))
                mgr.wait_until_finished()
                print(f"COMMITTED {step}", flush=True)
            except jaxckpt.CheckpointError as e:
                errors.append(str(e))
                break
    return {"errors": errors}


def run_resume(args):
    import jax

    import jaxckpt

    target = state(0)
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) if k == "big" else v
              for k, v in target.items()}
    with jaxckpt.CheckpointManager(args["path"], max_to_keep=2, timeout_s=20) as mgr:
        steps = mgr.all_steps()
        latest = mgr.latest_step()
        exact = same(mgr.restore(latest, target), latest)
        mgr.save(args["next"], state(args["next"]))
        mgr.wait_until_finished()
        after = mgr.all_steps()
        exact_next = same(mgr.restore(args["next"], target), args["next"])
    return {"steps": steps, "latest": latest, "exact": exact, "after": after, "exact_next": exact_next}


def run(args):
    if args["scenario"] == "manager":
        return run_manager(args)
    if args["scenario"] == "resume":
        return run_resume(args)
    import jaxckpt
    from jaxckpt import _commit

    _commit.RENAME_EXCHANGE = args.get("exchange", True)
    jaxckpt.save(args["path"], state(args["value"]), overwrite=True)
    return {}


def main(args):
    multi = "port" in args
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={2 if multi else 4}"
    if "format" in args:  # read per save
        os.environ["JAXCKPT_FORMAT"] = str(args["format"])
    import jax

    if multi:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(f"127.0.0.1:{args['port']}", num_processes=args["nproc"],
                                   process_id=args["pid"], initialization_timeout=60)
    try:
        result = run(args)
    except BaseException:  # noqa: BLE001 - reported to the test
        result = {"crash": traceback.format_exc()}
    print("RESULT " + json.dumps({"pid": args.get("pid", 0), **result}), flush=True)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
