"""The persistent tier is written under the directory's writer lease, like any writer:
while a step is being copied there, a cleaner (`jaxckpt gc --yes`, `jaxckpt rm`) or a
second job's manager refuses, naming the holder, and the copy commits intact.

A fault point holds the copy at its most delicate moment: files of the attempt written,
the manifest not yet."""

import os
import subprocess
import sys
import threading

import numpy as np
import pytest
from conftest import assert_bit_equal, sharded

import jaxckpt
from jaxckpt import _snapshot, _storage

EXE = os.path.join(os.path.dirname(sys.executable), "jaxckpt")
URL = "s3://jaxckpt-test/"


def state(i):
    return {"w": sharded(np.full((256, 64), i, np.float32), (4,), ("x",), ("x", None)),
            "b": np.arange(8, dtype=np.int32) + i, "step": i}


@pytest.fixture(autouse=True)
def _small_data_objects(monkeypatch):
    """Format 3 keeps this small state in one data object; 16 KiB objects make it several,
    so the copy can be held with one file of its attempt written."""
    monkeypatch.setattr(_snapshot, "SEGMENT_BYTES", 16 << 10)


class HoldCopy:
    """Holds the persistent copy after its first file until released."""

    def __init__(self):
        self.reached, self.release, self.files = threading.Event(), threading.Event(), 0

    def __call__(self, op, key):
        if op == "copy":
            self.files += 1
            if self.files == 2:  # one file of the attempt is written
                self.reached.set()
                assert self.release.wait(120), "the test never released the copy"

    def __enter__(self):
        _storage.fault_hook = self
        return self

    def __exit__(self, *exc):
        self.release.set()
        _storage.fault_hook = None


def cli(durable, *args):
    env = dict(os.environ, AWS_ENDPOINT_URL=durable["endpoint"], AWS_REGION="us-east-1")
    return subprocess.run([EXE, *args], capture_output=True, text=True, env=env, timeout=120)


def test_a_cleaner_refuses_while_the_persistent_copy_runs(tmp_path, s3_server):
    durable = s3_server("lease/a")
    url = URL + "lease/a"
    with jaxckpt.CheckpointManager(tmp_path / "local", persistent_directory=durable,
                                   persistent_interval_steps=2) as mgr:
        mgr.save(2, state(2))
        mgr.wait_until_finished()
        with HoldCopy() as hold:
            mgr.save(4, state(4))
            assert hold.reached.wait(60)
            # what a cleaner sees: the attempt belongs to a live writer
            reader = jaxckpt.CheckpointManager(durable, read_only=True)
            attempts = reader.attempts()
            reader.close()
            assert attempts and all(a["writer_alive"] for a in attempts), attempts
            assert {a["writer"]["pid"] for a in attempts} == {os.getpid()}
            gc = cli(durable, "gc", url, "--yes")
            assert gc.returncode != 0 and "live writer" in gc.stderr, (gc.returncode, gc.stdout, gc.stderr)
            rm = cli(durable, "rm", url, "2")
            assert rm.returncode != 0 and f"pid {os.getpid()}" in rm.stderr, (rm.returncode, rm.stderr)
            with pytest.raises(jaxckpt.CheckpointError, match=f"being written by another CheckpointManager: "
                                                               f"pid {os.getpid()}"):
                jaxckpt.CheckpointManager(durable)
            with pytest.raises(jaxckpt.CheckpointError, match="being written by another CheckpointManager"):
                jaxckpt.CheckpointManager(tmp_path / "other", persistent_directory=durable,
                                          persistent_interval_steps=2)
            hold.release.set()
            mgr.wait_until_finished()
        assert mgr.step_tiers() == {2: ("local", "persistent"), 4: ("local", "persistent")}
    for step in (2, 4):
        loc = dict(durable, path=f"lease/a/{step}")
        assert jaxckpt.verify(loc).ok
        back = jaxckpt.restore(loc)
        assert_bit_equal(back["w"], np.full((256, 64), step, np.float32))
        assert back["step"] == step
    # the writer is gone: its lease with it; a cleaner may now work there
    assert cli(durable, "gc", url, "--yes").returncode == 0


def test_the_persistent_lease_is_released_on_close_and_refused_while_held(tmp_path):
    durable = tmp_path / "durable"
    mgr = jaxckpt.CheckpointManager(tmp_path / "local", persistent_directory=durable, persistent_interval_steps=1)
    assert os.path.exists(durable / ".jaxckpt-writer.json")
    with pytest.raises(jaxckpt.CheckpointError, match="being written by another CheckpointManager"):
        jaxckpt.CheckpointManager(durable)
    mgr.close()
    assert not os.path.exists(durable / ".jaxckpt-writer.json")
    jaxckpt.CheckpointManager(durable).close()


def test_a_copy_refuses_to_commit_once_another_writer_took_the_tier(tmp_path):
    import json

    durable = tmp_path / "durable"
    with jaxckpt.CheckpointManager(tmp_path / "local", persistent_directory=durable,
                                   persistent_interval_steps=1) as mgr:
        with HoldCopy() as hold:
            mgr.save(1, state(1))
            assert hold.reached.wait(60)
            lease = durable / ".jaxckpt-writer.json"
            owner = json.loads(lease.read_text())
            lease.write_text(json.dumps(dict(owner, token="someone-else", pid=1)))  # taken over
            mgr._persistent.lease.renew()  # what the renewal thread does within RENEW_S
            hold.release.set()
            with pytest.raises(jaxckpt.CheckpointError, match="persistent tier .* cannot be written: the writer "
                                                               "lease .* was taken over by pid 1"):
                mgr.wait_until_finished()
        assert mgr.step_tiers() == {1: ("local",)}
    assert not [n for n in os.listdir(durable) if n.isdigit()]
