"""Save/restore throughput on a local S3 server (moto) vs local disk, and how long an
unreachable S3 endpoint takes to fail with the default I/O bound.

    python benchmarks/s3.py [--mib 256] [--reps 3] [--json FILE]
    python benchmarks/s3.py --formats [--mib 1024] [--reps 3] [--json FILE]

Repetitions are interleaved (disk, s3, disk, s3, ...) and medians reported. With
``--formats``: format 2 (S3's default) against format 3 (``JAXCKPT_FORMAT=3``) on S3,
interleaved: the HTTP requests and seconds of a save, a restore and the deletion of
the step (``_commit.delete_step``, what retention calls; the manager adds its readers'
check: two requests), and the objects per checkpoint. Requests are tensorstore's
(``/tensorstore/http/request_started``) plus boto3's (each send, retries included).
moto copies a whole object for every ranged GET (``FakeKey.value``): a format-3
restore's time there grows with the segment size (``--segment-mib``), which S3's does not. moto is a
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


class Requests:
    """HTTP requests sent to the store from now on: tensorstore's and boto3's."""

    def __init__(self, url: str):
        from jaxckpt._storage import location, s3

        self.boto = 0
        s3.client_for(location.resolve(url)).meta.events.register("before-send.s3.*", self._sent)
        self.start = self._tensorstore()

    def _sent(self, **_: object) -> None:
        self.boto += 1

    @staticmethod
    def _tensorstore() -> int:
        import tensorstore as ts

        (m,) = ts.experimental_collect_matching_metrics("/tensorstore/http/request_started", include_zero_metrics=True)
        return int(m["values"][0]["value"])

    def take(self) -> int:
        """Requests since the last ``take`` (or since made)."""
        now = self._tensorstore()
        n, self.start, self.boto = now - self.start + self.boto, now, 0
        return n


def format_round(fmt: str, url: str, tree, count: Requests, client) -> dict[str, float]:
    """Save, restore and delete one step in format ``fmt`` ("2" or "3"): requests, seconds."""
    import jax

    import jaxckpt
    from jaxckpt import _commit
    from jaxckpt._storage import location

    os.environ["JAXCKPT_FORMAT"] = fmt
    directory = location.resolve(url)
    step = directory.child(_commit.step_name(1))
    out: dict[str, float] = {}
    count.take()
    t = time.perf_counter()
    jaxckpt.save(step, tree)
    out["save_s"], out["save_requests"] = time.perf_counter() - t, count.take()
    out["objects"] = sum(len(p.get("Contents", [])) for p in client.get_paginator("list_objects_v2").paginate(
        Bucket="jaxckpt-bench", Prefix=step.kvstore["path"]))
    t = time.perf_counter()
    jax.block_until_ready(jaxckpt.restore(step, tree))
    out["restore_s"], out["restore_requests"] = time.perf_counter() - t, count.take()
    t = time.perf_counter()
    _commit.delete_step(directory, 1, _commit.new_token(directory))
    out["delete_s"], out["delete_requests"] = time.perf_counter() - t, count.take()
    os.environ.pop("JAXCKPT_FORMAT")
    return out


def formats_main(args: argparse.Namespace) -> None:
    import boto3

    tree = make_state(args.mib)
    nbytes = sum(x.nbytes for x in tree.values())
    proc, endpoint = start_moto()
    os.environ["AWS_ENDPOINT_URL"] = endpoint
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    count = Requests("s3://jaxckpt-bench/x")
    if args.segment_mib:
        from jaxckpt import _snapshot

        _snapshot.SEGMENT_BYTES = args.segment_mib << 20
    samples: dict[str, list[dict[str, float]]] = {f: [] for f in args.which.split(",")}
    try:
        for rep in range(args.reps):
            for fmt in samples:
                samples[fmt].append(format_round(fmt, f"s3://jaxckpt-bench/f{fmt}-r{rep}", tree, count, client))
                print(fmt, rep, {k: round(v, 2) for k, v in samples[fmt][-1].items()}, flush=True)
    finally:
        proc.terminate()
    medians = {f"format{f}": {k: round(statistics.median(r[k] for r in v), 2) for k in v[0]}
               for f, v in samples.items()}
    result = {"state_mib": nbytes / 2**20, "reps": args.reps, "segment_mib": args.segment_mib or 1024,
              "median": medians, "samples": samples}
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--formats", action="store_true", help="format 2 vs format 3 on S3: requests and seconds")
    ap.add_argument("--which", default="2,3", help="--formats: the formats, in the order of each round")
    ap.add_argument("--segment-mib", type=int, default=0, help="--formats: format 3's segment size (default 1 GiB)")
    args = ap.parse_args()
    if args.formats:
        formats_main(args)
        return
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
