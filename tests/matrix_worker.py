"""One actor of tests/test_matrix.py: a process that touches the contested directory.

Usage: matrix_worker.py ACTOR DIR AUX RUNDIR HOLD
With HOLD=1 the actor stops at its most delicate moment (a fault point): it creates
RUNDIR/<ACTOR>.held and waits (at most 120 s) for RUNDIR/<ACTOR>.release. It prints
one line `RESULT <json>`: its verdict ("ok" or the error) and the steps it committed.
"""

import json
import os
import signal
import sys
import time
import traceback

actor, directory, aux, rundir, hold = sys.argv[1:6]
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np

import jaxckpt
from jaxckpt import _owner, _storage, _untrusted
from jaxckpt._manager import lease as _lease


def state(i):
    return {"w": np.arange(64 * 64, dtype=np.float32).reshape(64, 64) + i,
            "b": np.arange(100, dtype=np.int32) * i, "step": i}


def arm(point, match=lambda key: True):
    """Hold at the first hit of ``point`` whose key matches, until released."""
    fired = []

    def hook(op, key):
        if op == point and not fired and match(key):
            fired.append(key)
            open(os.path.join(rundir, f"{actor}.held"), "w").close()
            deadline = time.monotonic() + 120
            while not os.path.exists(os.path.join(rundir, f"{actor}.release")):
                if time.monotonic() > deadline:
                    raise RuntimeError("never released")
                time.sleep(0.02)

    _storage.fault_hook = hook


def writer():
    """A writing manager: async saves with retention (keeps 2)."""
    if hold == "1":
        arm("commit:before-manifest", lambda key: key.endswith("/11"))
    with jaxckpt.CheckpointManager(directory, max_to_keep=2) as mgr:
        mgr.save(10, state(10))
        mgr.save(11, state(11))
        mgr.wait_until_finished()
    return [10, 11]


def persist():
    """A manager on its own directory whose persistent tier is the contested one."""
    if hold == "1":
        arm("copy")
    with jaxckpt.CheckpointManager(aux, persistent_directory=directory, persistent_interval_steps=1) as mgr:
        mgr.save(20, state(20))
        mgr.wait_until_finished()
    return [20]


def reader():
    """A read-only manager restoring the latest step, checked bit for bit."""
    if hold == "1":
        arm("read")
    with jaxckpt.CheckpointManager(directory, read_only=True) as mgr:
        step = mgr.latest_step()
        back = mgr.restore(step)
    want = state(step)
    assert back["w"].tobytes() == want["w"].tobytes() and back["b"].tobytes() == want["b"].tobytes(), step
    assert back["step"] == step
    return []


def plain_save():
    """``jaxckpt.save`` of a step directory, outside any manager."""
    if hold == "1":
        arm("commit:before-manifest", lambda key: key.endswith("/40"))
    jaxckpt.save(os.path.join(directory, "40"), state(40))
    return [40]


def preemption():
    """A training loop that gets SIGTERM and saves at the step the watch names."""
    if hold == "1":
        arm("commit:before-manifest")
    with jaxckpt.CheckpointManager(directory) as mgr:
        for step in range(30, 40):
            if mgr.reached_preemption(step):
                mgr.save(step, state(step), force=True)
                mgr.wait_until_finished()
                return [step]
            if step == 31:
                os.kill(os.getpid(), signal.SIGTERM)
    raise RuntimeError("the preemption step never came")


def restart():
    """A restarted container: the crashed writer before it had this very pid (another
    process start). Its lease and a dead attempt are on disk, unless a live writer's
    lease is there."""
    path = os.path.join(directory, _lease.LEASE_FILE)
    try:
        with open(path, "rb") as f:
            holder = _untrusted.load_record(f.read())
    except FileNotFoundError:
        holder = None
    if holder is None:
        me = _owner.identity(os.getpid())
        crashed = {"host": _owner.host(), "pid": os.getpid(), "token": "crashed", "started": time.time() - 60,
                   "renewed": time.time() - 1, "count": 7, "lease_s": _lease.LEASE_S, **me}
        if "start_ticks" in crashed:
            crashed["start_ticks"] -= 1
        with open(path, "w") as f:
            json.dump(crashed, f)
        os.makedirs(os.path.join(directory, ".50.jaxckpt-tmp-crashed0000"), exist_ok=True)
        with open(os.path.join(directory, ".50.jaxckpt-tmp-crashed0000", "junk"), "wb") as f:
            f.write(b"x" * 100)
    with jaxckpt.CheckpointManager(directory) as mgr:
        mgr.save(50, state(50))
        mgr.wait_until_finished()
    return [50]


def second_job():
    """Another job's writing manager on the same directory."""
    with jaxckpt.CheckpointManager(directory) as mgr:
        mgr.save(60, state(60))
        mgr.wait_until_finished()
    return [60]


ACTORS = {"writer": writer, "persist": persist, "reader": reader, "save": plain_save, "preempt": preemption,
          "restart": restart, "job2": second_job}

try:
    steps = ACTORS[actor]()
    out = {"verdict": "ok", "steps": steps}
except jaxckpt.CheckpointError as e:
    out = {"verdict": f"{type(e).__name__}: {e}", "steps": []}
except BaseException:
    out = {"verdict": "crash: " + traceback.format_exc()[-1500:], "steps": []}
print("RESULT " + json.dumps(out), flush=True)
