"""Crashes at exact places, and storage that refuses to write (issue 12, items 1, 2 and 8).

A child process (tests/crash_worker.py) saves with ``JAXCKPT_FAULT=<point>[@<key>][:<n>]``
set, and ``jaxckpt._storage`` SIGKILLs it at that fault point: before any data, in the
middle of the data, after the data, in the middle of the manifest, after the manifest,
between the two renames of a local overwrite, after the commit, in the middle of a
retention delete. After each kill: what is on disk is what the point says it is (the kill
happened there), a reader lists exactly the committed steps, a fresh writer manager
lists the same and cleans every leftover, the latest step restores bit for bit and
verifies, and the next save works. In a single process and in a real 2-process job.

Then full disks, denied permissions and read-only file systems, injected at the data
writes (format 3's stream entries; with ``JAXCKPT_FORMAT=1`` the chunk files and the
tensorstore writes), the manifest write and the commit's points (and, unless running as
root, a real ``chmod 0o500``): the save raises a ``CheckpointError`` with the cause,
commits nothing, leaves no staging directory, and the previous step still restores.
"""

import concurrent.futures
import errno
import json
import os
import re
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest
from crash_worker import same, state

import jaxckpt
from jaxckpt import _claims, _commit, _storage
from jaxckpt._storage import kvstore as _kvstore

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "crash_worker.py")
LEASE, HISTORY = ".jaxckpt-writer.json", "history.jsonl"


def spawn(args, fault=None):
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    env.pop(_storage.FAULT_ENV, None)
    if fault is not None:
        env[_storage.FAULT_ENV] = fault
    return subprocess.Popen([sys.executable, WORKER, json.dumps(args)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(proc, timeout=60):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    result = [json.loads(ln[7:]) for ln in out.splitlines() if ln.startswith("RESULT ")]
    committed = [int(ln.split()[1]) for ln in out.splitlines() if ln.startswith("COMMITTED ")]
    return {"rc": proc.returncode, "result": result[-1] if result else None, "committed": committed,
            "stderr": err[-3000:]}


def hidden(path, mark=""):
    """Hidden attempts (not the lease, not the claims that say who writes an attempt)."""
    return sorted(n for n in os.listdir(path)
                  if n.startswith(".") and mark in n and n != LEASE and _claims.CLAIM_MARK not in n)


def only(names):
    assert len(names) == 1, names
    return names[0]


def files_under(path):
    return sorted(os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs)


def check_recovered(path, steps, values=None, read=None):
    """A reader lists exactly ``steps`` (``read``, if given); a fresh writer lists
    ``steps`` and leaves no hidden attempt; every step verifies; the latest restores
    bit for bit (``values``: step -> the value its state was saved with); the next save
    works."""
    values = values or {}
    with jaxckpt.CheckpointManager(path, read_only=True) as reader:
        assert reader.all_steps() == (steps if read is None else read)
    with jaxckpt.CheckpointManager(path, async_save=False) as mgr:
        assert mgr.all_steps() == steps
        assert [n for n in os.listdir(path) if n.startswith(".") and n != LEASE] == []  # claims too
        for s in steps:
            report = jaxckpt.verify(os.path.join(path, str(s)))
            assert report.ok, (s, report)
        latest = steps[-1]
        got = mgr.restore()
        assert same(got, values.get(latest, latest)), latest
        assert isinstance(got["big"], np.ndarray) and got["big"].dtype == np.float32
        mgr.save(latest + 1, state(latest + 1))
        assert same(mgr.restore(latest + 1), latest + 1)
    assert sorted(os.listdir(path)) == sorted([*map(str, steps), str(latest + 1), HISTORY])


# --- a single process ---------------------------------------------------------------------

# Steps 1, 2, 3 with max_to_keep=2: step 3's save is killed, or the retention delete of
# step 1 that follows its commit. Format 3 (what a save writes): one stream of 5 entries per
# step, big's 4 chunks of 262,144 bytes at stride 262,208, then small's; "mid-data" is
# killed before big's third entry. The ``FORMAT1`` cases save the layout of formats 1 and 2
# (``JAXCKPT_FORMAT=1``): killed after 1 of big's 4 chunk files (jaxckpt's own writer), or
# in the tensorstore write of the packed small leaves.
# case -> (fault, async_save, the committed steps after the kill)
V3_STRIDE = 262208  # big's entries (a chunk's 262,144 bytes + crc32c, rounded up to 64)
V3_STREAM = 4 * V3_STRIDE + 52  # then small's entry (12 int32 + crc32c)
SINGLE = {
    "before-data": ("data:start:3", False, [1, 2]),
    "mid-data": (f"write@p0@{2 * V3_STRIDE}:3", False, [1, 2]),
    "mid-data-async": (f"write@p0@{2 * V3_STRIDE}:3", True, [1, 2]),
    "f1-mid-data": ("write@0:10", False, [1, 2]),
    "mid-tensorstore-data": ("write@packed/p0:3", False, [1, 2]),
    "after-data": ("commit:before-manifest:3", False, [1, 2]),
    "mid-manifest": ("manifest:partial:3", False, [1, 2]),
    "mid-manifest-async": ("manifest:partial:3", True, [1, 2]),
    "after-manifest": ("commit:after-manifest:3", False, [1, 2]),
    "after-rename": ("commit:after-rename:3", True, [1, 2, 3]),
    "delete-after-rename": ("delete:after-rename:1", False, [2, 3]),
    "mid-delete": ("delete:middle:1", False, [2, 3]),
    "mid-delete-async": ("delete:middle:1", True, [2, 3]),
}
FORMAT1 = {"f1-mid-data", "mid-tensorstore-data"}

# An overwrite of committed step 2 (value 2) with value 20, by ``jaxckpt.save(...,
# overwrite=True)``, with the atomic exchange or with two renames.
# case -> (fault, exchange, the value step 2 restores after the kill)
OVERWRITE = {
    "overwrite-mid-data": (f"write@p0@{2 * V3_STRIDE}", True, 2),
    "overwrite-mid-manifest": ("manifest:partial", True, 2),
    "overwrite-after-manifest": ("commit:after-manifest", True, 2),
    "overwrite-between-renames": ("commit:between-renames", False, 2),
    "overwrite-after-exchange": ("commit:after-rename", True, 20),
    "overwrite-after-renames": ("commit:after-rename", False, 20),
    "overwrite-mid-old-delete": ("delete:middle", False, 20),
}


def _prepare_overwrite(path):
    with jaxckpt.CheckpointManager(path, async_save=False) as mgr:
        mgr.save(1, state(1))
        mgr.save(2, state(2))


@pytest.fixture(scope="module")
def single_runs(tmp_path_factory):
    """Every single-process case, run at once (a few children at a time)."""
    base = tmp_path_factory.mktemp("crash")
    jobs = {}
    for case, (fault, async_save, _) in SINGLE.items():
        jobs[case] = (str(base / case), {"scenario": "manager", "steps": 3, "async": async_save,
                                         "format": 1 if case in FORMAT1 else 3}, fault)
    with pytest.MonkeyPatch.context() as mp:  # a module fixture: conftest's pin does not reach it
        mp.setenv("JAXCKPT_FORMAT", "3")
        for case, (fault, exchange, _) in OVERWRITE.items():
            path = str(base / case)
            _prepare_overwrite(path)
            jobs[case] = (path, {"scenario": "overwrite", "value": 20, "exchange": exchange, "format": 3,
                                 "path": os.path.join(path, "2")}, fault)

    def run(item):
        case, (path, args, fault) = item
        return case, {**finish(spawn({"path": path, **args}, fault)), "path": path}

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        return dict(pool.map(run, jobs.items()))


def _check_leftovers_single(case, path):
    """What the kill left is what its fault point says (so the kill happened there)."""
    staging = [os.path.join(path, n) for n in hidden(path, ".3.jaxckpt-tmp-")]
    v3, case = case not in FORMAT1, case.removeprefix("f1-")
    if case.startswith(("before-data", "mid-data", "mid-tensorstore", "after-data", "mid-manifest",
                        "after-manifest")):
        files = files_under(only(staging))
        assert "3" not in os.listdir(path) and hidden(path) == [os.path.basename(staging[0])]
        if case == "before-data":
            assert files == []
        elif v3 and case.startswith(("mid-data", "after-data")):  # the data object is made at its full size up front
            assert files == ["data/p0.0"] and os.path.getsize(os.path.join(staging[0], files[0])) == V3_STREAM
            with open(os.path.join(staging[0], files[0]), "rb") as f:
                f.seek(2 * V3_STRIDE)
                third = f.read(V3_STRIDE)
            assert (third.count(0) == V3_STRIDE) == case.startswith("mid-data")  # killed before it was written
        elif case.startswith(("mid-data", "mid-tensorstore")):
            chunks = [f for f in files if f.startswith("arrays/0/c/")]
            assert files and "manifest.json" not in files and len(chunks) < 4, files
        elif case == "after-data":
            assert len([f for f in files if f.startswith("arrays/0/c/")]) == 4 and "manifest.json" not in files
        elif case.startswith("mid-manifest"):
            assert "manifest.json" not in files and "manifest.json.writing" in files
            size = os.path.getsize(os.path.join(staging[0], "manifest.json.writing"))
            whole = os.path.getsize(os.path.join(path, "2", "manifest.json"))  # step 3's is as long, give or take
            assert abs(size - whole // 2) <= 16, (size, whole)  # half of it
        else:
            assert "manifest.json" in files
    elif case == "after-rename":
        assert hidden(path) == [] and "3" in os.listdir(path)
    elif case == "delete-after-rename":  # step 1 renamed aside, nothing of it deleted yet
        doomed = os.path.join(path, only(hidden(path, ".1.jaxckpt-old-")))
        assert "1" not in os.listdir(path)
        assert sorted(os.listdir(doomed)) == ["data", "manifest.json"]
    else:  # killed deleting step 1: renamed aside, its manifest gone, its data not yet
        doomed = os.path.join(path, only(hidden(path, ".1.jaxckpt-old-")))
        assert "1" not in os.listdir(path)
        assert sorted(os.listdir(doomed)) == ["data"]


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.format1) if c in FORMAT1 else c
                                  for c in sorted(SINGLE)])
def test_single_process_manager_killed_at_each_point(single_runs, case):
    run = single_runs[case]
    assert run["rc"] == -signal.SIGKILL, run
    assert run["committed"] == [1, 2], run  # killed in step 3's save (or the delete after it)
    _check_leftovers_single(case, run["path"])
    check_recovered(run["path"], SINGLE[case][2])


@pytest.mark.parametrize("case", sorted(OVERWRITE))
def test_overwrite_killed_at_each_point_keeps_the_old_or_the_new_step(single_runs, case):
    run = single_runs[case]
    fault, _, value = OVERWRITE[case]
    path = run["path"]
    assert run["rc"] == -signal.SIGKILL, run
    names = sorted(os.listdir(path))
    if case == "overwrite-between-renames":
        # nothing at 2: the old copy aside, the new one staged, both under one token
        old, tmp = hidden(path, ".2.jaxckpt-old-"), hidden(path, ".2.jaxckpt-tmp-")
        assert "2" not in names and len(old) == len(tmp) == 1
        assert old[0].split("-old-")[1] == tmp[0].split("-tmp-")[1]
        with pytest.raises(jaxckpt.CheckpointNotFoundError, match="stopped between its two renames: the "
                           r"checkpoint it replaced is whole at '.*/\.2\.jaxckpt-old-"):
            jaxckpt.restore(os.path.join(path, "2"))
        # readers do not call it gone: skipped, with why; they never put it back
        found, skipped = _commit.discover(_commit._location.resolve(path))
        assert sorted(found) == [1] and "between its two renames" in skipped[2]
        assert sorted(os.listdir(path)) == names
        assert _commit.stale_attempts(_commit._location.resolve(path)) == []  # never cleaned away
        check_recovered(path, [1, 2], {2: value}, read=[1])  # the writer's start puts it back
    else:
        assert "2" in names
        check_recovered(path, [1, 2], {2: value})


def test_a_step_renamed_aside_to_be_deleted_is_never_put_back(tmp_path):
    # what a delete killed right after its rename leaves: the hidden copy still has its
    # manifest, and no staging directory shares its token (a dead save of the same step
    # has another one)
    path = str(tmp_path)
    with jaxckpt.CheckpointManager(path, async_save=False) as mgr:
        mgr.save(1, state(1))
        mgr.save(2, state(2))
    os.rename(os.path.join(path, "1"), os.path.join(path, ".1.jaxckpt-old-0123456789ab"))
    os.mkdir(os.path.join(path, ".1.jaxckpt-tmp-ba9876543210"))
    loc = _commit._location.resolve(path)
    assert _commit.interrupted_overwrites(os.listdir(path)) == {}
    assert _commit.stale_attempts(loc) == [".1.jaxckpt-old-0123456789ab", ".1.jaxckpt-tmp-ba9876543210"]
    assert _commit.recover(loc) == []
    check_recovered(path, [2])


def test_deleting_a_link_to_a_checkpoint_leaves_the_checkpoint_whole(tmp_path):
    jaxckpt.save(tmp_path / "ckpt", state(1))
    os.symlink(tmp_path / "ckpt", tmp_path / "link")
    _kvstore.delete_tree(_commit._location.resolve(str(tmp_path / "link")))
    assert same(jaxckpt.restore(tmp_path / "ckpt"), 1)


def test_plain_path_overwrite_killed_between_renames_is_put_back_by_the_next_save(tmp_path):
    path = str(tmp_path / "ckpt")
    jaxckpt.save(path, state(5))
    run = finish(spawn({"scenario": "overwrite", "path": path, "value": 6, "exchange": False},
                       "commit:between-renames"))
    assert run["rc"] == -signal.SIGKILL, run
    assert not os.path.exists(path) and len(hidden(tmp_path)) == 2
    # a save without overwrite finds the checkpoint back, and refuses to replace it
    with pytest.raises(jaxckpt.CheckpointError, match="already exists; pass overwrite=True"):
        jaxckpt.save(path, state(7))
    assert hidden(tmp_path) == [] and same(jaxckpt.restore(path), 5) and jaxckpt.verify(path).ok
    jaxckpt.save(path, state(7), overwrite=True)
    assert same(jaxckpt.restore(path), 7) and sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_a_killed_plain_overwrite_leaves_nothing_once_the_next_save_there_commits(tmp_path):
    # issue 30, defect 9: a plain save killed mid-data left its staging directory and its
    # claim beside the checkpoint, and every later save to that path left them there
    path = str(tmp_path / "ckpt")
    jaxckpt.save(path, state(5))
    run = finish(spawn({"scenario": "overwrite", "path": path, "value": 6, "format": 3},
                       f"write@p0@{2 * V3_STRIDE}"))
    assert run["rc"] == -signal.SIGKILL, run
    staging = only(hidden(tmp_path, ".ckpt.jaxckpt-tmp-"))
    token = staging.split(_claims.TMP_MARK)[1]
    assert sorted(os.listdir(tmp_path)) == sorted(["ckpt", staging, _claims.claim_name("ckpt", token)])
    # a live save's attempt at the same path (this process's claim) is never taken for dead
    live = _commit._location.resolve(path)
    _claims.write_claim(live, "0123456789ab")
    os.makedirs(os.path.join(tmp_path, ".ckpt.jaxckpt-tmp-0123456789ab"))
    jaxckpt.save(path, state(7), overwrite=True)
    assert sorted(os.listdir(tmp_path)) == sorted(["ckpt", ".ckpt.jaxckpt-tmp-0123456789ab",
                                                  _claims.claim_name("ckpt", "0123456789ab")])
    assert same(jaxckpt.restore(path), 7) and jaxckpt.verify(path).ok
    _commit.abort(live, _commit.staging_location(live, "0123456789ab"), "0123456789ab")
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


@pytest.mark.parametrize("exchange", [True, False])
def test_a_failed_local_overwrite_commit_puts_the_old_copy_back(tmp_path, monkeypatch, exchange):
    path = str(tmp_path / "ckpt")
    jaxckpt.save(path, state(1))
    monkeypatch.setattr(_commit, "RENAME_EXCHANGE", exchange)
    real_rename = os.rename

    def rename(src, dst):  # the rename that would commit fails (the old copy is aside)
        if os.path.basename(src).startswith(".ckpt.jaxckpt-tmp-"):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real_rename(src, dst)

    monkeypatch.setattr(_commit.os, "rename", rename)
    if exchange:  # the exchange itself fails: nothing moved
        monkeypatch.setattr(_commit, "_exchange", lambda a, b: (_ for _ in ()).throw(
            OSError(errno.EIO, os.strerror(errno.EIO))))
    with pytest.raises(jaxckpt.CheckpointError,
                       match=rf"^Committing checkpoint '{re.escape(path)}' failed: \[Errno 5\] Input/output error"):
        jaxckpt.save(path, state(2), overwrite=True)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert same(jaxckpt.restore(path), 1)


def test_exchange_swaps_atomically_where_the_file_system_can(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "x").write_text("from a")
    assert _commit._exchange(str(a), str(b)) is True  # Linux, ext4/tmpfs/overlay: renameat2
    assert (b / "x").read_text() == "from a" and os.listdir(a) == []


# --- a real 2-process job -----------------------------------------------------------------


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(args, faults=None, timeout=90):
    port = free_port()
    procs = [spawn({**args, "port": port, "nproc": 2, "pid": i}, (faults or {}).get(i)) for i in range(2)]
    return [finish(p, timeout) for p in procs]


# case -> (the process killed, fault, the committed steps after). Process 1 is killed in
# its part of step 3's data; process 0 in its data, or where only it goes: the commit and
# the retention delete. Each process's stream starts with its 2 of big's 4 entries: "mid-data"
# is killed before its second.
MULTI = {
    "p1-before-data": (1, "data:start:3", [1, 2]),
    "p1-mid-data": (1, f"write@p1@{V3_STRIDE}:3", [1, 2]),
    "p0-mid-data": (0, f"write@p0@{V3_STRIDE}:3", [1, 2]),
    "p0-mid-manifest": (0, "manifest:partial:3", [1, 2]),
    "p0-after-manifest": (0, "commit:after-manifest:3", [1, 2]),
    "p0-after-rename": (0, "commit:after-rename:3", [1, 2, 3]),
    "p0-mid-delete": (0, "delete:middle:1", [2, 3]),
}


@pytest.mark.parametrize("case", [c if c in ("p1-before-data", "p0-after-manifest") else pytest.param(c, marks=pytest.mark.slow)
                                  for c in sorted(MULTI)])
def test_two_process_job_with_one_process_killed(tmp_path, case):
    killed, fault, steps = MULTI[case]
    path = str(tmp_path / "run")
    runs = run_job({"scenario": "manager", "path": path, "steps": 3, "stale_s": 4.0}, {killed: fault})
    assert runs[killed]["rc"] == -signal.SIGKILL, runs
    assert runs[killed]["committed"] == [1, 2], runs
    if killed == 1:
        # process 0 finds its peer dead, fails step 3 and removes its staging directory
        survivor = runs[0]["result"]
        assert survivor is not None, runs[0]
        (error,) = survivor["errors"]
        assert error.startswith(f"Saving step 3 to '{path}' failed: save") and \
            "process 1 stopped responding" in error, error
        assert hidden(path) == []
    visible = sorted(n for n in os.listdir(path) if not n.startswith("."))
    assert visible == sorted([*map(str, steps), HISTORY])
    # the job restarts: both processes agree on the steps, restore the latest exactly
    # (each its own shards) and save the next one
    resumed = run_job({"scenario": "resume", "path": path, "next": 4})
    for r in resumed:
        res = r["result"]
        assert res is not None and "crash" not in res, r
        assert res["steps"] == steps and res["latest"] == steps[-1] and res["exact"] and res["exact_next"], res
        assert res["after"] == [steps[-1], 4], res
    assert hidden(path) == []
    for s in (steps[-1], 4):
        assert jaxckpt.verify(os.path.join(path, str(s))).ok
    assert sorted(os.listdir(path)) == sorted([str(steps[-1]), "4", HISTORY])


# --- full disks, denied permissions, read-only file systems -------------------------------

ERRNOS = [errno.ENOSPC, errno.EACCES, errno.EROFS]
# where the error strikes: (fault point, key) and the message the save fails with. Format 3
# (what a save writes): the first entry of the stream; with ``JAXCKPT_FORMAT=1``
# (``WHERE_FORMAT1``): the first chunk file (jaxckpt's own writer), the tensorstore write of
# the packed small leaves. The manifest and the commit's points: every format.
WRITING, COMMITTING = "Writing checkpoint '{staging}' failed: [Errno {n}] {text}", \
    "Committing checkpoint '{final}' failed: [Errno {n}] {text}"
WHERE = {
    "entry": (("write", "p0@0"), WRITING),
    "chunk-file": (("write", "0"), WRITING),
    "tensorstore": (("write", "packed/p0"), WRITING),
    "manifest": (("manifest:partial", "manifest.json"), COMMITTING),
}
WHERE_FORMAT1 = {"chunk-file", "tensorstore"}
MODES = ["save", "manager-sync", "manager-async"]
CASES = [pytest.param(m, w, n, id=f"{m}-{w}-{errno.errorcode[n]}",
                      marks=[pytest.mark.format1] if w in WHERE_FORMAT1 else [])
         for m in MODES for w in WHERE for n in ERRNOS]
# each of the commit's points (one errno)
WHERE["data:start"] = (("data:start", None), WRITING)
for point in ("commit:before-manifest", "commit:after-manifest"):
    WHERE[point] = ((point, None), COMMITTING)
CASES += [pytest.param(m, w, errno.ENOSPC, id=f"{m}-{w}-ENOSPC") for m in MODES
          for w in ("data:start", "commit:before-manifest", "commit:after-manifest")]
WHERE_FORMAT1.add("chmod-f1")
if os.geteuid() != 0:  # root is never denied by a mode: then only the injected errors
    CASES += [pytest.param(m, "chmod", errno.EACCES, id=f"{m}-chmod-0o500") for m in MODES]
    CASES += [pytest.param("save", "chmod-f1", errno.EACCES, id="save-chmod-0o500-format1",
                           marks=pytest.mark.format1)]


def _inject(monkeypatch, where, code):
    """Fail the save's first write at ``where``: an injected ``OSError(code)``, or (``chmod``)
    a real one: the staging directory made read-only once it exists (before any data)."""
    def hook(op, key):
        if where.startswith("chmod"):
            if op == "data:start":
                os.chmod(key, 0o500)
        elif (op, key) == WHERE[where][0] or (op, None) == WHERE[where][0]:
            raise OSError(code, os.strerror(code))
    monkeypatch.setattr(_storage, "fault_hook", hook)


def _failing_save(mode, path, monkeypatch, where, code):
    """Save value 2 over value 1 (an overwrite, or the manager's next step) with the
    error injected; returns (the error, the final location)."""
    if mode == "save":
        final = os.path.join(path, "ckpt")
        jaxckpt.save(final, state(1))
        _inject(monkeypatch, where, code)
        with pytest.raises(jaxckpt.CheckpointError) as err:
            jaxckpt.save(final, state(2), overwrite=True)
        monkeypatch.setattr(_storage, "fault_hook", None)
        return err.value, final
    mgr = jaxckpt.CheckpointManager(path, async_save=mode == "manager-async")
    mgr.save(1, state(1))
    mgr.wait_until_finished()
    _inject(monkeypatch, where, code)
    with pytest.raises(jaxckpt.CheckpointError) as err:
        mgr.save(2, state(2))
        mgr.wait_until_finished()
    monkeypatch.setattr(_storage, "fault_hook", None)
    assert mgr.all_steps() == [1]
    mgr.save(3, state(3))  # the next save works
    mgr.close()
    return err.value, os.path.join(path, "2")


def _innermost(e):
    while e.__cause__ is not None:
        e = e.__cause__
    return e


@pytest.mark.parametrize("mode,where,code", CASES)
def test_storage_errors_fail_the_save_cleanly(tmp_path, monkeypatch, mode, where, code):
    path = str(tmp_path)
    layout = 1 if where in WHERE_FORMAT1 else 3
    monkeypatch.setenv("JAXCKPT_FORMAT", str(layout))  # (format1: what conftest sets too)
    err, final = _failing_save(mode, path, monkeypatch, where, code)
    text = os.strerror(code)
    message = str(err)
    if mode != "save":
        prefix = f"Saving step 2 to '{path}' failed: "
        assert message.startswith(prefix), message
        message = message[len(prefix):]
    staging = re.escape(os.path.join(path, f".{os.path.basename(final)}{_commit.TMP_MARK}")) + "[0-9a-f]{12}"
    if where == "chmod":  # format 3: the first data object cannot be created
        assert re.fullmatch(f"Writing checkpoint '({staging})' failed: \\[Errno 13\\] Permission denied: "
                            "'\\1/data'", message), message
        cause = _innermost(err)
        assert isinstance(cause, PermissionError) and cause.errno == errno.EACCES
    elif where == "chmod-f1":  # tensorstore cannot create the first array's zarr.json
        assert re.match(f"Opening array '{staging}/", message) and message.endswith(": Permission denied"), message
    else:
        want = re.escape(WHERE[where][1]).replace(re.escape("{staging}"), staging)
        want = want.replace(re.escape("{final}"), re.escape(final)).replace(re.escape("{n}"), str(code))
        assert re.fullmatch(want.replace(re.escape("{text}"), re.escape(text)), message), message
        cause = _innermost(err)
        assert isinstance(cause, OSError) and cause.errno == code and cause.strerror == text
    kept = final if mode == "save" else os.path.join(path, "1")
    assert jaxckpt.metadata(kept).format_version == layout
    if mode == "save":
        assert os.listdir(path) == ["ckpt"]  # the staging directory is gone
        assert same(jaxckpt.restore(final), 1) and jaxckpt.verify(final).ok
        jaxckpt.save(final, state(3), overwrite=True)
        assert same(jaxckpt.restore(final), 3)
        return
    assert sorted(os.listdir(path)) == ["1", "3", HISTORY]  # no staging, no lease left
    with jaxckpt.CheckpointManager(path) as mgr:
        assert mgr.all_steps() == [1, 3]
        assert same(mgr.restore(1), 1) and same(mgr.restore(3), 3)


def test_a_manifest_write_that_fails_leaves_no_partial_file(tmp_path, monkeypatch):
    def hook(op, key):
        if op == "manifest:partial":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(_storage, "fault_hook", hook)
    loc = _commit._location.resolve(str(tmp_path))
    with pytest.raises(OSError, match="No space left on device"):
        _kvstore.write_blob(loc, "manifest.json", b"x" * 100, fault="manifest:partial")
    assert os.listdir(tmp_path) == []


def test_the_fault_spec_names_a_point_a_key_and_a_hit():
    assert _storage.parse_kill_point(None) is None and _storage.parse_kill_point("") is None
    assert _storage.parse_kill_point("commit:between-renames") == ("commit:between-renames", "", 1)
    assert _storage.parse_kill_point("manifest:partial:3") == ("manifest:partial", "", 3)
    assert _storage.parse_kill_point("write@packed/p0:2") == ("write", "packed/p0", 2)
    with pytest.raises(ValueError, match="expected <point>"):
        _storage.parse_kill_point("write:0")
