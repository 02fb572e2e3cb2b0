"""The read-once exchange in real multi-process JAX jobs (gloo CPU collectives on
127.0.0.1, one CPU device per process): each wave's buffers stay within the budget
whatever the imbalance, and processes that planned differently fail, all of them,
instead of exchanging wrong bytes. The plan itself: test_exchange.py."""

import json
import os

from conftest import run_workers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "mp_exchange_worker.py")


def run_job(nproc, scenario, args, timeout):
    """Every process's RESULT; the job killed (and the test failed) past ``timeout``."""
    return run_workers(WORKER, nproc, lambda i, port: [port, nproc, i, scenario, json.dumps(args)], timeout,
                       scenario)


def test_a_wave_holds_at_most_its_budget_with_4_processes(tmp_path):
    # a 1 MiB leaf saved as one chunk (read whole by one process), a 1-D leaf, one whose
    # rows are larger than a block, and small leaves of several dtypes, restored
    # replicated on 4 processes in 256 KiB waves: every wave's own row (host + device)
    # plus the 4 gathered rows stays within 256 KiB; every value arrives bit for bit
    nproc, wave = 4, 256 << 10
    res = run_job(nproc, "bounded", {"path": str(tmp_path / "ckpt"), "wave": wave}, timeout=240)
    for p in range(nproc):
        assert res[p]["same"], res[p]
        widths = res[p]["widths"]
        assert widths == res[0]["widths"]  # one sequence of collectives in every process
        assert max(widths) * (nproc + 2) <= wave, f"a wave held {max(widths) * (nproc + 2)} bytes"
    # the blocks of the big leaves take many waves (about 3.3 MB / 40 KiB rows over the
    # 4 readers), not one per leaf
    assert len(res[0]["widths"]) >= 30, res[0]["widths"]


def test_processes_that_planned_differently_all_fail_loudly(tmp_path):
    # process 1 restores leaf "a" without the exchange while process 0 exchanges it (the
    # shape of a plan computed from what one process sees): before, process 0 got "b"'s
    # bytes as "a" or the two waited in mismatched collectives
    res = run_job(2, "diverge", {"path": str(tmp_path / "ckpt"), "odd": 1, "start_timeout": 20}, timeout=150)
    for p in (0, 1):
        error = res[p]["error"]
        assert error is not None, res[p]
        assert error.startswith("CheckpointError: Checkpoint "), error
        assert "read-once plan mismatch: process 1 planned a different exchange than process 0" in error
        assert res[p]["seconds"] < 15, res[p]
    assert res[0]["error"] == res[1]["error"]
