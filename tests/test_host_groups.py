"""A local directory per host: a manager start never deletes data; a step some host lacks
is restored from a host that holds all of it, or named with the host that lacks it.
Real 2-process jobs (tests/mp_hosts_worker.py)."""

import json
import os
import shutil
import socket

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


def run_sharded_job(args, nproc=2, timeout=120):
    """A job of tests/mp_peers_worker.py (its "ops": saves of versions, deletes, restores)
    without peer copies: state sharded over the hosts, a directory per host."""
    worker = os.path.join(ROOT, "tests", "mp_peers_worker.py")
    return run_workers(worker, nproc, lambda i, port: [port, nproc, i, "job", json.dumps({**args, "copies": 0})],
                       timeout)


def test_a_step_the_hosts_hold_from_two_saves_is_never_restored_mixed(tmp_path):
    """Host 1 keeps its copy of step 3 (version 1) aside while step 3 is deleted and
    saved again with other values (version 2), then puts it back (a disk restored from a
    backup; a host whose commit of the new save failed keeps the old one). Every host
    holds step 3, from two saves: it is not listed, restoring it is refused in both
    processes naming the hosts of each save (never one process's version 2 beside the
    other's version 1), the latest restore gives step 2, and the next save lets step 3
    go on both hosts."""
    run_sharded_job({"path": str(tmp_path), "save": [1, 2, 3], "keep": 3})
    shutil.copytree(tmp_path / "host1" / "3", tmp_path / "old3")
    res = run_sharded_job({"path": str(tmp_path), "keep": 3, "ops": [["delete", 3], ["save", 3, 2]]})
    assert [op["steps"] for op in res[0]["ops"]] == [[1, 2], [1, 2, 3]]
    shutil.rmtree(tmp_path / "host1" / "3")
    shutil.copytree(tmp_path / "old3", tmp_path / "host1" / "3")
    res = run_sharded_job({"path": str(tmp_path), "keep": 3, "ops": [["restore", 3], ["restore", None], ["save", 4]]})
    for p in (0, 1):
        assert res[p]["steps_at_start"] == [1, 2]
        error = res[p]["ops"][0]["error"]
        assert error.startswith(f"CheckpointError: Cannot restore step 3 from '{tmp_path / f'host{p}'}': the hosts "
                                "hold step 3 from 2 different saves (process 0 on host "), error
        assert error.endswith("; deleted and saved again while a host kept its old copy?) and the persistent tier "
                              "does not hold it"), error
        assert res[p]["ops"][1] == {"step": 2, "version": 1, "w": 1, "b": 1, "steps": [1, 2]}
        assert res[p]["ops"][2]["steps"] == [1, 2, 4] and res[p]["on_disk"] == ["1", "2", "4"]
        host = socket.gethostname()
        assert [w for w in res[p]["warnings"] if "different saves" in w] == [
            f"jaxckpt: the hosts hold steps [3] in '{tmp_path / f'host{p}'}' from different saves (deleted and "
            "saved again while a host kept its old copy); not listed, never restored from the hosts' directories",
            f"jaxckpt: the hosts hold step 3 from 2 different saves (process 0 on host {host!r}; process 1 on host "
            f"{host!r}; deleted and saved again while a host kept its old copy?) and the persistent tier does not "
            "hold it; restoring an older step"]


def test_the_persistent_copy_of_another_save_of_a_step_is_never_read_for_it(tmp_path):
    """Every step goes to the persistent tier (a local directory here) at first. A job
    copying every 2nd step deletes step 3 and saves it again with other values (version
    2); version 1's persistent copy is put back, as a delete killed between the local
    step and the tier would leave it. Host 1's directory is wiped: restoring
    step 3 never reads version 1 for it (both processes refuse, naming the other save),
    and the latest restore gives the persistent tier's step 2, of the same save as host
    0's."""
    durable = str(tmp_path / "durable")
    run_sharded_job({"path": str(tmp_path), "save": [1, 2, 3], "keep": 3, "durable": durable, "every": 1})
    shutil.copytree(os.path.join(durable, "3"), tmp_path / "old3")
    res = run_sharded_job({"path": str(tmp_path), "keep": 3, "durable": durable, "ops": [["delete", 3], ["save", 3, 2]]})
    assert res[0]["ops"][1] == {"steps": [1, 2, 3], "tiers": {"1": ["local", "persistent"], "2": ["local", "persistent"],
                                                             "3": ["local"]}}
    assert not os.path.exists(os.path.join(durable, "3"))  # delete() took the persistent copy too
    shutil.copytree(tmp_path / "old3", os.path.join(durable, "3"))  # as a delete killed before the tier leaves it
    shutil.rmtree(tmp_path / "host1")
    res = run_sharded_job({"path": str(tmp_path), "keep": 3, "durable": durable,
                           "ops": [["restore", 3], ["restore", None]]})
    for p in (0, 1):
        error = res[p]["ops"][0]["error"]
        assert error.startswith(f"CheckpointError: Cannot restore step 3 from '{tmp_path / f'host{p}'}': step 3 is "
                                "missing on process 1 on host "), error
        assert error.endswith(", no host holds all of it and the persistent tier holds only another save of it"), error
        assert res[p]["ops"][1] == {"step": 2, "version": 1, "w": 1, "b": 1, "steps": [1, 2, 3]}
        assert "jaxckpt: the persistent tier's steps [3] are other saves than the hosts' steps of those numbers " \
            "(deleted and saved again since); they are not read for them" in res[p]["warnings"]


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
