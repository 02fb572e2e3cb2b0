"""A save that holds no lease (a plain `jaxckpt.save` of a step in a manager's directory)
claims its attempt; a writer taking the directory over removes an attempt only when its
writer is gone. Locally and on an object store (the local S3 server)."""

import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

import jaxckpt
from jaxckpt import _claims, _commit, _storage
from jaxckpt._storage import location as _location


def state(i):
    return {"w": np.arange(64 * 64, dtype=np.float32).reshape(64, 64) + i, "step": i}


class HeldSave:
    """A plain save of step 40 on a thread, held before its manifest until released."""

    def __init__(self, directory):
        self.reached, self.release, self.error = threading.Event(), threading.Event(), None
        self.target = (os.path.join(directory, "40") if isinstance(directory, str)
                       else dict(directory, path=directory["path"] + "/40"))
        self.thread = threading.Thread(target=self._run)

    def _hook(self, op, key):
        if op == "commit:before-manifest" and key.rstrip("/").endswith("/40"):
            self.reached.set()
            assert self.release.wait(60)

    def _run(self):
        try:
            jaxckpt.save(self.target, state(40))
        except BaseException as e:  # noqa: BLE001 - checked by the test
            self.error = e

    def __enter__(self):
        _storage.fault_hook = self._hook
        self.thread.start()
        assert self.reached.wait(60)
        return self

    def __exit__(self, *exc):
        self.release.set()
        self.thread.join(60)
        _storage.fault_hook = None


def check(directory, steps):
    loc = _location.resolve(directory)
    assert sorted(_commit.discover_steps(loc)) == steps
    for s in steps:
        where = loc.child(str(s)).url if loc.local is not None else dict(directory, path=f"{directory['path']}/{s}")
        assert jaxckpt.verify(where).ok
        assert jaxckpt.restore(where)["w"].tobytes() == state(s)["w"].tobytes()


@pytest.mark.parametrize("store", ["local", "s3"])
def test_a_writer_taking_over_keeps_a_live_plain_saves_attempt(tmp_path, s3_server, store):
    directory = str(tmp_path / "run") if store == "local" else s3_server("claims/a")
    with jaxckpt.CheckpointManager(directory) as mgr:
        mgr.save(1, state(1))
    with HeldSave(directory) as held:
        with jaxckpt.CheckpointManager(directory) as mgr:  # a new writer: cleans what is dead
            mgr.save(2, state(2))
    assert held.error is None, held.error
    check(directory, [1, 2, 40])
    if store == "local":  # no claim is left once the attempts are committed
        assert [n for n in os.listdir(directory) if _claims.CLAIM_MARK in n] == []


def test_the_attempt_of_a_plain_save_whose_process_is_gone_is_removed(tmp_path, s3_server):
    """A claim of a process that no longer runs (a child that exited): the next writer
    removes its attempt and the claim, locally and on the object store."""
    local, remote = str(tmp_path / "run"), s3_server("claims/b")
    code = ("import json, os, sys; from jaxckpt import _commit; from jaxckpt._storage import location as _location\n"
            "for d in json.loads(sys.argv[1]):\n"
            "    _commit.prepare(_location.resolve(d).child('40'), _commit.new_token(_location.resolve(d).child('40')),"
            " False)\n")
    out = subprocess.run([sys.executable, "-c", code, json.dumps([local, remote])], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(__file__))))
    assert out.returncode == 0, out.stderr
    assert [n for n in os.listdir(local) if _claims.CLAIM_MARK in n]
    rloc = _location.resolve(remote)
    assert any(n.endswith(_claims.CLAIM_SUFFIX) for n in _storage_children(rloc.child("40").child("d")))
    for directory in (local, remote):
        with jaxckpt.CheckpointManager(directory) as mgr:
            mgr.save(1, state(1))
    assert [n for n in os.listdir(local) if n.startswith(".")] == []
    assert _storage_children(rloc.child("40").child("d")) == []


def _storage_children(loc):
    from jaxckpt._storage import kvstore as _kvstore

    try:
        return sorted(_kvstore.list_children(loc))
    except Exception:  # noqa: BLE001 - nothing there
        return []
