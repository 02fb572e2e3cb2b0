"""Reading orbax-checkpoint checkpoints (issue 10, items 1 and 2): jaxckpt restores what
orbax saved bit for bit, as orbax's own restore of the same checkpoint gives it."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp  # a test dependency (pyproject [test])
import pytest
from conftest import assert_bit_equal, mesh, sharded
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt import _formats, _storage
from jaxckpt._errors import CheckpointError, CorruptCheckpointError
from jaxckpt._formats import orbax as _orbax


def _tree():
    rng = np.random.default_rng(0)
    m4 = mesh((4,), ("x",))
    return {
        "params": {
            "w": sharded(rng.standard_normal((8, 4), np.float32), (4,), ("x",), ("x", None)),
            "b": jax.device_put(jnp.asarray(rng.standard_normal(4), jnp.bfloat16), NamedSharding(m4, P())),
            "q": sharded(rng.integers(-128, 128, (4, 6), np.int8), (4,), ("x",), ("x", None)),
        },
        "host": np.arange(12, dtype=np.int8).reshape(3, 4),
        "layers": [jnp.asarray(rng.standard_normal(6), jnp.float32), jnp.arange(4, dtype=jnp.int32)],
        "step": 7,
        "lr": 0.25,
        "rng": jax.random.key(3),
        "rngs": jax.random.split(jax.random.key(1), 4),
    }


def _same_sharding_target(tree):
    def one(x):
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        if isinstance(x, np.ndarray):
            return np.zeros_like(x)
        return x

    return jax.tree.map(one, tree)


def _mesh_target(tree):
    """Every jax array onto a 2x2 mesh: 2-D leaves P('a', 'b'), 1-D P('a'), keys replicated."""
    m = mesh((2, 2), ("a", "b"))

    def one(x):
        if not isinstance(x, jax.Array):
            return _same_sharding_target(x)
        spec = P("a", "b") if x.ndim == 2 else P("a") if x.ndim == 1 else P()
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(m, spec))

    return jax.tree.map(one, tree)


def _save(path, tree, how):
    path = os.path.abspath(path)
    if how in ("ocdbt", "files"):
        with ocp.StandardCheckpointer(use_ocdbt=how == "ocdbt") as ck:
            ck.save(path, tree)
            ck.wait_until_finished()
    else:  # zarr3, with or without OCDBT: PyTreeSave
        handler = ocp.PyTreeCheckpointHandler(use_zarr3=True, use_ocdbt=how == "zarr3-ocdbt")
        ocp.Checkpointer(handler).save(path, args=ocp.args.PyTreeSave(tree))
    return path


def _orbax_restore(path, target, how):
    if how in ("ocdbt", "files"):
        with ocp.StandardCheckpointer() as ck:
            return ck.restore(path, target)
    handler = ocp.PyTreeCheckpointHandler(use_zarr3=True)
    args = ocp.args.PyTreeRestore(item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target))
    return ocp.Checkpointer(handler).restore(path, args=args)


def _is_key(x):
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def assert_same(ours, theirs):
    """Same tree, same leaf types, shardings, dtypes and bits."""
    flat_ours, tdef_ours = jax.tree_util.tree_flatten_with_path(ours)
    flat_theirs, tdef_theirs = jax.tree_util.tree_flatten_with_path(theirs)
    assert tdef_ours == tdef_theirs
    for (path, a), (_, b) in zip(flat_ours, flat_theirs):
        where = jax.tree_util.keystr(path)
        assert type(a) is type(b) or (isinstance(a, jax.Array) and isinstance(b, jax.Array)), where
        if isinstance(b, jax.Array):
            assert a.sharding == b.sharding, where
        if _is_key(b):
            assert _is_key(a) and a.dtype == b.dtype, where
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        if isinstance(b, (jax.Array, np.ndarray)):
            assert_bit_equal(a, b)
        else:
            assert a == b or (a != a and b != b), where


SAVES = ["ocdbt", "files", "zarr3-ocdbt", "zarr3-files"]


@pytest.mark.parametrize("how", SAVES)
def test_restore_onto_saved_sharding_matches_orbax(tmp_path, how):
    tree = _tree()
    path = _save(tmp_path / "ckpt", tree, how)
    target = _same_sharding_target(tree)
    ours = jaxckpt.restore(path, target)
    assert_same(ours, _orbax_restore(path, target, how))
    assert_same(ours, tree)


@pytest.mark.parametrize("how", SAVES)
def test_restore_onto_2x2_mesh_matches_orbax(tmp_path, how):
    tree = _tree()
    path = _save(tmp_path / "ckpt", tree, how)
    target = _mesh_target(tree)
    ours = jaxckpt.restore(path, target)
    assert ours["params"]["w"].sharding.spec == P("a", "b")
    assert_same(ours, _orbax_restore(path, target, how))


@pytest.mark.parametrize("how", ["ocdbt", "files"])
def test_restore_without_target_gives_numpy_and_python_scalars(tmp_path, how):
    tree = _tree()
    path = _save(tmp_path / "ckpt", tree, how)
    ours = jaxckpt.restore(path)
    with ocp.StandardCheckpointer() as ck:
        theirs = ck.restore(path)
    assert type(ours["step"]) is int and ours["step"] == theirs["step"] == 7
    assert type(ours["lr"]) is float and ours["lr"] == theirs["lr"] == 0.25
    for key in ("rng", "rngs"):  # typed keys, as orbax recorded their implementation
        assert _is_key(ours[key]) and ours[key].dtype == theirs[key].dtype
        assert_bit_equal(jax.random.key_data(ours[key]), jax.random.key_data(theirs[key]))
    for p in (("params", "w"), ("params", "b"), ("params", "q"), ("host",), ("layers", 0), ("layers", 1)):
        a, b = ours, theirs
        for k in p:
            a, b = a[k], b[k]
        assert isinstance(a, np.ndarray)
        assert_bit_equal(a, np.asarray(b))


def test_metadata_and_open_list_leaves(tmp_path):
    tree = _tree()
    path = _save(tmp_path / "ckpt", tree, "ocdbt")
    info = jaxckpt.metadata(path)
    assert info.info["format"] == "orbax" and info.metadata == {} and info.format_version == 1
    w = info.tree["params"]["w"]
    assert (w.shape, w.dtype, w.path) == ((8, 4), np.dtype("float32"), "params/w")
    assert w.sharding.spec == P("x", None) and w.sharding.mesh_shape == {"x": 4}
    assert info.tree["params"]["b"].dtype == jnp.bfloat16 and info.tree["params"]["b"].sharding.spec == P()
    assert info.tree["host"].dtype == np.int8 and info.tree["host"].sharding is None
    assert info.tree["rngs"].shape == (4,) and info.tree["rngs"].dtype == jax.random.key(0).dtype
    assert info.tree["step"] == 7 and info.tree["lr"] == 0.25
    view = jaxckpt.open(path)
    assert view.format == "orbax"
    assert view.keys() == ["host", "layers/0", "layers/1", "lr", "params/b", "params/q", "params/w",
                           "rng", "rngs", "step"]
    _storage.reset_io_stats()
    part = view["params/w"][2:5, 1]
    assert _storage.io_stats()["bytes_read"] == 3 * 4  # the box [2:5, 1:2], nothing more
    assert_bit_equal(part, np.asarray(tree["params"]["w"])[2:5, 1])
    assert view["params/q"].dtype == np.int8 and view["step"] == 7


def test_orbax_records(tmp_path):
    path = _save(tmp_path / "ckpt", _tree(), "files")
    man = _orbax.open_source(path).manifest
    recs = {r.path: r for r in man.leaves}
    w = recs["params/w"]
    assert (w.kind, w.store, w.key, w.dtype, w.shape) == ("array", "orbax", "params.w", "float32", (8, 4))
    assert w.sharding == {"type": "named", "axis_names": ["x"], "axis_sizes": [4], "spec": ["x", None]}
    assert recs["rngs"].kind == "prng_key" and recs["rngs"].impl == "threefry2x32"
    assert (recs["rngs"].shape, recs["rngs"].key_ndim, recs["rngs"].dtype) == ((4, 2), 1, "uint32")
    assert recs["step"].kind == "value" and recs["step"].value == 7
    assert man.process_count == 1 and man.format_version == 1


def test_manager_step_with_two_items(tmp_path):
    tree = _tree()
    directory = os.path.abspath(tmp_path / "run")
    with ocp.CheckpointManager(directory) as mgr:
        mgr.save(3, args=ocp.args.Composite(state=ocp.args.StandardSave(tree),
                                            extra=ocp.args.JsonSave({"lr": 0.1, "tags": ["a", "b"]})))
        mgr.wait_until_finished()
    step = os.path.join(directory, "3")
    restored = jaxckpt.restore(step)
    assert set(restored) == {"state", "extra"}
    assert restored["extra"] == {"lr": 0.1, "tags": ["a", "b"]}
    assert_bit_equal(restored["state"]["params"]["w"], np.asarray(tree["params"]["w"]))
    view = jaxckpt.open(step)
    assert "state/params/w" in view.keys() and "extra/tags/1" in view.keys()
    assert view.info["orbax_items"] == ["extra", "state"]
    assert jaxckpt.metadata(step).tree["state"]["params"]["q"].shape == (4, 6)

    target = _mesh_target(tree)
    ours = jaxckpt.restore(os.path.join(step, "state"), target)
    with ocp.StandardCheckpointer() as ck:
        assert_same(ours, ck.restore(os.path.join(step, "state"), target))
    # the items as subtrees of a target
    ours = jaxckpt.restore(step, {"state": target, "extra": {"lr": 0.0, "tags": ["", ""]}})
    assert ours["extra"]["lr"] == 0.1
    assert_bit_equal(ours["state"]["params"]["q"], np.asarray(tree["params"]["q"]))


def test_manager_step_with_one_item_reads_as_that_item(tmp_path):
    directory = os.path.abspath(tmp_path / "run")
    with ocp.CheckpointManager(directory) as mgr:
        mgr.save(5, args=ocp.args.StandardSave({"w": jnp.arange(4.0)}))
        mgr.wait_until_finished()
    assert jaxckpt.open(os.path.join(directory, "5")).keys() == ["w"]
    assert_bit_equal(jaxckpt.restore(os.path.join(directory, "5"))["w"], np.arange(4.0, dtype=np.float32))
    assert _orbax.open_source(directory) is None  # the manager's directory is not a checkpoint


@pytest.mark.filterwarnings("ignore:Sharding info not provided")
def test_strings_none_and_empty_containers(tmp_path):
    tree = {"name": "run-1", "none": None, "d": {}, "l": [], "t": (), "x": np.float32(2.5),
            "nested": [{"a": np.ones(2, np.float32)}, (jnp.zeros(3),)]}
    path = os.path.abspath(tmp_path / "ckpt")
    with ocp.PyTreeCheckpointer() as ck:
        ck.save(path, tree)
        theirs = ck.restore(path)
    ours = jaxckpt.restore(path)
    assert ours["name"] == theirs["name"] == "run-1"
    assert ours["none"] is None and ours["d"] == {} and ours["l"] == [] and ours["t"] == ()
    assert type(ours["x"]) is type(theirs["x"]) and ours["x"] == theirs["x"]
    assert isinstance(ours["nested"], list) and isinstance(ours["nested"][1], list)  # as orbax gives them
    assert_bit_equal(ours["nested"][0]["a"], np.asarray(theirs["nested"][0]["a"]))
    assert_bit_equal(ours["nested"][1][0], np.asarray(theirs["nested"][1][0]))


def test_prng_key_without_recorded_impl_is_key_data(tmp_path):
    path = _save(tmp_path / "ckpt", {"rng": jax.random.key(5)}, "files")
    for name in os.listdir(os.path.join(path, "array_metadatas")):
        os.remove(os.path.join(path, "array_metadatas", name))
    rec = _orbax.open_source(path).manifest.leaves[0]
    assert rec.kind == "array" and rec.dtype == "uint32"
    assert_bit_equal(jaxckpt.restore(path)["rng"], np.asarray(jax.random.key_data(jax.random.key(5))))


def test_not_orbax_is_not_claimed(tmp_path):
    assert _orbax.open_source(tmp_path) is None  # empty directory
    (tmp_path / "metadata").write_text("{}")
    (tmp_path / "params.w").mkdir()
    assert _orbax.open_source(tmp_path) is None  # orbax-like names, no orbax metadata
    assert _orbax.open_source(tmp_path / "missing") is None
    ours = tmp_path / "jaxckpt"
    jaxckpt.save(ours, {"a": np.arange(3)})
    assert _orbax.open_source(ours) is None
    assert _formats.open_source(ours).format == "jaxckpt"
    with pytest.raises(jaxckpt.CheckpointNotFoundError):
        jaxckpt.restore(tmp_path)


def _hostile(tmp_path, text):
    path = _save(tmp_path / "ckpt", {"a": {"b": np.arange(3, dtype=np.int32)}}, "files")
    with open(os.path.join(path, "_METADATA")) as f:
        doc = json.load(f)
    with open(os.path.join(path, "_METADATA"), "w") as f:
        f.write(text(doc) if callable(text) else text)
    return path


def _renamed(key):
    def edit(doc):
        (entry,) = doc["tree_metadata"].values()
        entry["key_metadata"][0]["key"] = key
        return json.dumps(doc)

    return edit


@pytest.mark.parametrize("text", [
    "{not json",
    "[]",
    '{"tree_metadata": []}',
    _renamed(".."),
    _renamed("../../etc"),
    _renamed("/abs"),
    lambda doc: json.dumps({**doc, "use_ocdbt": "yes"}),
    lambda doc: json.dumps(doc).replace('"key_type": 2', '"key_type": 7', 1),
    lambda doc: json.dumps(doc).replace('"key_type": 2', '"key_type": 1', 1),  # "a" as an index
    lambda doc: '{"tree_metadata": {"x": ' * 3000 + "}" * 3000,
], ids=["bad-json", "not-object", "tree-not-object", "dotdot", "escape", "absolute", "bool-type",
        "key-type", "index-not-int", "deep"])
def test_hostile_metadata_is_corrupt(tmp_path, text):
    path = _hostile(tmp_path, text)
    for call in (jaxckpt.restore, jaxckpt.metadata, jaxckpt.open):
        with pytest.raises(CorruptCheckpointError, match="ckpt"):
            call(path)


def test_hostile_sharding_and_array_metadata_are_corrupt(tmp_path):
    path = _save(tmp_path / "ckpt", {"w": sharded(np.arange(8.0), (4,), ("x",), ("x",))}, "files")
    with open(os.path.join(path, "_sharding"), "w") as f:
        json.dump({"dw==": json.dumps({"sharding_type": "NamedSharding", "shape": [4], "axis_names": ["x"],
                                       "partition_spec": ["y"]})}, f)
    with pytest.raises(CorruptCheckpointError, match="sharding"):
        jaxckpt.metadata(path)
    os.remove(os.path.join(path, "_sharding"))
    assert jaxckpt.metadata(path).tree["w"].sharding is None  # not recorded: no sharding
    with open(os.path.join(path, "w", ".zarray"), "w") as f:
        f.write('{"zarr_format": 2, "shape": [8], "chunks": [2], "dtype": "|O", "compressor": null, '
                '"fill_value": null, "order": "C", "filters": null}')
    with pytest.raises(CorruptCheckpointError, match="'w'"):
        jaxckpt.metadata(path)


def test_corrupt_chunk_names_the_leaf(tmp_path):
    path = _save(tmp_path / "ckpt", {"w": sharded(np.arange(8.0, dtype=np.float32), (4,), ("x",), ("x",))},
                 "files")
    with open(os.path.join(path, "w", "1"), "wb") as f:
        f.write(b"garbage")
    view = jaxckpt.open(path)
    assert_bit_equal(view["w"][0:2], np.arange(2.0, dtype=np.float32))  # other chunks still read
    with pytest.raises(CorruptCheckpointError, match=r"leaf 'w' \(orbax parameter 'w'\)"):
        jaxckpt.restore(path)


def test_step_without_readable_items(tmp_path):
    step = tmp_path / "4"
    (step / "other").mkdir(parents=True)
    (step / "_CHECKPOINT_METADATA").write_text(json.dumps({"item_handlers": {"other": "my.Handler"}}))
    with pytest.raises(CheckpointError, match="'other'"):
        jaxckpt.restore(step)
    (step / "_CHECKPOINT_METADATA").write_text(json.dumps({"item_handlers": {"../x": "my.Handler"}}))
    with pytest.raises(CorruptCheckpointError):
        jaxckpt.restore(step)


@pytest.mark.parametrize("how", ["ocdbt", "files"])
def test_orbax_step_on_s3(tmp_path, s3_server, how):
    """An orbax step copied to an object store reads through a kvstore spec."""
    tree = _tree()
    directory = os.path.abspath(tmp_path / "run")
    handler = ocp.StandardCheckpointHandler(use_ocdbt=how == "ocdbt")
    with ocp.CheckpointManager(directory, item_handlers=handler) as mgr:
        mgr.save(2, args=ocp.args.StandardSave(tree))
        mgr.wait_until_finished()
    for root, _, files in os.walk(os.path.join(directory, "2")):
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), directory)
            s3_server.client.upload_file(os.path.join(root, name), "jaxckpt-test", f"orbax-{how}/{rel}")
    spec = s3_server(f"orbax-{how}/2")
    target = _mesh_target(tree)
    ours = jaxckpt.restore(spec, target)
    assert_same(ours, jaxckpt.restore(os.path.join(directory, "2"), target))
    assert_bit_equal(ours["params"]["w"], np.asarray(tree["params"]["w"]))
    assert jaxckpt.open(spec)["params/q"][1:3].shape == (2, 6)


@pytest.mark.parametrize("impl", ["nope", "../x", 7])
def test_hostile_prng_impl_is_corrupt(tmp_path, impl):
    path = _save(tmp_path / "ckpt", {"rng": jax.random.key(5)}, "files")
    (name,) = os.listdir(os.path.join(path, "array_metadatas"))
    meta = os.path.join(path, "array_metadatas", name)
    with open(meta) as f:
        doc = json.load(f)
    doc["array_metadatas"][0]["array_metadata"]["ext_metadata"]["random_key_impl"] = impl
    with open(meta, "w") as f:
        json.dump(doc, f)
    with pytest.raises(CorruptCheckpointError, match="rng|random_key_impl"):
        jaxckpt.metadata(path)


# --- issue 31: what every orbax user has (optax's empty states, a fresh replicated key) --


def _abstract_of(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                        if isinstance(x, jax.Array) else x, tree)


def _adamw_state():
    import optax

    params = {"w": sharded(np.arange(32, dtype=np.float32).reshape(8, 4), (4,), ("x",), ("x", None))}
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    return {"params": params, "opt_state": opt.init(params)}


@pytest.mark.parametrize("how", ["ocdbt", "files"])
def test_optax_empty_state_restores_strictly(tmp_path, how):
    """orbax stores optax's EmptyState() as None; a strict restore onto the optax state
    (and onto an import of it) matches it with the target's EmptyState(), as orbax does."""
    state = _adamw_state()
    path = _save(tmp_path / "c", state, how)
    target = _abstract_of(state)
    theirs = _orbax_restore(path, target, how)
    assert_same(jaxckpt.restore(path, target), theirs)
    jaxckpt.convert.from_orbax(path, tmp_path / "j")
    assert_same(jaxckpt.restore(tmp_path / "j", target), theirs)


def test_saved_none_stays_strict_where_the_target_has_no_empty_node(tmp_path):
    """The None-for-EmptyState rule matches an empty container only: a saved None where the
    target has nothing is still a mismatch, and so is a target leaf the checkpoint lacks."""
    state = {"a": jnp.arange(3), "gone": None, "empty": ()}
    path = _save(tmp_path / "c", state, "ocdbt")
    with pytest.raises(jaxckpt.TreeMismatchError, match="in the checkpoint but not in the target: gone"):
        jaxckpt.restore(path, {"a": jnp.zeros(3, jnp.int32), "empty": ()})
    with pytest.raises(jaxckpt.TreeMismatchError, match="not in the checkpoint: extra"):
        jaxckpt.restore(path, {"a": jnp.zeros(3, jnp.int32), "gone": (), "empty": (), "extra": None})
    out = jaxckpt.restore(path, {"a": jnp.zeros(3, jnp.int32), "gone": (), "empty": ()})
    assert out["gone"] == () and out["empty"] == ()


def test_jaxckpt_saved_none_does_not_match_an_empty_node(tmp_path):
    """jaxckpt's own checkpoints keep the strict rule: None is a leaf, () has none."""
    jaxckpt.save(tmp_path / "c", {"a": jnp.arange(3), "b": None})
    with pytest.raises(jaxckpt.TreeMismatchError, match="in the checkpoint but not in the target: b"):
        jaxckpt.restore(tmp_path / "c", {"a": jnp.zeros(3, jnp.int32), "b": ()})


@pytest.mark.parametrize("how", SAVES)
def test_fresh_replicated_key_reads(tmp_path, how):
    """A replicated typed key put on a mesh (never through jit) is saved with the spec
    [None]; restore, show and import read it, as orbax restores it."""
    m4 = mesh((4,), ("x",))
    tree = {"key": jax.device_put(jax.random.key(1), NamedSharding(m4, P())),
            "keys": jax.device_put(jax.random.split(jax.random.key(2), 4), NamedSharding(m4, P()))}
    path = _save(tmp_path / "c", tree, how)
    target = _abstract_of(tree)
    theirs = _orbax_restore(path, target, how)
    assert_same(jaxckpt.restore(path, target), theirs)
    assert _formats.open_source(path).manifest.leaves[0].sharding["spec"] == []
    view = jaxckpt.open(path)
    assert view["key"].prng_impl == "threefry2x32" and view["key"].shape == ()
    assert [r["path"] for r in view.rows()] == ["key", "keys"]
    from click.testing import CliRunner

    from jaxckpt.cli import main

    shown = CliRunner().invoke(main, ["show", str(path)])
    assert shown.exit_code == 0 and "key  key<fry>[]  P() on x=4  8 B" in shown.output, shown.output
    jaxckpt.convert.from_orbax(path, tmp_path / "j")
    assert_same(jaxckpt.restore(tmp_path / "j", target), theirs)


def test_key_spec_sharding_key_data_is_corrupt(tmp_path):
    """Entries past a key's rank may only be None: a sharded key-data dimension is refused."""
    path = _save(tmp_path / "c", {"key": jax.random.key(1)}, "files")
    raw = json.loads((tmp_path / "c" / "_sharding").read_text()) if (tmp_path / "c" / "_sharding").exists() else None
    m4 = mesh((4,), ("x",))
    sharding = {"sharding_type": "NamedSharding", "shape": [4], "axis_names": ["x"], "partition_spec": ["x"],
                "device_mesh": {"mesh": [{"id": i} for i in range(4)]}}
    del m4
    name = "key"
    import base64

    key = base64.urlsafe_b64encode(name.encode()).decode()
    (tmp_path / "c" / "_sharding").write_text(json.dumps({**(raw or {}), key: json.dumps(sharding)}))
    with pytest.raises(CorruptCheckpointError, match=r"leaf 'key': sharding spec \['x'\] is longer than its rank 0"):
        jaxckpt.restore(path)
