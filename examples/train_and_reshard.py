"""Train a small MLP sharded over 8 devices, checkpoint it, restore it onto 2 devices
with other partition specs, and check the restored state continues identically.

Run: make demo   (or: .venv/bin/python examples/train_and_reshard.py)
"""

import os
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt


def init_params(key, sizes):
    params = []
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        k = jax.random.fold_in(key, i)
        params.append({"kernel": jax.random.normal(k, (n_in, n_out)) / np.sqrt(n_in), "bias": jnp.zeros(n_out)})
    return params


def loss_fn(params, x, y):
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["kernel"] + layer["bias"])
    out = x @ params[-1]["kernel"] + params[-1]["bias"]
    return jnp.mean((out - y) ** 2)


def make_step(opt):
    @jax.jit
    def step(state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], x, y)
        updates, opt_state = opt.update(grads, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {**state, "params": params, "opt": opt_state, "step": state["step"] + 1}, loss

    return step


def place(tree, mesh, kernel_spec):
    """Kernels sharded by `kernel_spec`, everything else replicated."""

    def put(path, x):
        if not isinstance(x, jax.Array) or jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return x
        spec = kernel_spec if x.ndim == 2 else P()
        return jax.device_put(x, NamedSharding(mesh, spec))

    return jax.tree_util.tree_map_with_path(put, tree)


def main():
    auto = jax.sharding.AxisType.Auto  # let jit propagate shardings through the matmuls
    mesh8 = jax.make_mesh((4, 2), ("data", "model"), axis_types=(auto, auto))
    opt = optax.adam(1e-2)
    params = init_params(jax.random.key(0), [64, 256, 256, 8])
    state = {"params": params, "opt": opt.init(params), "step": jnp.int32(0), "rng": jax.random.key(42)}
    state = place(state, mesh8, P("data", "model"))
    step = make_step(opt)
    data_rng = np.random.default_rng(0)
    batches = [(data_rng.standard_normal((32, 64), np.float32), data_rng.standard_normal((32, 8), np.float32))
               for _ in range(8)]
    for x, y in batches[:5]:
        state, loss = step(state, x, y)
    print(f"trained 5 steps on a {dict(mesh8.shape)} mesh, loss {float(loss):.4f}")

    ckpt = os.path.join(tempfile.mkdtemp(prefix="jaxckpt-demo-"), "step_5")
    t0 = time.perf_counter()
    jaxckpt.save(ckpt, state, metadata={"run": "demo", "mesh": dict(mesh8.shape)})
    n_files = sum(len(f) for _, _, f in os.walk(ckpt))
    info = jaxckpt.metadata(ckpt)
    print(f"saved {info.info['bytes']:,} bytes in {len(jax.tree.leaves(state))} leaves to {ckpt} "
          f"({n_files} files, {time.perf_counter() - t0:.3f}s)")
    k0 = info.tree["params"][0]["kernel"]
    print(f"  params/0/kernel: shape {k0.shape}, {k0.dtype}, saved as {k0.sharding.spec} on {k0.sharding.mesh_shape}")

    # Restore onto 2 devices with the kernels sharded the other way round.
    mesh2 = jax.make_mesh((2,), ("model",), axis_types=(auto,), devices=jax.devices()[:2])

    def abstract_leaf(s):
        spec = P(None, "model") if len(s.shape) == 2 else P()
        return jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(mesh2, spec))

    target = jax.tree.map(abstract_leaf, jax.eval_shape(lambda: state))
    t0 = time.perf_counter()
    restored = jaxckpt.restore(ckpt, target)
    print(f"restored onto a {dict(mesh2.shape)} mesh in {time.perf_counter() - t0:.3f}s; "
          f"params/0/kernel now {restored['params'][0]['kernel'].sharding.spec} on "
          f"{len(restored['params'][0]['kernel'].sharding.device_set)} devices")

    same = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
               zip(jax.tree.leaves(jax.tree.map(_plain, state)), jax.tree.leaves(jax.tree.map(_plain, restored))))
    print(f"restored state equals saved state bit for bit: {same}")

    # Both copies continue training and stay identical.
    a, b = state, restored
    for x, y in batches[5:]:
        a, la = step(a, x, y)
        b, lb = step(b, x, y)
    print(f"3 more steps: loss on 8 devices {float(la):.6f}, on 2 devices {float(lb):.6f}")
    if not same:
        raise SystemExit("restore mismatch")


def _plain(x):
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(x)
    return x


if __name__ == "__main__":
    main()
