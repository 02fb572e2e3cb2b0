"""A format-3 save to a local GCS emulator: data objects uploaded whole (each assembled
in memory, one request) against uploaded in parts and composed (issue 22).

    python benchmarks/gcs_uploads.py [--mib 256] [--segment-mib 64] [--part-mib 8] [--reps 3]

Each save runs in a fresh process (a host numpy state of ``--mib`` MiB, one small save
first to load everything): its seconds, its peak RSS above the process's RSS before the
save (``ru_maxrss``), and the HTTP requests the emulator answered during it, by kind.
"whole" is the path taken without a token for the compose request (``gcs.composing``
false). The emulator (gcp-storage-emulator, in memory, one thread, on 127.0.0.1) is a
Python server on the same cores: its seconds say little about GCS; the requests and the
memory are what this measures. Repetitions are interleaved (whole, parts, whole, ...).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

# The emulator, with tests/conftest.py's fix of its listing (it ignores startOffset and
# endOffset, which tensorstore lists a prefix with) and a log line per request.
EMULATOR = """
import sys
from gcp_storage_emulator.handlers import objects

_ls = objects.ls


def ls(request, response, storage, *args, **kwargs):
    start = (request.query.get("startOffset") or [None])[0]
    end = (request.query.get("endOffset") or [None])[0]

    def keep(name):
        return (start is None or name >= start) and (end is None or name < end)

    class Offsets:
        def __getattr__(self, name):
            return getattr(storage, name)

        def get_file_list(self, *a, **kw):
            files, prefixes = storage.get_file_list(*a, **kw)
            return [f for f in files if keep(f["name"])], [p for p in prefixes if keep(p)]

    return _ls(request, response, Offsets(), *args, **kwargs)


objects.ls = ls  # before the server module builds its routing table
from gcp_storage_emulator import server

log = open(sys.argv.pop(1), "a", buffering=1)
_handle = server.Router.handle


def handle(self, method):
    path = self._request_handler.path.split("?")[0]
    kind = ("compose" if path.endswith("/compose") else "upload" if path.startswith("/upload/")
            else "download" if path.startswith("/download/") else "list" if path.endswith("/o") else "object")
    log.write(f"{method} {kind}\\n")
    return _handle(self, method)


server.Router.handle = handle
from gcp_storage_emulator.__main__ import main

main(sys.argv[1:])
"""

CHILD = """
import json, os, resource, sys, time
import numpy as np
import jaxckpt
from jaxckpt import _snapshot
from jaxckpt._storage import gcs, uploads

mode, url, mib, segment, part = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
_snapshot.SEGMENT_BYTES, uploads.PART_BYTES = segment << 20, part << 20
if mode == "whole":
    gcs.composing = lambda root: False
state = {"w": np.arange(mib << 18, dtype=np.float32), "step": 1}
jaxckpt.save(url.replace("gs://bench/", "gs://bench/warm/"), {"x": np.ones(16)})
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
rss = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 10
print("MARK", flush=True)
sys.stdin.readline()
start = time.perf_counter()
jaxckpt.save(url, state)
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"seconds": seconds, "extra_mib": (peak - max(before, rss)) / 1024}), flush=True)
sys.stdin.readline()
back = jaxckpt.restore(url)
assert np.array_equal(back["w"], state["w"])
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--segment-mib", type=int, default=64)
    ap.add_argument("--part-mib", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tempfile.mktemp(suffix=".log")
    endpoint = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-c", EMULATOR, log, "start", "-H", "127.0.0.1", "--port", str(port),
                               "--in-memory", "--default-bucket", "bench", "-q"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(200):  # until it answers
            try:
                urllib.request.urlopen(f"{endpoint}/storage/v1/b/bench", timeout=5).read()
                break
            except OSError:
                time.sleep(0.05)
        env = {**os.environ, "TENSORSTORE_GCS_HTTP_URL": endpoint, "GOOGLE_AUTH_TOKEN_FOR_TESTING": "bench",
               "JAXCKPT_FORMAT": "3"}
        rows: dict[str, list[dict]] = collections.defaultdict(list)
        for rep in range(args.reps):
            for mode in ("whole", "parts"):
                child = subprocess.Popen([sys.executable, "-c", CHILD, mode, f"gs://bench/{mode}/{rep}",
                                          str(args.mib), str(args.segment_mib), str(args.part_mib)],
                                         env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # noqa: SIM115
                assert child.stdout.readline().strip() == "MARK"
                seen = len(open(log).readlines())
                child.stdin.write("\n")
                child.stdin.flush()
                out = json.loads(child.stdout.readline())
                out["requests"] = collections.Counter(open(log).read().splitlines()[seen:])
                child.stdin.write("\n")
                child.stdin.flush()
                assert child.wait(120) == 0, f"{mode}: the restore failed"
                rows[mode].append(out)
        for mode, runs in rows.items():
            secs = statistics.median(r["seconds"] for r in runs)
            mib = statistics.median(r["extra_mib"] for r in runs)
            print(f"{mode}: save {secs:.2f} s, peak RSS +{mib:.0f} MiB, requests {dict(runs[-1]['requests'])}")
    finally:
        server.terminate()
        server.wait(10)
        os.remove(log)


if __name__ == "__main__":
    main()
