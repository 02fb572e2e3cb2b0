"""Checkpoint a flax linen ``TrainState`` (params, batch statistics, a dropout key, Adam's
moments, the step) sharded on a data x model mesh, and resume it bit for bit.

The restore target is ``jax.eval_shape`` of the function that creates the state (no
memory allocated) plus the shardings linen derives from ``nn.with_partitioning``
(``nn.get_sharding``): the restored state is a ``TrainState`` again, with its
``apply_fn`` and ``tx`` taken from the target.

Run: .venv/bin/python examples/flax_linen.py
"""

import os
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax

jax.config.update("jax_num_cpu_devices", 8)

import functools
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

import jaxckpt


class MLP(nn.Module):
    hidden: int = 32
    classes: int = 4

    @nn.compact
    def __call__(self, x, train):
        init = nn.initializers.lecun_normal()
        x = nn.Dense(self.hidden, use_bias=False, kernel_init=nn.with_partitioning(init, (None, "model")))(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        x = nn.Dropout(0.2, deterministic=not train)(nn.relu(x))
        return nn.Dense(self.classes, kernel_init=nn.with_partitioning(init, ("model", None)))(x)


class TrainState(train_state.TrainState):
    batch_stats: Any
    key: jax.Array  # the dropout stream


# One model and one optimizer: a TrainState's apply_fn and tx are static (part of its
# tree structure), so every state must share these very objects.
MODEL = MLP()
TX = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 20))


def create_state(seed):
    variables = MODEL.init(jax.random.key(seed), jnp.zeros((1, 16)), train=False)
    return TrainState.create(apply_fn=MODEL.apply, params=variables["params"], tx=TX,
                             batch_stats=variables["batch_stats"], key=jax.random.key(seed + 1))


def abstract_state(mesh):
    """Shapes, dtypes and shardings of the state on ``mesh``, without allocating it.

    ``nn.with_partitioning`` boxes the params (``nn.Partitioned``) with their axis names;
    ``nn.get_sharding`` turns those into shardings (replicated where there are none) and
    the state itself is kept unboxed."""
    abstract = jax.eval_shape(functools.partial(create_state, 0))
    shardings = nn.get_sharding(abstract, mesh)
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), nn.unbox(abstract),
                        shardings)


def train_step(state, x, y):
    key, dropout = jax.random.split(state.key)

    def loss_fn(params):
        logits, updates = state.apply_fn({"params": params, "batch_stats": state.batch_stats}, x, train=True,
                                         rngs={"dropout": dropout}, mutable=["batch_stats"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), updates

    (loss, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads, batch_stats=updates["batch_stats"], key=key), loss


def batches(n):
    rng = np.random.default_rng(0)
    return [(rng.standard_normal((16, 16), np.float32), rng.integers(0, 4, 16).astype(np.int32)) for _ in range(n)]


def leaves(state):
    """The state's leaves as numpy (typed keys as their key data)."""
    return [np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
            for x in jax.tree.leaves(state)]


def run(step, state, data):
    losses = []
    for x, y in data:
        state, loss = step(state, x, y)
        losses.append(np.asarray(loss))
    return state, np.array(losses)


def main(work):
    auto = jax.sharding.AxisType.Auto
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(auto, auto))
    target = abstract_state(mesh)
    shardings = jax.tree.map(lambda a: a.sharding, target)
    step = jax.jit(train_step, donate_argnums=0, out_shardings=(shardings, None))
    state = jax.jit(lambda: nn.unbox(create_state(0)), out_shardings=shardings)()
    data = batches(6)

    directory = os.path.join(work, "ckpts")
    with jaxckpt.CheckpointManager(directory, max_to_keep=2) as mgr:
        for i, (x, y) in enumerate(data[:3], start=1):
            state, loss = step(state, x, y)
            mgr.save(i, state, metrics={"loss": float(loss)})  # then the next step donates `state`
        state, losses = run(step, state, data[3:])  # the uninterrupted run goes on
    print(f"trained 6 steps on {dict(mesh.shape)}, saved steps {mgr.all_steps()}; losses after step 3: "
          + " ".join(f"{x:.5f}" for x in losses))

    with jaxckpt.CheckpointManager(directory, read_only=True) as reader:
        restored = reader.restore(target=target)
    kernel = restored.params["Dense_0"]["kernel"]
    print(f"restored step {int(restored.step)} as {type(restored).__name__} (apply_fn and tx from the target); "
          f"params/Dense_0/kernel {kernel.sharding.spec}, key {restored.key.dtype}")
    resumed, resumed_losses = run(step, restored, data[3:])
    same = all(a.dtype == b.dtype and a.tobytes() == b.tobytes() for a, b in zip(leaves(state), leaves(resumed)))
    print("resumed 3 steps: losses " + " ".join(f"{x:.5f}" for x in resumed_losses))
    print(f"state equal to the uninterrupted run's bit for bit: {same}; "
          f"losses: {losses.tobytes() == resumed_losses.tobytes()}")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="jaxckpt-linen-") as work:
        main(work)
