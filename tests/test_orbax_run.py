"""An orbax run directory is a run (issue 31, items 3 and 4): what orbax's
CheckpointManager wrote is listed, restored and imported with its metrics, a writer is
refused saying what to do instead, and verify reads an orbax step chunk by chunk."""

import json
import logging
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import assert_bit_equal, sharded
from test_orbax import assert_same

import jaxckpt
from jaxckpt import cli, convert
from jaxckpt._errors import CheckpointError, CheckpointNotFoundError, TreeMismatchError

STEPS = (0, 5, 10)


def _state(step):
    return {"params": {"w": sharded(np.arange(32, dtype=np.float32).reshape(8, 4) + step, (4,), ("x",), ("x", None)),
                       "b": jnp.full((4,), step, jnp.bfloat16)},
            "count": np.int32(step)}


def _metrics(step):
    return {"loss": 1.0 / (step + 1), "acc": step}


def _make_run(path, **options):
    """An orbax run as its CheckpointManager writes it: a state item, a JSON item and metrics."""
    opts = ocp.CheckpointManagerOptions(best_fn=lambda m: m["loss"], best_mode="min", **options)
    with ocp.CheckpointManager(str(path), options=opts) as mgr:
        for step in STEPS:
            mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(_state(step)),
                                                   extra=ocp.args.JsonSave({"lr": 0.1, "step": step})),
                     metrics=_metrics(step))
        mgr.wait_until_finished()
    return str(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("orbax-runs")
    return {"plain": _make_run(base / "plain"),
            "prefixed": _make_run(base / "prefixed", step_prefix="ckpt", step_format_fixed_length=5)}


def _copy(runs, kind, tmp_path):
    return shutil.copytree(runs[kind], tmp_path / kind)


def _target(step=0):
    state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                         if isinstance(x, jax.Array) else np.zeros_like(x), _state(step))
    return {"state": state, "extra": {"lr": 0.0, "step": 0}}


def _orbax_restore(run, step, options=None):
    with ocp.CheckpointManager(run, options=options) as mgr:
        out = mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(_target()["state"]),
                                                        extra=ocp.args.JsonRestore()))
        return {"state": out["state"], "extra": out["extra"]}, mgr.metrics(step)


def _files(path):
    return sorted(os.path.relpath(os.path.join(r, n), path) for r, ds, fs in os.walk(path) for n in ds + fs)


@pytest.mark.parametrize("kind", ["plain", "prefixed"])
def test_read_only_manager_lists_and_restores_orbax_steps(runs, kind):
    run = runs[kind]
    options = ocp.CheckpointManagerOptions(step_prefix="ckpt", step_format_fixed_length=5) if kind == "prefixed" \
        else None
    before = _files(run)
    with jaxckpt.CheckpointManager(run, read_only=True, best_metric="loss") as mgr:
        assert mgr.all_steps() == list(STEPS) and mgr.latest_step() == 10
        assert mgr.best_step() == 10
        for step in STEPS:
            theirs, their_metrics = _orbax_restore(run, step, options)
            assert mgr.metrics(step) == their_metrics == _metrics(step)
            assert_same(mgr.restore(step, target=_target()), theirs)
        assert mgr.info(5)["format"] == "orbax"
        assert mgr.info(5)["orbax_step_dir"] == ("ckpt_00005" if kind == "prefixed" else "5")
        latest = mgr.restore()  # no target: numpy, the latest step
        assert_bit_equal(latest["state"]["params"]["w"], np.arange(32, dtype=np.float32).reshape(8, 4) + 10)
        assert latest["extra"] == {"lr": 0.1, "step": 10}
        with pytest.raises(TreeMismatchError, match="extra"):  # strict, as jaxckpt.restore of the step
            mgr.restore(5, target={"state": _target()["state"]})
        assert [r.step for r in mgr.history()] == list(STEPS)
    assert _files(run) == before  # nothing written there


def test_writer_and_deletes_are_refused_saying_what_to_do(runs, tmp_path):
    run = str(_copy(runs, "plain", tmp_path))
    before = _files(run)
    with pytest.raises(CheckpointError, match=r"orbax-checkpoint run directory \(steps 0, 5, 10\).*"
                                              r"read_only=True.*jaxckpt import-orbax"):
        jaxckpt.CheckpointManager(run)
    with jaxckpt.CheckpointManager(run, read_only=True) as mgr:
        with pytest.raises(CheckpointError, match="read-only: delete"):
            mgr.delete(5)
        with pytest.raises(CheckpointError, match="read-only: save"):
            mgr.save(11, _state(11))
    assert cli.run(["rm", run, "5"]) == 1
    assert _files(run) == before


def test_tmp_hidden_and_hostile_entries_are_not_steps(runs, tmp_path, caplog):
    run = _copy(runs, "plain", tmp_path)
    os.rename(run / "10", run / "10.orbax-checkpoint-tmp-1733")  # a save orbax had not committed
    shutil.copytree(run / "5", run / "7.orbax-checkpoint-tmp-99")
    for name in ("notastep", "12x", ".9", "step_", "٣"):
        shutil.copytree(run / "5", run / name)
    os.mkdir(run / "11")  # no _CHECKPOINT_METADATA: not a committed step
    os.symlink(run / "5", run / "13")  # a link could lead out of the run
    (run / "14").write_text("a file")
    shutil.copytree(run / "5", run / "15")
    (run / "15" / "_CHECKPOINT_METADATA").write_text("[1, 2")  # skipped, with a warning
    with caplog.at_level(logging.WARNING, logger="jaxckpt"):
        with jaxckpt.CheckpointManager(run, read_only=True) as mgr:
            assert mgr.all_steps() == [0, 5]
    assert "Skipping orbax step 15" in caplog.text
    # metrics orbax's manager would choke on, or jaxckpt cannot keep: the step without them
    (run / "0" / "metrics" / "metrics").write_text("{not json")
    with open(run / "5" / "metrics" / "metrics", "wb") as f:
        f.truncate(2 << 20)  # huge (sparse): never read whole
    with caplog.at_level(logging.WARNING, logger="jaxckpt"):
        with jaxckpt.CheckpointManager(run, read_only=True) as mgr:
            assert mgr.all_steps() == [0, 5] and mgr.metrics(0) is None and mgr.metrics(5) is None
            assert_bit_equal(mgr.restore(5)["state"]["params"]["w"],
                             np.arange(32, dtype=np.float32).reshape(8, 4) + 5)
    assert "orbax step 0" in caplog.text and "orbax step 5" in caplog.text and "more than 1048576 bytes" in caplog.text
    (run / "5" / "metrics" / "metrics").write_text(json.dumps({"eval": {"loss": 1.0}}))
    with jaxckpt.CheckpointManager(run, read_only=True) as mgr:
        assert mgr.metrics(5) is None


def test_one_run_one_step_name_format(runs, tmp_path):
    run = _copy(runs, "plain", tmp_path)
    shutil.copytree(run / "5", run / "00005")
    with pytest.raises(CheckpointError, match="two orbax steps 5: '00005' and '5'"):
        jaxckpt.CheckpointManager(run, read_only=True)
    shutil.rmtree(run / "00005")
    shutil.copytree(run / "5", run / "other_7")
    with pytest.raises(CheckpointError, match="named with 2 prefixes"):
        jaxckpt.CheckpointManager(run, read_only=True)


def test_import_run_then_train_on(runs, tmp_path):
    out = tmp_path / "jaxckpt-run"
    seen = []
    result = convert.from_orbax(runs["prefixed"], out, progress=lambda d, t: seen.append((d, t)))
    assert isinstance(result, convert.RunImportResult) and result.path == str(out)
    assert result.steps == STEPS and result.skipped == ()
    assert result.leaves == 3 * 5 and seen[-1][0] == seen[-1][1] == result.total_size
    with jaxckpt.CheckpointManager(out, max_to_keep=3, best_metric="loss") as mgr:  # the one line changed
        assert mgr.all_steps() == list(STEPS) and mgr.best_step() == 10
        for step in STEPS:
            assert mgr.metrics(step) == _metrics(step)
            theirs, _ = _orbax_restore(runs["prefixed"], step,
                                       ocp.CheckpointManagerOptions(step_prefix="ckpt", step_format_fixed_length=5))
            assert_same(mgr.restore(step, target=_target()), theirs)
        state = mgr.restore(target=_target())
        mgr.save(11, state, metrics={"loss": 0.01})
        mgr.wait_until_finished()
        assert mgr.all_steps() == [5, 10, 11] and mgr.best_step() == 11


def test_import_run_interrupted_then_rerun(runs, tmp_path, monkeypatch):
    out = tmp_path / "out"
    real = convert.import_source

    def stop_at_step_10(source, dest, **kw):
        if str(dest).endswith("/10"):
            raise KeyboardInterrupt
        return real(source, dest, **kw)

    monkeypatch.setattr(convert, "import_source", stop_at_step_10)
    with pytest.raises(KeyboardInterrupt):
        convert.from_orbax(runs["plain"], out)
    monkeypatch.undo()
    assert jaxckpt.CheckpointManager(out, read_only=True).all_steps() == [0, 5]
    kept = (out / "5" / "manifest.json").read_bytes()
    result = convert.from_orbax(runs["plain"], out)  # again: the rest, nothing twice
    assert result.steps == (10,) and result.skipped == (0, 5)
    assert (out / "5" / "manifest.json").read_bytes() == kept
    assert sorted(os.listdir(out)) == ["0", "10", "5"]
    assert convert.from_orbax(runs["plain"], out).steps == ()  # and again: nothing to do


def test_import_run_refuses_a_step_from_elsewhere_before_writing(runs, tmp_path):
    out = tmp_path / "out"
    with jaxckpt.CheckpointManager(out, async_save=False) as mgr:
        mgr.save(5, {"x": np.zeros(3)})
    with pytest.raises(CheckpointError, match=r"Step 5 of .* is already committed \(saved by jaxckpt\).*overwrite"):
        convert.from_orbax(runs["plain"], out)
    assert sorted(os.listdir(out)) == ["5", "history.jsonl"]  # step 0 was not imported either
    result = convert.from_orbax(runs["plain"], out, overwrite=True)
    assert result.steps == STEPS
    assert jaxckpt.CheckpointManager(out, read_only=True).metrics(5) == _metrics(5)
    with pytest.raises(CheckpointError, match="orbax-checkpoint run directory"):  # never into an orbax run
        convert.from_orbax(runs["plain"], _copy(runs, "prefixed", tmp_path))


def test_cli_ls_and_import_an_orbax_run(runs, tmp_path, capsys):
    assert cli.run(["ls", runs["plain"]]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["step", "committed", "age", "size", "blocking", "total", "metrics"]
    assert [line.split()[0] for line in out.splitlines()[1:4]] == ["0", "5", "10"]
    assert "loss=0.166667 acc=5" in out and f"jaxckpt import-orbax {runs['plain']} OUT" in out
    dest = tmp_path / "out"
    assert cli.run(["import-orbax", runs["plain"], str(dest)]) == 0
    assert capsys.readouterr().out == f"{runs['plain']} -> {dest}: 3 steps [0, 5, 10], 15 leaves, 420 B\n"
    assert cli.run(["import-orbax", runs["plain"], str(dest), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["steps"], doc["skipped"], doc["leaves"]) == ([], [0, 5, 10], 0)


def test_from_orbax_of_nothing_is_not_found(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointNotFoundError):
        convert.from_orbax(tmp_path / "empty", tmp_path / "out")
    assert not (tmp_path / "out").exists()


# --- verify (item 4) ------------------------------------------------------------------


def _files_step(tmp_path):
    path = str(tmp_path / "files")
    with ocp.StandardCheckpointer(use_ocdbt=False) as ck:
        ck.save(path, {"w": sharded(np.arange(32, dtype=np.float32).reshape(8, 4), (4,), ("x",), ("x", None)),
                       "v": np.ones(3, np.float32)})
        ck.wait_until_finished()
    return path


def test_verify_reads_every_chunk_of_an_orbax_step(runs, tmp_path, capsys):
    report = jaxckpt.verify(os.path.join(runs["plain"], "5"))
    assert (report.ok, report.leaves, report.chunks, report.bytes_read) == (True, 5, 6, 128 + 8 + 4)  # w in 4 chunks
    path = _files_step(tmp_path)
    good = jaxckpt.verify(path)
    assert (good.ok, good.chunks, good.bytes_read) == (True, 5, 140)
    with open(os.path.join(path, "w", "1.0"), "wb") as f:
        f.write(b"garbage")  # does not decode
    os.remove(os.path.join(path, "w", "2.0"))  # orbax writes every chunk: a missing one is damage
    report = jaxckpt.verify(path)
    assert not report.ok and report.bytes_read == 140 - 2 * 32  # two chunks of w unread
    assert [(p["leaf"], p["chunk"]) for p in report.problems] == [("w", "cell [1, 0]"), ("w", "cell [2, 0]")]
    assert "ZSTD" in report.problems[0]["message"] and "missing" in report.problems[1]["message"]
    assert report.unrestorable == ["w"]
    assert cli.run(["verify", path]) == 1
    assert "CORRUPT" in capsys.readouterr().out
    assert cli.run(["verify", os.path.join(runs["plain"], "0")]) == 0


def test_verify_reports_orbax_metadata_that_cannot_be_read(tmp_path, capsys):
    path = _files_step(tmp_path)
    os.remove(os.path.join(path, "w", ".zarray"))
    report = jaxckpt.verify(path)
    assert not report.ok and report.leaves == 0
    assert "leaf 'w' (orbax parameter 'w') could not be opened" in report.problems[0]["message"]
    assert cli.run(["verify", path]) == 1
    (tmp_path / "nothing").mkdir()
    assert cli.run(["verify", str(tmp_path / "nothing")]) == 2


def test_an_import_rerun_refuses_a_step_orbax_saved_again(runs, tmp_path):
    """orbax deleted step 5 and saved it again (other values, other metrics) after the
    import: a rerun does not take the step it imported for the one orbax holds now (the
    path is the same, orbax's commit time is not); it refuses, nothing written, and
    ``overwrite=True`` imports the new step 5 as orbax restores it."""
    run, out = _copy(runs, "plain", tmp_path), tmp_path / "out"
    convert.from_orbax(run, out)
    kept = (out / "5" / "manifest.json").read_bytes()
    opts = ocp.CheckpointManagerOptions(best_fn=lambda m: m["loss"], best_mode="min")
    with ocp.CheckpointManager(run, options=opts) as mgr:
        mgr.delete(5)
        mgr.save(5, args=ocp.args.Composite(state=ocp.args.StandardSave(_state(55)),
                                            extra=ocp.args.JsonSave({"lr": 0.5, "step": 55})),
                 metrics=_metrics(55), force=True)
        mgr.wait_until_finished()
    with pytest.raises(CheckpointError, match=r"^Step 5 of .* was imported from .*/5' as orbax committed it at "
                                              r".* UTC, but orbax's step 5 there now was committed at .* \(saved "
                                              r"again since\): nothing was imported\. Pass overwrite=True"):
        convert.from_orbax(run, out)
    assert (out / "5" / "manifest.json").read_bytes() == kept
    assert convert.from_orbax(run, out, overwrite=True).steps == STEPS
    theirs, metrics = _orbax_restore(run, 5)
    with jaxckpt.CheckpointManager(out, read_only=True) as mgr:
        assert_same(mgr.restore(5, target=_target()), theirs)
        assert mgr.metrics(5) == metrics == _metrics(55)


def test_a_step_orbax_is_still_writing_in_place_is_not_a_step(tmp_path):
    """orbax's COMMIT_FILE mode (for file systems like GCSFuse that look local) writes a
    step at its final name, ``_CHECKPOINT_METADATA`` first with a null commit time, and
    ``commit_success.txt`` last. A save stopped in between (as a kill leaves it) is not
    listed, not the latest, not imported: as orbax lists it."""
    from orbax.checkpoint import options as ocp_options

    run = tmp_path / "run"
    opts = ocp.CheckpointManagerOptions(
        atomicity_options=ocp_options.AtomicityOptions(mode=ocp_options.AtomicityMode.COMMIT_FILE))
    with ocp.CheckpointManager(str(run), options=opts) as mgr:
        for step in (0, 5):
            mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(_state(step))))
        mgr.wait_until_finished()
    assert sorted(os.listdir(run / "5")) == ["_CHECKPOINT_METADATA", "commit_success.txt", "state"]
    # step 5 as a kill leaves it: the commit file not yet written, the metadata's commit time null
    os.remove(run / "5" / "commit_success.txt")
    meta = json.loads((run / "5" / "_CHECKPOINT_METADATA").read_text())
    meta["commit_timestamp_nsecs"] = None
    (run / "5" / "_CHECKPOINT_METADATA").write_text(json.dumps(meta))
    with ocp.CheckpointManager(str(run), options=opts) as mgr:
        assert mgr.all_steps() == [0]
    with jaxckpt.CheckpointManager(run, read_only=True) as mgr:
        assert mgr.all_steps() == [0] and mgr.latest_step() == 0
    assert convert.from_orbax(run, tmp_path / "out").steps == (0,)
