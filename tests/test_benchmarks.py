"""The benchmark scripts run end to end on CPU, in smoke size (about 80 s together).

``benchmarks/gpu_check.py`` (meant for a GPU), ``benchmarks/run.py``'s restore
matrix (``--reshard``) and cold-cache rows (``--cold``), and ``benchmarks/peak_memory.py``
(every row of the peak-memory table); each in fresh processes, as ``make bench-smoke``
would run them.
"""

import json
import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # the full tier (`make test-all`); CI also runs `make bench-smoke`

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args, timeout):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=timeout)
    assert p.returncode == 0, f"rc={p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p.stdout, p.stderr


def test_gpu_check_runs_on_cpu(tmp_path):
    out, err = _run(["benchmarks/gpu_check.py", "--gib", "0.05", "--reps", "1",
                     "--dir", str(tmp_path), "--json", str(tmp_path / "gpu.json"),
                     "--pinned-probe", "2"], 120)
    assert "rep 0: async save blocking" in err  # progress
    rows = {}
    for line in out.splitlines():
        m = re.match(r"\| (.+?) \| ([0-9.]+|n/a) \|", line)
        if m:
            rows[m.group(1)] = m.group(2)
    for label in ("async save: blocking (`mgr.save` returns)",
                  "async save: blocking, first save (fresh manager)",
                  "async save: total to commit",
                  "restore (`mgr.restore`, page cache warm)",
                  "restore, page cache dropped",
                  "D2H limit: `jax.device_get` (pageable)",
                  "D2H limit: `copy_to_host_async` + `np.asarray` per shard",
                  "H2D limit: `jax.device_put` from numpy"):
        assert label in rows, (label, out)
        assert rows[label] != "n/a", (label, out)
    assert "D2H: `device_put` to `pinned_host`" in rows
    assert "Target: blocking <= 1.2x the D2H limit" in out
    assert "Target (issue 34): blocking <= 1.2x the pinned-host transfer" in out
    assert re.search(r"then `np.asarray` of every pinned shard: [0-9.]+ s \(zero-copy: (True|False)\)", out), out
    res = json.loads((tmp_path / "gpu.json").read_text())
    assert res["reps"] == 1 and res["bytes"] > 0
    assert os.listdir(tmp_path) == ["gpu.json"]  # the checkpoints are gone


def test_run_reshard_and_cold_smoke(tmp_path):
    out, err = _run(["benchmarks/run.py", "--reshard", "--cold", "--smoke",
                     "--json", str(tmp_path / "m.json")], 180)
    for label in ("4 P(data,-) -> same", "4 P(data,-) -> 2x2 P(a,b)", "4 P(data,-) -> 2x2 P(-,b)",
                  "4 P(data,-) -> 1 device", "4 P(data,-) -> 4x2 P(data,model)",
                  "4x2 P(data,model) -> 4 P(data,-)", "2x2 P(a,b) -> 4 P(data,-)",
                  "4 P(data,-) -> same [cold]", "4 P(data,-) -> 2x2 P(-,b) [cold]",
                  "many: 1 device -> same", "many: 1 device -> same [cold]"):
        assert re.search(r"^" + re.escape(label) + r"\s+[0-9.]+\s", out, re.M), (label, out)
    assert "fadvise check" in out
    res = json.loads((tmp_path / "m.json").read_text())
    assert not res["errors"]
    mx = {r["id"]: r for r in res["matrix"]}
    assert len(mx) == 11
    for r in mx.values():
        assert set(r["time"]) == {"jaxckpt", "orbax", "orbax_nocomp", "limit"}, r["id"]
        assert set(r["targets"]) == {"jx/orbax", "jx/limit", "rss/restored", "read/held"}
        # the counter: the limit reads exactly the bytes held; every library read some
        assert 0.99 <= r["per_lib"]["limit"]["read/held"] <= 1.05, (r["id"], r["per_lib"])
        for lib in ("jaxckpt", "orbax", "orbax_nocomp"):
            assert r["per_lib"][lib]["read/held"] > 0.5, (r["id"], lib, r["per_lib"])
        assert r["per_lib"]["jaxckpt"]["self/held"] > 0.5, (r["id"], r["per_lib"])
    assert mx["big:4>2x2b"]["held"] == 2 * mx["big:4>2x2b"]["needed"]  # column blocks, 2 holders
    for rid in ("big:4>4:cold", "big:4>2x2b:cold", "many:1>1:cold"):
        assert "cold/warm" in mx[rid]["per_lib"]["jaxckpt"]
    assert res["fadvise"]["bytes"] > 0


def test_peak_memory_smoke(tmp_path):
    """Every path of the peak-memory table runs (tiny sizes; the figures are not checked)."""
    out, err = _run(["benchmarks/peak_memory.py", "--smoke", "--json", str(tmp_path / "peak.json")], 240)
    assert out.startswith("Peak host RSS above the state, state of 4 and 8 MiB"), out
    assert "| path | peak above state, 4 MiB | 8 MiB | B/A | slope |" in out
    rows = {}
    for line in out.splitlines():
        m = re.match(r"\| (.+?) \| (-?[0-9]+) MiB \| (-?[0-9]+) MiB \| ", line)
        if m:
            rows[m.group(1)] = (int(m.group(2)), int(m.group(3)))
    for label in ("save, local, raw", 'save, local, `compression="zstd"`', 'save, local, `quantize={"mu*": "int8"}`',
                  "async save (manager), numpy leaves, no budget",
                  "async save (manager), numpy leaves, `max_staging_bytes` 64 MiB",
                  "save, S3, with boto3", "save, S3, without boto3",
                  "save, GCS, with a token (google-auth's path)", "save, GCS, without google-auth",
                  "restore, raw, 4 devices", "restore, zstd, 4 devices", "`verify`, raw", "`verify`, zstd",
                  "read-once restore, 2 processes, replicated",
                  "host copy: start + restore, a wiped host gets the step (2 processes)",
                  "peer copy: save with `peer_copies=1` (2 processes)",
                  "peer copy: start + restore, a wiped host's part sent back (2 processes)",
                  "bound check: save, S3, with boto3, parts of 8 MiB",
                  "bound check: save, GCS, with a token, parts of 8 MiB",
                  "bound check: read-once restore, waves of 64 MiB"):
        assert label in rows, (label, out)
    assert len(rows) == 20, out
    res = json.loads((tmp_path / "peak.json").read_text())
    assert res["sizes"] == [4, 8] and not res["errors"]
    # each object-store save took the path its row names: data objects in parts, or whole
    parts = {case: {ln["out"]["parts"] for ln in res["runs"][case]}
             for case in ("save_s3", "save_s3_bare", "save_gcs", "save_gcs_bare", "save_s3_parts8", "save_gcs_parts8")}
    assert parts == {"save_s3": {True}, "save_s3_bare": {False}, "save_gcs": {True}, "save_gcs_bare": {False},
                     "save_s3_parts8": {True}, "save_gcs_parts8": {True}}
    # both processes of each 2-process case reported, at both sizes
    for case in ("read_once", "host_copy", "peer_save", "peer_repair", "read_once_waves64"):
        assert sorted((ln["mib"], ln["pid"]) for ln in res["runs"][case]) == [(4, 0), (4, 1), (8, 0), (8, 1)]
