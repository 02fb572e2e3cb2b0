"""The writer lease and reader marks (``_lease``, ``_readers``) judged by who the holder
is, not only its pid (issue 19, defect 5), and kept through a failed renewal, lost in
every process at the same call (defect 6)."""

import json
import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from conftest import run_workers

import jaxckpt
from jaxckpt import _owner, _storage
from jaxckpt._manager import lease as _lease
from jaxckpt._manager import marks as _marks
from jaxckpt._storage import location as _location

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "mp_lease_worker.py")
REFUSED = "is being written by another CheckpointManager"


def proc_stat_start_ticks(pid):
    """Field 22 of /proc/<pid>/stat, counted by hand (the command name may hold spaces)."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    return int(stat[stat.rindex(")") + 2:].split(" ")[19])


def this_process(**changes):
    """A lease or mark owner naming this very process, as the library writes one."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot_id = f.read().strip()
    now = time.time()
    owner = {"host": socket.gethostname(), "pid": os.getpid(), "boot_id": boot_id,
             "start_ticks": proc_stat_start_ticks(os.getpid()), "token": "crashed", "started": now - 100,
             "renewed": now, "count": 7, "lease_s": 15.0}
    owner.update(changes)
    return {k: v for k, v in owner.items() if v is not None}


def write_lease(directory, owner):
    directory.mkdir(exist_ok=True)
    (directory / _lease.LEASE_FILE).write_text(json.dumps(owner))


def lease_on_disk(directory):
    return json.loads((directory / _lease.LEASE_FILE).read_text())


def test_identity_is_the_start_time_and_boot_id_of_the_pid():
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot_id = f.read().strip()
    assert _owner.identity(os.getpid()) == {"boot_id": boot_id, "start_ticks": proc_stat_start_ticks(os.getpid())}
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:  # another process: its own start time, the same boot
        assert _owner.identity(child.pid) == {"boot_id": boot_id, "start_ticks": proc_stat_start_ticks(child.pid)}
    finally:
        child.kill()
        child.wait(10)


# --- defect 5: a restarted container (same host, same pid) -----------------------------

def restarted(case):
    """The lease or mark a crashed process left that this process must judge gone."""
    return {
        # the entrypoint of the restarted container got the crashed writer's pid
        "restarted": lambda: this_process(start_ticks=proc_stat_start_ticks(os.getpid()) - 1000),
        # the machine rebooted (same hostname, same pid again)
        "rebooted": lambda: this_process(boot_id="00000000-0000-0000-0000-000000000000"),
        # an older version's (no identity), not renewed for 5 s past its period (not 75 s)
        "old_version_stale": lambda: this_process(boot_id=None, start_ticks=None, renewed=time.time() - 20),
    }[case]()


RESTARTS = ["old_version_stale", "rebooted", "restarted"]


@pytest.mark.parametrize("case", RESTARTS)
def test_a_restarted_writer_takes_over_the_lease_its_crashed_self_left(tmp_path, case):
    owner = restarted(case)
    write_lease(tmp_path, owner)
    lease = _lease.Lease.acquire(_location.resolve(str(tmp_path)))
    try:
        held = lease_on_disk(tmp_path)
        assert held["token"] == lease.owner["token"] != "crashed" and held["pid"] == os.getpid()
        assert held["start_ticks"] == proc_stat_start_ticks(os.getpid())
    finally:
        lease.release()
    assert not (tmp_path / _lease.LEASE_FILE).exists()
    # the manager the restarted container constructs starts (which attempts it cleans then
    # is the attempts' own rule: test_manager.py, test_crash.py)
    write_lease(tmp_path, owner)
    with jaxckpt.CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, {"w": np.arange(8, dtype=np.int32)})
        assert lease_on_disk(tmp_path)["token"] == mgr._lease.owner["token"]
    assert jaxckpt.restore(tmp_path / "1")["w"].tobytes() == np.arange(8, dtype=np.int32).tobytes()


@pytest.mark.parametrize("case", ["same_process", "old_version_fresh"])
def test_a_live_writer_on_this_host_is_still_refused(tmp_path, case):
    # the same identity (or none recorded, by an older version) and a fresh renewal: alive
    owner = this_process() if case == "same_process" else this_process(boot_id=None, start_ticks=None)
    write_lease(tmp_path, owner)
    with pytest.raises(jaxckpt.CheckpointError, match=f"{REFUSED}: pid {os.getpid()} on host "):
        jaxckpt.CheckpointManager(tmp_path)
    assert lease_on_disk(tmp_path) == owner
    # and a real second manager in this process, while the first one holds the lease
    (tmp_path / _lease.LEASE_FILE).unlink()
    with jaxckpt.CheckpointManager(tmp_path):
        with pytest.raises(jaxckpt.CheckpointError, match=REFUSED):
            jaxckpt.CheckpointManager(tmp_path)


def write_mark(directory, step, owner):
    marks = directory / _marks.READERS_DIR
    marks.mkdir(exist_ok=True)
    (marks / f"{step}-0123456789ab.json").write_text(json.dumps(owner))


@pytest.mark.parametrize("case", RESTARTS)
def test_a_reader_mark_left_by_a_restarted_pid_does_not_hold_a_delete(tmp_path, case):
    with jaxckpt.CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, {"w": np.ones(4, np.float32)})
        mgr.save(2, {"w": np.full(4, 2.0, np.float32)})
        owner = restarted(case)
        owner.pop("token")
        write_mark(tmp_path, 1, owner)
        mgr.delete(1)
        assert mgr.all_steps() == [2] and sorted(os.listdir(tmp_path / _marks.READERS_DIR)) == []
        assert not (tmp_path / "1").exists()


def test_a_live_reader_mark_on_this_host_still_holds_a_delete(tmp_path):
    with jaxckpt.CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, {"w": np.ones(4, np.float32)})
        mgr.save(2, {"w": np.full(4, 2.0, np.float32)})
        owner = this_process()
        owner.pop("token")
        write_mark(tmp_path, 1, owner)
        with pytest.raises(jaxckpt.CheckpointError,
                           match=rf"Step 1 in '{tmp_path}' is being restored by pid {os.getpid()} on host "):
            mgr.delete(1)
        assert mgr.all_steps() == [1, 2]
        assert jaxckpt.restore(tmp_path / "1")["w"].tobytes() == np.ones(4, np.float32).tobytes()


def test_a_reader_mark_records_the_identity_of_its_process(tmp_path):
    with _marks.ReaderMark(_location.resolve(str(tmp_path)), 3) as mark:
        (name,) = os.listdir(tmp_path / _marks.READERS_DIR)
        written = json.loads((tmp_path / _marks.READERS_DIR / name).read_text())
        assert written == mark.owner
        assert written["start_ticks"] == proc_stat_start_ticks(os.getpid())
        assert _marks.live_readers(_location.resolve(str(tmp_path)), 3) == [written]


# --- defect 6: a failed renewal is not a lost lease ------------------------------------


class RenewFaults:
    """A fault hook failing the first ``failures`` renewals of the writer lease (all of
    them for ``None``); ``reached(n)`` waits (bounded) for the n-th renewal attempt."""

    def __init__(self, failures):
        self.failures, self.calls = failures, 0
        self.cond = threading.Condition()

    def __call__(self, op, key):
        if (op, key) != ("renew", _lease.LEASE_FILE):
            return
        with self.cond:
            self.calls += 1
            self.cond.notify_all()
            fail = self.failures is None or self.calls <= self.failures
        if fail:
            raise OSError(f"injected: lease store unreachable (renewal {self.calls})")

    def reached(self, n, timeout=10):
        with self.cond:
            return self.cond.wait_for(lambda: self.calls >= n, timeout)


def test_one_failed_renewal_keeps_the_lease_and_the_next_saves_commit(tmp_path, monkeypatch):
    monkeypatch.setattr(_lease, "RENEW_S", 0.05)
    faults = RenewFaults(failures=1)
    with jaxckpt.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"w": np.ones(4, np.float32)})
        mgr.wait_until_finished()
        count = lease_on_disk(tmp_path)["count"]
        monkeypatch.setattr(_storage, "fault_hook", faults)
        # the failed renewal, then two that worked (the fourth begins after they wrote)
        assert faults.reached(4), f"the renew fault point was reached {faults.calls} times"
        assert mgr._lease.lost is None
        assert lease_on_disk(tmp_path)["count"] >= count + 2
        assert lease_on_disk(tmp_path)["token"] == mgr._lease.owner["token"]
        for step in (2, 3):
            assert mgr.save(step, {"w": np.full(4, step, np.float32)})
        mgr.wait_until_finished()
        assert mgr.all_steps() == [1, 2, 3]
    assert jaxckpt.restore(tmp_path / "3")["w"].tobytes() == np.full(4, 3, np.float32).tobytes()
    assert not (tmp_path / _lease.LEASE_FILE).exists()  # released on close


def test_renewals_failing_for_a_lease_period_lose_the_lease_for_good(tmp_path, monkeypatch):
    monkeypatch.setattr(_lease, "LEASE_S", 1.0)
    monkeypatch.setattr(_lease, "RENEW_S", 0.05)
    faults = RenewFaults(failures=None)
    mgr = jaxckpt.CheckpointManager(tmp_path)
    mgr.save(1, {"w": np.ones(4, np.float32)})
    mgr.wait_until_finished()
    lease = mgr._lease
    monkeypatch.setattr(_storage, "fault_hook", faults)
    deadline = time.monotonic() + 10
    while lease.lost is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert faults.calls >= 5, faults.calls  # 0.95 s of renewals every 0.05 s, all failed
    lost = (rf"the writer lease of '{tmp_path}' was not renewed for \d+\.\d s \(the last renewal failed: "
            r"OSError: injected: lease store unreachable \(renewal \d+\)\); after its lease period \(1 s\) "
            "another writer may take the directory over")
    assert mgr.save(2, {"w": np.full(4, 2.0, np.float32)})  # async: fails at its commit
    with pytest.raises(jaxckpt.CheckpointError,
                       match=rf"Saving step 2 to '{tmp_path}' failed: CheckpointManager for '{tmp_path}' "
                             rf"cannot commit: {lost}"):
        mgr.wait_until_finished()
    with pytest.raises(jaxckpt.CheckpointError,
                       match=rf"CheckpointManager for '{tmp_path}' cannot delete step 1: {lost}"):
        mgr.delete(1)
    assert mgr.all_steps() == [1]
    assert sorted(n for n in os.listdir(tmp_path) if not n.startswith(".jaxckpt")) == ["1", "history.jsonl"]
    # the storage is back: still lost (a newcomer on this host may already have taken over)
    monkeypatch.setattr(_storage, "fault_hook", None)
    time.sleep(0.2)  # several renewal intervals: none may revive it
    assert lease.lost is not None
    # a newcomer judges the silent holder gone at once (same host, renewal older than its period)
    t0 = time.monotonic()
    with jaxckpt.CheckpointManager(tmp_path, async_save=False) as newcomer:
        assert time.monotonic() - t0 < 1.0
        newcomer.save(2, {"w": np.full(4, 2.0, np.float32)})
        mgr.close()  # the old writer gives up without touching the newcomer's lease
        assert lease_on_disk(tmp_path)["token"] == newcomer._lease.owner["token"]
    assert jaxckpt.restore(tmp_path / "2")["w"].tobytes() == np.full(4, 2.0, np.float32).tobytes()


# --- defect 6: two processes raise at the same call ------------------------------------


def run_job(args, nproc=2, ndev=2, timeout=150):
    return run_workers(WORKER, nproc, lambda i, port: [port, nproc, i, ndev, json.dumps(args)], timeout)


@pytest.mark.parametrize("async_save", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["sync", "async"])
def test_a_lease_taken_over_fails_the_same_call_in_every_process(tmp_path, async_save):
    path, other = str(tmp_path / "steps"), str(tmp_path / "plain")
    res = run_job({"path": path, "other": other, "async": async_save})
    taken = f"the writer lease of '{path}' was taken over by pid 4242 on host 'other-host'"
    assert res[0]["lost"].startswith(taken), res[0]
    failing = "wait" if async_save else "save"  # async: the save returns; its failure surfaces at the wait
    for p in (0, 1):
        r = res[p]
        assert r[failing]["raised"] == "CheckpointError", (p, r)
        assert f"Saving step 2 to '{path}' failed" in r[failing]["message"], (p, r)
        assert f"cannot commit: {taken}" in r[failing]["message"], (p, r)
        if async_save:
            assert r["save"] == {"returned": "True"}, (p, r)
        else:
            assert r["wait"] == {"returned": "None"}, (p, r)
        assert r["delete"]["raised"] == "CheckpointError", (p, r)
        assert f"cannot delete step 1: {taken}" in r["delete"]["message"], (p, r)
        assert r["steps"] == [1], (p, r)
        assert r["close"] == {"returned": "None"}, (p, r)
        # the operation counters still agree: a plain save afterwards commits in both
        assert r["plain_save"] == {"returned": "None"} and r["plain_restored"] is True, (p, r)
    assert sorted(os.listdir(path)) == [".jaxckpt-writer.json", "1", "history.jsonl"]
    assert lease_on_disk(tmp_path / "steps")["token"] == "intruder"  # the new writer's lease is left alone
