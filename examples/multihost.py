"""A 2-process JAX job on this machine (jax.distributed, gloo CPU collectives): train,
checkpoint with a CheckpointManager from both processes, restore and resume.

Run as a script it launches its own two processes (2 CPU devices each, 4 in all, a
data=2 x model=2 mesh whose data axis spans the processes) on 127.0.0.1 and a free
port. Each process feeds only its own rows of every global batch (the data position is
one global cursor, the same in every process) and writes only its own shards. After
step 3 both go on to step 6 (the reference), then restore step 3 together and train to
step 6 again: every shard and loss must equal the reference bit for bit. Finally this
launcher, one process with 4 devices and no jax.distributed, restores the same step
onto the same mesh shape and resumes it too (its sums run without gloo: compared with a
tolerance).

Run: .venv/bin/python examples/multihost.py
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time


def _args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--process-id", type=int, help="run as this process of the job (else: launch the job)")
    p.add_argument("--port", type=int)
    p.add_argument("--dir", help="the CheckpointManager's directory (shared by the processes)")
    return p.parse_args()


ARGS = _args() if __name__ == "__main__" else None
WORKER = ARGS is not None and ARGS.process_id is not None
NPROC, LOCAL_DEVICES = 2, 2
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={LOCAL_DEVICES if WORKER else 4}"

import jax

if WORKER:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{ARGS.port}", num_processes=NPROC, process_id=ARGS.process_id,
                               initialization_timeout=60)

import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt

SAVE_AT, STEPS, BATCH, TOL = 3, 6, 16, 1e-5
OPT = optax.adamw(1e-2)


def global_batch(position):
    """The global batch at a position of the (global) data cursor: every process can
    compute any of it; it reads only its own rows."""
    rng = np.random.default_rng([0, position])
    x = rng.standard_normal((BATCH, 8), np.float32)
    return x, np.tanh(x[:, :2] * 2).astype(np.float32)


def local_rows(sharding, shape):
    """The rows of a batch-sharded array this process's devices hold."""
    idx = sharding.addressable_devices_indices_map(shape).values()
    return slice(min(i[0].start or 0 for i in idx), max(i[0].stop or shape[0] for i in idx))


def make_mesh(devices):
    auto = jax.sharding.AxisType.Auto
    return jax.make_mesh((2, 2), ("data", "model"), axis_types=(auto, auto), devices=devices)


def shardings(mesh):
    """The train state's shardings: the optimizer's moments like their params, its
    counts replicated."""
    spec = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None)}
    params = {k: NamedSharding(mesh, s) for k, s in spec.items()}

    def like_params(path, _):
        name = getattr(path[-1], "key", None)
        return params[name] if name in params else NamedSharding(mesh, P())

    opt = jax.tree_util.tree_map_with_path(like_params, jax.eval_shape(OPT.init, abstract_params(params)))
    return {"params": params, "opt": opt}


def abstract_params(shardings):
    shapes = {"w1": (8, 32), "b1": (32,), "w2": (32, 2)}
    return {k: jax.ShapeDtypeStruct(s, jnp.float32, sharding=shardings[k]) for k, s in shapes.items()}


def init(mesh):
    def make():
        k1, k2 = jax.random.split(jax.random.key(0))
        params = {"w1": jax.random.normal(k1, (8, 32)) / np.sqrt(8), "b1": jnp.zeros(32),
                  "w2": jax.random.normal(k2, (32, 2)) / np.sqrt(32)}
        return {"params": params, "opt": OPT.init(params)}
    return jax.jit(make, out_shardings=shardings(mesh))()


def make_step(mesh):
    def step(state, x, y):
        def loss_fn(p):
            return jnp.mean((jax.nn.relu(x @ p["w1"] + p["b1"]) @ p["w2"] - y) ** 2)
        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt = OPT.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss

    jitted = jax.jit(step, donate_argnums=0, out_shardings=(shardings(mesh), NamedSharding(mesh, P())))
    batch = NamedSharding(mesh, P("data"))

    def train_step(state, position):
        x, y = global_batch(position)
        rows = local_rows(batch, x.shape)
        xs = jax.make_array_from_process_local_data(batch, x[rows], x.shape)
        ys = jax.make_array_from_process_local_data(batch, y[rows], y.shape)
        return jitted(state, xs, ys)

    return train_step


def train(state, step_fn, start, stop, mgr=None):
    losses = []
    for step in range(start + 1, stop + 1):
        state, loss = step_fn(state, step - 1)  # the batch at cursor position step - 1
        losses.append(float(loss))
        if mgr is not None:
            mgr.save(step, {**state, "data": {"position": step}, "step": step})
    return state, losses


def target(mesh):
    sh = shardings(mesh)
    abstract = jax.eval_shape(lambda: {"params": abstract_params(sh["params"]), "opt": OPT.init(abstract_params(sh["params"]))})
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, sh)
    return {**abstract, "data": {"position": 0}, "step": 0}


def local_shards(state):
    """This process's shards, by leaf path and index: what it holds."""
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        for shard in leaf.addressable_shards:
            out[f"{jax.tree_util.keystr(path)}{shard.index}@{shard.device.id}"] = np.asarray(shard.data)
    return out


def worker(args):
    mesh = make_mesh(jax.devices())
    step_fn = make_step(mesh)
    with jaxckpt.CheckpointManager(args.dir, max_to_keep=2) as mgr:  # every process, same calls
        state, _ = train(init(mesh), step_fn, 0, SAVE_AT, mgr)
        state, ref_losses = train(state, step_fn, SAVE_AT, STEPS)
        reference = local_shards(state)
        mgr.wait_until_finished()  # saves are async: restore reads committed steps only
        restored = mgr.restore(SAVE_AT, target=target(mesh))
        steps = mgr.all_steps()
    resumed, losses = train({"params": restored["params"], "opt": restored["opt"]}, step_fn,
                            restored["data"]["position"], STEPS)
    mine = local_shards(resumed)
    same = mine.keys() == reference.keys() and all(mine[k].tobytes() == reference[k].tobytes() for k in mine)
    print("RESULT " + json.dumps({"process": jax.process_index(), "devices": [d.id for d in jax.local_devices()],
                                  "steps": steps, "losses": ref_losses, "resumed_losses": losses,
                                  "shards_equal": same, "shards": len(mine)}), flush=True)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(directory, timeout=180):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    port = free_port()
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--process-id", str(i), "--port", str(port),
                               "--dir", directory], stdout=subprocess.PIPE, text=True, env=env)
             for i in range(NPROC)]
    deadline, results = time.monotonic() + timeout, []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=max(1, deadline - time.monotonic()))
            if p.returncode != 0:
                raise SystemExit(f"process exited with {p.returncode}")
            results.append(json.loads([ln for ln in out.splitlines() if ln.startswith("RESULT ")][-1][7:]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return results


def main(work):
    directory = os.path.join(work, "ckpts")
    results = launch(directory)
    for r in results:
        print(f"process {r['process']} (devices {r['devices']}): committed steps {r['steps']}, "
              f"resumed at step {SAVE_AT}: its {r['shards']} shards equal the reference's bit for bit: "
              f"{r['shards_equal']}, losses: {r['resumed_losses'] == r['losses']}")
    reference = results[0]["losses"]
    print(f"both processes saw the same losses: {all(r['losses'] == reference for r in results)}; "
          "losses " + " ".join(f"{x:.6f}" for x in reference))

    mesh = make_mesh(jax.devices())
    with jaxckpt.CheckpointManager(directory, read_only=True) as mgr:
        restored = mgr.restore(SAVE_AT, target=target(mesh))
    _, losses = train({"params": restored["params"], "opt": restored["opt"]}, make_step(mesh),
                      restored["data"]["position"], STEPS)
    diff = float(np.max(np.abs(np.array(losses) - np.array(reference))))
    print(f"one process, 4 devices: restored step {restored['step']} (written by {NPROC} processes), resumed: "
          f"max abs loss difference {diff:.3g} (tolerance {TOL:g}): {diff <= TOL}")


if __name__ == "__main__":
    if WORKER:
        worker(ARGS)
    else:
        with tempfile.TemporaryDirectory(prefix="jaxckpt-multihost-") as work:
            main(work)
