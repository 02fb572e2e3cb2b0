"""One process of a real 2-process JAX job that runs manager options against each other
(tests/test_option_pairs.py). One CPU device per process.

Usage: pairs_worker.py PORT NPROC PID JSON_ARGS
JSON_ARGS: {"path": a shared scratch directory, "endpoint": the S3 server, "pairs": [[a, b], ...]}
Prints one line `RESULT <json>`: {"a+b": verdict, ...}, a verdict being "ok", "refused: <the
constructor's error>" or "FAILED: <what went wrong>".

Each pair runs the same life: a manager with both options saves steps 1 and 2, deletes
2, saves 2 again with other values and 3; where the pair keeps a copy elsewhere (peer copies,
the persistent tier) and writes, host 1 then loses its directory; a new manager (read-only
when the pair has ``read_only``) lists the steps and restores 2, 1 and the latest, each
checked in every process bit for bit (a quantized moment within the int8 bound).
"""

import json
import os
import shutil
import sys
import traceback

port, nproc, pid = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
args = json.loads(sys.argv[4])
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid, initialization_timeout=60)

import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt

MESH = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
ROWS = 64  # per process: w and mu are 64 KiB per process, more than max_staging_bytes
STAGING = 16 << 10
BUCKET = "jaxckpt-test"


def values(i):
    rng = np.random.default_rng(i)
    return {"w": rng.standard_normal((ROWS * nproc, 256)).astype(np.float32),
            "mu": rng.standard_normal((ROWS * nproc, 256)).astype(np.float32) * 1e-3,
            "b": np.arange(1000, dtype=np.int32) * i}


def state(i):
    out = {}
    for k, v in values(i).items():
        spec = P(None) if k == "b" else P("x", None)
        out[k] = jax.make_array_from_callback(v.shape, NamedSharding(MESH, spec), lambda idx, v=v: v[idx])
    out["step"] = i
    return out


def target():
    out = {}
    for k, v in values(0).items():
        spec = P(None) if k == "b" else P("x", None)
        out[k] = jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(MESH, spec))
    out["step"] = 0
    return out


def check(back, i, lossy):
    assert back["step"] == i, ("step", back["step"], i)
    for k, full in values(i).items():
        for shard in back[k].addressable_shards:
            got, want = np.asarray(shard.data), full[shard.index]
            assert got.dtype == want.dtype and got.shape == want.shape, (k, i, got.dtype, got.shape)
            if k == "mu" and lossy:  # int8: within absmax / 254 of a block of 128 (plus rounding)
                bound = np.abs(full).max() / 254 * 1.001
                assert np.abs(got - want).max() <= bound, (k, i, float(np.abs(got - want).max()), bound)
            else:
                assert got.tobytes() == want.tobytes(), (k, i)


def location(name, opts, where):
    """The manager's directory (``where="local"``) or its persistent tier's."""
    if where == "durable":
        if "s3" in opts:
            return {"driver": "s3", "bucket": BUCKET, "path": f"{name}/durable", "endpoint": args["endpoint"],
                    "aws_region": "us-east-1"}
        return os.path.join(args["path"], name, "durable")
    if "s3" in opts and not per_host(opts) and "persistent" not in opts:
        return {"driver": "s3", "bucket": BUCKET, "path": f"{name}/mgr", "endpoint": args["endpoint"],
                "aws_region": "us-east-1"}
    if per_host(opts):
        return os.path.join(args["path"], name, f"host{pid}")
    return os.path.join(args["path"], name, "shared")


def per_host(opts):
    return "per_host" in opts or "peers" in opts


def options(name, opts):
    kw = {"async_save": "async" in opts}
    if "staging" in opts:
        kw["max_staging_bytes"] = STAGING
    if "peers" in opts:
        kw["peer_copies"] = 1
    # an object store beside a local directory per host is the persistent tier
    if "persistent" in opts or ("s3" in opts and per_host(opts)):
        kw.update(persistent_directory=location(name, opts, "durable"), persistent_interval_steps=1)
    if "compression" in opts:
        kw["compression"] = "zstd"
    if "quantize" in opts:
        kw["quantize"] = {"mu": "int8"}
    if "verify_before_delete" in opts:
        kw["verify_before_delete"] = True
    return kw


def loses_a_host(opts):
    """Host 1 loses its directory where another copy of its part exists to come back from,
    and the restarted manager may write (a read-only one never repairs)."""
    keeps_a_copy = "peers" in opts or "persistent" in opts or ("s3" in opts and per_host(opts))
    return per_host(opts) and keeps_a_copy and "read_only" not in opts


def run_pair(pair):
    opts = set(pair)
    name = "+".join(pair)
    os.environ["JAXCKPT_READ_ONCE"] = "1" if "read_once" in opts else "auto"
    directory, kw = location(name, opts, "local"), options(name, opts)
    try:
        mgr = jaxckpt.CheckpointManager(directory, **kw)
    except (jaxckpt.CheckpointError, ValueError) as e:
        return f"refused: {e}"
    with mgr:
        mgr.save(1, state(1))
        mgr.save(2, state(2))
        mgr.wait_until_finished()
        mgr.delete(2)
        assert mgr.all_steps() == [1], ("after delete", mgr.all_steps())
        mgr.save(2, state(20))  # step 2 again, other values: its old copies must never come back
        mgr.save(3, state(3))
        mgr.wait_until_finished()
        assert mgr.all_steps() == [1, 2, 3], ("after saves", mgr.all_steps())
    multihost_utils.sync_global_devices(f"saved {name}")
    if loses_a_host(opts) and pid == 1:
        shutil.rmtree(directory)
    multihost_utils.sync_global_devices(f"lost {name}")
    lossy = "quantize" in opts
    again = dict(kw, read_only=True) if "read_only" in opts else kw
    with jaxckpt.CheckpointManager(directory, **again) as mgr:
        check(mgr.restore(2, target()), 20, lossy)
        check(mgr.restore(1, target()), 1, lossy)
        check(mgr.restore(target=target()), 3, lossy)
        assert mgr.latest_step() == 3, ("latest", mgr.latest_step())
        assert mgr.all_steps() == [1, 2, 3], ("after restart", mgr.all_steps())
    multihost_utils.sync_global_devices(f"done {name}")
    return "ok"


def main():
    out = {}
    for pair in args["pairs"]:
        try:
            out["+".join(pair)] = run_pair(pair)
        except Exception as e:  # noqa: BLE001 - reported per pair; the job goes on to the next
            tb = traceback.format_exc(limit=4).replace("\n", " | ")
            out["+".join(pair)] = f"FAILED: {type(e).__name__}: {e} [{tb[-600:]}]"
            try:
                multihost_utils.sync_global_devices(f"after failure {'+'.join(pair)}")
            except Exception:  # noqa: BLE001 - the job is broken: report what we have
                break
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
