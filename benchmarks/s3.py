"""Save/restore throughput on a local S3 server (moto) vs local disk, and how long an
unreachable S3 endpoint takes to fail with the default I/O bound.

    python benchmarks/s3.py [--mib 256] [--reps 3] [--json FILE]

Repetitions are interleaved (disk, s3, disk, s3, ...) and medians reported. moto is a
Python server holding objects in memory: its numbers are what jaxckpt's S3 path costs
against a fast, nearby endpoint, not what AWS gives. Every endpoint is on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto() -> tuple[subprocess.Popen, str]:
    import boto3

    port = free_port()
    exe = os.path.join(os.path.dirname(sys.executable), "moto_server")
    proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    for _ in range(200):
        try:
            client.create_bucket(Bucket="jaxckpt-bench")
            return proc, endpoint
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(0.05)
    proc.terminate()
    raise RuntimeError("moto_server did not start")


def make_state(mib: int):
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("x",))
    leaves = 8
    rows = (mib << 20) // leaves // 4 // 1024
    rng = np.random.default_rng(0)
    return {f"w{i}": jax.device_put(rng.standard_normal((rows, 1024), dtype=np.float32),
                                    NamedSharding(mesh, P("x", None))) for i in range(leaves)}


def time_round(url: str, tree, nbytes: int) -> tuple[float, float]:
    import jax

    import jaxckpt

    t = time.perf_counter()
    jaxckpt.save(url, tree)
    save_s = time.perf_counter() - t
    t = time.perf_counter()
    back = jaxckpt.restore(url, tree)
    jax.block_until_ready(back)
    restore_s = time.perf_counter() - t
    return nbytes / save_s / 2**20, nbytes / restore_s / 2**20


def fail_times() -> dict[str, float]:
    """Seconds until an unreachable endpoint (a closed port) fails, default bound."""
    import numpy as np

    import jaxckpt

    os.environ.pop("JAXCKPT_IO_TIMEOUT_S", None)
    os.environ["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{free_port()}"
    out = {}
    for name, call in (("save", lambda: jaxckpt.save("s3://jaxckpt-bench/gone/c", {"x": np.arange(3)})),
                       ("restore", lambda: jaxckpt.restore("s3://jaxckpt-bench/gone/c"))):
        t = time.perf_counter()
        try:
            call()
        except jaxckpt.CheckpointError as e:
            out[name] = round(time.perf_counter() - t, 2)
            out[name + "_error"] = str(e)[:300]
    del os.environ["AWS_ENDPOINT_URL"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    tree = make_state(args.mib)
    nbytes = sum(x.nbytes for x in tree.values())
    proc, endpoint = start_moto()
    os.environ["AWS_ENDPOINT_URL"] = endpoint
    tmp = tempfile.mkdtemp(prefix="jaxckpt-bench-")
    samples: dict[str, list[tuple[float, float]]] = {"disk": [], "s3": []}
    try:
        for rep in range(args.reps):
            for kind in ("disk", "s3"):
                url = os.path.join(tmp, f"c{rep}") if kind == "disk" else f"s3://jaxckpt-bench/r{rep}"
                samples[kind].append(time_round(url, tree, nbytes))
                print(kind, rep, [round(x) for x in samples[kind][-1]], "MiB/s", flush=True)
        del os.environ["AWS_ENDPOINT_URL"]
        fails = fail_times()
    finally:
        proc.terminate()
        shutil.rmtree(tmp, ignore_errors=True)
    result = {"state_mib": nbytes / 2**20, "reps": args.reps,
              "median_mib_s": {k: {"save": round(statistics.median(s for s, _ in v)),
                                   "restore": round(statistics.median(r for _, r in v))}
                               for k, v in samples.items()},
              "samples_mib_s": samples, "unreachable_fail_s": fails}
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
