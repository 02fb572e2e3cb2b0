"""Bytes written per process for a fully replicated state (data-parallel training).

Starts N real JAX processes on this machine (gloo CPU collectives, one device each),
each holding the whole state, saves it once with ``jaxckpt.save`` and prints the bytes
each process wrote and max/mean (1.0 is perfect balance; with every replicated chunk
written by its first holder it is N).

    python benchmarks/replicated_writes.py [--processes 4] [--mib 1024] [--dir /tmp/x]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time


def worker(port: int, n: int, i: int, mib: int, path: str) -> None:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=n, process_id=i)
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxckpt
    from jaxckpt import _storage

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    replicated = NamedSharding(mesh, P())
    # a model-like mix: one big embedding, a few mid-size matrices, many small leaves
    sizes = [mib // 2] + [mib // 16] * 7
    small = (mib * (1 << 20) - sum(sizes) * (1 << 20)) // (64 << 10)
    tree = {f"big{k}": np.full((s << 20) // 4, k, np.float32) for k, s in enumerate(sizes)}
    tree.update({f"small{k}": np.full((64 << 10) // 4, k, np.float32) for k in range(small)})
    tree = {k: jax.device_put(v, replicated) for k, v in tree.items()}
    _storage.reset_io_stats()
    t0 = time.perf_counter()
    jaxckpt.save(path, tree, timeout_s=120)
    seconds = time.perf_counter() - t0
    print("RESULT " + json.dumps({"written": _storage.io_stats()["bytes_written"], "seconds": seconds}), flush=True)
    jax.distributed.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--processes", type=int, default=4)
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--worker", nargs=4, type=int, help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        port, n, i, mib = args.worker
        worker(port, n, i, mib, args.path)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = args.dir or tempfile.mkdtemp(prefix="jaxckpt-repl-")
    path = os.path.join(root, "ckpt")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(port), str(args.processes), str(i),
                               str(args.mib), "--path", path], stdout=subprocess.PIPE, text=True, env=env)
             for i in range(args.processes)]
    written, seconds = [], []
    for p in procs:
        out, _ = p.communicate(timeout=900)
        line = next(ln for ln in out.splitlines() if ln.startswith("RESULT "))
        r = json.loads(line[7:])
        written.append(r["written"])
        seconds.append(r["seconds"])
    mean = sum(written) / len(written)
    print(f"{args.processes} processes, {args.mib} MiB replicated: bytes written per process "
          f"{[round(w / 2**20, 1) for w in written]} MiB; max/mean {max(written) / mean:.3f}; "
          f"save {max(seconds):.2f} s")
    if args.dir is None:
        import shutil

        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
