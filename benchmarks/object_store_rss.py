"""Peak host memory of a format-3 save to an object store, with and without the optional
extras (issue 30, defect 4): S3 (a local moto server) with boto3 and without it, GCS (the
local emulator) with a token for compose requests and without google-auth.

    python benchmarks/object_store_rss.py [--mib 192,384] [--reps 2] [--stores s3,gcs] [--src DIR]

Each save runs in a fresh process (a host numpy state of the given MiB, one small save
first to load everything): its peak RSS above the process's RSS before the save
(``ru_maxrss``) and its seconds. "without" hides the extra from jaxckpt in that process
(``sys.modules["boto3"] = None``; for GCS no google-auth and no token that jaxckpt sees,
while tensorstore keeps its own). Runs are interleaved (with, without, with, ...) and the
medians printed, with the ratio without/with of the extra memory; two state sizes show
whether it grows with the state. ``--src DIR`` imports ``jaxckpt`` from ``DIR`` (e.g. a
worktree of an older commit, to compare before and after). Both servers are Python
processes on the same cores, on 127.0.0.1: the seconds say little about S3 or GCS; the
memory is what this measures.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.parse
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from gcs_uploads import EMULATOR  # noqa: E402 - the emulator with the listing fix
from s3 import start_moto  # noqa: E402

CHILD = """
import json, os, resource, sys, time
store, mode, url, mib = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
if mode == "without":
    sys.modules["boto3"] = None
    sys.modules["google.auth"] = None
import numpy as np
import jaxckpt
from jaxckpt._storage import gcs, uploads
for name, value in json.loads(sys.argv[5]).items():  # --object-mib, --uploads
    setattr(uploads, name, value)
if mode == "without":
    gcs.TOKEN_ENV = "JAXCKPT_BENCH_NO_TOKEN"  # tensorstore still reads its own
target = json.loads(url) if url.startswith("{") else url
state = {"w": np.arange(mib << 18, dtype=np.float32).reshape(64, -1), "step": 1}
warm = dict(target, path="warm/" + target["path"]) if isinstance(target, dict) else url.replace("/rss/", "/warm/")
jaxckpt.save(warm, {"x": np.ones(16)})
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
rss = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 10
start = time.perf_counter()
jaxckpt.save(target, state)
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
man = json.loads(jaxckpt._commit._read_manifest_bytes(jaxckpt._storage.location.resolve(target)))
print(json.dumps({"seconds": seconds, "extra_mib": (peak - max(before, rss)) / 1024,
                  "segment_mib": man["segment_bytes"] / 2**20}), flush=True)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_gcs() -> tuple[subprocess.Popen, str, str]:
    import tempfile

    port = free_port()
    log = tempfile.mktemp(suffix=".log")
    endpoint = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-c", EMULATOR, log, "start", "-H", "127.0.0.1", "--port", str(port),
                             "--in-memory", "--default-bucket", "bench", "-q"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(200):
        try:
            urllib.request.urlopen(f"{endpoint}/storage/v1/b/bench", timeout=5).read()
            return proc, endpoint, log
        except OSError:
            time.sleep(0.05)
    proc.terminate()
    raise RuntimeError("the GCS emulator did not start")


def delete_prefix(store: str, endpoint: str, prefix: str) -> None:
    """Drop what a run saved (both servers hold objects in memory)."""
    if store == "s3":
        import boto3

        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        for page in client.get_paginator("list_objects_v2").paginate(Bucket="jaxckpt-bench", Prefix=prefix):
            for obj in page.get("Contents", []):
                client.delete_object(Bucket="jaxckpt-bench", Key=obj["Key"])
        return
    listed = json.loads(urllib.request.urlopen(f"{endpoint}/storage/v1/b/bench/o?prefix={prefix}").read())
    for item in listed.get("items", []):
        name = urllib.parse.quote(item["name"], safe="")
        urllib.request.urlopen(urllib.request.Request(f"{endpoint}/storage/v1/b/bench/o/{name}", method="DELETE"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", default="192,384")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--stores", default="s3,gcs")
    ap.add_argument("--src", default=ROOT, help="the directory jaxckpt is imported from")
    ap.add_argument("--object-mib", type=int, default=None, help="uploads.WHOLE_OBJECT_BYTES, in MiB")
    ap.add_argument("--uploads", type=int, default=None, help="uploads.WHOLE_UPLOADS")
    args = ap.parse_args()
    sizes = [int(m) for m in args.mib.split(",")]
    stores = args.stores.split(",")
    settings = {name: value for name, value in (("WHOLE_OBJECT_BYTES", args.object_mib and args.object_mib << 20),
                                                ("WHOLE_UPLOADS", args.uploads)) if value}
    servers = []
    env = {**os.environ, "PYTHONPATH": os.path.abspath(args.src), "JAXCKPT_FORMAT": "3",
           "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench"}
    env.pop("XLA_FLAGS", None)
    try:
        if "s3" in stores:
            proc, s3_endpoint = start_moto()
            servers.append(proc)
        if "gcs" in stores:
            proc, gcs_endpoint, log = start_gcs()
            servers.append(proc)
            env.update(TENSORSTORE_GCS_HTTP_URL=gcs_endpoint, GOOGLE_AUTH_TOKEN_FOR_TESTING="bench")
        rows: dict[tuple[str, int, str], list[dict]] = collections.defaultdict(list)
        for rep in range(args.reps):
            for store in stores:
                for mib in sizes:
                    for mode in ("with", "without"):
                        if store == "s3":
                            where = json.dumps({"driver": "s3", "bucket": "jaxckpt-bench", "endpoint": s3_endpoint,
                                                "aws_region": "us-east-1", "path": f"rss/{mode}/{mib}/{rep}/"})
                        else:
                            where = f"gs://bench/rss/{mode}/{mib}/{rep}"
                        out = subprocess.run([sys.executable, "-c", CHILD, store, mode, where, str(mib),
                                              json.dumps(settings)], env=env,
                                             capture_output=True, text=True, timeout=600, cwd=env["PYTHONPATH"])
                        if out.returncode:
                            raise RuntimeError(f"{store} {mode} {mib} MiB failed:\n{out.stderr[-3000:]}")
                        rows[(store, mib, mode)].append(json.loads(out.stdout.strip().splitlines()[-1]))
                        delete_prefix(store, s3_endpoint if store == "s3" else gcs_endpoint, "rss/")
        print(f"jaxckpt from {os.path.abspath(args.src)}; medians of {args.reps}")
        print(f"{'store':6} {'state':>8} {'extras':>8} {'objects':>8} {'save s':>7} {'peak RSS +MiB':>14} {'/ with':>7}")
        for store in stores:
            for mib in sizes:
                base = statistics.median(r["extra_mib"] for r in rows[(store, mib, "with")])
                for mode in ("with", "without"):
                    runs = rows[(store, mib, mode)]
                    extra = statistics.median(r["extra_mib"] for r in runs)
                    ratio = extra / base if base > 1 else float("nan")
                    print(f"{store:6} {mib:>5} MiB {mode:>8} {runs[0]['segment_mib']:>5.0f} MiB "
                          f"{statistics.median(r['seconds'] for r in runs):>7.2f} {extra:>14.0f} {ratio:>7.2f}")
    finally:
        for proc in servers:
            proc.terminate()
            proc.wait(10)
        if "gcs" in stores and os.path.exists(log):
            os.remove(log)


if __name__ == "__main__":
    main()
