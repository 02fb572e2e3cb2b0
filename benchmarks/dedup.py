"""Deduplicated checkpoints (issue 35, item 5): what ``dedup=True`` saves a fine-tune, and
what it costs a run where every byte changes.

    python benchmarks/dedup.py [--layers 8] [--dim 512] [--steps 8] [--dir /tmp] [--smoke]

Two runs of a small transformer's parameters (an embedding and ``--layers`` blocks of
attention and MLP matrices, float32), each saved every step by a ``CheckpointManager``
(``max_to_keep=2``), with ``dedup=True`` and without, in the same process; orbax's
``CheckpointManager`` and a raw write (one file per leaf, fsync) of the same state as
baselines:

* **LoRA**: the base frozen (the same ``jax.Array`` objects at every step), rank-8
  adapters on the query and value matrices trained by optax's Adam: the base is > 99% of
  the bytes. Per step: the bytes each writes (the step's files; with dedup the step's pool
  entry too), the save's total time (``save`` to commit) and its blocking part.
* **dense**: every parameter trained by Adam (params, mu and nu change at every step):
  the overhead of ``dedup=True`` (hashing, and not hashing once it backs off).

Then the restore of the last step of each run. Medians over the steps after the first
(the first save of a run writes everything).

``--part requests``: what deleting a step costs in requests on an object store (the local
S3 server, moto, recording its requests) as steps accumulate: a directory of N steps
(each referring to step 0's base), a fresh manager (a restart), then ``delete`` of one
step and of another, each with the sweep of the pool that follows it; against
``dedup=False``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxckpt  # noqa: E402


def model(layers: int, dim: int, vocab: int, seed: int = 0) -> dict:
    keys = iter(jax.random.split(jax.random.key(seed), 2 + 6 * layers))
    init = lambda shape: jax.random.normal(next(keys), shape, jnp.float32) * 0.02  # noqa: E731
    blocks = {f"block{i}": {"wq": init((dim, dim)), "wk": init((dim, dim)), "wv": init((dim, dim)),
                            "wo": init((dim, dim)), "w1": init((dim, 4 * dim)), "w2": init((4 * dim, dim)),
                            "ln": jnp.ones((dim,), jnp.float32)} for i in range(layers)}
    return {"embed": init((vocab, dim)), **blocks}


def lora_init(base: dict, rank: int) -> dict:
    out = {}
    for name, block in base.items():
        if name.startswith("block"):
            dim = block["wq"].shape[0]
            k = jax.random.key(hash(name) % (1 << 30))
            out[name] = {m: {"a": jax.random.normal(k, (dim, rank)) * 0.01, "b": jnp.zeros((rank, dim))}
                         for m in ("wq", "wv")}
    return out


def _forward(base: dict, lora: dict | None, tokens: jax.Array) -> jax.Array:
    x = base["embed"][tokens]
    for name in sorted(k for k in base if k.startswith("block")):
        b = base[name]
        q = x @ b["wq"] + (x @ lora[name]["wq"]["a"] @ lora[name]["wq"]["b"] if lora else 0)
        v = x @ b["wv"] + (x @ lora[name]["wv"]["a"] @ lora[name]["wv"]["b"] if lora else 0)
        x = x + jnp.tanh(q * v) @ b["wo"]
        x = x + jax.nn.gelu(x @ b["w1"]) @ b["w2"]
        x = x * b["ln"]
    return x


def lora_step(opt: optax.GradientTransformation):
    @jax.jit
    def step(base, lora, opt_state, x):
        grads = jax.grad(lambda lo: jnp.mean(_forward(base, lo, x) ** 2))(lora)
        updates, opt_state = opt.update(grads, opt_state, lora)
        return optax.apply_updates(lora, updates), opt_state
    return step


def dense_step(opt: optax.GradientTransformation):
    @jax.jit
    def step(params, opt_state, x):
        grads = jax.grad(lambda p: jnp.mean(_forward(p, None, x) ** 2))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state
    return step


def du(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total


def pool_entries(d: str) -> dict[str, int]:
    pool = os.path.join(d, ".jaxckpt-data")
    return {n: du(os.path.join(pool, n)) for n in os.listdir(pool)} if os.path.isdir(pool) else {}


def raw_write(d: str, state: dict) -> float:
    """The floor: every leaf's bytes to a file of its own, fsynced."""
    os.makedirs(d, exist_ok=True)
    t0 = time.perf_counter()
    for i, leaf in enumerate(jax.tree.leaves(state)):
        with open(os.path.join(d, str(i)), "wb") as f:
            f.write(np.asarray(leaf).tobytes())
            f.flush()
            os.fsync(f.fileno())
    return time.perf_counter() - t0


def run_jaxckpt(d: str, states, dedup: bool) -> dict:
    """Save each state of ``states`` (a generator), one step each; per step the bytes written,
    total and blocking seconds."""
    rows = []
    with jaxckpt.CheckpointManager(d, max_to_keep=2, dedup=dedup) as mgr:
        for step, state in enumerate(states):
            before = set(pool_entries(d))
            mgr.save(step, state)
            mgr.wait_until_finished()
            info = mgr.info(step)
            step_dir = os.path.join(d, str(step))
            new = {n: s for n, s in pool_entries(d).items() if n not in before}
            rows.append({"bytes": du(step_dir) + sum(new.values()), "total": info["total_seconds"],
                         "blocking": info["blocking_seconds"]})
        mgr._deleter.wait()
        last = mgr.latest_step()
    cold, warm = [], []
    for _ in range(3):  # cold (the page cache dropped, where this process may), then warm
        dropped = drop_caches()
        t0 = time.perf_counter()
        jax.block_until_ready(jaxckpt.restore(os.path.join(d, str(last))))
        (cold if dropped else warm).append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        jax.block_until_ready(jaxckpt.restore(os.path.join(d, str(last))))
        warm.append(time.perf_counter() - t0)
    return {"rows": rows, "restore": statistics.median(cold or warm), "warm": statistics.median(warm),
            "last": last}


def drop_caches() -> bool:
    """Empty the page cache (``drop_caches``, root only); whether it was."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def run_orbax(d: str, states) -> dict:
    import orbax.checkpoint as ocp

    rows = []
    with ocp.CheckpointManager(os.path.abspath(d), options=ocp.CheckpointManagerOptions(max_to_keep=2)) as mgr:
        for step, state in enumerate(states):
            t0 = time.perf_counter()
            mgr.save(step, args=ocp.args.StandardSave(state))
            blocking = time.perf_counter() - t0
            mgr.wait_until_finished()
            rows.append({"bytes": du(os.path.join(d, str(step))), "total": time.perf_counter() - t0,
                         "blocking": blocking})
    return {"rows": rows}


def med(rows: list[dict], key: str) -> float:
    later = rows[1:] or rows
    return statistics.median(r[key] for r in later)


def lora_states(layers: int, dim: int, vocab: int, steps: int):
    base = model(layers, dim, vocab)
    lora = lora_init(base, 8)
    opt = optax.adam(1e-3)
    opt_state = opt.init(lora)
    step = lora_step(opt)
    x = jax.random.randint(jax.random.key(1), (8,), 0, vocab)
    for _ in range(steps):
        lora, opt_state = step(base, lora, opt_state, x)
        yield {"base": base, "lora": lora, "opt_state": opt_state}


def dense_states(layers: int, dim: int, vocab: int, steps: int):
    params = model(layers, dim, vocab)
    opt = optax.adam(1e-3)
    opt_state = opt.init(params)
    step = dense_step(opt)
    x = jax.random.randint(jax.random.key(1), (8,), 0, vocab)
    for _ in range(steps):
        params, opt_state = step(params, opt_state, x)
        yield {"params": params, "opt_state": opt_state}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--part", choices=("saves", "requests"), default="saves")
    parser.add_argument("--counts", type=int, nargs="+", default=[10, 100, 1000])
    args = parser.parse_args()
    if args.smoke:
        args.layers, args.dim, args.vocab, args.steps = 2, 64, 256, 3
    root = tempfile.mkdtemp(prefix="jaxckpt-dedup-", dir=args.dir)
    try:
        if args.part == "requests":
            requests(args.counts if not args.smoke else [3])
        else:
            report(root, args)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def report(root: str, args: argparse.Namespace) -> None:
    sizes = (args.layers, args.dim, args.vocab, args.steps)
    first = next(lora_states(*sizes[:3], 1))
    state_bytes = sum(np.asarray(x).nbytes for x in jax.tree.leaves(first))
    base_bytes = sum(np.asarray(x).nbytes for x in jax.tree.leaves(first["base"]))
    print(f"LoRA state {state_bytes / 2**20:.1f} MiB, frozen base {100 * base_bytes / state_bytes:.2f}% of it; "
          f"{args.steps} saves a run, max_to_keep=2; medians over saves 2..{args.steps}")
    print("| run | saver | bytes written a step | save total [s] | blocking [s] | restore, cold [s] | warm [s] |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, states in (("LoRA", lora_states), ("dense", dense_states)):
        out = {}
        for saver in ("jaxckpt", "jaxckpt dedup=True"):
            out[saver] = run_jaxckpt(os.path.join(root, f"{name}-{saver}"), states(*sizes), "dedup" in saver)
        out["orbax"] = run_orbax(os.path.join(root, f"{name}-orbax"), states(*sizes))
        state_bytes = sum(np.asarray(x).nbytes for x in jax.tree.leaves(next(states(*sizes[:3], 1))))
        raws = [raw_write(os.path.join(root, f"{name}-raw", str(i)), s) for i, s in enumerate(states(*sizes))]
        for saver, r in out.items():
            rest = f"{r['restore']:.3f} | {r['warm']:.3f}" if "restore" in r else "- | -"
            print(f"| {name} | {saver} | {med(r['rows'], 'bytes') / 2**20:.3f} MiB | {med(r['rows'], 'total'):.3f} | "
                  f"{med(r['rows'], 'blocking'):.4f} | {rest} |")
        print(f"| {name} | raw write (floor) | {state_bytes / 2**20:.3f} MiB | "
              f"{statistics.median(raws[1:] or raws):.3f} | | | |")
        plain, dd = out["jaxckpt"], out["jaxckpt dedup=True"]
        sums = {k: sum(r["total"] for r in v["rows"][1:]) for k, v in out.items()}
        print(f"| {name} | sum of save totals, saves 2..{args.steps}: plain {sums['jaxckpt']:.3f} s, "
              f"dedup {sums['jaxckpt dedup=True']:.3f} s ({sums['jaxckpt dedup=True'] / sums['jaxckpt']:.3f}x), "
              f"orbax {sums['orbax']:.3f} s | | | | |")
        print(f"| {name} | dedup / plain | {med(dd['rows'], 'bytes') / med(plain['rows'], 'bytes'):.4f}x | "
              f"{med(dd['rows'], 'total') / med(plain['rows'], 'total'):.2f}x | "
              f"{med(dd['rows'], 'blocking') / max(med(plain['rows'], 'blocking'), 1e-9):.2f}x | "
              f"{dd['restore'] / plain['restore']:.2f}x | {dd['warm'] / plain['warm']:.2f}x |")


def requests(counts: list[int]) -> None:
    import json
    import subprocess

    from time_to_step import start_moto  # the local S3 server, as that benchmark starts it

    print("| steps kept | dedup | requests: 1st delete after a restart | its GETs | next delete | its GETs |")
    print("|---:|---|---:|---:|---:|---:|")
    for n in counts:
        for dedup in (False, True):
            log = tempfile.mktemp(suffix=".jsonl")
            proc, endpoint = start_moto({"MOTO_ENABLE_RECORDING": "True", "MOTO_RECORDER_FILEPATH": log})
            try:
                spec = {"driver": "s3", "bucket": "steps", "path": "run", "endpoint": endpoint,
                        "aws_region": "us-east-1"}
                base = jnp.asarray(np.ones((256, 256), np.float32))
                with jaxckpt.CheckpointManager(spec, dedup=dedup, async_save=False) as mgr:
                    for s in range(n):
                        mgr.save(s, {"base": base, "head": jnp.full((4,), s, jnp.float32)})
                sent = []
                with jaxckpt.CheckpointManager(spec, dedup=dedup, async_save=False) as mgr:
                    for step in (n - 2, n - 3) if n > 2 else (0,):
                        open(log, "w").close()
                        mgr.delete(step)
                        mgr._deleter.wait()
                        with open(log) as f:
                            sent.append([json.loads(line)["method"] for line in f if line.strip()])
                sent += [sent[-1]] * (2 - len(sent))
                print(f"| {n} | {dedup} | {len(sent[0])} | {sent[0].count('GET')} | {len(sent[1])} | "
                      f"{sent[1].count('GET')} |")
            finally:
                proc.terminate()
                proc.wait(10)
                subprocess.run(["rm", "-f", log], check=False)


if __name__ == "__main__":
    main()
