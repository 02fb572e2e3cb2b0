"""The run history (jaxckpt/_history.py) and plot_history (jaxckpt/_plot.py)."""

import json
import logging
import os
import sys

import numpy as np
import pytest

import jaxckpt
from jaxckpt import _commit
from jaxckpt._manager import history as _history
from jaxckpt._storage import kvstore as _kvstore
from jaxckpt._storage import location as _location


class FakeClock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


def run(path, steps, *, max_to_keep=None, clock=None, **kw):
    """Save ``steps`` with loss = 1/(step+1); commit times 1000 + 10·step on a fake clock."""
    clock = clock or FakeClock()
    with jaxckpt.CheckpointManager(path, max_to_keep=max_to_keep, clock=clock, async_save=False, **kw) as mgr:
        for s in steps:
            clock.t = 1000.0 + 10 * s
            mgr.save(s, {"x": np.full(4, s, np.float32)}, metrics={"loss": 1.0 / (s + 1), "tag": f"s{s}"})
        return mgr.history()


def test_history_survives_retention(tmp_path):
    hist = run(tmp_path, range(6), max_to_keep=2)
    assert hist.steps == [0, 1, 2, 3, 4, 5]
    assert [r.exists for r in hist] == [False] * 4 + [True] * 2
    assert [r.metrics for r in hist] == [{"loss": 1.0 / (s + 1), "tag": f"s{s}"} for s in range(6)]
    assert [r.commit_time for r in hist] == [1000.0 + 10 * s for s in range(6)]
    assert all(r.bytes == 16 and r.created.endswith("+00:00") for r in hist)
    assert all(0 <= r.blocking_seconds <= r.total_seconds and r.write_seconds >= 0 for r in hist)
    assert sorted(n for n in os.listdir(tmp_path)) == ["4", "5", "history.jsonl"]
    # the same from the directory alone, and from a read-only manager
    assert jaxckpt.history(tmp_path) == hist
    assert jaxckpt.CheckpointManager(tmp_path, read_only=True).history() == hist
    assert repr(hist) == f"History({str(tmp_path)!r}, 6 records, 2 still committed)"


def test_one_line_per_commit_and_discovery_ignores_the_log(tmp_path):
    run(tmp_path, [3, 7])
    lines = (tmp_path / "history.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [3, 7]
    assert set(json.loads(lines[0])) == {"step", "commit_time", "created", "metrics", "bytes",
                                         "blocking_seconds", "total_seconds", "write_seconds", "started"}
    found, skipped = _commit.discover(_location.resolve(tmp_path))
    assert sorted(found) == [3, 7] and skipped == {}
    assert _commit.stale_attempts(_location.resolve(tmp_path)) == []


def test_read_only_managers_see_the_history_and_never_write_it(tmp_path):
    reader = jaxckpt.CheckpointManager(tmp_path, read_only=True)
    assert list(reader.history()) == []
    assert not (tmp_path / "history.jsonl").exists()
    clock = FakeClock()
    with jaxckpt.CheckpointManager(tmp_path, clock=clock) as writer:
        writer.save(1, {"x": np.ones(2)}, metrics={"loss": 0.5})
        writer.wait_until_finished()
        assert [(r.step, r.metrics, r.exists) for r in reader.history()] == [(1, {"loss": 0.5}, True)]
        before = (tmp_path / "history.jsonl").read_bytes()
        reader.restore(1)
        reader.history()
        assert (tmp_path / "history.jsonl").read_bytes() == before
        with pytest.raises(jaxckpt.CheckpointError, match="read-only: save"):
            reader.save(2, {"x": np.ones(2)})
    assert (tmp_path / "history.jsonl").read_bytes() == before


def test_bad_lines_are_skipped_and_logged(tmp_path, caplog, monkeypatch):
    run(tmp_path, [1])
    log = tmp_path / "history.jsonl"
    good = log.read_bytes()
    monkeypatch.setattr(_history, "MAX_LINE_BYTES", 500)
    bad = [b"not json", b"[1, 2]", b'{"step": -1}', b'{"step": true}', b'{"step": 2, "metrics": [1]}',
           b'{"step": 2, "commit_time": "soon"}', b'{"step": 2, "bytes": -5}', b'{"step": 2, "created": 5}',
           b'{"step": 2, "metrics": {"loss": {"deep": 1}}}', b'{"step": 2, "x": "' + b"a" * 600 + b'"}',
           b"[" * 400 + b"]" * 400, b"\xff\xfe"]
    log.write_bytes(good + b"\n".join(bad) + b"\n" + b'{"step": 9, "metrics": {"loss": 0.1}')  # torn last
    with caplog.at_level(logging.WARNING, logger="jaxckpt"):
        hist = jaxckpt.history(tmp_path)
    assert [(r.step, r.exists) for r in hist] == [(1, True)]
    (message,) = [r.getMessage() for r in caplog.records]
    assert "skipped 13 bad record(s) in the history of" in message and "line 2: not JSON" in message
    # the next append starts a new line: the torn one stays one bad line, the new one is read
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="jaxckpt"):
        hist = run(tmp_path, [4])
    assert [(r.step, r.exists) for r in hist] == [(1, True), (4, True)]
    assert "skipped 13 bad record(s)" in caplog.records[0].getMessage()
    assert b'{"step": 9, "metrics": {"loss": 0.1}\n{"step":4,' in log.read_bytes()


def test_only_the_newest_part_of_a_huge_log_is_read(tmp_path, monkeypatch, caplog):
    run(tmp_path, range(5), max_to_keep=1)
    size = len((tmp_path / "history.jsonl").read_bytes())
    monkeypatch.setattr(_history, "MAX_LOG_BYTES", size // 2)
    with caplog.at_level(logging.WARNING, logger="jaxckpt"):
        hist = jaxckpt.history(tmp_path)
    assert hist.steps[-1] == 4 and 0 not in hist.steps and len(hist) >= 2
    assert f"is {size} bytes; reading its last {size // 2}" in caplog.records[0].getMessage()


def test_history_of_a_directory_written_before_the_log_existed(tmp_path):
    run(tmp_path, range(4), max_to_keep=2)
    os.remove(tmp_path / "history.jsonl")
    hist = jaxckpt.history(tmp_path)
    assert [(r.step, r.exists, r.metrics["loss"]) for r in hist] == [(2, True, 1 / 3), (3, True, 1 / 4)]
    assert [r.commit_time for r in hist] == [1020.0, 1030.0]
    # the writer goes on appending; the old steps come from their manifests
    hist = run(tmp_path, [5], max_to_keep=2)
    assert [(r.step, r.exists) for r in hist] == [(3, True), (5, True)]  # 2 went unrecorded
    assert (tmp_path / "history.jsonl").read_text().count("\n") == 1


def test_a_committed_manifest_wins_over_the_log(tmp_path):
    run(tmp_path, [1])
    with open(tmp_path / "history.jsonl", "a") as f:
        f.write(json.dumps({"step": 1, "metrics": {"loss": 99.0}}) + "\n")
        f.write(json.dumps({"step": 0, "metrics": {"loss": 7.0}}) + "\n")
        f.write(json.dumps({"step": 0, "metrics": {"loss": 8.0}}) + "\n")  # the later record wins
    hist = jaxckpt.history(tmp_path)
    assert [(r.step, r.metrics["loss"], r.exists) for r in hist] == [(0, 8.0, False), (1, 0.5, True)]
    assert hist[0] == jaxckpt.HistoryRecord(step=0, metrics={"loss": 8.0})


def test_history_on_an_object_store_is_one_blob_per_step(tmp_path):
    url = "memory://history-test"
    hist = run(url, range(4), max_to_keep=1)
    assert [(r.step, r.exists, r.metrics["tag"]) for r in hist] == [
        (0, False, "s0"), (1, False, "s1"), (2, False, "s2"), (3, True, "s3")]
    loc = _location.resolve(url)
    assert _kvstore.list_children(loc.child(".history")) == ["0.json", "1.json", "2.json", "3.json"]
    assert json.loads(_kvstore.read_blob(loc.child(".history"), "2.json"))["metrics"]["loss"] == 1 / 3
    _kvstore.write_blob(loc.child(".history"), "9.json", b"{garbage")
    _kvstore.write_blob(loc.child(".history"), "notes.txt", b"ignored")
    assert jaxckpt.history(url) == hist
    assert _commit.discover(loc)[1] == {}


def test_to_json_and_to_pandas(tmp_path, monkeypatch):
    hist = run(tmp_path, range(3), max_to_keep=1)
    doc = json.loads(hist.to_json())
    assert [d["step"] for d in doc] == [0, 1, 2] and doc[1]["metrics"] == {"loss": 0.5, "tag": "s1"}
    assert [d["exists"] for d in doc] == [False, False, True]
    df = hist.to_pandas()
    assert list(df.columns) == ["step", "commit_time", "created", "bytes", "blocking_seconds", "total_seconds",
                                "write_seconds", "exists", "started", "metric/loss", "metric/tag"]
    assert df["step"].tolist() == [0, 1, 2]
    assert df["metric/loss"].tolist() == [1.0, 0.5, 1 / 3]
    assert df["metric/tag"].tolist() == ["s0", "s1", "s2"]
    assert df["exists"].tolist() == [False, False, True]
    monkeypatch.setitem(sys.modules, "pandas", None)
    with pytest.raises(ImportError, match="History.to_pandas\\(\\) needs pandas: pip install pandas"):
        hist.to_pandas()


def test_plot_history_draws_the_recorded_values(tmp_path, monkeypatch):
    import matplotlib  # a test dependency (pyproject [test])
    matplotlib.use("Agg")
    hist = run(tmp_path, range(5), max_to_keep=2)
    fig = jaxckpt.plot_history(tmp_path)
    metric_ax, cost_ax = fig.axes
    (loss,) = metric_ax.get_lines()  # "tag" is a str metric: not plotted
    assert loss.get_label() == "loss"
    assert list(loss.get_xdata()) == [0, 1, 2, 3, 4]
    assert list(loss.get_ydata()) == [r.metrics["loss"] for r in hist]
    blocking, total = cost_ax.get_lines()
    assert list(blocking.get_ydata()) == [r.blocking_seconds for r in hist]
    assert list(total.get_ydata()) == [r.total_seconds for r in hist]
    assert list(total.get_xdata()) == hist.steps

    # into the caller's axes, cost on a second y axis; from a manager; one metric chosen
    from matplotlib.figure import Figure

    own = Figure()
    ax = own.subplots()
    mgr = jaxckpt.CheckpointManager(tmp_path, read_only=True)
    assert jaxckpt.plot_history(mgr, metrics="loss", ax=ax) is own
    assert len(own.axes) == 2 and list(ax.get_lines()[0].get_ydata()) == [r.metrics["loss"] for r in hist]
    with pytest.raises(KeyError, match=r"no numeric metric \['acc'\]"):
        jaxckpt.plot_history(hist, metrics=["acc"])
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match='pip install "jaxckpt\\[notebook\\]"'):
        jaxckpt.plot_history(hist)
