"""Time to resume (issue 34): a manager's start reads one listing and the newest step's
manifest whatever the number of steps; a manifest read at the start is not parsed again
by the restore after it; ``prefetch`` reads a step's data into the page cache, bounded,
and never follows a link or opens a FIFO."""

import dataclasses
import json
import logging
import os
import threading

import numpy as np
import pytest

import jaxckpt
from jaxckpt import _commit
from jaxckpt._manager import prefetch as _prefetch
from jaxckpt._manager import steplist as _steplist


def _save_steps(path, steps, **kw):
    with jaxckpt.CheckpointManager(path, async_save=False, **kw) as mgr:
        for s in steps:
            mgr.save(s, {"w": np.arange(8, dtype=np.float32) + s, "step": s}, metrics={"loss": 100.0 - s})


def _count_manifest_reads(monkeypatch):
    reads = []
    real = _commit._read_manifest_bytes

    def counted(loc):
        reads.append(os.path.basename(str(loc).rstrip("/")))
        return real(loc)

    monkeypatch.setattr(_commit, "_read_manifest_bytes", counted)
    return reads


@pytest.mark.parametrize("read_only", [False, True])
def test_the_start_reads_the_newest_manifest_only(tmp_path, monkeypatch, read_only):
    _save_steps(tmp_path, range(1, 41))
    reads = _count_manifest_reads(monkeypatch)
    mgr = jaxckpt.CheckpointManager(tmp_path, read_only=read_only)
    assert reads == ["40"]
    assert mgr.latest_step() == 40 and reads == ["40"]
    back = mgr.restore(7, {"w": np.zeros(8, np.float32), "step": 0})
    assert np.array_equal(back["w"], np.arange(8, dtype=np.float32) + 7) and back["step"] == 7
    assert mgr.metrics(12) == {"loss": 88.0}
    assert sorted(reads) == sorted(["40", "7", "7", "12"])  # the listing's read of 7, then the restore's
    assert mgr.all_steps() == list(range(1, 41))  # the listing asked for: every step validated, once
    assert sorted(reads, key=int) == sorted([str(s) for s in range(1, 41)] + ["7"], key=int)
    assert mgr.all_steps() == list(range(1, 41)) and len(reads) == 41
    mgr.close()


def test_a_newest_step_that_fails_is_skipped_down_to_one_that_validates(tmp_path, caplog):
    _save_steps(tmp_path, (1, 2, 3))
    with open(tmp_path / "3" / "manifest.json", "ab") as f:
        f.write(b"garbage")
    os.makedirs(tmp_path / "4")  # no manifest: not a step, silently
    with caplog.at_level(logging.WARNING, logger="jaxckpt"):
        mgr = jaxckpt.CheckpointManager(tmp_path, read_only=True)
    assert mgr.all_steps() == [1, 2] and mgr.latest_step() == 2
    assert [r.getMessage()[:30] for r in caplog.records] == [f"Skipping step 3 at '{tmp_path / '3'}"[:30]]
    assert np.array_equal(mgr.restore(target={"w": np.zeros(8, np.float32), "step": 0})["w"],
                          np.arange(8, dtype=np.float32) + 2)
    mgr.close()


def test_an_older_step_that_fails_is_unlisted_when_read_with_its_reason(tmp_path, caplog):
    _save_steps(tmp_path, (1, 2, 3))
    with open(tmp_path / "2" / "manifest.json", "r+b") as f:
        f.seek(5)
        f.write(b"\x00")
    mgr = jaxckpt.CheckpointManager(tmp_path)
    with caplog.at_level(logging.WARNING, logger="jaxckpt"):
        with pytest.raises(jaxckpt.CheckpointNotFoundError, match=r"No committed step 2 .*\(committed: \[1, 3\]\)"):
            mgr.restore(2, {"w": np.zeros(8, np.float32), "step": 0})
    assert any(f"Skipping step 2 at '{tmp_path / '2'}'" in r.getMessage() for r in caplog.records)
    assert mgr.all_steps() == [1, 3] and [mgr.metrics(s) for s in mgr.all_steps()] == [{"loss": 99.0}, {"loss": 97.0}]
    mgr.close()


def test_ls_over_a_damaged_old_step_lists_the_others(tmp_path, capsys):
    from jaxckpt import cli

    _save_steps(tmp_path, (1, 2, 3))
    (tmp_path / "2" / "manifest.json").write_bytes(b"{")
    with pytest.raises(SystemExit) as done:
        cli.main(["ls", str(tmp_path), "--json"])
    assert done.value.code == 0
    assert [row["step"] for row in json.loads(capsys.readouterr().out)["steps"]] == [1, 3]


def test_a_listed_step_without_a_manifest_is_not_listed(tmp_path, monkeypatch):
    _save_steps(tmp_path, (1, 3, 5))
    os.makedirs(tmp_path / "2")  # an empty step directory, older than the newest
    mgr = jaxckpt.CheckpointManager(tmp_path, read_only=True)
    assert mgr.all_steps() == [1, 3, 5] and mgr.step_tiers() == {1: ("local",), 3: ("local",), 5: ("local",)}
    os.remove(tmp_path / "3" / "manifest.json")  # read once: listed until a reload
    assert mgr.all_steps() == [1, 3, 5]
    mgr.reload()
    assert mgr.all_steps() == [1, 5]
    mgr.close()


def test_a_stray_step_directory_never_takes_a_real_steps_place_in_retention(tmp_path):
    _save_steps(tmp_path, (1, 2, 3, 5))
    os.makedirs(tmp_path / "4")  # empty: no manifest
    with jaxckpt.CheckpointManager(tmp_path, async_save=False, max_to_keep=3) as mgr:
        mgr.save(6, {"w": np.zeros(8, np.float32), "step": 6})
        assert mgr.all_steps() == [3, 5, 6]
    with jaxckpt.CheckpointManager(tmp_path, read_only=True) as mgr:
        assert mgr.all_steps() == [3, 5, 6]
        assert np.array_equal(mgr.restore(3, {"w": np.zeros(8, np.float32), "step": 0})["w"],
                              np.arange(8, dtype=np.float32) + 3)


def test_retention_reads_each_old_manifest_once_after_the_start_and_keeps_the_unreadable(tmp_path, monkeypatch):
    _save_steps(tmp_path, range(1, 31))
    (tmp_path / "12" / "manifest.json").write_bytes(b"{")  # damaged: neither counted nor deleted
    reads = _count_manifest_reads(monkeypatch)
    with jaxckpt.CheckpointManager(tmp_path, async_save=False, max_to_keep=3) as mgr:
        assert reads == ["30"]
        mgr.save(31, {"w": np.zeros(8, np.float32), "step": 31})
        assert mgr.all_steps() == [29, 30, 31]
    assert sorted(reads, key=int) == [str(s) for s in range(1, 31)]  # each once, the start's 30 included
    assert {n for n in os.listdir(tmp_path) if n.isdigit()} == {"12", "29", "30", "31"}
    with jaxckpt.CheckpointManager(tmp_path, async_save=False, best_metric="loss", keep_best=1,
                                   max_to_keep=1) as mgr:
        mgr.save(40, {"w": np.zeros(8, np.float32), "step": 40}, metrics={"loss": 99.5})
        # the best by loss (step 31 has no metric; 29 and 30: 71.0 and 70.0) and the latest
        assert mgr.all_steps() == [30, 40] and mgr.best_step() == 30


def test_many_steps_listed_lazily_agree_with_eager_discovery(tmp_path):
    _save_steps(tmp_path, range(0, 60, 3))
    eager = _commit.discover_steps(jaxckpt._storage.location.resolve(str(tmp_path)))
    lazy = _steplist.discover(jaxckpt._storage.location.resolve(str(tmp_path)))
    assert list(lazy) == sorted(eager) and len(lazy) == len(eager)
    assert {s: m.info for s, m in lazy.items()} == {s: m.info for s, m in eager.items()}
    lazy.pop(3)
    del lazy[6]
    assert 3 not in lazy and 6 not in lazy and lazy.get(9).info["step"] == 9
    with pytest.raises(KeyError):
        lazy[4]


def test_a_manifest_parsed_again_is_equal_and_its_metadata_its_own(tmp_path):
    _save_steps(tmp_path, (1,))
    data = (tmp_path / "1" / "manifest.json").read_bytes()
    first = _commit.parse_manifest(data, "x")
    first.info["metrics"]["loss"] = -1.0
    first.metadata["new"] = 1
    again = _commit.parse_manifest(data, "x")
    assert again.info["metrics"] == {"loss": 99.0} and "new" not in again.metadata
    assert again.leaves == first.leaves and again.structure == first.structure
    with pytest.raises(jaxckpt.CorruptCheckpointError):
        _commit.parse_manifest(data[:-3] + b"xx}", "x")


def _data_bytes(step_dir):
    return sum(os.path.getsize(os.path.join(r, n)) for r, _, ns in os.walk(step_dir / "data") for n in ns)


def test_prefetch_reads_the_steps_data_and_the_restore_is_exact(tmp_path):
    with jaxckpt.CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, {"w": np.arange(1 << 20, dtype=np.float32)})
        mgr.save(2, {"w": np.arange(1 << 20, dtype=np.float32) * 2})
    with jaxckpt.CheckpointManager(tmp_path) as mgr:
        assert mgr.prefetch().result(timeout=60) == _data_bytes(tmp_path / "2") > 4 << 20
        assert mgr.prefetch(1).result(timeout=60) == _data_bytes(tmp_path / "1")
        back = mgr.restore(target={"w": np.zeros(1 << 20, np.float32)})
        assert np.array_equal(back["w"], np.arange(1 << 20, dtype=np.float32) * 2)
        with pytest.raises(jaxckpt.CheckpointNotFoundError, match="No committed step 5"):
            mgr.prefetch(5)
    with pytest.raises(jaxckpt.CheckpointError, match="is closed"):
        mgr.prefetch()


def test_prefetch_opens_no_fifo_and_follows_no_link(tmp_path):
    _save_steps(tmp_path / "run", (1,))
    data = tmp_path / "run" / "1" / "data"
    outside = tmp_path / "secret"
    outside.write_bytes(b"x" * 12345)
    os.symlink(outside, data / "p0.9")
    os.mkfifo(data / "p0.8")
    os.symlink(tmp_path, data / "p0.7")  # a link to a directory: not walked into
    with jaxckpt.CheckpointManager(tmp_path / "run", read_only=True) as mgr:
        got = mgr.prefetch().result(timeout=30)
    assert got == os.path.getsize(data / "p0.0")


def test_prefetch_reads_this_process_streams_only_when_the_count_matches(tmp_path):
    _save_steps(tmp_path, (1,))
    man = _commit.read_manifest(jaxckpt._storage.location.resolve(str(tmp_path / "1")))
    for name in ("p1.0", "p1.1"):  # another process's objects
        (tmp_path / "1" / "data" / name).write_bytes(b"y" * 100)
    files = _prefetch.data_files(str(tmp_path / "1"), man)
    assert [os.path.basename(f) for f, _ in files] == ["p0.0"]
    assert files[0][1] == os.path.getsize(tmp_path / "1" / "data" / "p0.0")
    man2 = dataclasses.replace(man, process_count=2, streams={0: man.streams[0], 1: 100})
    assert [os.path.basename(f) for f, _ in _prefetch.data_files(str(tmp_path / "1"), man2)] == ["p0.0", "p1.0"]


def test_prefetch_reads_what_the_manifest_names_only_and_one_at_a_time(tmp_path):
    _save_steps(tmp_path, (1, 2))
    data = tmp_path / "2" / "data"
    size = os.path.getsize(data / "p0.0")
    with open(data / "p0.0", "ab") as f:  # longer than the manifest says: read to its size
        f.write(b"z" * 100_000)
    with open(data / "stray", "wb") as f:  # named by no manifest: never read
        f.truncate(64 << 30)
    with jaxckpt.CheckpointManager(tmp_path, read_only=True) as mgr:
        assert mgr.prefetch(2).result(timeout=30) == size
        first = mgr.prefetch(1)
        again = mgr.prefetch(1)
        assert again is first or first.done()
        assert first.result(timeout=30) == os.path.getsize(tmp_path / "1" / "data" / "p0.0")
    assert not [t for t in threading.enumerate() if t.name.startswith("jaxckpt-prefetch")]


def test_prefetch_on_an_object_store_reads_nothing(tmp_path):
    path = "memory://ttstep/run"
    with jaxckpt.CheckpointManager(path, async_save=False) as mgr:
        mgr.save(1, {"w": np.arange(16, dtype=np.float32)})
        assert mgr.prefetch().result(timeout=10) == 0
        assert np.array_equal(mgr.restore(target={"w": np.zeros(16, np.float32)})["w"],
                              np.arange(16, dtype=np.float32))


def test_history_of_many_steps_is_not_read_at_the_start(tmp_path, monkeypatch):
    _save_steps(tmp_path, (1,))
    line = json.loads((tmp_path / "history.jsonl").read_text().splitlines()[0])
    with open(tmp_path / "history.jsonl", "w") as f:
        for s in range(1, 2001):
            f.write(json.dumps(dict(line, step=s)) + "\n")
    from jaxckpt._manager import history as _history

    loads = []
    real = _history.load
    monkeypatch.setattr(_history, "load", lambda *a, **k: loads.append(1) or real(*a, **k))
    mgr = jaxckpt.CheckpointManager(tmp_path)
    assert mgr.latest_step() == 1 and loads == []
    assert len(mgr.history()) == 2000 and loads == [1]
    mgr.close()


@pytest.mark.parametrize("scenario", ["info", "missing"])
def test_processes_of_a_job_agree_on_a_step_only_one_of_them_read(tmp_path, scenario):
    """Process 0 alone reads the steps (its metrics logged, or all_steps()); every process
    then deletes step 2 (damaged) or saves it again (its manifest gone): the same answer
    in both from the same bytes, at once, and the job goes on (no wait for a process that
    listed it differently)."""
    from conftest import run_workers

    _save_steps(tmp_path, (1, 2, 3))
    if scenario == "info":
        with open(tmp_path / "2" / "manifest.json", "r+b") as f:
            f.truncate(50)
    else:
        os.remove(tmp_path / "2" / "manifest.json")
    worker = os.path.join(os.path.dirname(__file__), "mp_steplist_worker.py")
    res = run_workers(worker, 2, lambda i, port: (port, i, tmp_path, scenario), timeout=120)
    firsts = {res[p]["first"] for p in (0, 1)}
    assert all(res[p]["first_s"] < 10 for p in (0, 1)), res
    if scenario == "info":
        assert res[0]["seen"] == {"1": {"loss": 99.0}, "3": {"loss": 97.0}}
        assert firsts == {f"CheckpointNotFoundError: No committed step 2 in '{tmp_path}' (committed: [1, 3])"}
    else:
        assert res[0]["seen"] == [1, 3]
        why = f"'{tmp_path / '2'}' exists and is not a jaxckpt checkpoint (no manifest.json); refusing to overwrite it"
        assert res[0]["first"] == f"CheckpointError: Saving step 2 to '{tmp_path}' failed: {why}"
        assert res[1]["first"].startswith(f"CheckpointError: Saving step 2 to '{tmp_path}' failed: ") and why in (
            res[1]["first"]), res  # process 1 told by process 0
    assert res[0]["steps"] == res[1]["steps"] == [1, 3, 10] and res[0]["ten"] == [10.0] * 4


def _silent_store_for(monkeypatch, failing):
    """``_storage.kvstore.read_blob`` raising the error a store that stops answering gives
    (``no answer from the store``) for the manifests of the steps in ``failing`` (a set
    the test changes; empty: the store answers again); returns the manifests asked."""
    from jaxckpt._storage import kvstore as _kvstore

    monkeypatch.setenv("JAXCKPT_IO_TIMEOUT_S", "5")
    real, asked = _kvstore.read_blob, []

    def read_blob(root, key):
        if key == "manifest.json":
            step = int(str(root.url).rstrip("/").rsplit("/", 1)[1])
            asked.append(step)
            if step in failing:
                raise _kvstore.storage_error(root, "reading", key, _kvstore.no_answer(5.0))
        return real(root, key)

    monkeypatch.setattr(_kvstore, "read_blob", read_blob)
    return asked


def test_a_store_that_fails_while_a_step_is_first_read_loses_no_step(monkeypatch):
    """A writer started over steps 3, 4, 5 (max_to_keep=3); the store stops answering while
    restore(4) reads step 4's manifest: a storage error, not 'no committed step 4', and
    steps 3 and 4 stay listed; once it answers they restore, and retention deletes them."""
    path = "memory://ttstep-silent/run"
    _save_steps(path, (3, 4, 5), max_to_keep=3)
    failing: set[int] = set()
    asked = _silent_store_for(monkeypatch, failing)
    with jaxckpt.CheckpointManager(path, async_save=False, max_to_keep=3) as mgr:
        assert mgr.latest_step() == 5
        failing.update({3, 4})
        with pytest.raises(jaxckpt.CheckpointError) as e:
            mgr.restore(4)
        assert type(e.value) is jaxckpt.CheckpointError
        assert str(e.value) == (f"Reading 'manifest.json' in '{path}/4' failed: no answer from the store in 5 s "
                                "(JAXCKPT_IO_TIMEOUT_S=5)")
        with pytest.raises(jaxckpt.CheckpointError, match="no answer from the store"):
            mgr.all_steps()
        failing.clear()
        assert mgr.all_steps() == [3, 4, 5]
        assert mgr.restore(4)["step"] == 4 and np.array_equal(mgr.restore(3)["w"], np.arange(8, dtype=np.float32) + 3)
        for s in (6, 7, 8):
            mgr.save(s, {"w": np.arange(8, dtype=np.float32) + s, "step": s})
        assert mgr.all_steps() == [6, 7, 8]
    assert asked.count(4) >= 2  # read again once the store answered
    with jaxckpt.CheckpointManager(path, read_only=True) as mgr:
        assert mgr.all_steps() == [6, 7, 8]
    assert jaxckpt.CheckpointManager(path, read_only=True).step_tiers() == {6: ("local",), 7: ("local",),
                                                                              8: ("local",)}


@pytest.mark.parametrize("read_only", [False, True])
def test_a_store_that_fails_on_the_newest_manifest_fails_the_start(monkeypatch, read_only):
    """The newest step's manifest unanswered at the start: the start fails, rather than
    listing step 4 as the latest and restoring its older values without an error."""
    path = f"memory://ttstep-newest-{read_only}/run"
    _save_steps(path, (3, 4, 5))
    failing = {5}
    _silent_store_for(monkeypatch, failing)
    with pytest.raises(jaxckpt.CheckpointError, match="no answer from the store") as e:
        jaxckpt.CheckpointManager(path, async_save=False, read_only=read_only)
    assert type(e.value) is jaxckpt.CheckpointError
    failing.clear()
    with jaxckpt.CheckpointManager(path, async_save=False, read_only=read_only) as mgr:
        assert mgr.latest_step() == 5 and mgr.restore()["step"] == 5


def test_a_store_that_fails_under_many_unread_steps_stops_the_reads(monkeypatch):
    """200 unread steps and a store that stops answering: all_steps() fails after at most
    one round of READ_THREADS reads (not one bounded wait each), and every step is
    listed again once it answers."""
    path = "memory://ttstep-many/run"
    with jaxckpt.CheckpointManager(path, async_save=False) as mgr:
        for s in range(1, 201):
            mgr.save(s, {"step": s})
    failing: set[int] = set()
    asked = _silent_store_for(monkeypatch, failing)
    with jaxckpt.CheckpointManager(path, read_only=True) as mgr:
        assert mgr.latest_step() == 200
        failing.update(range(1, 200))
        del asked[:]
        with pytest.raises(jaxckpt.CheckpointError, match="no answer from the store"):
            mgr.all_steps()
        assert 1 <= len(asked) <= _steplist.READ_THREADS
        failing.clear()
        assert mgr.all_steps() == list(range(1, 201))
        assert mgr.restore(1)["step"] == 1
