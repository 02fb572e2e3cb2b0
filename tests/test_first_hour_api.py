"""Issue 20 ("the first hour"), items 2, 3 and 9, each as a new user met it: the API's
argument order, a run directory passed where a step is expected, and the places where
two faces of the library gave two answers (jaxckpt/_manager.py, _commit.py, inspect.py,
cli.py, convert.py)."""

import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_bit_equal, sharded

import jaxckpt

EXE = os.path.join(os.path.dirname(sys.executable), "jaxckpt")


def cli(*args, ok=(0,)):
    """Run the console script as a user does; returns (exit code, stdout, stderr)."""
    p = subprocess.run([EXE, *map(str, args)], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, JAX_PLATFORMS="cpu", COLUMNS="80"))
    assert p.returncode in ok, (p.returncode, p.stdout, p.stderr)
    assert "Traceback" not in p.stderr
    return p.returncode, p.stdout, p.stderr


def train_state(i=1):
    return {"params": {"w": sharded(np.arange(32, dtype=np.float32).reshape(8, 4) * i, (4,), ("x",), ("x", None)),
                       "b": np.arange(4, dtype=np.float32) * i},
            "rng": jax.random.key(i), "step": i}


@pytest.fixture
def run_dir(tmp_path):
    d = tmp_path / "run"
    with jaxckpt.CheckpointManager(d) as mgr:
        for i in range(1, 4):
            mgr.save(i * 10, train_state(i))
    return d


# --- item 2: mgr.restore(abstract_state) ---------------------------------------------


def test_manager_restore_with_the_target_first_says_pass_target(run_dir):
    abstract_state = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
        if hasattr(x, "dtype") else x, train_state(3))
    with jaxckpt.CheckpointManager(run_dir) as mgr:
        with pytest.raises(jaxckpt.CheckpointError) as e:
            mgr.restore(abstract_state)  # d7c90e7: TypeError: unhashable type: 'dict'
        assert type(e.value) is jaxckpt.CheckpointError
        assert str(e.value) == (
            f"Restoring from '{run_dir}': mgr.restore() takes the step first: got a dict; pass target=... "
            "(mgr.restore(target=abstract_state), or mgr.restore(step, target=abstract_state))")
        with pytest.raises(jaxckpt.CheckpointError, match="takes the step first: got a str; pass target="):
            mgr.restore("30")
        with pytest.raises(jaxckpt.CheckpointError, match="takes the step first: got a bool"):
            mgr.restore(True)
        with pytest.raises(jaxckpt.CheckpointError, match="step must be a non-negative int, got -1"):
            mgr.restore(-1)
        # what the message says works; a numpy int is a step
        got = mgr.restore(target=abstract_state)
        assert_bit_equal(got["params"]["w"], np.arange(32, dtype=np.float32).reshape(8, 4) * 3)
        assert got["step"] == 3
        assert mgr.restore(np.int64(20))["step"] == 2


# --- item 3: a manager directory where a step is expected ----------------------------


def _manager_message(where, steps, latest):
    return (f"No checkpoint at '{where}': manifest.json is missing (not committed, or not a checkpoint); "
            f"'{where}' is a CheckpointManager directory, not a checkpoint: its committed steps are {steps}. "
            f"Open one by its step directory, e.g. jaxckpt.restore('{latest}') (or `jaxckpt show {latest}`), "
            f"or the latest with jaxckpt.CheckpointManager('{where}').restore()")


@pytest.mark.parametrize("call", ["restore", "open", "metadata"])
def test_a_run_directory_passed_as_a_checkpoint_lists_its_steps(run_dir, call):
    (run_dir / "40").mkdir()  # a save in progress: a step directory without a manifest is no step
    with pytest.raises(jaxckpt.CheckpointNotFoundError) as e:
        getattr(jaxckpt, call)(run_dir)  # d7c90e7: "... manifest.json is missing (not committed, ...)"
    assert str(e.value) == _manager_message(run_dir, "10, 20, 30", run_dir / "30")
    assert isinstance(e.value, FileNotFoundError)
    # the way out it names works
    assert jaxckpt.restore(run_dir / "30")["step"] == 3
    with jaxckpt.CheckpointManager(run_dir, read_only=True) as mgr:
        assert mgr.restore()["step"] == 3


def test_jaxckpt_show_of_a_run_directory_lists_its_steps(run_dir):
    code, out, err = cli("show", run_dir, ok=(2,))
    assert out == ""
    assert err == "jaxckpt: " + _manager_message(run_dir, "10, 20, 30", run_dir / "30") + "\n"


def test_many_steps_are_named_by_their_first_and_last(tmp_path):
    d = tmp_path / "long"
    with jaxckpt.CheckpointManager(d) as mgr:
        for step in range(0, 100, 10):
            mgr.save(step, {"x": np.float32(step)})
    with pytest.raises(jaxckpt.CheckpointNotFoundError) as e:
        jaxckpt.restore(d)
    assert str(e.value) == _manager_message(d, "0, 10, 20, …, 70, 80, 90 (10 steps)", d / "90")


def test_a_writer_with_no_step_yet_is_named(tmp_path):
    d = tmp_path / "fresh"
    with jaxckpt.CheckpointManager(d):  # holds the writer's lease, saved nothing
        with pytest.raises(jaxckpt.CheckpointNotFoundError) as e:
            jaxckpt.open(d)
    assert str(e.value) == (
        f"No checkpoint at '{d}': manifest.json is missing (not committed, or not a checkpoint); '{d}' is a "
        "CheckpointManager directory with no committed step yet (a writer holds or held its lease)")


def test_a_plain_directory_says_only_what_is_missing(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "7.txt").write_text("x")
    with pytest.raises(jaxckpt.CheckpointNotFoundError) as e:
        jaxckpt.restore(tmp_path / "notes")
    assert str(e.value) == (f"No checkpoint at '{tmp_path / 'notes'}': manifest.json is missing "
                            "(not committed, or not a checkpoint)")


def test_a_run_directory_on_an_object_store_lists_its_steps(s3_server):
    spec = s3_server("first-hour/run")
    with jaxckpt.CheckpointManager(spec) as mgr:
        for step in (5, 6):
            mgr.save(step, {"x": np.float32(step)})
    s3_server.client.put_object(Bucket="jaxckpt-test", Key="first-hour/run/7/d/0-0123456789ab/junk", Body=b"x")
    where = "s3://jaxckpt-test/first-hour/run"
    with pytest.raises(jaxckpt.CheckpointNotFoundError) as e:
        jaxckpt.restore(spec)
    assert str(e.value) == _manager_message(where, "5, 6", f"{where}/6")
    assert jaxckpt.restore({**spec, "path": "first-hour/run/6"})["x"] == np.float32(6)
