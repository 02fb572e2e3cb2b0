"""Save grain's iterator state with the train state, and resume the data exactly.

A grain pipeline (shuffle, map, batch, repeat, read with prefetch threads) feeds a
data-parallel MLP on 4 CPU devices. Every checkpoint holds ``iterator.get_state()``
(a dict of Python ints: inline in the manifest) next to the params and optimizer
state. After a "preemption" at step 4 a fresh process restores the latest step, hands
the data position back with ``iterator.set_state``, and trains on: on the same mesh
it sees the same batches and ends with the same state bit for bit; on a data axis of
another size (2 devices) it still sees the same global batches in the same order,
because the pipeline yields global batches and each device takes its slice.

Run: .venv/bin/python examples/grain_pipeline.py
"""

import argparse
import os
import subprocess
import sys
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax

jax.config.update("jax_num_cpu_devices", 4)

import grain
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt

SAVE_AT, STEPS, BATCH = 4, 8, 16
TOL = 1e-5  # max abs difference on another data axis size: float32 sums in another order
OPT = optax.adam(optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 20))


def dataset(seed=0, n=48):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 8), np.float32)
    y = (x @ rng.standard_normal((8, 2), np.float32)).astype(np.float32)
    return (grain.MapDataset.range(n)
            .shuffle(seed=seed)
            .map(lambda i: {"id": np.int32(i), "x": x[i], "y": y[i]})
            .repeat(None)  # endless: epoch after epoch
            .batch(BATCH)
            .to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=2)))


def init(key):
    k1, k2 = jax.random.split(key)
    params = {"w1": jax.random.normal(k1, (8, 32)) / np.sqrt(8), "b1": jnp.zeros(32),
              "w2": jax.random.normal(k2, (32, 2)) / np.sqrt(32)}
    return {"params": params, "opt": OPT.init(params)}


def loss_fn(params, x, y):
    return jnp.mean((jax.nn.relu(x @ params["w1"] + params["b1"]) @ params["w2"] - y) ** 2)


@jax.jit
def _step(state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(state["params"], x, y)
    updates, opt = OPT.update(grads, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss


def train(state, iterator, mesh, start, stop, mgr=None):
    """Steps ``start + 1 .. stop``: the losses and the example ids of every batch."""
    batch = NamedSharding(mesh, P("data"))
    losses, ids = [], []
    for step in range(start + 1, stop + 1):
        b = next(iterator)
        state, loss = _step(state, jax.device_put(b["x"], batch), jax.device_put(b["y"], batch))
        losses.append(np.asarray(loss))
        ids.append(b["id"])
        if mgr is not None:
            mgr.save(step, {**state, "data": iterator.get_state(), "step": step})
    return state, np.array(losses), np.array(ids)


def mesh_of(n):
    return jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:n])


def resume(directory, mesh):
    """The latest step restored onto ``mesh``, and a fresh iterator set to its position."""
    iterator = iter(dataset())
    abstract = jax.eval_shape(init, jax.random.key(0))  # no shardings: replicated on the mesh in context
    target = {**abstract, "data": iterator.get_state(), "step": 0}  # a fresh iterator's state: the types to expect
    with jax.set_mesh(mesh), jaxckpt.CheckpointManager(directory, read_only=True) as mgr:
        restored = mgr.restore(target=target)
    iterator.set_state(restored.pop("data"))
    return restored, iterator, restored.pop("step")


def as_numpy(state):
    return np.concatenate([np.ravel(x) for x in jax.tree.leaves(state)])


def fresh_process(directory, out):
    """Resume from ``directory`` on 4 and on 2 devices; write what each run saw to ``out``."""
    results = {}
    for n in (4, 2):
        state, iterator, step = resume(directory, mesh_of(n))
        state, losses, ids = train(state, iterator, mesh_of(n), step, STEPS)
        results.update({f"start{n}": step, f"losses{n}": losses, f"ids{n}": ids, f"state{n}": as_numpy(state),
                        f"position{n}": iterator.get_state()["next_index"]})
    np.savez(out, **results)


def main(work):
    mesh = mesh_of(4)
    state = jax.device_put(init(jax.random.key(0)), NamedSharding(mesh, P()))
    iterator = iter(dataset())
    state, ref_losses, ref_ids = train(state, iterator, mesh, 0, STEPS)
    reference, ref_position = as_numpy(state), iterator.get_state()
    print(f"reference: {STEPS} steps, {STEPS * BATCH} examples ({STEPS * BATCH / 48:.2f} epochs), "
          f"iterator state at the end {ref_position}")

    directory = os.path.join(work, "ckpts")
    state = jax.device_put(init(jax.random.key(0)), NamedSharding(mesh, P()))
    iterator = iter(dataset())
    with jaxckpt.CheckpointManager(directory, max_to_keep=2) as mgr:
        train(state, iterator, mesh, 0, SAVE_AT, mgr)
    saved = jaxckpt.restore(os.path.join(directory, str(SAVE_AT)), {"data": iterator.get_state()}, partial=True)
    print(f"preempted after step {SAVE_AT}; the checkpoint holds the iterator state {saved['data']}")

    out = os.path.join(work, "resumed.npz")
    subprocess.run([sys.executable, os.path.abspath(__file__), "--resume", directory, "--out", out], check=True)
    with np.load(out) as r:
        for n in (4, 2):
            same_ids = np.array_equal(r[f"ids{n}"], ref_ids[SAVE_AT:])
            print(f"fresh process, data axis {n}: resumed at step {int(r[f'start{n}'])}, same batches in the "
                  f"same order: {same_ids}, iterator state at the end {{'next_index': {int(r[f'position{n}'])}}}")
            if n == 4:
                exact = (r["state4"].tobytes() == reference.tobytes()
                         and r["losses4"].tobytes() == ref_losses[SAVE_AT:].tobytes())
                print(f"  state and losses equal to the uninterrupted run's bit for bit: {exact}")
            else:
                diff = max(float(np.max(np.abs(r["state2"] - reference))),
                           float(np.max(np.abs(r["losses2"] - ref_losses[SAVE_AT:]))))
                print(f"  max abs difference of state and losses: {diff:.3g} (sums over 2 shards, not 4; "
                      f"tolerance {TOL:g}): {diff <= TOL}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--resume", help="resume from this manager directory (the fresh process)")
    p.add_argument("--out")
    args = p.parse_args()
    if args.resume:
        fresh_process(args.resume, args.out)
    else:
        with tempfile.TemporaryDirectory(prefix="jaxckpt-grain-") as work:
            main(work)
