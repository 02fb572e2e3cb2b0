"""Build notebooks/explore.ipynb from the cells below, execute it, save it with outputs.

Usage: .venv/bin/python tools/build_notebook.py notebooks/explore.ipynb
"""
import sys
import tempfile
import time

import nbformat
from nbclient import NotebookClient

CELLS = []


def md(cid, text):
    CELLS.append(nbformat.v4.new_markdown_cell(text.strip("\n"), id=cid))


def code(cid, text):
    CELLS.append(nbformat.v4.new_code_cell(text.strip("\n"), id=cid))


md("intro", r"""
# A walk through jaxckpt

This notebook trains a small model sharded over 8 devices and checkpoints it with a
`jaxckpt.CheckpointManager`. Then it looks at what was saved the way you would after a
run: the history of the saves, advice on how often to save, a read-only view of one
step, a check of every byte on disk, and a restore onto a different mesh.

It runs on a CPU in well under a minute; the 8 devices are fake CPU devices.
""")

md("setup-md", r"""
## 1. Setup

JAX fixes the number of CPU devices when it starts, so the flag that asks for 8 of them
has to be set before `import jax`. The checkpoints go to a fresh temporary directory.
""")

code("setup", r"""
import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"  # this walk-through runs on the CPU, even where a GPU is present

import shutil
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pandas as pd
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt

%matplotlib inline

ckpt_dir = tempfile.mkdtemp(prefix="jaxckpt-explore-")
print(f"{len(jax.devices())} {jax.devices()[0].platform.upper()} devices; checkpoints go to {ckpt_dir}")
""")

md("model-md", r"""
## 2. Train a small sharded model

A two-layer MLP in plain JAX, with Adam from optax. The mesh has two axes: the batch is
split over `data` (4 ways) and the hidden layer over `model` (2 ways). The parameters
are created inside `jit` with the shardings we ask for; Adam's moments follow them.
""")

code("model", r"""
auto = jax.sharding.AxisType.Auto  # let jit propagate shardings through the matmuls
mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(auto, auto))
param_specs = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "b2": P()}
opt = optax.adam(1e-2)


def init_state(key):
    k1, k2 = jax.random.split(key)
    params = {"w1": jax.random.normal(k1, (32, 256)) / np.sqrt(32), "b1": jnp.zeros(256),
              "w2": jax.random.normal(k2, (256, 8)) / np.sqrt(256), "b2": jnp.zeros(8)}
    params = jax.lax.with_sharding_constraint(
        params, {k: NamedSharding(mesh, spec) for k, spec in param_specs.items()})
    return {"params": params, "opt": opt.init(params), "step": jnp.int32(0)}


state = jax.jit(init_state)(jax.random.key(0))
for name, x in state["params"].items():
    print(f"params/{name}: {x.shape} {x.dtype} sharded {x.sharding.spec} over {dict(mesh.shape)}")
""")

md("train-md", r"""
The training step is jitted and **donates** its input state (`donate_argnums=0`): XLA may
reuse those buffers for the new state, so the old `state` must not be used after the
call. That is safe with the manager: `mgr.save` returns once it has copied the state
into host memory, and writes the files on a background thread while training goes on.

The loss goes into `metrics` as a JAX scalar, not `float(loss)`: the manager reads its
value on the background thread, so the loop never waits for the device.
`best_metric="loss"` lets the manager rank steps (`mgr.best_step()`), and
`max_to_keep=3` deletes older steps once newer ones are committed.
""")

code("train", r"""
def loss_fn(params, x, y):
    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] + params["b2"] - y) ** 2)


@jax.jit(donate_argnums=0)
def train_step(state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(state["params"], x, y)
    updates, opt_state = opt.update(grads, state["opt"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    return {"params": params, "opt": opt_state, "step": state["step"] + 1}, loss


rng = np.random.default_rng(0)
w_true = rng.standard_normal((32, 8)).astype(np.float32)
batch_sharding = NamedSharding(mesh, P("data"))

mgr = jaxckpt.CheckpointManager(ckpt_dir, max_to_keep=3, best_metric="loss")
for step in range(1, 61):
    x = rng.standard_normal((64, 32)).astype(np.float32)
    x, y = jax.device_put((x, np.tanh(x @ w_true)), batch_sharding)
    state, loss = train_step(state, x, y)
    if step % 5 == 0:
        mgr.save(step, state, metrics={"loss": loss})  # returns after a host snapshot
mgr.wait_until_finished()  # only so that the cells below see every commit

print(f"trained {int(state['step'])} steps, final loss {float(loss):.4f}")
print(f"committed steps on disk: {mgr.all_steps()}, best by loss: {mgr.best_step()}")
""")

md("view-md", r"""
## 3. The run so far

In a notebook the manager renders as a table: one row per step still on disk, with its
size, how long `save` blocked the training loop, how long the step took to commit, and
its metrics.
""")

code("mgr-html", r"""
mgr
""")

md("history-md", r"""
`mgr.history()` also remembers the steps that retention has deleted since
(`exists=False`). It reads the run's log, `history.jsonl`, which the manager appends
to after every commit. `.to_pandas()` gives one row per step and one column per metric
(a few of its columns here).
""")

code("history", r"""
hist = mgr.history()
print(hist)
hist.to_pandas()[["step", "exists", "metric/loss", "bytes", "blocking_seconds", "total_seconds"]]
""")

md("plot-md", r"""
`jaxckpt.plot_history` draws the metrics over steps (top) and the cost of each save
(bottom): *blocking* is what the training loop paid, *total* is the time from `save`
until the step was committed on disk.
""")

code("plot", r"""
jaxckpt.plot_history(mgr)
""")

md("advice-md", r"""
### How often to save?

`advise_interval` takes the job's mean time between failures (here: one failure every 4
hours) and this run's measured save cost, and returns the Young–Daly interval
`sqrt(2 × save cost × MTBF)`: the one that balances the time spent saving against the
work redone after a crash. Saves in this toy run cost a few milliseconds, so the
advice is to save far less often than every 5 steps.
""")

code("advice", r"""
advice = mgr.advise_interval(mtbf_s=4 * 3600)
print(f"save every {advice.interval_steps} steps (~{advice.interval_s:.0f} s) instead of every "
      f"{advice.current_interval_steps}: expected time lost {advice.lost_fraction_advised:.2%} "
      f"instead of {advice.lost_fraction_now:.2%}")
""")

md("policy-md", r"""
### Let the manager choose: `save_policy`

`save_policy=jaxckpt.policies.goodput()` acts on that advice: it saves at the Young–Daly
interval from the run's own measured costs, re-evaluated as they change, with the mean
time between failures learned from the run's restarts (one day until there are some).
Combined with `on_preemption()`, a SIGTERM still saves at the step the job agrees on.
Call `save` every step; the view shows the policy and its next save. In a simulation over
failure traces with the save costs measured on a 2-core machine
(`benchmarks/goodput_sim.py`, docs/training.md), `goodput` loses less time than every fixed
choice at every MTBF:

![time lost by policy and MTBF](../docs/images/goodput_sim.png)
""")

code("policy", r"""
import time

from jaxckpt import policies

policy_dir = tempfile.mkdtemp(prefix="jaxckpt-policy-")
policy = policies.any_of(policies.goodput(mtbf_s=60), policies.on_preemption())  # a failure a minute
with jaxckpt.CheckpointManager(policy_dir, save_policy=policy) as pm:
    saved = []
    for step in range(300):
        time.sleep(0.01)  # the training step
        if pm.save(step, {"w": np.full(1_000_000, step, np.float32)}):
            saved.append(step)
    pm.wait_until_finished()
    print(f"saved {len(saved)} of 300 steps: {saved}")
    display(pm)
shutil.rmtree(policy_dir)
""")

md("open-md", r"""
## 4. Open a step read-only

`jaxckpt.open` reads only the manifest: no model code, no restore, no device memory.
The view renders as a tree of the saved state; click a subtree to fold it.
""")

code("open", r"""
latest = os.path.join(ckpt_dir, str(mgr.latest_step()))
view = jaxckpt.open(latest)
view
""")

code("summary", r"""
view.summary()
""")

md("slice-md", r"""
A leaf of the view is a `LazyArray`. Nothing is read until you index it, and then only
the chunks that the slice touches:
""")

code("slice", r"""
lazy_w1 = view["params/w1"]
print(lazy_w1, "saved as", lazy_w1.sharding.spec, "on", lazy_w1.sharding.mesh_shape)
lazy_w1[:2, :4]
""")

md("stats-md", r"""
`stats` streams every chunk under a prefix and reduces it in float64: a quick way to
look for NaNs or exploding weights without restoring anything.
""")

code("stats", r"""
stats = view.stats("params")
pd.DataFrame([s.to_json() for s in stats.values()]).set_index("path").drop(columns=["kind", "numeric"])
""")

md("verify-md", r"""
`jaxckpt.verify` reads every chunk, checks its crc32c, and checks that the files on disk
are exactly the ones the manifest names.
""")

code("verify", r"""
report = jaxckpt.verify(latest)
print(f"verify ok: {report.ok} ({report.leaves} leaves, {report.chunks} chunks, "
      f"{report.bytes_read:,} bytes checked, {len(report.problems)} problems)")
""")

md("restore-md", r"""
## 5. Restore onto another mesh

The shardings a checkpoint was saved with are a record, not a constraint. Here the
target is a mesh of 4 devices with a `model` axis of size 1: the weights are split by
rows over `data` and nothing is split over `model`. The target is a tree of
`jax.ShapeDtypeStruct`s carrying the new `NamedSharding`s, and each device reads only
its own slice.
""")

code("restore", r"""
mesh4 = jax.make_mesh((4, 1), ("data", "model"), axis_types=(auto, auto), devices=jax.devices()[:4])


def on_mesh4(x):
    spec = P("data", None) if x.ndim == 2 else P()
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh4, spec))


target = jax.tree.map(on_mesh4, state)
restored = mgr.restore(target=target)  # the latest committed step

before, after = state["params"]["w1"], restored["params"]["w1"]
print(f"params/w1 trained: {before.sharding.spec} over {dict(before.sharding.mesh.shape)}")
print(f"params/w1 restored: {after.sharding.spec} over {dict(after.sharding.mesh.shape)}, "
      f"{len(after.sharding.device_set)} devices")

same = jax.tree.all(jax.tree.map(
    lambda a, b: a.dtype == b.dtype and np.asarray(a).tobytes() == np.asarray(b).tobytes(), state, restored))
print("restored state equals the trained state bit for bit:", same)
""")

md("cli-md", r"""
## 6. The same from a shell

The `jaxckpt` command does all of this without Python code: `jaxckpt ls DIR` lists the
steps (and gives the cadence advice with `--mtbf`), `jaxckpt show STEP` prints the tree,
`jaxckpt stats STEP [KEYS]` the statistics, `jaxckpt verify STEP` checks every chunk.
`jaxckpt diff A B` compares two steps, and `jaxckpt rm` and `jaxckpt gc` clean up.
The cell runs it as `python -m jaxckpt`, inside the checkpoint directory, so that it
uses this kernel's environment.
""")

code("cli", r"""
def cli(*args):
    out = subprocess.run([sys.executable, "-m", "jaxckpt", *args], cwd=ckpt_dir, capture_output=True, text=True)
    print(f"$ jaxckpt {' '.join(args)}\n{out.stdout}{out.stderr}")


step = str(mgr.latest_step())
cli("ls", ".", "--mtbf", "14400")
cli("show", step)
cli("stats", step, "params")
cli("verify", step)
""")

md("close-md", r"""
Close the manager when you are done: it finishes pending saves and gives up the
directory's writer lease. (`with jaxckpt.CheckpointManager(...) as mgr:` does this for
you.) Then remove the temporary directory.
""")

code("close", r"""
mgr.close()
shutil.rmtree(ckpt_dir)
""")

nb = nbformat.v4.new_notebook(cells=CELLS)
nb.metadata = {
    "kernelspec": {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"},
    "language_info": {"name": "python"},
}
out = sys.argv[1]
t0 = time.perf_counter()
with tempfile.TemporaryDirectory() as cwd:
    NotebookClient(nb, timeout=300, kernel_name="python3", record_timing=False,
                   resources={"metadata": {"path": cwd}}).execute()
print(f"executed in {time.perf_counter() - t0:.1f} s")
nbformat.validate(nb)
nbformat.write(nb, out)
