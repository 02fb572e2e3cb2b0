"""jaxckpt.convert and the streaming writer (jaxckpt/convert.py, jaxckpt/_stream.py),
and the `import-orbax`, `export` and `convert` commands."""

import gc
import json
import os
import subprocess
import sys
import weakref

import jax
import ml_dtypes
import numpy as np
import pytest
from conftest import assert_bit_equal, mesh, sharded
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file

import jaxckpt
from jaxckpt import _commit, _distributed, _formats, _layout, _storage, convert
from jaxckpt._formats import stream as _stream
from jaxckpt._manifest import LeafRecord
from jaxckpt._storage import location as _location

EXE = os.path.join(os.path.dirname(sys.executable), "jaxckpt")


def state():
    rows = np.arange(1024 * 512, dtype=np.float32).reshape(1024, 512)  # 2 MiB: chunk files
    return {
        "params": {
            "w": sharded(rows, (4,), ("x",), ("x", None)),
            "emb": sharded(rows[:512].astype(ml_dtypes.bfloat16), (2, 2), ("a", "b"), (None, "b")),
            "b": np.linspace(-1, 1, 100, dtype=np.float32),  # packed
            "layers": [np.arange(6, dtype=np.int32).reshape(2, 3), np.zeros((0, 4), np.float32),
                       sharded(np.arange(64, dtype=np.float16).reshape(8, 8), (2,), ("x",), ("x", None))],
        },
        "opt": {"count": np.int64(7), "mask": np.array([True, False, True])},
        "rng": jax.random.key(3),
        "step": 12, "name": "run-a", "lr": None,
    }


def restored_bytes(path, **kw):
    return {p: np.asarray(jax.random.key_data(v) if isinstance(v, jax.Array) and jax.dtypes.issubdtype(
        v.dtype, jax.dtypes.prng_key) else v) for p, v in _flat(jaxckpt.restore(path, **kw))}


def _flat(tree):
    from jaxckpt import _tree

    return _tree.flatten(tree)[0]


def records(path):
    return {r.path: r for r in _formats.open_source(path).manifest.leaves}


# --- import (the generic path from_orbax runs) ---------------------------------------------


@pytest.mark.parametrize("version", [pytest.param(1, marks=pytest.mark.format1), 3])
def test_import_keeps_tree_values_dtypes_and_shardings(tmp_path, version):
    jaxckpt.save(tmp_path / "a", state(), metadata={"run": "a"})
    _storage.reset_io_stats()
    convert.import_source(_formats.open_source(tmp_path / "a"), tmp_path / "b")
    recs = records(tmp_path / "a").values()
    stored = sum(r.nbytes for r in recs if r.store == "file") + sum(
        p.nbytes for p in _formats.open_source(tmp_path / "a").manifest.packed) + sum(
        sum(run[2] for run in r.runs) * (r.entry_bytes - 4) for r in recs if r.store == "stream")
    assert stored >= sum(r.nbytes for r in recs)
    assert _storage.io_stats()["bytes_read"] == stored  # each saved chunk once (packed: padding too)
    assert jaxckpt.verify(tmp_path / "b").ok
    a, b = jaxckpt.restore(tmp_path / "a"), jaxckpt.restore(tmp_path / "b")
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for (pa, va), (pb, vb) in zip(_flat(a), _flat(b)):
        assert pa == pb
        if isinstance(va, jax.Array):  # the PRNG key
            assert vb.dtype == va.dtype and (jax.random.key_data(va) == jax.random.key_data(vb)).all()
        elif isinstance(va, (np.ndarray, np.generic)):
            assert type(vb) is type(va)
            assert_bit_equal(va, vb)
        else:
            assert type(vb) is type(va) and vb == va
    ra, rb = records(tmp_path / "a"), records(tmp_path / "b")
    assert {p: r.sharding for p, r in ra.items()} == {p: r.sharding for p, r in rb.items()}
    # chunks follow the recorded shard shape; whole leaf without a sharding
    big, small = ("file", "packed") if version == 1 else ("stream", "stream")
    assert _formats.open_source(tmp_path / "b").manifest.format_version == version
    assert rb["params/w"].chunk_shape == (256, 512) and rb["params/w"].store == big
    assert rb["params/emb"].chunk_shape == (512, 256)
    assert rb["params/layers/2"].chunk_shape == (4, 8) and rb["params/layers/2"].store == small
    assert rb["params/b"].chunk_shape == (100,)
    info = jaxckpt.metadata(tmp_path / "b")
    assert info.metadata == {"run": "a"}
    assert info.info["converted_from"] == {"path": str(tmp_path / "a"), "format": "jaxckpt"}


@pytest.mark.format1
def test_import_packs_small_leaves_exactly_as_save_does(tmp_path):
    jaxckpt.save(tmp_path / "a", state())
    convert.import_source(_formats.open_source(tmp_path / "a"), tmp_path / "b")
    ma, mb = (_formats.open_source(tmp_path / p).manifest for p in "ab")
    assert ma.packed == mb.packed
    packed = [r.path for r in ma.leaves if r.store == "packed" and r.kind != "value"]
    assert {p: records(tmp_path / "a")[p].chunks for p in packed} == {p: records(tmp_path / "b")[p].chunks
                                                                        for p in packed}
    for name in sorted(os.listdir(tmp_path / "a" / "packed" / "p0" / "c")):
        assert (tmp_path / "a/packed/p0/c" / name).read_bytes() == (tmp_path / "b/packed/p0/c" / name).read_bytes()


def _orbax_step(directory, tree, step=5):
    import orbax.checkpoint as ocp

    with ocp.CheckpointManager(os.path.abspath(directory)) as mgr:
        mgr.save(step, args=ocp.args.StandardSave(tree))
        mgr.wait_until_finished()
    return directory / str(step)


def test_from_orbax_keeps_tree_values_dtypes_and_shardings(tmp_path):
    rows = np.arange(1024 * 512, dtype=np.float32).reshape(1024, 512)
    tree = {"params": {"w": sharded(rows, (4,), ("x",), ("x", None)),
                       "emb": sharded(rows[:512].astype(ml_dtypes.bfloat16), (2, 2), ("a", "b"), (None, "b")),
                       "b": np.linspace(-1, 1, 100, dtype=np.float32)},
            "q": np.arange(12, dtype=np.int8).reshape(3, 4), "rng": jax.random.key(3), "step": 12}
    step = _orbax_step(tmp_path / "orbax", tree)
    convert.from_orbax(step, tmp_path / "b")
    assert jaxckpt.verify(tmp_path / "b").ok
    assert jaxckpt.metadata(tmp_path / "b").info["converted_from"] == {"path": str(step), "format": "orbax"}
    rb = records(tmp_path / "b")
    assert rb["params/w"].chunk_shape == (256, 512) and rb["params/w"].store == "stream"
    assert rb["params/emb"].chunk_shape == (512, 256) and rb["params/emb"].dtype == "bfloat16"
    assert rb["params/w"].sharding == {"type": "named", "axis_names": ["x"], "axis_sizes": [4],
                                       "spec": ["x", None]}
    assert rb["params/b"].chunk_shape == (100,) and rb["q"].dtype == "int8"
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                          if isinstance(x, jax.Array) else x, tree)
    _storage.reset_io_stats()
    out = jaxckpt.restore(tmp_path / "b", target)
    leaf_bytes = sum(r.nbytes for r in rb.values())
    assert _storage.io_stats()["bytes_read"] == leaf_bytes  # every entry once (no edge chunk here)
    assert out["params"]["w"].sharding == tree["params"]["w"].sharding
    assert_bit_equal(out["params"]["w"], rows)
    assert_bit_equal(out["params"]["emb"], rows[:512].astype(ml_dtypes.bfloat16))
    assert_bit_equal(out["params"]["b"], tree["params"]["b"])
    assert_bit_equal(out["q"], tree["q"])
    assert (jax.random.key_data(out["rng"]) == jax.random.key_data(tree["rng"])).all() and out["step"] == 12
    code, stdout, _ = cli("import-orbax", step, tmp_path / "c")
    assert stdout.strip() == f"{step} -> {tmp_path / 'c'}: 6 leaves, 2.5 MiB"
    assert jaxckpt.diff(tmp_path / "b", tmp_path / "c").identical


def test_from_orbax_refuses_a_checkpoint_of_another_format(tmp_path):
    jaxckpt.save(tmp_path / "a", {"x": np.zeros(3)})
    with pytest.raises(jaxckpt.CheckpointError, match=r"is a jaxckpt checkpoint, not an orbax-checkpoint one"):
        convert.from_orbax(tmp_path / "a", tmp_path / "b")
    assert not (tmp_path / "b").exists()
    with pytest.raises(jaxckpt.CheckpointNotFoundError):
        convert.from_orbax(tmp_path / "nothing", tmp_path / "b")


def test_import_refuses_an_existing_destination_unless_overwrite(tmp_path):
    jaxckpt.save(tmp_path / "a", {"x": np.arange(3)})
    jaxckpt.save(tmp_path / "b", {"y": np.arange(2)})
    source = _formats.open_source(tmp_path / "a")
    with pytest.raises(jaxckpt.CheckpointError, match="already exists; pass overwrite=True"):
        convert.import_source(source, tmp_path / "b")
    convert.import_source(source, tmp_path / "b", overwrite=True)
    assert list(jaxckpt.restore(tmp_path / "b")) == ["x"]


# --- the streaming writer -----------------------------------------------------------------


def _template(path, shape, chunk_shape, dtype="float32"):
    return LeafRecord(path=path, kind="array", dtype=dtype, shape=shape, chunk_shape=chunk_shape)


def test_writer_holds_one_leaf_at_a_time(tmp_path):
    shapes = [(512, 1024), (300,), (768, 512), (16, 16)]
    leaves = [_template(f"l{i}", s, s) for i, s in enumerate(shapes)]
    structure = {"dict": [[f"l{i}", {"leaf": i}] for i in range(len(shapes))]}
    alive, order = [], []

    def chunk_data(i, rec):
        gc.collect()
        order.append((i, [r() is not None for r in alive]))
        data = np.full(rec.shape, i, np.float32)
        alive.append(weakref.ref(data))
        return lambda index: data[_layout.index_to_slices(index)]

    _stream.write_checkpoint(tmp_path / "c", structure, leaves, chunk_data)
    assert order == [(0, []), (1, [False]), (2, [False, False]), (3, [False, False, False])]
    out = jaxckpt.restore(tmp_path / "c")
    for i, s in enumerate(shapes):
        assert_bit_equal(out[f"l{i}"], np.full(s, i, np.float32))
    assert jaxckpt.verify(tmp_path / "c").ok


@pytest.mark.format1
def test_writer_casts_and_writes_strided_chunks_blockwise_with_tensorstores_bytes(tmp_path, monkeypatch):
    monkeypatch.setattr(_stream, "BLOCK_BYTES", 4096)  # many blocks per chunk
    x = np.random.default_rng(0).standard_normal((1024, 768)).astype(np.float32)
    leaves = [_template("x", x.shape, (1024, 256), "bfloat16")]
    _stream.write_checkpoint(tmp_path / "c", {"dict": [["x", {"leaf": 0}]]}, leaves, lambda i, rec: x)
    # the same array saved through jax: column blocks, written by _writer/tensorstore
    m = mesh((3,), ("b",))
    jaxckpt.save(tmp_path / "ref", {"x": jax.device_put(x.astype(ml_dtypes.bfloat16), NamedSharding(m, P(None, "b")))})
    for k in range(3):
        ours, ref = (tmp_path / d / "arrays" / "0" / "c" / "0" / str(k) for d in ("c", "ref"))
        assert ours.read_bytes() == ref.read_bytes()
    assert_bit_equal(jaxckpt.restore(tmp_path / "c")["x"], x.astype(ml_dtypes.bfloat16))


@pytest.mark.format1
def test_writer_writes_uneven_edge_chunks_through_tensorstore(tmp_path):
    x = np.arange(1001 * 300, dtype=np.float32).reshape(1001, 300)
    leaves = [_template("x", x.shape, (501, 300))]
    _stream.write_checkpoint(tmp_path / "c", {"dict": [["x", {"leaf": 0}]]}, leaves,
                             lambda i, rec: lambda index: x[_layout.index_to_slices(index)])
    assert jaxckpt.verify(tmp_path / "c").ok
    assert_bit_equal(jaxckpt.restore(tmp_path / "c")["x"], x)
    # zarr stores the edge chunk at full size
    assert os.path.getsize(tmp_path / "c/arrays/0/c/1/0") == os.path.getsize(tmp_path / "c/arrays/0/c/0/0")


def test_writer_checks_the_shapes_it_is_given(tmp_path):
    leaves = [_template("x", (512, 1024), (256, 1024))]
    with pytest.raises(jaxckpt.CheckpointError, match=r"Leaf 'x': data of shape \(512, 512\), expected \(512, 1024\)"):
        _stream.write_checkpoint(tmp_path / "c", {"dict": [["x", {"leaf": 0}]]}, leaves,
                                 lambda i, rec: np.zeros((512, 512), np.float32))
    with pytest.raises(jaxckpt.CheckpointError, match=r"Leaf 'x': chunk \(\(0, 256\), \(0, 1024\)\) came as shape"):
        _stream.write_checkpoint(tmp_path / "c", {"dict": [["x", {"leaf": 0}]]}, leaves,
                                 lambda i, rec: lambda index: np.zeros((3,), np.float32))
    assert os.listdir(tmp_path) == []


def test_writer_refuses_multiple_processes(tmp_path, monkeypatch):
    monkeypatch.setattr(_distributed, "process_count", lambda: 2)
    with pytest.raises(jaxckpt.CheckpointError, match="single process; this job has 2"):
        _stream.write_checkpoint(tmp_path / "c", {"leaf": 0}, [_template("", (2,), (2,))],
                                 lambda i, rec: lambda index: np.zeros(2, np.float32))
    assert not os.path.exists(tmp_path / "c")


def test_writer_failure_leaves_nothing_behind(tmp_path):
    def chunk_data(i, rec):
        if i == 1:
            raise OSError("disk on fire")
        return lambda index: np.zeros(_layout.index_shape(index), np.float32)

    leaves = [_template("a", (512, 1024), (256, 1024)), _template("b", (4,), (4,))]
    with pytest.raises(jaxckpt.CheckpointError, match="leaf 'b' failed: disk on fire"):
        _stream.write_checkpoint(tmp_path / "c", {"dict": [["a", {"leaf": 0}], ["b", {"leaf": 1}]]}, leaves,
                                 chunk_data)
    assert os.listdir(tmp_path) == []


# --- relayout -------------------------------------------------------------------------


def test_relayout_onto_an_abstract_mesh_matches_its_shards_and_reads_each_byte_once(tmp_path):
    x = np.random.default_rng(1).standard_normal((1024, 512)).astype(np.float32)
    jaxckpt.save(tmp_path / "a", {"w": sharded(x, (2,), ("x",), ("x", None))})
    target = NamedSharding(AbstractMesh((2, 2), ("a", "b")), P(None, "b"))
    _storage.reset_io_stats()
    convert.relayout(tmp_path / "a", tmp_path / "b", shardings=target)
    assert _storage.io_stats()["bytes_read"] == x.nbytes
    rec = records(tmp_path / "b")["w"]
    assert rec.chunk_shape == target.shard_shape(x.shape) == (1024, 256)
    assert rec.sharding == {"type": "named", "axis_names": ["a", "b"], "axis_sizes": [2, 2], "spec": [None, "b"]}
    concrete = NamedSharding(mesh((2, 2), ("a", "b")), P(None, "b"))
    _storage.reset_io_stats()
    out = jaxckpt.restore(tmp_path / "b", {"w": jax.ShapeDtypeStruct(x.shape, np.float32, sharding=concrete)})
    assert _storage.io_stats()["bytes_read"] == x.nbytes  # each column block once for its two holders
    assert out["w"].sharding == concrete
    assert_bit_equal(out["w"], x)
    assert jaxckpt.metadata(tmp_path / "b").tree["w"].sharding.spec == P(None, "b")


def test_relayout_casts_floats_only_and_selects(tmp_path):
    jaxckpt.save(tmp_path / "a", state())
    convert.relayout(tmp_path / "a", tmp_path / "b", dtype="bfloat16", select=["params/layers", "rng"])
    out = jaxckpt.restore(tmp_path / "b")
    assert list(out) == ["params", "rng"] and list(out["params"]) == ["layers"]
    layers = out["params"]["layers"]
    assert isinstance(layers, list) and len(layers) == 3  # nothing pruned from the list: stays a list
    assert layers[0].dtype == np.int32 and layers[1].dtype == ml_dtypes.bfloat16
    assert_bit_equal(layers[2], np.arange(64, dtype=np.float16).reshape(8, 8).astype(ml_dtypes.bfloat16))
    assert (jax.random.key_data(out["rng"]) == jax.random.key_data(jax.random.key(3))).all()
    # a list that loses items becomes a dict with int keys: key paths stay the same
    convert.relayout(tmp_path / "a", tmp_path / "c", select="params/layers/2")
    out = jaxckpt.restore(tmp_path / "c")
    assert list(out["params"]["layers"]) == [2]
    restored = jaxckpt.restore(tmp_path / "c", {"params": {"layers": {2: jax.ShapeDtypeStruct((8, 8), np.float16)}}})
    assert_bit_equal(restored["params"]["layers"][2], np.arange(64, dtype=np.float16).reshape(8, 8))


def test_relayout_takes_a_tree_of_shardings(tmp_path):
    jaxckpt.save(tmp_path / "a", state())
    am = AbstractMesh((4,), ("d",))
    tree = jax.tree.map(lambda _: None, jaxckpt.metadata(tmp_path / "a").tree,
                        is_leaf=lambda x: isinstance(x, jaxckpt.LeafInfo))
    tree["params"]["w"] = NamedSharding(am, P(None, "d"))
    tree["rng"] = NamedSharding(am, P())
    convert.relayout(tmp_path / "a", tmp_path / "b", shardings=tree)
    rb, ra = records(tmp_path / "b"), records(tmp_path / "a")
    assert rb["params/w"].chunk_shape == (1024, 128)
    assert rb["params/emb"].sharding == ra["params/emb"].sharding and rb["params/emb"].chunk_shape == (512, 256)
    assert rb["rng"].chunk_shape == (2,)
    a, b = restored_bytes(tmp_path / "a"), restored_bytes(tmp_path / "b")
    assert a.keys() == b.keys()
    for p, v in a.items():
        assert_bit_equal(b[p], v)
    del tree["params"]["b"]
    tree["extra"] = None
    with pytest.raises(jaxckpt.TreeMismatchError, match="not in the checkpoint: extra; no entry for: params/b") as e:
        convert.relayout(tmp_path / "a", tmp_path / "c", shardings=tree)
    assert list(e.value.paths) == ["extra", "params/b"]


def test_relayout_in_place_on_a_local_disk(tmp_path):
    x = np.arange(512 * 1024, dtype=np.float32).reshape(512, 1024)
    jaxckpt.save(tmp_path / "a", {"w": x})
    convert.relayout(tmp_path / "a", tmp_path / "a", shardings=NamedSharding(AbstractMesh((4,), ("m",)), P("m")),
                     overwrite=True)
    assert records(tmp_path / "a")["w"].chunk_shape == (128, 1024)
    assert_bit_equal(jaxckpt.restore(tmp_path / "a")["w"], x)
    assert sorted(os.listdir(tmp_path)) == ["a"]


def test_relayout_uneven_shards_round_up(tmp_path):
    x = np.arange(1001 * 300, dtype=np.float32).reshape(1001, 300)
    jaxckpt.save(tmp_path / "a", {"w": x})
    convert.relayout(tmp_path / "a", tmp_path / "b", shardings=NamedSharding(AbstractMesh((2,), ("m",)), P("m")))
    assert records(tmp_path / "b")["w"].chunk_shape == (501, 300)
    assert_bit_equal(jaxckpt.restore(tmp_path / "b")["w"], x)


def test_relayout_refuses_a_non_float_dtype_and_an_empty_selection(tmp_path):
    jaxckpt.save(tmp_path / "a", state())
    with pytest.raises(jaxckpt.CheckpointError, match="dtype must be a floating dtype"):
        convert.relayout(tmp_path / "a", tmp_path / "b", dtype="int8")
    with pytest.raises(jaxckpt.CheckpointError, match="select: no leaf under 'nope'"):
        convert.relayout(tmp_path / "a", tmp_path / "b", select=["params", "nope"])


def test_a_selection_of_nothing_names_the_keys_there_are(tmp_path):
    # issue 31: "no leaf under 'parms'" left the user to guess the key paths
    jaxckpt.save(tmp_path / "a", {"params": {"dense": {"kernel": np.ones(2)}, "out": np.ones(2)},
                                  "opt_state": [np.ones(2)], "step": 3})
    where = f"Checkpoint '{tmp_path / 'a'}': select: no leaf under"
    with pytest.raises(jaxckpt.CheckpointError) as e:
        convert.to_safetensors(tmp_path / "a", tmp_path / "x.safetensors", select="parms")
    assert str(e.value) == f"{where} 'parms' (top-level keys: 'opt_state', 'params', 'step')"
    with pytest.raises(jaxckpt.CheckpointError) as e:  # as deep as the path is right
        convert.to_safetensors(tmp_path / "a", tmp_path / "x.safetensors", select=["params/dense/bias", "params/x/y"])
    assert str(e.value) == (f"{where} 'params/dense/bias' (keys under 'params/dense': 'kernel'); "
                            "'params/x/y' (keys under 'params': 'dense', 'out')")
    jaxckpt.save(tmp_path / "b", {f"k{i:02d}": i for i in range(25)})
    with pytest.raises(jaxckpt.CheckpointError) as e:  # many keys: the first 20, counted beyond
        convert.relayout(tmp_path / "b", tmp_path / "c", select="x")
    keys = ", ".join(f"'k{i:02d}'" for i in range(20))
    assert str(e.value) == f"Checkpoint '{tmp_path / 'b'}': select: no leaf under 'x' (top-level keys: {keys}, … 5 more)"


# --- safetensors ------------------------------------------------------------------------


def test_to_safetensors_one_file_streams_each_leaf_once(tmp_path):
    jaxckpt.save(tmp_path / "a", state())
    expected = {p: v for p, v in restored_bytes(tmp_path / "a").items() if p.startswith("params/")}
    _storage.reset_io_stats()
    result = convert.to_safetensors(tmp_path / "a", tmp_path / "m.safetensors", select="params")
    # each saved chunk once: the leaves' bytes, and the packed chunks' padding (< 64 B a leaf)
    need = sum(v.nbytes for v in expected.values())
    assert need <= _storage.io_stats()["bytes_read"] < need + 64 * len(expected)
    loaded = load_file(tmp_path / "m.safetensors")
    assert set(loaded) == {"w", "emb", "b", "layers.0", "layers.1", "layers.2"}
    for p, v in expected.items():
        assert_bit_equal(loaded[p[len("params/"):].replace("/", ".")], v)
    assert result == convert.ExportResult((str(tmp_path / "m.safetensors"),), 6,
                                          sum(v.nbytes for v in expected.values()), ())


def test_to_safetensors_casts_floats_and_skips_keys_and_values(tmp_path):
    jaxckpt.save(tmp_path / "a", state())
    result = convert.to_safetensors(tmp_path / "a", tmp_path / "m.safetensors", dtype="bfloat16")
    assert result.skipped == ("lr", "name", "rng", "step")
    loaded = load_file(tmp_path / "m.safetensors")
    assert loaded["params.w"].dtype == ml_dtypes.bfloat16
    assert_bit_equal(loaded["params.w"], np.arange(1024 * 512, dtype=np.float32).reshape(1024, 512)
                     .astype(ml_dtypes.bfloat16))
    assert loaded["params.layers.0"].dtype == np.int32 and loaded["opt.mask"].dtype == np.bool_
    assert loaded["opt.count"].dtype == np.int64 and loaded["opt.count"].shape == ()


def test_to_safetensors_directory_shards_greedily_with_an_index(tmp_path):
    leaves = {f"l{i}": np.full((n,), i, np.float32) for i, n in enumerate([100, 200, 300, 1000, 50])}
    jaxckpt.save(tmp_path / "a", leaves)
    result = convert.to_safetensors(tmp_path / "a", tmp_path / "out", max_shard_bytes=1600)
    # 400 + 800 bytes; 1200; 4000 (over the limit: alone); 200
    names = [f"model-0000{k}-of-00004.safetensors" for k in (1, 2, 3, 4)]
    assert result.files == tuple(str(tmp_path / "out" / n) for n in names) + (
        str(tmp_path / "out" / "model.safetensors.index.json"),)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert index == {"metadata": {"total_size": 1650 * 4}, "weight_map": {
        "l0": names[0], "l1": names[0], "l2": names[1], "l3": names[2], "l4": names[3]}}
    merged = {}
    for n in names:
        merged.update(load_file(tmp_path / "out" / n))
    assert merged.keys() == leaves.keys()
    for k, v in leaves.items():
        assert_bit_equal(merged[k], v)


def test_exported_weights_restore_onto_a_mesh_with_a_key_map(tmp_path):
    w = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    jaxckpt.save(tmp_path / "a", {"params": {"dense": {"kernel": w, "bias": np.ones(32, np.float32)}}, "step": 3})
    convert.to_safetensors(tmp_path / "a", tmp_path / "out", select="params", max_shard_bytes=4096)
    m = mesh((2, 2), ("a", "b"))
    target = {"model": {"dense": {
        "kernel": jax.ShapeDtypeStruct((64, 32), np.float32, sharding=NamedSharding(m, P("a", "b"))),
        "bias": jax.ShapeDtypeStruct((32,), np.float32, sharding=NamedSharding(m, P()))}}}
    out = jaxckpt.restore(tmp_path / "out", target, key_map={"model": ""})
    assert out["model"]["dense"]["kernel"].sharding == NamedSharding(m, P("a", "b"))
    assert_bit_equal(out["model"]["dense"]["kernel"], w)
    assert_bit_equal(out["model"]["dense"]["bias"], np.ones(32, np.float32))


def test_to_safetensors_refuses_clearly(tmp_path):
    jaxckpt.save(tmp_path / "a", {"c": np.zeros(3, np.complex64), "p": {"x": np.zeros(2)}, "q": {"x": np.zeros(2)}})
    with pytest.raises(jaxckpt.CheckpointError, match="leaf 'c': dtype complex64 has no safetensors equivalent"):
        convert.to_safetensors(tmp_path / "a", tmp_path / "m.safetensors")
    with pytest.raises(jaxckpt.CheckpointError, match="leaves 'p/x' and 'q/x' would both be tensor 'x'"):
        convert.to_safetensors(tmp_path / "a", tmp_path / "m.safetensors", select=["p", "q"])
    with pytest.raises(jaxckpt.CheckpointError, match="max_shard_bytes shards a directory export"):
        convert.to_safetensors(tmp_path / "a", tmp_path / "m.safetensors", select="p", max_shard_bytes=10)
    convert.to_safetensors(tmp_path / "a", tmp_path / "m.safetensors", select="p")
    with pytest.raises(jaxckpt.CheckpointError, match="already exist"):
        convert.to_safetensors(tmp_path / "a", tmp_path / "m.safetensors", select="q")
    assert sorted(os.listdir(tmp_path)) == ["a", "m.safetensors"]  # no temporary file left


# --- the commands -------------------------------------------------------------------------


def cli(*args, ok=(0,)):
    p = subprocess.run([EXE, *map(str, args)], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert p.returncode in ok, (p.returncode, p.stdout, p.stderr)
    assert "Traceback" not in p.stderr
    return p.returncode, p.stdout, p.stderr


def test_cli_export_writes_safetensors(tmp_path):
    jaxckpt.save(tmp_path / "a", state())
    _, out, _ = cli("export", tmp_path / "a", tmp_path / "out", "--select", "params", "--select", "opt",
                    "--dtype", "bfloat16", "--max-shard-bytes", "1MiB")
    assert "8 tensors" in out and "model.safetensors.index.json" in out
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == ["b", "count", "emb", "layers.0", "layers.1", "layers.2", "mask", "w"]
    _, out, _ = cli("export", tmp_path / "a", tmp_path / "one.safetensors", "--json")
    doc = json.loads(out)
    assert doc["files"] == [str(tmp_path / "one.safetensors")] and doc["skipped"] == ["lr", "name", "rng", "step"]
    code, _, err = cli("export", tmp_path / "a", tmp_path / "x.safetensors", "--select", "nope", ok=(1,))
    assert err == (f"jaxckpt: Checkpoint '{tmp_path / 'a'}': select: no leaf under 'nope' "
                   "(top-level keys: 'lr', 'name', 'opt', 'params', 'rng', 'step')\n")


def test_cli_convert_relayouts_onto_a_mesh(tmp_path):
    jaxckpt.save(tmp_path / "a", state())
    _, out, _ = cli("convert", tmp_path / "a", tmp_path / "b", "--mesh", "a=2,b=2", "--spec", "params/emb=a,b",
                    "--spec", "None,b", "--dtype", "bfloat16")
    assert f"-> {tmp_path / 'b'}" in out
    rb = records(tmp_path / "b")
    assert rb["params/emb"].chunk_shape == (256, 256) and rb["params/w"].chunk_shape == (1024, 256)
    assert rb["params/b"].sharding["spec"] == [] and rb["params/w"].dtype == "bfloat16"
    assert rb["params/layers/0"].dtype == "int32"
    assert jaxckpt.verify(tmp_path / "b").ok
    code, _, err = cli("convert", tmp_path / "a", tmp_path / "c", "--spec", "x,None", ok=(2,))
    assert "--spec needs --mesh" in err
    code, _, err = cli("convert", tmp_path / "a", tmp_path / "c", "--mesh", "a=2", "--spec", "q", ok=(2,))
    assert "axis 'q' is not in the mesh (a)" in err


def test_cli_import_orbax_refuses_a_jaxckpt_checkpoint(tmp_path):
    jaxckpt.save(tmp_path / "a", {"x": np.zeros(3)})
    code, _, err = cli("import-orbax", tmp_path / "a", tmp_path / "b", ok=(1,))
    assert "is a jaxckpt checkpoint, not an orbax-checkpoint one" in err
    code, _, err = cli("import-orbax", tmp_path / "missing", tmp_path / "b", ok=(2,))
    assert err.startswith("jaxckpt: ")


def test_location_of_a_relayout_onto_itself_on_an_object_store_is_refused():
    loc = _location.resolve("memory://x")
    assert _commit.staging_location(loc, "t") == loc  # no rename there: why it is refused
    jaxckpt.save("memory://x", {"w": np.zeros(4)})
    with pytest.raises(jaxckpt.CheckpointError, match="works on a local disk only"):
        convert.relayout("memory://x", "memory://x", overwrite=True)


def test_from_orbax_of_a_two_item_manager_step_equals_orbax_restore(tmp_path):
    import orbax.checkpoint as ocp

    m = mesh((4,), ("x",))
    state = {"w": sharded(np.arange(256 * 64, dtype=np.float32).reshape(256, 64), (4,), ("x",), ("x", None)),
             "repl": jax.device_put(np.linspace(0, 1, 64, dtype=np.float32), NamedSharding(m, P())),
             "half": jax.device_put(np.ones((8, 8), ml_dtypes.bfloat16), NamedSharding(m, P(None, "x"))),
             "q": np.arange(-4, 4, dtype=np.int8), "rng": jax.random.key(11), "count": 3}
    with ocp.CheckpointManager(str(tmp_path / "orbax")) as mgr:
        mgr.save(7, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                            extra=ocp.args.JsonSave({"lr": 0.1, "name": "run"})))
        mgr.wait_until_finished()
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                                if isinstance(x, jax.Array) else x, state)
        theirs = mgr.restore(7, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))["state"]
    convert.from_orbax(tmp_path / "orbax" / "7", tmp_path / "ours")
    assert jaxckpt.verify(tmp_path / "ours").ok
    ours = jaxckpt.restore(tmp_path / "ours", {"state": abstract, "extra": {"lr": 0.0, "name": ""}})
    assert ours["extra"] == {"lr": 0.1, "name": "run"}
    for key in ("w", "repl", "half", "q"):
        assert_bit_equal(ours["state"][key], theirs[key])
        if isinstance(theirs[key], jax.Array):
            assert ours["state"][key].sharding == theirs[key].sharding
    assert_bit_equal(jax.random.key_data(ours["state"]["rng"]), jax.random.key_data(theirs["rng"]))
    assert ours["state"]["count"] == theirs["count"] == 3
