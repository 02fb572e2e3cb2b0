"""Real multi-process JAX (gloo CPU collectives on 127.0.0.1): save in N processes,
restore in M, agreement on commit, failing as one, the manager in a jitted loop."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "mp_worker.py")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(nproc, ndev, scenario, args, timeout=90):
    port = free_port()
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    procs = [
        subprocess.Popen([sys.executable, WORKER, str(port), str(nproc), str(i), str(ndev), scenario, json.dumps(args)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for i in range(nproc)
    ]
    results = {}
    deadline = time.monotonic() + timeout
    for i, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"process {i} of {scenario} timed out")
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        if lines:
            results[i] = json.loads(lines[-1][7:])
            assert "crash" not in results[i], results[i]["crash"]
        else:
            results[i] = {"pid": i, "exit": p.returncode, "stderr": err[-2000:]}
    return results


# (saving processes, mesh, spec) -> (restoring processes, mesh, spec); 2 devices per process
MATRIX = {
    "2->1": ((2, (4,), ("x",), ["x", None]), (1, (2,), ("y",), [None, "y"])),
    "1->2": ((1, (2,), ("x",), [None, "x"]), (2, (2, 2), ("a", "b"), ["b", "a"])),
    "2->4": ((2, (2, 2), ("a", "b"), ["a", "b"]), (4, (4, 2), ("d", "m"), ["d", None])),
    "4->2": ((4, (8,), ("x",), ["x", None]), (2, (2, 2), ("p", "q"), [None, ["p", "q"]])),
}


@pytest.mark.parametrize("case", sorted(MATRIX))
def test_save_in_n_processes_restore_in_m(tmp_path, case):
    (n, mesh_s, names_s, spec_s), (m, mesh_r, names_r, spec_r) = MATRIX[case]
    path = str(tmp_path / "ckpt")
    saved = run_job(n, 2, "save", {"mesh": mesh_s, "names": names_s, "spec": spec_s, "path": path})
    written = [saved[i]["written"] for i in range(n)]
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    packed = sum(p["nbytes"] for p in manifest["packed"])
    small = 8 * 16 * 4 + 16 * 4 + 3  # the sharded small leaf, the replicated one, the host one
    n_chunks = sum(len(leaf.get("chunks", [])) for leaf in manifest["leaves"])
    # small leaves are packed with each shard padded to 64 bytes
    assert small <= packed < small + 64 * n_chunks
    # every byte written exactly once in total: replicated leaves once, not once per process
    assert sum(written) == 64 * 4096 * 4 + packed, written
    restored = run_job(m, 2, "restore", {"mesh": mesh_r, "names": names_r, "spec": spec_r, "path": path})
    for i in range(m):
        assert restored[i].get("ok"), restored[i]
        # Each process read only the saved chunks its own devices' slices touch, each
        # once (small leaves: plus their 64-byte alignment padding). Where the target's
        # slices are whole saved chunks that is exactly the bytes its devices hold.
        r = restored[i]
        assert r["needed"] <= r["read"] <= r["chunk_bytes"] + 64 * 8, r
        if case != "4->2":
            assert r["read"] - r["needed"] < 64 * 8, r
    if case == "2->4":
        print(f"\n(2,4): bytes written per process {written}; read per process "
              f"{[restored[i]['read'] for i in range(m)]}")


def test_injected_write_failure_fails_every_process(tmp_path):
    path = str(tmp_path / "ckpt")
    args = {"mesh": (4,), "names": ("x",), "spec": ["x", None], "path": path, "bad": 1, "timeout": 20}
    res = run_job(2, 2, "fail_write", args)
    assert "injected failure in process 1" in res[1]["error"]
    assert "failed in process 1" in res[0]["error"] and "injected failure" in res[0]["error"]
    assert not res[0]["committed"] and not os.path.exists(path)
    assert os.listdir(tmp_path) == []  # the staging directory was removed


def test_dead_process_fails_the_save_within_the_timeout(tmp_path):
    path = str(tmp_path / "ckpt")
    args = {"mesh": (4,), "names": ("x",), "spec": ["x", None], "path": path, "bad": 1, "timeout": 4}
    res = run_job(2, 2, "die", args)
    assert res[1].get("exit") == 3
    assert "process 1 did not report within 4s" in res[0]["error"]
    assert res[0]["seconds"] < 15
    assert not res[0]["committed"] and not os.path.exists(path)


def test_async_manager_in_two_processes(tmp_path):
    path = str(tmp_path / "steps")
    res = run_job(2, 2, "manager", {"mesh": (2, 2), "names": ("a", "b"), "spec": ["a", "b"], "path": path})
    for i in range(2):
        assert res[i]["steps"] == [4, 5], res[i]
        assert res[i]["files"] == ["4", "5"]
        assert res[i]["restored_total"] == res[i]["expected"]
        assert res[i]["n"] == 5
