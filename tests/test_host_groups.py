"""A local directory per host: a manager start never deletes data; a step some host lacks
is restored from a host that holds all of it, or named with the host that lacks it.
Real 2-process jobs (tests/mp_hosts_worker.py)."""

import json
import os
import shutil

import numpy as np
import pytest
from conftest import run_workers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "mp_hosts_worker.py")


def run_job(scenario_args, nproc=2, ndev=2, timeout=120):
    return run_workers(WORKER, nproc, lambda i, port: [port, nproc, i, ndev, "job", json.dumps(scenario_args)],
                       timeout)


def test_a_manager_start_never_deletes_steps_a_replaced_host_lacks(tmp_path):
    """Replicated state: every host holds a complete copy. Host 1 is replaced (empty
    directory). Starting a manager keeps host 0's steps (not listed: host 1 lacks them);
    restoring the latest copies it to host 1 over the collectives and restores it bit
    for bit everywhere; the next committed step lets the older partial ones go."""
    res = run_job({"path": str(tmp_path), "save": [1, 2, 3]})
    assert res[0]["steps"] == res[1]["steps"] == [1, 2, 3]
    shutil.rmtree(tmp_path / "host1")

    res = run_job({"path": str(tmp_path)})  # a start, nothing else
    for p in (0, 1):
        assert res[p]["groups"] == [[0], [1]]
        assert res[p]["steps_at_start"] == []
    assert res[0]["on_disk"] == ["1", "2", "3"]  # d7c90e7 deleted them here
    assert res[1]["on_disk"] == []

    res = run_job({"path": str(tmp_path), "restore": None, "then_save": [4]})
    for p in (0, 1):
        assert res[p]["restored"] == 3
        assert res[p]["steps_after_restore"] == [3]
        assert res[p]["steps"] == [3, 4]
    assert res[1]["on_disk_after_restore"] == ["3"]  # host 1 got a committed copy
    assert res[0]["on_disk"] == res[1]["on_disk"] == ["3", "4"]  # 1, 2: superseded by 4, deleted


@pytest.mark.slow
def test_a_step_no_host_holds_whole_is_named_with_the_host_that_lacks_it(tmp_path):
    """Sharded state: host 1's half exists nowhere else. Asked for, the step fails with a
    CheckpointError naming the step and the host; the latest restore does not fall back
    silently either."""
    res = run_job({"path": str(tmp_path), "save": [1, 2], "sharded": True})
    shutil.rmtree(tmp_path / "host1")
    res = run_job({"path": str(tmp_path), "sharded": True, "restore": 2})
    for p in (0, 1):
        assert res[p]["error"].startswith("CheckpointError: Cannot restore step 2 from "), res[p]["error"]
        assert "step 2 is missing on process 1 on host " in res[p]["error"]
        assert "no host holds all of it and the persistent tier does not hold it" in res[p]["error"]
    assert res[0]["on_disk"] == ["1", "2"]
    res = run_job({"path": str(tmp_path), "sharded": True, "restore": None})
    for p in (0, 1):
        assert res[p]["error"].startswith("CheckpointNotFoundError: No committed step in "), res[p]["error"]
        assert "step 2 is missing on process 1" in res[p]["error"] and "step 1 is missing" in res[p]["error"]
    assert res[0]["on_disk"] == ["1", "2"]


def test_the_source_is_the_lowest_host_holding_every_file():
    from jaxckpt._manager import hostcopy as _hostcopy

    expected = {"arrays/a/c/0": (20, ()), "arrays/a/zarr.json": (None, ())}
    listings = {0: {"arrays/a/c/0": 20}, 1: {"arrays/a/c/0": 20, "arrays/a/zarr.json": 5},
                2: {"arrays/a/c/0": 20, "arrays/a/zarr.json": 7}}
    assert _hostcopy.plan_source(listings, expected) == 1
    assert _hostcopy.plan_source({0: {"arrays/a/c/0": 19, "arrays/a/zarr.json": 5}}, expected) is None
    assert _hostcopy.blocks([10, 0, 7], 8) == 3 and _hostcopy.blocks([], 8) == 0


def test_stream_and_sink_move_files_back_to_back(tmp_path):
    from jaxckpt._manager import hostcopy as _hostcopy

    rng = np.random.default_rng(0)
    files = [("arrays/a/c/0", 13), ("arrays/a/zarr.json", 0), ("packed/p0", 40), ("z", 0)]
    for path, size in files:
        os.makedirs(os.path.dirname(tmp_path / "src" / path) or ".", exist_ok=True)
        (tmp_path / "src" / path).write_bytes(rng.integers(0, 256, size, np.uint8).tobytes())
    stream = _hostcopy._Stream(str(tmp_path / "src"), files)
    sink = _hostcopy._Sink(str(tmp_path / "dst"), files)
    for _ in range(_hostcopy.blocks([s for _, s in files], 8)):
        sink.put(stream.next(8))
    sink.close()
    for path, _ in files:
        assert (tmp_path / "dst" / path).read_bytes() == (tmp_path / "src" / path).read_bytes(), path


@pytest.mark.slow
def test_a_lease_lost_on_another_host_fails_the_save_in_every_process(tmp_path):
    """Per-host directories: host 1's writer lease is taken over. Only host 1's first
    process knows; the save fails in both processes at the same call, and host 1's
    directory (now another writer's) gets nothing of it."""
    run_job({"path": str(tmp_path), "save": [1]})
    res = run_job({"path": str(tmp_path), "save": [2], "steal": 1})
    for p in (0, 1):
        assert "Saving step 2 to " in res[p]["save_error"], res[p]
        assert "cannot commit: the writer lease of" in res[p]["save_error"], res[p]["save_error"]
        assert res[p]["steps"] == [1]
    assert res[0]["on_disk"] == res[1]["on_disk"] == ["1"]
