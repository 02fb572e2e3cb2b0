"""One process of a real multi-process JAX job, for tests/test_exchange_mp.py (the
read-once exchange: its memory bound, its plan agreement).

Usage: mp_exchange_worker.py PORT NPROC PID SCENARIO JSON_ARGS  (one CPU device each)
Prints one line `RESULT <json>`.
"""

import json
import os
import sys
import time
import traceback

port, nproc, pid, scenario = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
args = json.loads(sys.argv[5])
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"

import jax  # noqa: E402 - XLA_FLAGS first

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid,
                           initialization_timeout=60)

import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxckpt  # noqa: E402
from jaxckpt import (
    _distributed,
    _exchange,  # noqa: E402
)


def bounded_state():
    """Leaves the exchange must cut into blocks (each saved as one chunk, far larger than
    a row of a 256 KiB wave) next to small ones of several dtypes."""
    rng = np.random.default_rng(7)
    return {
        "big": rng.standard_normal((256, 1024), dtype=np.float32),  # 1 MiB, one chunk
        "flat": np.arange(300_000, dtype=np.float32),  # 1-D: blocks are element runs
        "wide": rng.standard_normal((2, 100_000), dtype=np.float32),  # a row larger than a block
        "rows": np.arange(128 * 256, dtype=np.float32).reshape(128, 256),  # saved as row blocks
        "h": rng.standard_normal((64, 96)).astype(jax.numpy.bfloat16),
        "odd": np.arange(100, dtype=np.int8),
        "mask": rng.standard_normal(48) > 0,
        "s": np.array(7, np.int32),
    }


def pair_state():
    return {k: np.full((64, 1024), i + 1, np.float32) for i, k in enumerate(("a", "b"))}


def save_and_target(path, host):
    """Save ``host`` (``rows`` row-sharded, the rest replicated) from every process, and
    the target that restores every leaf replicated on every process."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
    specs = {k: P("d") if k == "rows" else P() for k in host}
    saved = {k: jax.make_array_from_callback(v.shape, NamedSharding(mesh, specs[k]), lambda i, v=v: v[i])
             for k, v in host.items()}
    jaxckpt.save(path, saved, timeout_s=30)
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, P())) for k, v in host.items()}


def record_gathers():
    """Wrap the all-gather to record each wave's row width (every process's row is
    padded to it): the process holds its own row on host and device and the gathered
    rows, (nproc + 2) x width."""
    widths = []
    gather = _exchange.all_gather

    def recorded(row, lengths):
        widths.append(int(row.shape[1]))
        return gather(row, lengths)
    _exchange.all_gather = recorded
    return widths


def same_values(back, host):
    ok = True
    for k, v in host.items():
        for shard in back[k].addressable_shards:
            ok &= np.asarray(shard.data).tobytes() == v[shard.index].tobytes()
    return bool(ok)


def run_bounded(path):
    _exchange.READ_ONCE = "1"
    _exchange.WAVE_BYTES = args["wave"]
    host = bounded_state()
    target = save_and_target(path, host)
    widths = record_gathers()
    back = jaxckpt.restore(path, target)
    return {"same": same_values(back, host), "widths": widths}


def run_diverge(path):
    """Process ``odd`` restores leaf ``a`` without the exchange (as if its sharding were
    fully addressable there): the processes' plans differ."""
    _exchange.READ_ONCE = "1"
    _exchange.START_TIMEOUT_S = args["start_timeout"]
    _distributed.STALE_S = args["start_timeout"]
    host = pair_state()
    target = save_and_target(path, host)
    if pid == args["odd"]:
        add_global = _exchange.ReadOnce.add_global

        def add_a_locally(self, rec, sharding, mine):
            if rec.path != "a":
                return add_global(self, rec, sharding, mine)
            for index in mine:
                self.add(rec, index)
        _exchange.ReadOnce.add_global = add_a_locally
    t0 = time.monotonic()
    try:
        back = jaxckpt.restore(path, target)
    except jaxckpt.CheckpointError as e:
        return {"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - t0}
    return {"error": None, "same": same_values(back, host), "seconds": time.monotonic() - t0}


def main():
    result = {"pid": pid}
    path = args["path"]
    if scenario == "bounded":
        result.update(run_bounded(path))
    elif scenario == "diverge":
        result.update(run_diverge(path))
    print("RESULT " + json.dumps(result), flush=True)


try:
    main()
except BaseException:
    print("RESULT " + json.dumps({"pid": pid, "crash": traceback.format_exc()}), flush=True)
sys.stdout.flush()
jax.distributed.shutdown()
os._exit(0)
