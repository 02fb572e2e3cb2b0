"""Issue 20 ("the first hour"), items 2, 3 and 9, each as a new user met it: the API's
argument order, a run directory passed where a step is expected, and the places where
two faces of the library gave two answers (jaxckpt/_manager.py, _commit.py, inspect.py,
cli.py, convert.py)."""

import json
import os
import subprocess
import sys

import jax
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
            mgr.restore(abstract_state)  # 18952db: TypeError: unhashable type: 'dict'
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
        getattr(jaxckpt, call)(run_dir)  # 18952db: "... manifest.json is missing (not committed, ...)"
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


# --- item 9: one answer from every face ----------------------------------------------


@pytest.fixture
def saved(tmp_path):
    keys = jax.device_put(jax.random.split(jax.random.key(5), 8), jax.sharding.NamedSharding(
        jax.sharding.Mesh(np.array(jax.devices()[:4]), ("x",)), jax.sharding.PartitionSpec("x")))
    tree = {"params": {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "a/b": np.ones(2, np.int8)},
            "opt": (np.arange(3, dtype=np.float32), {"mu": np.full(2, 7, np.float32)}),
            "rng": jax.random.key(3), "keys": keys, "step": 12}
    jaxckpt.save(tmp_path / "ckpt", tree)
    return tmp_path / "ckpt", tree


def test_the_view_takes_the_nested_keys_metadata_shows(saved):
    path, tree = saved
    view, info = jaxckpt.open(path), jaxckpt.metadata(path)

    def walk(node, at, keys):  # every leaf of metadata().tree, reached on the view by the same keys
        if isinstance(node, jaxckpt.LeafInfo):  # a NamedTuple: before the sequences
            assert isinstance(at, jaxckpt.LazyArray) and at.path == node.path, keys
            assert (at.shape, at.dtype) == (node.shape, node.dtype), keys
            assert view[keys].path == node.path
        elif isinstance(node, dict):
            for k, v in node.items():
                walk(v, at[k], keys + (k,))
        elif isinstance(node, (tuple, list)):
            for i, v in enumerate(node):
                walk(v, at[i], keys + (i,))
        else:
            assert at == node, keys

    assert_bit_equal(view["opt"][1]["mu"][...], tree["opt"][1]["mu"])  # 18952db: AttributeError: 'int' ...
    walk(info.tree, view, ())
    assert_bit_equal(view["opt/1/mu"][...], tree["opt"][1]["mu"])  # flat, as keys() lists it
    assert_bit_equal(view["params", "a/b"][...], tree["params"]["a/b"])  # a tuple: raw keys
    assert_bit_equal(view["params"]["a%2Fb"][...], tree["params"]["a/b"])  # a str: a key path
    assert "params" in view and ("opt", 1) in view and "params/w" in view and "nope" not in view
    with pytest.raises(KeyError, match="'2' is not a key path"):
        view["opt"][2]
    with pytest.raises(TypeError, match="indexed by a key path .str., an int or a tuple of them, got float"):
        view[1.5]


def test_a_typed_key_is_a_key_in_the_view_as_in_show(saved):
    path, tree = saved
    view = jaxckpt.open(path)
    rng = view["rng"]  # 18952db: uint32 (2,), where metadata and show say key<fry> ()
    assert (rng.shape, rng.dtype, rng.ndim, rng.size) == ((), jax.random.key(0).dtype, 0, 1)
    assert str(rng.dtype) == "key<fry>" and rng.prng_impl == "threefry2x32"
    assert (rng.shape, rng.dtype) == tuple(jaxckpt.metadata(path).tree["rng"][:2])
    assert repr(rng) == "LazyArray('rng', shape=(), dtype=key<fry>)"
    _, out, _ = cli("show", path)
    assert "\nrng  key<fry>[]  " in out and "\nkeys  key<fry>[8]  " in out
    # indexing gives typed keys; key_data the stored uint32 data as numpy
    got = rng[...]
    assert got.dtype == tree["rng"].dtype
    assert_bit_equal(jax.random.key_data(got), jax.random.key_data(tree["rng"]))
    assert_bit_equal(rng.key_data[...], np.asarray(jax.random.key_data(tree["rng"])))
    assert repr(rng.key_data) == "LazyArray('rng'.key_data, shape=(2,), dtype=uint32)"
    keys = view["keys"]
    assert (keys.shape, len(keys), str(keys.dtype)) == ((8,), 8, "key<fry>")
    assert_bit_equal(jax.random.key_data(keys[2:7:2]), jax.random.key_data(tree["keys"])[2:7:2])
    assert_bit_equal(jax.random.key_data(keys[5]), jax.random.key_data(tree["keys"])[5])
    assert_bit_equal(keys.key_data[1:3, 1], np.asarray(jax.random.key_data(tree["keys"]))[1:3, 1])
    with pytest.raises(TypeError, match=r"'rng' is a typed PRNG key \(key<fry>\): it has no numpy form; "
                                        r"index it for typed keys, or read its uint32 data with .key_data"):
        np.asarray(rng)
    with pytest.raises(TypeError, match="'params/w' is not a typed PRNG key"):
        view["params/w"].key_data
    row = next(r for r in view.rows() if r["path"] == "rng")
    assert (row["kind"], row["shape"], row["dtype"]) == ("key<threefry2x32>", (), "key<fry>")


def test_ls_shows_blocking_and_total_seconds_as_the_html_view_does(run_dir):
    _, out, _ = cli("ls", run_dir)  # 18952db: one column "save", the total
    lines = out.splitlines()
    assert lines[0].split() == ["step", "committed", "age", "size", "blocking", "total", "metrics"]
    with jaxckpt.CheckpointManager(run_dir, read_only=True) as mgr:
        html = mgr._repr_html_()
        for line, step in zip(lines[1:], (10, 20, 30)):
            info = mgr.info(step)
            cells = line.split()  # step, date, time, age, size, unit, blocking, total
            assert cells[0] == str(step)
            assert cells[6:8] == [f"{info['blocking_seconds']:.2f}s", f"{info['total_seconds']:.2f}s"]
    assert "blocking s" in html and "total s" in html


def test_from_orbax_returns_what_it_wrote(tmp_path):
    import orbax.checkpoint as ocp

    tree = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "rng": jax.random.key(1), "step": 4}
    with ocp.CheckpointManager(os.path.abspath(tmp_path / "orbax")) as mgr:
        mgr.save(5, args=ocp.args.StandardSave(tree))
        mgr.wait_until_finished()
    result = jaxckpt.convert.from_orbax(tmp_path / "orbax" / "5", tmp_path / "ours")  # 18952db: None
    assert isinstance(result, jaxckpt.convert.ImportResult) and isinstance(result, tuple)
    assert result == (str(tmp_path / "ours"), 3, 2, 24 + 8)
    assert result._asdict() == {"path": str(tmp_path / "ours"), "leaves": 3, "arrays": 2, "total_size": 32}
    _, out, _ = cli("import-orbax", tmp_path / "orbax" / "5", tmp_path / "again", "--json")
    assert json.loads(out) == {"src": str(tmp_path / "orbax" / "5"), "dest": str(tmp_path / "again"),
                               "leaves": 3, "bytes": 32}


def _first_sentence(doc):
    words = doc.partition("\n\n")[0].split()
    for i, w in enumerate(words):
        if w.endswith(".") and (i == len(words) - 1 or not words[i + 1][0].islower()):
            return " ".join(words[: i + 1])
    return " ".join(words)


def test_help_lists_each_command_with_its_whole_first_sentence():
    from jaxckpt import cli as cli_module

    _, out, _ = cli("--help")  # 18952db: "convert  Rewrite the checkpoint SRC at DEST with its chunks laid..."
    listing = out.split("Commands:", 1)[1]
    assert "..." not in listing
    flat = " ".join(listing.split())
    for name, command in cli_module.main.commands.items():
        assert f"{name} {_first_sentence(command.help)}" in flat, name
    assert "convert Rewrite the checkpoint SRC at DEST with its chunks laid out for another mesh, floats " \
           "cast, or a subset of its leaves, one leaf at a time." in flat


def test_one_leaf_is_one_leaf(tmp_path):
    jaxckpt.save(tmp_path / "one", {"w": np.zeros(3, np.float32)})
    _, out, _ = cli("show", tmp_path / "one")
    assert out.splitlines()[0] == f"{tmp_path / 'one'}: 1 leaf, 12 B, format version 3"  # 18952db: 1 leaves
    assert repr(jaxckpt.open(tmp_path / "one")) == f"CheckpointView('{tmp_path / 'one'}', 1 leaf, 12 B)"
    _, out, _ = cli("convert", tmp_path / "one", tmp_path / "copy", "--dtype", "bfloat16")
    assert out.strip() == f"{tmp_path / 'one'} -> {tmp_path / 'copy'}: 1 leaf, 6 B"
    _, out, _ = cli("export", tmp_path / "one", tmp_path / "one.safetensors")
    assert out.splitlines()[-1] == "1 tensor, 12 B"
    jaxckpt.save(tmp_path / "two", {"p": {"a": np.zeros(1, np.int8), "b": np.zeros(1, np.int8)}})
    _, out, _ = cli("show", tmp_path / "two", "--depth", "1")
    assert out.splitlines()[0] == f"{tmp_path / 'two'}: 2 leaves, 2 B, format version 3"
    assert "\np/  2 leaves, 2 B  …" in out
