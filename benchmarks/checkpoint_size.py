#!/usr/bin/env python
"""Checkpoint size and save/restore time per codec on a trained Adam state (issue 23).

Trains an MLP with optax adam for ``--steps`` steps (float32 params, two float32 moments),
then saves and restores the train state (params, ``opt_state``, step) with:

* ``raw``: jaxckpt's default (no codec);
* ``zstd``, ``zstd-9``, ``blosc``: lossless on every array leaf;
* ``quantized``: Adam's mu as int8 and nu as int4 (``quantize=``), params exact;
* ``quantized+zstd``: the same, params and everything else zstd;
* orbax's defaults (``StandardSave``: OCDBT, zstd level 1) and orbax without compression;

and the same for a bfloat16 copy of the params (``--bf16``: a state whose weights are
bfloat16). Every lossless restore is checked bit for bit. Also the blocking part of an
async save (``CheckpointManager.save``) with and without a codec. Medians of ``--reps``.

    python benchmarks/checkpoint_size.py --steps 300 --reps 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jaxckpt  # noqa: E402

VARIANTS = {
    "raw": {},
    "zstd": {"compression": "zstd"},
    "zstd-9": {"compression": ("zstd", 9)},
    "blosc": {"compression": "blosc"},
    "quantized": {"quantize": {"opt_state/*/mu/*": "int8", "opt_state/*/nu/*": "int4"}},
    "quantized+zstd": {"quantize": {"opt_state/*/mu/*": "int8", "opt_state/*/nu/*": "int4"},
                       "compression": "zstd"},
}


def train(sizes: list[int], steps: int, dtype) -> dict:
    """An MLP regression trained with adam (lr 1e-3); the state after ``steps``."""
    key = jax.random.key(0)
    params = []
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        k = jax.random.fold_in(key, i)
        params.append({"kernel": (jax.random.normal(k, (n_in, n_out)) / np.sqrt(n_in)).astype(dtype),
                       "bias": jnp.zeros(n_out, dtype)})
    opt = optax.adam(1e-3)
    state = {"params": params, "opt_state": opt.init(params), "step": 0}
    w_true = jax.random.normal(jax.random.key(1), (sizes[0], sizes[-1])) / np.sqrt(sizes[0])

    def loss_fn(p, x, y):
        for layer in p[:-1]:
            x = jax.nn.relu(x @ layer["kernel"].astype(jnp.float32) + layer["bias"].astype(jnp.float32))
        out = x @ p[-1]["kernel"].astype(jnp.float32) + p[-1]["bias"].astype(jnp.float32)
        return jnp.mean((out - y) ** 2)

    @jax.jit
    def step(s, x):
        loss, grads = jax.value_and_grad(loss_fn)(s["params"], x, x @ w_true)
        updates, opt_state = opt.update(grads, s["opt_state"], s["params"])
        return {"params": optax.apply_updates(s["params"], updates), "opt_state": opt_state,
                "step": s["step"] + 1}, loss

    data = jax.random.key(2)
    for i in range(steps):
        state, loss = step(state, jax.random.normal(jax.random.fold_in(data, i), (256, sizes[0])))
    print(f"  trained {steps} steps ({np.dtype(dtype).name} params), loss {float(loss):.4f}", file=sys.stderr)
    return jax.block_until_ready(state)


def dir_bytes(d: str) -> int:
    return sum(os.path.getsize(os.path.join(p, f)) for p, _, fs in os.walk(d) for f in fs)


def same(a, b) -> bool:
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return len(la) == len(lb) and all(np.asarray(x).tobytes() == np.asarray(y).tobytes() for x, y in zip(la, lb))


def measure_jaxckpt(state, root: str, options: dict, reps: int) -> dict:
    saves, restores, size, exact = [], [], 0, None
    for r in range(reps):
        d = os.path.join(root, f"jx{r}")
        t0 = time.perf_counter()
        jaxckpt.save(d, state, **options)
        saves.append(time.perf_counter() - t0)
        size = dir_bytes(d)
        t0 = time.perf_counter()
        back = jaxckpt.restore(d, state)
        jax.block_until_ready(back)
        restores.append(time.perf_counter() - t0)
        exact = same(back, state)
        shutil.rmtree(d)
    return {"bytes": size, "save_s": statistics.median(saves), "restore_s": statistics.median(restores),
            "exact": exact}


def measure_orbax(state, root: str, compression: bool, reps: int) -> dict:
    import orbax.checkpoint as ocp

    saves, restores, size = [], [], 0
    for r in range(reps):
        d = os.path.join(root, f"ob{r}")
        ckptr = ocp.StandardCheckpointer() if compression else ocp.PyTreeCheckpointer(use_compression=False)
        t0 = time.perf_counter()
        if compression:
            ckptr.save(d, state)
            ckptr.wait_until_finished()
        else:
            ckptr.save(d, state)
        saves.append(time.perf_counter() - t0)
        size = dir_bytes(d)
        t0 = time.perf_counter()
        back = ckptr.restore(d, state) if compression else ckptr.restore(d)
        jax.block_until_ready(back)
        restores.append(time.perf_counter() - t0)
        shutil.rmtree(d)
    return {"bytes": size, "save_s": statistics.median(saves), "restore_s": statistics.median(restores),
            "exact": None}


def blocking(state, root: str, options: dict, reps: int) -> float:
    """Median time of ``CheckpointManager.save`` (the blocking part), async, over ``reps`` saves."""
    d = os.path.join(root, "mgr")
    mgr = jaxckpt.CheckpointManager(d, max_to_keep=2, **options)
    times = []
    for step in range(reps + 1):
        t0 = time.perf_counter()
        mgr.save(step, state)
        times.append(time.perf_counter() - t0)
        mgr.wait_until_finished()
    mgr.close()
    shutil.rmtree(d)
    return statistics.median(times[1:])


def table(state, reps: int, root: str, label: str) -> None:
    leaves = jax.tree_util.tree_leaves(state)
    logical = sum(np.asarray(x).nbytes for x in leaves)
    print(f"\n{label}: {len(leaves)} leaves, {logical / 2**20:.1f} MiB\n")
    print("| variant | stored [MiB] | stored / raw | save [s] | restore [s] | bit-exact | async blocking [ms] |")
    print("|---|---:|---:|---:|---:|---|---:|")
    rows = {}
    for name, options in VARIANTS.items():
        rows[name] = measure_jaxckpt(state, root, options, reps)
        rows[name]["blocking_ms"] = 1e3 * blocking(state, root, options, reps)
    rows["orbax default (zstd 1)"] = measure_orbax(state, root, True, reps)
    rows["orbax, no compression"] = measure_orbax(state, root, False, reps)
    raw = rows["raw"]["bytes"]
    for name, r in rows.items():
        exact = "" if r["exact"] is None else ("yes" if r["exact"] else "no (lossy)")
        blk = f"{r['blocking_ms']:.2f}" if "blocking_ms" in r else ""
        print(f"| {name} | {r['bytes'] / 2**20:.2f} | {r['bytes'] / raw:.3f} | {r['save_s']:.3f} | "
              f"{r['restore_s']:.3f} | {exact} | {blk} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--sizes", default="512,2048,2048,512", help="layer widths of the MLP")
    ap.add_argument("--bf16", action="store_true", help="also a state with bfloat16 params")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    root = tempfile.mkdtemp(prefix="jaxckpt-compression-")
    try:
        table(train(sizes, args.steps, jnp.float32), args.reps, root, "float32 params, Adam moments")
        if args.bf16:
            table(train(sizes, args.steps, jnp.bfloat16), args.reps, root, "bfloat16 params, Adam moments")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
