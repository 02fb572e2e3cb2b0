"""One process of a real 2-process JAX job, for tests/test_restore_placement.py: where a
restore places leaves the target gives no sharding, in every process.

Usage: mp_place_worker.py PORT NPROC PID NDEV PATH
Saves a state (a sharded array, a replicated one, a scalar step counter, a typed key, a
leaf on process 0's devices only), restores it five ways and prints one line
`RESULT <json>`: for each restore and leaf, what this process got, and the slices each
exchanging restore shared. ``JAXCKPT_READ_ONCE`` in the environment (read by jaxckpt)
turns the exchange on or off.
"""

import json
import os
import sys
import traceback

port, nproc, pid, ndev, path = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={ndev}"

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid,
                           initialization_timeout=60)

import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt import _exchange

# a process that plans no exchange where its peer plans one fails in seconds, not minutes
_exchange.START_TIMEOUT_S = 20
EXCHANGES = []
_run = _exchange.ReadOnce.run


def counted_run(self):
    EXCHANGES.append(len(self.shared))
    return _run(self)


_exchange.ReadOnce.run = counted_run


def expected():
    """Every leaf's global value (key leaves: their key data)."""
    return {
        "w": np.arange(8 * 16, dtype=np.float32).reshape(8, 16),
        "repl": np.linspace(-1, 1, 16, dtype=np.float32),
        "repl2": np.arange(16, 32, dtype=np.float32),
        "step": np.array(1234, np.int32),
        "key": np.asarray(jax.random.key_data(jax.random.key(7))),
        "p0": np.arange(4 * 3, dtype=np.int16).reshape(4, 3),
    }


def process0_mesh():
    """A mesh of process 0's devices only."""
    return jax.sharding.Mesh(np.array([d for d in jax.devices() if d.process_index == 0]), ("y",))


def init():
    """The state's construction; under ``jax.set_mesh`` (explicit axes) ``jax.eval_shape``
    of it gives ``w`` and ``repl`` shardings on an abstract mesh and ``step`` and ``key`` none."""
    return {"w": jax.device_put(jnp.zeros((8, 16), jnp.float32), P("x")), "repl": jnp.zeros(16, jnp.float32),
            "step": jnp.int32(0), "key": jax.random.key(0)}


def state(mesh):
    """The saved state: global arrays, every process building its own part."""
    host = expected()
    on = {"w": NamedSharding(mesh, P("x")), "p0": NamedSharding(process0_mesh(), P("y"))}
    out = {k: jax.make_array_from_callback(v.shape, on.get(k, NamedSharding(mesh, P())), lambda i, v=v: v[i],
                                         dtype=v.dtype)
           for k, v in host.items()}
    out["key"] = jax.random.wrap_key_data(out["key"])
    return out


def describe(value, want, sharding):
    """What this process got for one leaf: its type, whether every addressable shard is
    bit-exact, and whether its sharding is ``sharding``."""
    if not isinstance(value, jax.Array):
        got = {"type": type(value).__name__}
        if isinstance(value, np.ndarray):
            got["exact"] = value.dtype == want.dtype and value.tobytes() == want.tobytes()
        return got
    key = jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key)
    data = jax.random.key_data(value) if key else value
    exact = [np.asarray(s.data).dtype == want.dtype and np.asarray(s.data).tobytes() == want[s.index].tobytes()
             for s in data.addressable_shards]
    return {"type": "key" if key else "array", "shards": len(exact), "exact": all(exact),
            "sharding": value.sharding.is_equivalent_to(sharding, value.ndim)}


def restore_eval_shape(mesh, host):
    """(a) a target from ``jax.eval_shape`` under ``jax.set_mesh``: step and key have no sharding."""
    with jax.set_mesh(mesh):
        target = jax.eval_shape(init)
        assert target["step"].sharding is None and target["key"].sharding is None, target
        back = jaxckpt.restore(path, target, partial=True)
    replicated = NamedSharding(mesh, P())
    return {k: describe(back[k], host[k], NamedSharding(mesh, P("x")) if k == "w" else replicated)
            for k in ("w", "repl", "step", "key")}


def restore_without_target(host):
    """(b) no target: arrays as numpy, the key a typed key every process holds."""
    back = jaxckpt.restore(path)
    everywhere = NamedSharding(jax.sharding.Mesh(np.array(jax.devices()), ("all",)), P())
    out = {k: describe(back[k], host[k], None) for k in ("w", "repl", "repl2", "step", "p0")}
    out["key"] = describe(back["key"], host["key"], everywhere)
    return out


def restore_on_process0(mesh, host):
    """(d) a leaf on process 0's devices only, next to two replicated ones (a plan that
    counts process 0's reads in one process only assigns their pieces differently)."""
    on0 = NamedSharding(process0_mesh(), P("y"))
    replicated = NamedSharding(mesh, P())
    target = {"p0": jax.ShapeDtypeStruct((4, 3), np.int16, sharding=on0),
              "repl": jax.ShapeDtypeStruct((16,), np.float32, sharding=replicated),
              "repl2": jax.ShapeDtypeStruct((16,), np.float32, sharding=replicated)}
    back = jaxckpt.restore(path, target, partial=True)
    return {k: describe(back[k], host[k], on0 if k == "p0" else replicated) for k in target}


def bare_target(host):
    """What ``jax.eval_shape`` gives under Auto axes: shapes and dtypes, no shardings."""
    target = {k: jax.ShapeDtypeStruct(host[k].shape, host[k].dtype) for k in ("w", "repl", "step")}
    target["key"] = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
    return target


def restore_bare_without_mesh(host):
    """(e) no sharding anywhere, no mesh in context: the saved mesh (x over every device of
    the job) fits the devices at hand, so each leaf gets its saved spec on a mesh of
    ``jax.devices()`` shaped as the saved one (c1abc6a: CheckpointError, no mesh)."""
    back = jaxckpt.restore(path, bare_target(host), partial=True)
    built = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
    return {k: describe(back[k], host[k], NamedSharding(built, P("x") if k == "w" else P()))
            for k in ("w", "repl", "step", "key")}


def restore_bare_on_another_mesh(host):
    """(f) no sharding, a 2x2 mesh in context: w's saved P("x") fits it (x=2 divides 8
    rows), so w is split over x there (c1abc6a: replicated)."""
    mesh = jax.make_mesh((2, 2), ("x", "y"))
    with jax.set_mesh(mesh):
        back = jaxckpt.restore(path, bare_target(host), partial=True)
    return {k: describe(back[k], host[k], NamedSharding(mesh, P("x") if k == "w" else P()))
            for k in ("w", "repl", "step", "key")}


def attempt(fn, *args):
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - reported to the test, which names it
        return {"error": f"{type(e).__name__}: {e}"}


def main():
    host = expected()
    mesh = jax.make_mesh((nproc * ndev,), ("x",))  # explicit axes (jax 0.10's default)
    jaxckpt.save(path, state(mesh), timeout_s=30)
    result = {"pid": pid, "read_once": os.environ.get("JAXCKPT_READ_ONCE")}
    result["eval_shape"] = attempt(restore_eval_shape, mesh, host)
    result["no_target"] = attempt(restore_without_target, host)
    result["process0"] = attempt(restore_on_process0, mesh, host)
    result["bare_no_mesh"] = attempt(restore_bare_without_mesh, host)
    result["bare_other_mesh"] = attempt(restore_bare_on_another_mesh, host)
    result["exchanges"] = EXCHANGES  # per exchanging restore: the slices it shared
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    try:
        main()
    except BaseException:  # noqa: BLE001 - reported to the test
        print("RESULT " + json.dumps({"pid": pid, "crash": traceback.format_exc()[-3000:]}), flush=True)
        raise
