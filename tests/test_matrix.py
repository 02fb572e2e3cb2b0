"""Features against each other: every pair of the things that touch one manager
directory, run at once, one of them held at its most delicate moment by a fault point.

The actors (each a process of its own, tests/matrix_worker.py, or the `jaxckpt` CLI):

  writer   a writing manager, async saves 10 and 11, retention keeps 2  (held: step 11's
           data written, its manifest not yet)
  persist  a manager elsewhere whose persistent tier is this directory, step 20 (held:
           mid-copy)
  reader   a read-only manager restoring the latest step, checked bit for bit (held:
           mid-read, its reader mark set)
  save     a plain `jaxckpt.save` of step 40 into the directory (held: before its manifest)
  preempt  a training loop that gets SIGTERM and saves the step the watch names (held:
           before its manifest)
  restart  a restarted container: the crashed writer before it had the same pid (its
           lease and a dead attempt are left), saves step 50
  job2     a second job's writing manager, step 60
  gc       `jaxckpt gc --yes`
  rm       `jaxckpt rm <dir> 1`
  verify   `jaxckpt verify` of the newest step

A pair (a, b): a is started and held (when it has a hold point), b runs to the end, a is
released and finishes; two actors without a hold point run at the same time. Every wait
is bounded. Afterwards every listed step verifies and restores to its own values, and
every step an actor reported committed is listed. Each actor's verdict is asserted; the
table is in docs/guarantees.md ("Features against each other").
"""

import itertools
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import jaxckpt
from jaxckpt import _commit
from jaxckpt._storage import location as _location

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ACTOR = os.path.join(ROOT, "tests", "matrix_worker.py")
EXE = os.path.join(os.path.dirname(sys.executable), "jaxckpt")
ORDER = ["writer", "persist", "reader", "save", "preempt", "restart", "job2", "gc", "rm", "verify"]
HOLDS = {"writer", "persist", "reader", "save", "preempt"}
TIMEOUT = 120

OK, LIVE, READ = "ok", "refused: a live writer", "refused: being restored"
OLDER = "refused: older than the newest step"

# (a, b) -> (verdict of a, verdict of b). Writers exclude each other (the lease), a held
# reader defers the delete of its step, a plain save is no writer and needs no lease.
EXPECTED = {
    ("writer", "persist"): (OK, LIVE), ("writer", "reader"): (OK, OK), ("writer", "save"): (OK, OK),
    ("writer", "preempt"): (OK, LIVE), ("writer", "restart"): (OK, LIVE), ("writer", "job2"): (OK, LIVE),
    ("writer", "gc"): (OK, LIVE), ("writer", "rm"): (OK, LIVE), ("writer", "verify"): (OK, OK),
    ("persist", "reader"): (OK, OK), ("persist", "save"): (OK, OK), ("persist", "preempt"): (OK, LIVE),
    ("persist", "restart"): (OK, LIVE), ("persist", "job2"): (OK, LIVE), ("persist", "gc"): (OK, LIVE),
    ("persist", "rm"): (OK, LIVE), ("persist", "verify"): (OK, OK),
    ("reader", "save"): (OK, OK), ("reader", "preempt"): (OK, OK), ("reader", "restart"): (OK, OK),
    ("reader", "job2"): (OK, OK), ("reader", "gc"): (OK, OK), ("reader", "rm"): (OK, OK),
    ("reader", "verify"): (OK, OK),
    ("save", "preempt"): (OK, OK), ("save", "restart"): (OK, OK), ("save", "job2"): (OK, OK),
    ("save", "gc"): (OK, LIVE), ("save", "rm"): (OK, OK), ("save", "verify"): (OK, OK),
    ("preempt", "restart"): (OK, LIVE), ("preempt", "job2"): (OK, LIVE), ("preempt", "gc"): (OK, LIVE),
    ("preempt", "rm"): (OK, LIVE), ("preempt", "verify"): (OK, OK),
    ("restart", "job2"): ("race", "race"), ("restart", "gc"): ("race", "race"), ("restart", "rm"): ("race", "race"),
    ("restart", "verify"): (OK, OK), ("job2", "gc"): ("race", "race"), ("job2", "rm"): ("race", "race"),
    ("job2", "verify"): (OK, OK), ("gc", "rm"): ("race", "race"), ("gc", "verify"): (OK, OK),
    ("rm", "verify"): (OK, OK),
}
PAIRS = list(itertools.combinations(ORDER, 2))
FAST = ("save", "job2")  # the one pair of the fast tier (`make test`); `make test-all` runs all 45


def state(i):
    return {"w": np.arange(64 * 64, dtype=np.float32).reshape(64, 64) + i,
            "b": np.arange(100, dtype=np.int32) * i, "step": i}


def classify(text):
    if text == OK:
        return OK
    if "being written by another CheckpointManager" in text or "a live writer holds" in text:
        return LIVE
    if "being restored" in text:
        return READ
    if "could never be restored as the latest" in text:
        return OLDER
    return text


class Actor:
    def __init__(self, name, directory, aux, rundir, hold):
        self.name, self.rundir, self.hold = name, rundir, hold
        env = dict(os.environ, PYTHONPATH=os.environ.get("JAXCKPT_TEST_ROOT", ROOT), JAX_PLATFORMS="cpu")
        if name in ("gc", "rm", "verify"):
            args = {"gc": ["gc", directory, "--yes"], "rm": ["rm", directory, "1"],
                    "verify": ["verify", os.path.join(directory, str(max(_steps(directory), default=1)))]}[name]
            cmd = [EXE, *args]
        else:
            cmd = [sys.executable, ACTOR, name, directory, aux, rundir, "1" if hold else "0"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)

    def wait_held(self):
        """Until the actor reached its hold point (or ended without reaching it)."""
        deadline = time.monotonic() + TIMEOUT
        while not os.path.exists(os.path.join(self.rundir, f"{self.name}.held")):
            if self.proc.poll() is not None:
                return
            assert time.monotonic() < deadline, f"{self.name} never reached its hold point"
            time.sleep(0.02)

    def release(self):
        open(os.path.join(self.rundir, f"{self.name}.release"), "w").close()

    def finish(self):
        try:
            out, err = self.proc.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"{self.name} did not finish within {TIMEOUT}s") from None
        if self.name in ("gc", "rm", "verify"):
            return (OK if self.proc.returncode == 0 else classify(err.strip())), []
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        assert lines, f"{self.name} exited {self.proc.returncode}: {err[-2000:]}"
        res = json.loads(lines[-1][7:])
        assert not res["verdict"].startswith("crash"), f"{self.name}: {res['verdict']}"
        return classify(res["verdict"]), res["steps"]


def _steps(directory):
    return sorted(_commit.discover_steps(_location.resolve(str(directory))))


def check_directory(directory):
    """Every listed step verifies and restores to its own values, bit for bit."""
    listed = _steps(directory)
    for step in listed:
        where = os.path.join(directory, str(step))
        report = jaxckpt.verify(where)
        assert report.ok, (step, report.problems)
        back = jaxckpt.restore(where)
        want = state(step)
        assert back["w"].tobytes() == want["w"].tobytes() and back["b"].tobytes() == want["b"].tobytes(), step
        assert back["step"] == step
    return listed


@pytest.mark.parametrize("a,b", [pytest.param(a, b, id=f"{a}+{b}", marks=() if (a, b) == FAST else pytest.mark.slow)
                                 for a, b in PAIRS])
def test_pair(tmp_path, a, b):
    directory, rundir = str(tmp_path / "run"), str(tmp_path / "ctl")
    os.makedirs(rundir)
    with jaxckpt.CheckpointManager(directory) as mgr:
        mgr.save(1, state(1))
        mgr.save(2, state(2))
    if a in HOLDS:
        first = Actor(a, directory, str(tmp_path / "aux-a"), rundir, hold=True)
        first.wait_held()
        second = Actor(b, directory, str(tmp_path / "aux-b"), rundir, hold=False)
        got_b = second.finish()
        first.release()
        got_a = first.finish()
    else:  # neither has a hold point: both at once
        first = Actor(a, directory, str(tmp_path / "aux-a"), rundir, hold=False)
        second = Actor(b, directory, str(tmp_path / "aux-b"), rundir, hold=False)
        got_a, got_b = first.finish(), second.finish()
    listed = check_directory(directory)
    verdicts = (got_a[0], got_b[0])
    want = EXPECTED[(a, b)]
    if want == ("race", "race"):
        # who wins depends on timing; at least one goes through, and a loser names the
        # winner: its lease, or (one after the other) its newer step, as any older step is
        assert OK in verdicts and all(v in (OK, LIVE, OLDER) for v in verdicts), verdicts
    else:
        assert verdicts == want, verdicts
    promised = set(got_a[1]) | set(got_b[1])
    assert promised <= set(listed), (promised, listed)
