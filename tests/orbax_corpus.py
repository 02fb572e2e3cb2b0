"""The states orbax users bring (issue 31 item 2): the optax zoo, a linen TrainState with a
dropout key, an nnx model and optimizer, an equinox model with its optimizer state. Each is
built fresh (step 0, never through jit, its params sharded on a 4-device mesh) and trained
(two jitted steps), small (KBs). Used by tests/test_orbax_corpus.py and
tests/fixtures/make_orbax_0_12_8.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

STEPS = 2  # jitted steps of a trained state
IN, HIDDEN, OUT = 8, 16, 4


def mesh4():
    return Mesh(np.array(jax.devices()[:4]), ("x",))


def mesh22():
    return Mesh(np.array(jax.devices()[4:8]).reshape(2, 2), ("a", "b"))


def _spec(path, x):
    """Params shard their widest dimension of 16 over x; the rest is replicated."""
    if x.ndim == 2:
        return P(None, "x") if x.shape[1] == HIDDEN else P("x", None)
    return P("x") if x.shape == (HIDDEN,) else P()


def shard_params(params, mesh):
    return jax.tree_util.tree_map_with_path(
        lambda p, x: jax.device_put(x, NamedSharding(mesh, _spec(p, x))), params)


def _batch(seed):
    rng = np.random.default_rng(100 + seed)
    return (jnp.asarray(rng.standard_normal((4, IN)), jnp.float32),
            jnp.asarray(rng.standard_normal((4, OUT)), jnp.float32))


def _mlp_params(seed=0):
    """A two-layer MLP's params, the output kernel in bfloat16 (mixed precision)."""
    rng = np.random.default_rng(seed)
    return {"dense": {"kernel": jnp.asarray(rng.standard_normal((IN, HIDDEN)) * 0.3, jnp.float32),
                      "bias": jnp.asarray(rng.standard_normal(HIDDEN) * 0.1, jnp.float32)},
            "out": {"kernel": jnp.asarray(rng.standard_normal((HIDDEN, OUT)) * 0.3, jnp.bfloat16),
                    "bias": jnp.zeros(OUT, jnp.float32)}}


def _mlp(params, x):
    h = jnp.tanh(x @ params["dense"]["kernel"] + params["dense"]["bias"])
    return h @ params["out"]["kernel"] + params["out"]["bias"]


def _loss(params, batch):
    x, y = batch
    return jnp.mean((_mlp(params, x) - y) ** 2)


# --- the optax zoo: {params, opt_state, step} ------------------------------------------------


def _labels(params):
    return {"dense": {"kernel": "train", "bias": "train"}, "out": {"kernel": "frozen", "bias": "train"}}


OPTIMIZERS = {
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=1e-2),
    "sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9),
    "lion": lambda: optax.lion(1e-3),
    "adafactor": lambda: optax.adafactor(1e-2),
    "lamb": lambda: optax.lamb(1e-2),
    "chain_clip_adamw": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)),
    "multi_transform": lambda: optax.multi_transform(
        {"train": optax.adam(1e-2), "frozen": optax.set_to_zero()}, _labels),
    "inject_schedule": lambda: optax.inject_hyperparams(optax.adamw)(
        learning_rate=optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10), weight_decay=1e-3),
    "multi_steps": lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2),
}


def _optax_state(name, trained):
    mesh = mesh4()
    tx = OPTIMIZERS[name]()
    params = shard_params(_mlp_params(), mesh)
    state = {"params": params, "opt_state": tx.init(params), "step": 0}
    if not trained:
        return state

    @jax.jit
    def train_step(state, batch):
        grads = jax.grad(_loss)(state["params"], batch)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state,
                "step": state["step"] + 1}

    for i in range(STEPS):
        state = train_step(state, _batch(i))
    return state


# --- flax linen TrainState with a dropout key -----------------------------------------------


def _linen_state(trained):
    import flax.linen as nn
    from flax.training import train_state

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x, train):
            x = nn.tanh(nn.Dense(HIDDEN)(x))
            x = nn.Dropout(0.5, deterministic=not train)(x)
            return nn.Dense(OUT)(x)

    class TrainState(train_state.TrainState):
        dropout_key: jax.Array

    mesh = mesh4()
    model = MLP()
    params = model.init(jax.random.key(0), jnp.zeros((1, IN)), train=False)["params"]
    params = shard_params(params, mesh)
    key = jax.device_put(jax.random.key(1), NamedSharding(mesh, P()))
    state = TrainState.create(apply_fn=model.apply, params=params,
                              tx=optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)),
                              dropout_key=key)
    if not trained:
        return state

    @jax.jit
    def train_step(state, batch):
        x, y = batch
        key = jax.random.fold_in(state.dropout_key, state.step)

        def loss(params):
            out = state.apply_fn({"params": params}, x, train=True, rngs={"dropout": key})
            return jnp.mean((out - y) ** 2)

        return state.apply_gradients(grads=jax.grad(loss)(state.params))

    for i in range(STEPS):
        state = train_step(state, _batch(i))
    return state


# --- flax nnx: the model's and the optimizer's state -----------------------------------------


def _nnx_model_and_optimizer():
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.dense = nnx.Linear(IN, HIDDEN, rngs=rngs)
            self.dropout = nnx.Dropout(0.5, rngs=rngs)
            self.out = nnx.Linear(HIDDEN, OUT, rngs=rngs)

        def __call__(self, x):
            return self.out(self.dropout(jnp.tanh(self.dense(x))))

    mesh = mesh4()
    model = MLP(nnx.Rngs(params=0, dropout=1))
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, _spec(None, x))), params))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    return model, optimizer


def _nnx_state(trained):
    from flax import nnx

    model, optimizer = _nnx_model_and_optimizer()
    if trained:
        @nnx.jit
        def train_step(model, optimizer, batch):
            x, y = batch
            grads = nnx.grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
            optimizer.update(model, grads)

        for i in range(STEPS):
            train_step(model, optimizer, _batch(i))
    return {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}


# --- equinox: the model's arrays (eqx.filter) and its optax state ----------------------------


def _eqx_state(trained):
    import equinox as eqx

    mesh = mesh4()
    model = eqx.nn.MLP(IN, OUT, HIDDEN, depth=1, activation=jnp.tanh, key=jax.random.key(2))
    arrays, static = eqx.partition(model, eqx.is_array)
    arrays = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, _spec(None, x))), arrays)
    model = eqx.combine(arrays, static)
    tx = optax.adam(1e-2)
    state = {"model": eqx.filter(model, eqx.is_array), "opt_state": tx.init(eqx.filter(model, eqx.is_array)),
             "step": 0}
    if not trained:
        return state

    @eqx.filter_jit
    def train_step(model, opt_state, batch):
        x, y = batch
        grads = eqx.filter_grad(lambda m: jnp.mean((jax.vmap(m)(x) - y) ** 2))(model)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state

    opt_state = state["opt_state"]
    for i in range(STEPS):
        model, opt_state = train_step(model, opt_state, _batch(i))
    return {"model": eqx.filter(model, eqx.is_array), "opt_state": opt_state, "step": STEPS}


BUILDERS = {**{name: functools.partial(_optax_state, name) for name in OPTIMIZERS},
            "linen_train_state": _linen_state, "nnx": _nnx_state, "equinox": _eqx_state}
STATES = list(BUILDERS)


@functools.lru_cache(maxsize=None)
def state(name, trained):
    """The state ``name``, fresh (``trained=False``) or after ``STEPS`` jitted steps; built once
    per process (the tests never change it)."""
    return BUILDERS[name](trained)


# --- targets --------------------------------------------------------------------------------


def abstract(tree):
    """The target a user restores onto the saved shardings: each jax array's shape, dtype and
    sharding; every other leaf as it is."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                        if isinstance(x, jax.Array) else x, tree)


def on_mesh22(tree):
    """The same target on another mesh (2x2, axes a, b): 2-D leaves P('a', 'b') where both
    dimensions divide, 1-D P('a') where it divides, everything else replicated."""
    m = mesh22()

    def one(x):
        if not isinstance(x, jax.Array):
            return x
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) or x.ndim == 0:
            spec = P()
        elif x.ndim == 2 and x.shape[0] % 2 == 0 and x.shape[1] % 2 == 0:
            spec = P("a", "b")
        elif x.ndim >= 1 and x.shape[0] % 2 == 0:
            spec = P("a")
        else:
            spec = P()
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(m, spec))

    return jax.tree.map(one, tree)
