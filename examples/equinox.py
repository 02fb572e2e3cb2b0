"""Checkpoint an equinox model: save the array half of ``eqx.partition``, rebuild the
model with ``eqx.combine`` and the static half from code, and resume bit for bit.

The train state is ``{"params", "bn" (an eqx.nn.State), "opt" (optax), "key", "step"}``:
arrays and Python ints only. Functions, layer sizes and other static fields are never
saved; the restore target comes from ``eqx.filter_eval_shape`` (nothing allocated), and
equinox's modules come back as themselves. Data parallel on 4 CPU devices.

Run: .venv/bin/python examples/equinox.py
"""

import os
import sys
import tempfile

# This file is named equinox.py: keep its own directory off the import path, so that
# `import equinox` finds the library rather than this script.
_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax

jax.config.update("jax_num_cpu_devices", 4)

import equinox as eqx
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt


class Model(eqx.Module):
    lin1: eqx.nn.Linear
    bn: eqx.nn.BatchNorm
    drop: eqx.nn.Dropout
    lin2: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.lin1 = eqx.nn.Linear(16, 32, use_bias=False, key=k1)
        self.bn = eqx.nn.BatchNorm(32, axis_name="batch", mode="ema")
        self.drop = eqx.nn.Dropout(0.2)
        self.lin2 = eqx.nn.Linear(32, 4, key=k2)

    def __call__(self, x, bn, key):  # one example; vmap over the batch
        x, bn = self.bn(self.lin1(x), bn)
        return self.lin2(self.drop(jax.nn.relu(x), key=key)), bn


OPT = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 20))


def create(seed):
    """The train state and the static half of the model."""
    model, bn = eqx.nn.make_with_state(Model)(jax.random.key(seed))
    params, static = eqx.partition(model, eqx.is_array)
    return {"params": params, "bn": bn, "opt": OPT.init(params), "key": jax.random.key(seed + 1)}, static


def make_step(static, batch_sharding):
    def step(state, x, y):
        key, dropout = jax.random.split(state["key"])

        def loss_fn(params):
            model = eqx.combine(params, static)
            keys = jax.random.split(dropout, x.shape[0])
            logits, bn = jax.vmap(model, axis_name="batch", in_axes=(0, None, 0), out_axes=(0, None))(
                x, state["bn"], keys)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), bn

        (loss, bn), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
        updates, opt = OPT.update(grads, state["opt"], state["params"])
        return {"params": eqx.apply_updates(state["params"], updates), "bn": bn, "opt": opt, "key": key}, loss

    jitted = jax.jit(step, donate_argnums=0)
    return lambda state, x, y: jitted(state, jax.device_put(x, batch_sharding), jax.device_put(y, batch_sharding))


def run(step, state, data):
    losses = []
    for x, y in data:
        state, loss = step(state, x, y)
        losses.append(np.asarray(loss))
    return state, np.array(losses)


def as_numpy(state):
    return [np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
            for x in jax.tree.leaves(state)]


def main(work):
    mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    replicated = NamedSharding(mesh, P())
    state, static = create(0)
    state = jax.device_put(state, replicated)
    step = make_step(static, NamedSharding(mesh, P("data")))
    rng = np.random.default_rng(0)
    data = [(rng.standard_normal((16, 16), np.float32), rng.integers(0, 4, 16).astype(np.int32)) for _ in range(6)]

    directory = os.path.join(work, "ckpts")
    with jaxckpt.CheckpointManager(directory) as mgr:
        state, _ = run(step, state, data[:3])
        mgr.save(3, {**state, "step": 3})
        state, losses = run(step, state, data[3:])  # the uninterrupted run goes on
    saved = jax.tree.leaves(jaxckpt.metadata(os.path.join(directory, "3")).tree["params"],
                            is_leaf=lambda x: x is None or isinstance(x, jaxckpt.LeafInfo))
    arrays = sum(isinstance(x, jaxckpt.LeafInfo) for x in saved)
    print(f"trained 6 steps on {mesh.devices.size} devices, saved step 3: params as {arrays} arrays "
          f"and {saved.count(None)} None (the places of static fields)")

    # A fresh start: the static half from code, the arrays' shapes from filter_eval_shape.
    # Its leaves have no sharding: each gets the spec it was saved with (replicated here)
    # on the mesh in context.
    abstract, static = eqx.filter_eval_shape(create, 0)
    with jax.set_mesh(mesh), jaxckpt.CheckpointManager(directory, read_only=True) as reader:
        restored = reader.restore(target={**abstract, "step": 0})
    model = eqx.combine(restored["params"], static)
    print(f"restored step {restored['step']}: params as {type(restored['params']).__name__}, "
          f"bn as {type(restored['bn']).__name__}, opt as {type(restored['opt'][0]).__name__}; "
          f"combined model: {type(model).__name__} with lin1.weight {model.lin1.weight.shape}")
    restored.pop("step")
    resumed, resumed_losses = run(make_step(static, NamedSharding(mesh, P("data"))), restored, data[3:])
    same = all(a.dtype == b.dtype and a.tobytes() == b.tobytes() for a, b in zip(as_numpy(state), as_numpy(resumed)))
    print("losses after step 3: " + " ".join(f"{x:.5f}" for x in losses))
    print("resumed:             " + " ".join(f"{x:.5f}" for x in resumed_losses))
    print(f"state equal to the uninterrupted run's bit for bit: {same}; "
          f"losses: {losses.tobytes() == resumed_losses.tobytes()}")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="jaxckpt-eqx-") as work:
        main(work)
