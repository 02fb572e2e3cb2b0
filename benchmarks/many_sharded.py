"""Many small sharded leaves (issue 14 item 3): 500 kernels sharded over 4 CPU devices
plus 500 replicated biases (1,000 leaves, 1-8 KiB per shard), saved and restored by
jaxckpt and by orbax-checkpoint (its CheckpointManager defaults) in the same process,
repetitions interleaved, medians printed with the ratio.

    python benchmarks/many_sharded.py [--reps 5] [--leaves 1000]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt


def state(leaves: int) -> dict:
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
    rng = np.random.default_rng(0)
    tree = {}
    for i in range(leaves // 2):
        kernel = rng.standard_normal((64, 16 * (1 + i % 8))).astype(np.float32)
        tree[f"layer{i}"] = {"kernel": jax.device_put(kernel, NamedSharding(mesh, P("x"))),
                             "bias": jax.device_put(np.full(16, i, np.float32), NamedSharding(mesh, P()))}
    return tree


def timed(fn) -> float:
    t = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--leaves", type=int, default=1000)
    a = ap.parse_args()
    import orbax.checkpoint as ocp

    tree = state(a.leaves)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
    root = tempfile.mkdtemp(prefix="jaxckpt-many-sharded-")
    times: dict[str, list[float]] = {k: [] for k in ("jx save", "orbax save", "jx restore", "orbax restore")}
    try:
        for rep in range(a.reps):
            jx_dir, ob_dir = os.path.join(root, f"jx{rep}"), os.path.join(root, f"ob{rep}")
            times["jx save"].append(timed(lambda: jaxckpt.save(jx_dir, tree)))
            mngr = ocp.CheckpointManager(ob_dir, options=ocp.CheckpointManagerOptions(create=True))
            times["orbax save"].append(timed(lambda: (mngr.save(0, args=ocp.args.StandardSave(tree)),
                                                      mngr.wait_until_finished())))
            times["jx restore"].append(timed(lambda: jaxckpt.restore(jx_dir, target)))
            times["orbax restore"].append(timed(lambda: mngr.restore(0, args=ocp.args.StandardRestore(target))))
            mngr.close()
            back = jaxckpt.restore(jx_dir, target)
            assert all(np.array_equal(np.asarray(back[k]["kernel"]), np.asarray(tree[k]["kernel"])) for k in tree)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{a.leaves} leaves (kernels sharded over 4 devices, biases replicated), median of {a.reps}")
    print("| | jaxckpt [s] | orbax [s] | jaxckpt/orbax |")
    print("|---|---:|---:|---:|")
    for op in ("save", "restore"):
        jx, ob = med[f"jx {op}"], med[f"orbax {op}"]
        print(f"| {op} | {jx:.3f} | {ob:.3f} | {jx / ob:.3f} ({ob / jx:.0f}x) |")


if __name__ == "__main__":
    main()
