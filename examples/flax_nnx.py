"""Preempt a flax nnx training run and resume it, bit for bit, in a fresh process.

The run: an MLP with batch norm and dropout, AdamW on a warmup + cosine schedule, a
jitted step that donates its state, a 2-axis mesh (data=2 x model=4, 8 CPU devices),
input noise from a typed PRNG key and a data pipeline whose position is saved with
the rest. What one checkpoint holds (see docs/training.md):

    {"model": nnx.State   params, batch statistics, the dropout RNG stream (key + count)
     "opt":   nnx.State   AdamW moments, its counts, the schedule's count, the step
     "rng":   key<fry>    a typed PRNG key (the input noise)
     "data":  {"epoch": int, "index": int}   the pipeline's position
     "step":  int
     "config": {...}}     the hyperparameters, checked on resume

This script trains STEPS steps uninterrupted (the reference), then trains again and
"is preempted" after step SAVE_AT, saving with a CheckpointManager; then a fresh
process restores the latest step and trains to STEPS on the same mesh, and another
fresh process (4 devices: data=4, model=1) does the same on another mesh. It prints
whether every part equals the reference bit for bit, and on the other mesh the largest
differences (sums run in another order there, so values differ by float rounding).

Run: .venv/bin/python examples/flax_nnx.py
A phase alone: examples/flax_nnx.py --phase resume --devices 4 --mesh 4,1 --dir D --out F.npz
"""

import argparse
import os
import subprocess
import sys
import tempfile


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--phase", choices=["all", "resume"], default="all")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--mesh", default="2,4", help="data,model axis sizes")
    p.add_argument("--dir", help="the CheckpointManager's directory")
    p.add_argument("--out", help="where the resumed run writes its results (npz)")
    p.add_argument("--keep", help="work in this directory and keep the checkpoints and every run's results "
                                  "(reference.npz, same.npz, other.npz) there")
    return p.parse_args(argv)


ARGS = _args() if __name__ == "__main__" else None
if ARGS is not None:  # the device count is fixed when jax starts
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={ARGS.devices}"

import jax

if ARGS is not None:
    jax.config.update("jax_num_cpu_devices", ARGS.devices)

import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt

CONFIG = {"seed": 0, "examples": 64, "batch": 16, "features": 16, "hidden": 32, "classes": 4,
          "dropout": 0.2, "peak_lr": 0.01, "warmup": 3, "decay_steps": 20, "weight_decay": 1e-4,
          "noise": 0.1, "optimizer": "adamw"}
SAVE_AT, STEPS = 5, 10
# Max abs difference allowed after resuming on another mesh, where float32 sums run in
# another order (measured: 1.2e-07 for params, moments and losses after 5 steps).
OTHER_MESH_TOL = 1e-5


# --- the data pipeline: a cursor over a shuffled dataset -------------------------------

class Batches:
    """Global batches of a fixed dataset, reshuffled each epoch; its state is two ints.

    The position counts *global* batches, so it stays valid when the data axis changes
    size: every data shard (and every process) cuts its slice from the same global batch.
    """

    def __init__(self, config):
        rng = np.random.default_rng(config["seed"])
        self.x = rng.standard_normal((config["examples"], config["features"]), np.float32)
        teacher = rng.standard_normal((config["features"], config["classes"]), np.float32)
        self.y = np.argmax(self.x @ teacher, axis=1).astype(np.int32)
        self.seed, self.batch = config["seed"], config["batch"]
        self.epoch, self.index = 0, 0

    def get_state(self):
        return {"epoch": self.epoch, "index": self.index}

    def set_state(self, state):
        self.epoch, self.index = state["epoch"], state["index"]

    def __next__(self):
        order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.x))
        ids = order[self.index * self.batch:(self.index + 1) * self.batch]
        self.index += 1
        if self.index * self.batch >= len(self.x):
            self.epoch, self.index = self.epoch + 1, 0
        return ids, self.x[ids], self.y[ids]


# --- the model and its train state ------------------------------------------------------

class Model(nnx.Module):
    def __init__(self, config, rngs):
        init = nnx.initializers.lecun_normal()
        f, h, c = config["features"], config["hidden"], config["classes"]
        # no bias before batch norm: its gradient is ~0 and Adam would amplify rounding noise
        self.lin1 = nnx.Linear(f, h, use_bias=False, kernel_init=nnx.with_partitioning(init, (None, "model")),
                               rngs=rngs)
        self.bn = nnx.BatchNorm(h, scale_metadata={"sharding": ("model",)},
                                bias_metadata={"sharding": ("model",)}, rngs=rngs)
        self.drop = nnx.Dropout(config["dropout"], rngs=rngs)
        self.lin2 = nnx.Linear(h, c, kernel_init=nnx.with_partitioning(init, ("model", None)), rngs=rngs)

    def __call__(self, x):
        return self.lin2(self.drop(nnx.relu(self.bn(self.lin1(x)))))


def make_optimizer(model, config):
    schedule = optax.warmup_cosine_decay_schedule(0.0, config["peak_lr"], config["warmup"],
                                                  config["decay_steps"])
    return nnx.Optimizer(model, optax.adamw(schedule, weight_decay=config["weight_decay"]), wrt=nnx.Param)


def create(config):
    """(graphdefs, train state): the arrays sharded by their annotations on the mesh set
    with ``jax.set_mesh``. Under ``nnx.eval_shape`` it allocates nothing."""
    model = Model(config, nnx.Rngs(params=config["seed"], dropout=config["seed"] + 1))
    model_graph, model_state = nnx.split(model)
    opt_graph, opt_state = nnx.split(make_optimizer(model, config))
    rng = jax.device_put(jax.random.key(config["seed"] + 2), P())  # replicated on the mesh
    return (model_graph, opt_graph), {"model": model_state, "opt": opt_state, "rng": rng}


def checkpoint_tree(state, data, step, config):
    return {**state, "data": data.get_state(), "step": step, "config": config}


def restore_target(config):
    """The restore target: ShapeDtypeStructs with shardings, and Python values whose
    types the restored values must have. Nothing is allocated. Build it, and restore,
    under ``jax.set_mesh(mesh)``.

    nnx's annotations give the Variables their shardings (on the abstract mesh of
    ``jax.set_mesh``); a plain array such as the typed key has none after
    ``eval_shape``, and the restore replicates it on the mesh in context, as ``create``
    does."""
    _, abstract = nnx.eval_shape(lambda: create(config))
    return {**abstract, "data": {"epoch": 0, "index": 0}, "step": 0, "config": config}


def make_train_step(graphdefs, config, shardings, mesh):
    model_graph, opt_graph = graphdefs
    batch_sharding = NamedSharding(mesh, P("data"))

    def step(state, x, y):
        model = nnx.merge(model_graph, state["model"])
        optimizer = nnx.merge(opt_graph, state["opt"])
        rng, noise = jax.random.split(state["rng"])
        x = x + config["noise"] * jax.random.normal(noise, x.shape)

        def loss_fn(model):
            return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return {"model": nnx.state(model), "opt": nnx.state(optimizer), "rng": rng}, loss

    # Fixed output shardings: every step (first, resumed, later) runs one compiled program.
    jitted = jax.jit(step, donate_argnums=0, out_shardings=(shardings, NamedSharding(mesh, P())))

    def train_step(state, x, y):
        return jitted(state, jax.device_put(x, batch_sharding), jax.device_put(y, batch_sharding))

    return train_step


def train(state, train_step, data, start, stop, mgr=None, config=None):
    """Steps ``start + 1 .. stop``; returns the state, losses and the example ids seen."""
    losses, seen = [], []
    for step in range(start + 1, stop + 1):
        ids, x, y = next(data)
        state, loss = train_step(state, x, y)
        losses.append(np.asarray(loss))
        seen.append(ids)
        if mgr is not None:
            mgr.save(step, checkpoint_tree(state, data, step, config), metrics={"loss": float(loss)})
    return state, np.array(losses, np.float32), np.array(seen)


def make_mesh(data, model):
    auto = jax.sharding.AxisType.Auto  # jit propagates shardings through the matmuls
    return jax.make_mesh((data, model), ("data", "model"), axis_types=(auto, auto),
                         devices=jax.devices()[:data * model])


def start_fresh(config, mesh):
    with jax.set_mesh(mesh):
        graphdefs, state = create(config)
    shardings = jax.tree.map(lambda a: a.sharding, state)
    return state, make_train_step(graphdefs, config, shardings, mesh), Batches(config)


def resume(directory, config, mesh):
    """Restore the latest step onto ``mesh``: the state, the pipeline's position."""
    with jax.set_mesh(mesh):
        graphdefs, _ = nnx.eval_shape(lambda: create(config))
        target = restore_target(config)
        with jaxckpt.CheckpointManager(directory, read_only=True) as mgr:
            step = mgr.latest_step()
            restored = mgr.restore(step, target=target)
    if restored["config"] != config:
        raise SystemExit(f"the checkpoint was written with another config: {restored['config']}")
    data = Batches(config)
    data.set_state(restored["data"])
    state = {k: restored[k] for k in ("model", "opt", "rng")}
    shardings = jax.tree.map(lambda a: a.sharding, state)
    return state, make_train_step(graphdefs, config, shardings, mesh), data, restored["step"]


# --- comparing runs ---------------------------------------------------------------------

def flat_numpy(state, data):
    """Every leaf of the train state as numpy (typed keys as their key data), by path."""
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        out["state" + jax.tree_util.keystr(path)] = np.asarray(leaf)
    for k, v in data.get_state().items():
        out[f"data/{k}"] = np.asarray(v)
    return out


def run_resume(args):
    mesh = make_mesh(*map(int, args.mesh.split(",")))
    state, train_step, data, step = resume(args.dir, CONFIG, mesh)
    state, losses, seen = train(state, train_step, data, step, STEPS)
    np.savez(args.out, losses=losses, seen=seen, start=step, **flat_numpy(state, data))


def fresh_processes(directory, work, runs):
    """Resume from ``directory`` in one fresh process per ``(name, devices, mesh)``, all at
    once (they only read); each writes its results to ``work/<name>.npz``."""
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--phase", "resume", "--devices",
                               str(devices), "--mesh", mesh, "--dir", directory,
                               "--out", os.path.join(work, f"{name}.npz")])
             for name, devices, mesh in runs]
    if any([p.wait() != 0 for p in procs]):  # a list: wait for every one
        raise SystemExit("a resumed run failed")
    results = []
    for name, _, _ in runs:
        with np.load(os.path.join(work, f"{name}.npz")) as f:
            results.append(dict(f))
    return results


def part(name):
    """Which part of the train state a flattened path belongs to."""
    for key, label in [("data/", "data position"), ("'rngs'", "RNG streams"), ("'rng'", "RNG streams"),
                       ("'mean'", "batch statistics"), ("'var'", "batch statistics"),
                       ("'mu'", "optimizer moments"), ("'nu'", "optimizer moments"),
                       ("'count'", "counters"), ("'step'", "counters"), ("'model'", "params")]:
        if key in name:
            return label
    raise ValueError(name)


def main(work):
    mesh = make_mesh(2, 4)
    state, train_step, data = start_fresh(CONFIG, mesh)
    state, ref_losses, ref_seen = train(state, train_step, data, 0, STEPS)
    ref = flat_numpy(state, data)
    print(f"reference: {STEPS} steps uninterrupted on {dict(mesh.shape)}, losses "
          + " ".join(f"{x:.4f}" for x in ref_losses))

    np.savez(os.path.join(work, "reference.npz"), losses=ref_losses, seen=ref_seen, **ref)
    directory = os.path.join(work, "ckpts")
    state, train_step, data = start_fresh(CONFIG, mesh)
    with jaxckpt.CheckpointManager(directory, max_to_keep=2) as mgr:
        state, _, _ = train(state, train_step, data, 0, SAVE_AT, mgr, CONFIG)
    print(f"preempted after step {SAVE_AT}; committed steps {mgr.all_steps()}")

    same, other = fresh_processes(directory, work, [("same", 8, "2,4"), ("other", 4, "4,1")])
    parts = {}
    for name, value in ref.items():
        parts.setdefault(part(name), []).append(value.tobytes() == same[name].tobytes()
                                                 and value.dtype == same[name].dtype)
    print(f"fresh process, same mesh: resumed at step {int(same['start'])}, ran to {STEPS}")
    for label, equal in parts.items():
        print(f"  {label}: {len(equal)} leaves bit for bit equal: {all(equal)}")
    print(f"  losses bit for bit equal: {ref_losses[SAVE_AT:].tobytes() == same['losses'].tobytes()}")
    print(f"  data order equal: {np.array_equal(ref_seen[SAVE_AT:], same['seen'])}")

    exact = [k for k in ref if part(k) in ("data position", "counters", "RNG streams")]
    floats = [k for k in ref if k not in exact]
    diff = max(float(np.max(np.abs(ref[k] - other[k]))) for k in floats)
    loss_diff = float(np.max(np.abs(ref_losses[SAVE_AT:] - other["losses"])))
    print(f"fresh process, other mesh {{'data': 4, 'model': 1}}: resumed at step {int(other['start'])}")
    print(f"  data order equal: {np.array_equal(ref_seen[SAVE_AT:], other['seen'])}")
    print(f"  counters, RNG streams, data position equal: {all(np.array_equal(ref[k], other[k]) for k in exact)}")
    print(f"  max abs difference: params and moments {diff:.3g}, losses {loss_diff:.3g} "
          f"(tolerance {OTHER_MESH_TOL:g}): {max(diff, loss_diff) <= OTHER_MESH_TOL}")


if __name__ == "__main__":
    if ARGS.phase == "resume":
        run_resume(ARGS)
    elif ARGS.keep:
        os.makedirs(ARGS.keep, exist_ok=True)
        main(ARGS.keep)
    else:
        with tempfile.TemporaryDirectory(prefix="jaxckpt-nnx-") as work:
            main(work)
