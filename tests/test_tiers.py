"""Two tiers: every step commits locally; every K-th is copied to a persistent tier (the
local S3 server here) with its own commit and retention; restore takes either."""

import os
import shutil
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import assert_bit_equal, sharded

import jaxckpt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def state(i):
    return {"w": sharded(np.full((256, 64), i, np.float32), (4,), ("x",), ("x", None)),
            "b": np.arange(8, dtype=np.int32) + i, "step": i}


def test_every_kth_step_is_copied_and_kept_by_its_own_retention(tmp_path, s3_server):
    durable = s3_server("tiers/a")
    with jaxckpt.CheckpointManager(tmp_path / "local", max_to_keep=1, persistent_directory=durable,
                                   persistent_interval_steps=2, persistent_max_to_keep=2) as mgr:
        for i in range(1, 7):
            mgr.save(i, state(i))
        mgr.wait_until_finished()
        assert mgr.step_tiers() == {4: ("persistent",), 6: ("local", "persistent")}
        assert mgr.all_steps() == [4, 6] and mgr.latest_step() == 6
        assert sorted(n for n in os.listdir(tmp_path / "local") if n.isdigit()) == ["6"]
        back = mgr.restore(4, state(0))  # only in the persistent tier
        assert_bit_equal(back["w"], np.full((256, 64), 4, np.float32))
        assert back["step"] == 4
        assert mgr.restore()["step"] == 6
    assert jaxckpt.verify(dict(durable, path="tiers/a/6")).ok
    info = jaxckpt.metadata(dict(durable, path="tiers/a/4")).info
    assert info["step"] == 4 and info["copied_from"] == str(tmp_path / "local" / "4")


def test_a_lost_local_directory_restores_from_the_persistent_tier(tmp_path, s3_server):
    durable = s3_server("tiers/b")
    with jaxckpt.CheckpointManager(tmp_path / "local", persistent_directory=durable,
                                   persistent_interval_steps=3) as mgr:
        for i in range(1, 5):
            mgr.save(i, state(i))
    shutil.rmtree(tmp_path / "local")  # a new machine
    with jaxckpt.CheckpointManager(tmp_path / "local", persistent_directory=durable,
                                   persistent_interval_steps=3) as mgr:
        assert mgr.step_tiers() == {3: ("persistent",)}
        back = mgr.restore(None, state(0))
        assert_bit_equal(back["w"], np.full((256, 64), 3, np.float32))
        assert_bit_equal(back["b"], np.arange(8, dtype=np.int32) + 3)


def test_a_copy_killed_midway_leaves_no_persistent_step(tmp_path, s3_server):
    durable = s3_server("tiers/c")
    code = f"""
        import os, threading
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
        import numpy as np, jaxckpt
        from jaxckpt import _snapshot, _storage
        _snapshot.SEGMENT_BYTES = 1 << 19  # step 2's 2 MiB in 5 data objects: a copy of several files
        durable = {durable!r}
        copied = []
        lock = threading.Lock()
        def hook(op, key):
            if op == "copy":  # the copy's files; killed when the second one starts
                with lock:
                    copied.append(key)
                    if len(copied) == 2:
                        print("COPYING", key, flush=True)
                        os.kill(os.getpid(), 9)
        _storage.fault_hook = hook
        mgr = jaxckpt.CheckpointManager({str(tmp_path / "local")!r}, persistent_directory=durable,
                                        persistent_interval_steps=2)
        mgr.save(1, {{"w": np.ones((512, 1024), np.float32)}})
        mgr.save(2, {{"w": np.full((512, 1024), 2.0, np.float32)}})
        mgr.wait_until_finished()
        print("NOT KILLED", flush=True)
    """
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    child = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True,
                           text=True, timeout=120)
    assert child.returncode == -signal.SIGKILL and "COPYING" in child.stdout, child.stderr[-2000:]
    with jaxckpt.CheckpointManager(tmp_path / "local", persistent_directory=durable,
                                   persistent_interval_steps=2, read_only=True) as mgr:
        assert mgr.step_tiers() == {1: ("local",), 2: ("local",)}  # nothing partial is persistent
        assert_bit_equal(mgr.restore()["w"], np.full((512, 1024), 2.0, np.float32))


def test_two_tier_arguments_are_checked(tmp_path):
    with pytest.raises(jaxckpt.CheckpointError, match="need persistent_directory"):
        jaxckpt.CheckpointManager(tmp_path, persistent_interval_steps=2)
    with pytest.raises(jaxckpt.CheckpointError, match="persistent_interval_steps must be a positive int, got None"):
        jaxckpt.CheckpointManager(tmp_path, persistent_directory=str(tmp_path / "p"))


def test_ls_says_which_tier_holds_each_step(tmp_path, s3_server):
    import json

    durable = s3_server("tiers/d")
    with jaxckpt.CheckpointManager(tmp_path / "local", max_to_keep=1, persistent_directory=durable,
                                   persistent_interval_steps=2) as mgr:
        for i in range(1, 4):
            mgr.save(i, state(i))
    exe = os.path.join(os.path.dirname(sys.executable), "jaxckpt")
    url = "s3://jaxckpt-test/tiers/d"
    env = dict(os.environ, AWS_ENDPOINT_URL=durable["endpoint"], AWS_REGION="us-east-1")
    out = subprocess.run([exe, "ls", str(tmp_path / "local"), "--persistent", url, "--json"], capture_output=True,
                         text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert [(s["step"], s["tiers"]) for s in json.loads(out.stdout)["steps"]] == [
        (2, ["persistent"]), (3, ["local"])]
    out = subprocess.run([exe, "ls", str(tmp_path / "local"), "--persistent", url], capture_output=True,
                         text=True, env=env, timeout=120)
    assert out.stdout.splitlines()[0].split() == [
        "step", "committed", "age", "size", "blocking", "total", "tier", "metrics"]
    step2, step3 = out.stdout.splitlines()[1:3]
    assert step2.split()[0] == "2" and step2.split()[-1] == "persistent"  # no metrics were saved
    assert step3.split()[0] == "3" and step3.split()[-1] == "local"


@pytest.mark.parametrize("version", [pytest.param(1, marks=pytest.mark.format1), 3])
def test_expected_files_are_exactly_the_files_a_save_writes(tmp_path, monkeypatch, version):
    from jaxckpt import _commit, _snapshot, _verify
    from jaxckpt._manager import tiers as _tiers

    monkeypatch.setattr(_snapshot, "SEGMENT_BYTES", 1 << 20)  # format 3: several data objects

    tree = {"big": sharded(np.arange(600 * 1000, dtype=np.float32).reshape(600, 1000), (4,), ("x",), ("x", None)),
            "edge": np.ones((1030, 300), np.float32),  # a host array split in pieces with an edge
            "small": np.arange(10, dtype=np.int16), "scalar": np.float32(3.0), "empty": np.zeros((0, 4)),
            "key": __import__("jax").random.key(1), "n": 3}
    jaxckpt.save(tmp_path / "c", tree)
    loc = jaxckpt._storage.location.resolve(str(tmp_path / "c"))
    man = _commit.read_manifest(loc)
    assert set(_tiers.list_files(loc)) == set(_verify.expected_files(man))
    assert man.format_version == version
    if version == 1:
        assert any(p.startswith("packed/") for p in _verify.expected_files(man))
    else:  # process 0's stream, cut in 1 MiB objects (the manifest is not among them)
        objects = -(-man.streams[0] // (1 << 20))
        assert objects > 1 and set(_verify.expected_files(man)) == {f"data/p0.{n}" for n in range(objects)}


def test_copies_are_assigned_once_each_to_a_process_that_holds_them():
    from jaxckpt._manager import tiers as _tiers

    listings = {0: {"a": 10, "b": 5, "z": 1}, 2: {"a": 10, "c": 7, "z": 1}}  # leaders of groups (0, 1), (2,)
    out = _tiers.assign_copies(listings, [(0, 1), (2,)])
    assert sorted(p for paths in out.values() for p in paths) == ["a", "b", "c", "z"]
    assert set(out.get(2, [])) <= {"a", "c", "z"} and "c" in out[2]
    assert set(out.get(0, []) + out.get(1, [])) <= {"a", "b", "z"}
    assert len(out) == 3  # the group (0, 1) shares its files between its two processes


def test_a_copy_missing_a_file_fails_and_leaves_no_persistent_step(tmp_path):
    from jaxckpt import _commit
    from jaxckpt._manager import tiers as _tiers

    jaxckpt.save(tmp_path / "local" / "1", state(1))
    loc = jaxckpt._storage.location.resolve(str(tmp_path / "local" / "1"))
    man = _commit.read_manifest(loc)
    chunk = next(p for p in sorted(_tiers.list_files(loc)) if p.startswith("data/p0."))  # a data object
    os.remove(tmp_path / "local" / "1" / chunk)  # the only copy of it is gone
    dest = jaxckpt._storage.location.resolve(str(tmp_path / "durable" / "1"))
    with pytest.raises(jaxckpt.CheckpointError, match=f"no process's local directory holds 1 of its files "
                                                      f"\\(e.g. '{chunk}'\\); a host lost its copy"):
        _tiers._Copy(1, loc, dest, man, [(0,)], 5).run()
    assert not os.path.exists(tmp_path / "durable" / "1")
    assert os.listdir(tmp_path / "durable") == []  # the attempt's staging is gone too


def test_delete_removes_the_step_from_every_tier_and_a_step_saved_again_is_the_new_one(tmp_path, s3_server):
    """``delete`` takes the persistent copy with the local step (c1abc6a left it listed and
    restorable from the tier: a deleted step came back); a step saved again restores its
    new values from either tier, and a step only the tier holds is deleted there."""
    durable = s3_server("tiers/del")
    with jaxckpt.CheckpointManager(tmp_path / "local", max_to_keep=2, persistent_directory=durable,
                                   persistent_interval_steps=1) as mgr:
        for i in (1, 2, 3):
            mgr.save(i, state(i))
        mgr.wait_until_finished()
        assert mgr.step_tiers() == {1: ("persistent",), 2: ("local", "persistent"), 3: ("local", "persistent")}
        mgr.delete(3)
        assert mgr.all_steps() == [1, 2] and mgr.latest_step() == 2
        mgr.delete(1)  # only the persistent tier holds it
        assert mgr.step_tiers() == {2: ("local", "persistent")}
        with pytest.raises(jaxckpt.CheckpointNotFoundError, match="No committed step 1 "):
            mgr.delete(1)
        mgr.save(3, state(30))
        mgr.wait_until_finished()
        assert mgr.restore(3, state(0))["step"] == 30
    with pytest.raises(jaxckpt.CheckpointNotFoundError):
        jaxckpt.metadata(dict(durable, path="tiers/del/1"))
    shutil.rmtree(tmp_path / "local")  # the step saved again comes back from the tier as itself
    with jaxckpt.CheckpointManager(tmp_path / "local", persistent_directory=durable,
                                   persistent_interval_steps=1) as mgr:
        assert mgr.all_steps() == [2, 3]
        back = mgr.restore(3, state(0))
        assert_bit_equal(back["w"], np.full((256, 64), 30, np.float32))
        assert back["step"] == 30
