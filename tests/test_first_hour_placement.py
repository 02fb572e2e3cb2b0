"""Issue 20, item 1, as the user met it: their own nnx model and adamw with a schedule on a
4x2 mesh, a manager, a target from `nnx.eval_shape` / `jax.eval_shape` whose optax counts,
step counter and typed key have no sharding. The restored state must go straight into
the next jitted (donating) step on the mesh: no leaf left on device 0."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt


class Model(nnx.Module):
    def __init__(self, rngs):
        init = nnx.initializers.lecun_normal()
        self.lin1 = nnx.Linear(8, 16, kernel_init=nnx.with_partitioning(init, (None, "model")), rngs=rngs)
        self.lin2 = nnx.Linear(16, 4, kernel_init=nnx.with_partitioning(init, ("model", None)), rngs=rngs)

    def __call__(self, x):
        return self.lin2(nnx.relu(self.lin1(x)))


def create():
    model = Model(nnx.Rngs(0))
    schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 3, 20)
    opt = nnx.Optimizer(model, optax.adamw(schedule, weight_decay=1e-4), wrt=nnx.Param)
    return {"model": nnx.state(model), "opt": nnx.state(opt), "rng": jax.random.key(3),
            "step": jnp.zeros((), jnp.int32)}


def mesh_of(shape, auto=False):
    kinds = (AxisType.Auto,) * 2 if auto else (AxisType.Explicit,) * 2
    return jax.make_mesh(shape, ("data", "model"), axis_types=kinds)


@jax.jit
def next_step(state):
    """What the user's train step does to the devices: every leaf in one computation."""
    floats = [x for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.floating)]
    total = sum(jnp.sum(x) for x in floats)
    return total + state["step"] + jax.random.key_data(state["rng"]).sum()


def flat(tree):
    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)}


@pytest.mark.parametrize("resume", [(4, 2), (2, 4), (8, 1)])
@pytest.mark.parametrize("how", ["nnx", "jax-auto"])
def test_a_target_without_shardings_resumes_on_the_mesh(tmp_path, resume, how):
    with jax.set_mesh(mesh_of((4, 2))):
        state = create()
        with jaxckpt.CheckpointManager(tmp_path, save_interval_steps=10) as mgr:
            mgr.save(10, state)
    saved = {k: np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
             for k, x in flat(state).items()}

    mesh = mesh_of(resume, auto=how == "jax-auto")
    with jax.set_mesh(mesh):
        abstract = nnx.eval_shape(create) if how == "nnx" else jax.eval_shape(create)
        unsharded = [k for k, s in flat(abstract).items() if s.sharding is None]
        assert unsharded, "the target has leaves without a sharding, as the user's did"
        with jaxckpt.CheckpointManager(tmp_path, read_only=True) as mgr:
            back = mgr.restore(target=abstract)
        for k, x in flat(back).items():
            assert isinstance(x.sharding, NamedSharding) and x.sharding.mesh.devices.shape == mesh.devices.shape, k
            assert len(x.sharding.device_set) == 8, k  # on the whole mesh, not device 0
            data = jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x
            assert np.asarray(data).tobytes() == saved[k].tobytes(), k
        for k in unsharded:  # the spec it was saved with (issue 31; before: replicated, P())
            assert flat(back)[k].sharding.spec == flat(state)[k].sharding.spec, k
        if how == "jax-auto":  # every leaf unsharded: the params and moments too
            assert flat(back)["['model']['lin1']['kernel'].value"].sharding.spec == P(None, "model")
        next_step(back)  # the next step runs; d7c90e7: "incompatible devices"


def test_without_any_mesh_a_single_process_keeps_the_default_device(tmp_path):
    jaxckpt.save(tmp_path / "c", {"step": jnp.int32(4)})
    back = jaxckpt.restore(tmp_path / "c", {"step": jax.ShapeDtypeStruct((), jnp.int32)})
    assert back["step"].sharding.device_set == {jax.devices()[0]} and int(back["step"]) == 4
