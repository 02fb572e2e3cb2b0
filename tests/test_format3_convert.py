"""The convert and relayout writer in format 3 (issue 22, item 5; jaxckpt/_formats/stream.py;
the default, ``JAXCKPT_FORMAT=3`` here, format-1 sources with ``JAXCKPT_FORMAT=1``): imports of jaxckpt, orbax and safetensors sources and
relayouts write one stream of entries for process 0, byte for byte what ``save`` writes
for the same layout, restore bit for bit and verify; relayout goes from format 1 to 3
and back; the writer still holds one leaf at a time and leaves nothing behind when it
fails."""

import gc
import json
import os
import weakref

import crc32c
import jax
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy as st_numpy
from conftest import assert_bit_equal, mesh, sharded
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P
from test_convert import _orbax_step, _template, restored_bytes, state
from test_format3_save import check_entries

import jaxckpt
from jaxckpt import _formats, _layout, _snapshot, _storage, convert
from jaxckpt._formats import stream as _stream
from jaxckpt._manifest import LeafRecord


@pytest.fixture
def format3(monkeypatch):
    monkeypatch.setenv("JAXCKPT_FORMAT", "3")


def manifest(path):
    with open(os.path.join(path, "manifest.json")) as f:
        return json.load(f)


def leaves_of(path):
    return {leaf["path"]: leaf for leaf in manifest(path)["leaves"]}


def same_values(a, b):
    """Two checkpoints restore (without a target) to the same bytes, dtypes and shapes."""
    ra, rb = restored_bytes(a), restored_bytes(b)
    assert ra.keys() == rb.keys()
    for p, v in ra.items():
        assert_bit_equal(rb[p], v)


def test_an_import_writes_what_save_writes(tmp_path, format3):
    """A format-1 checkpoint imported in format 3 is one data object whose entries and
    runs are exactly those ``save`` lays out for the same tree (process 0 writes all)."""
    jaxckpt.save(tmp_path / "v3", state(), metadata={"run": "a"})  # format 3
    os.environ["JAXCKPT_FORMAT"] = "1"
    jaxckpt.save(tmp_path / "v1", state(), metadata={"run": "a"})
    assert manifest(tmp_path / "v1")["format_version"] == 1
    os.environ["JAXCKPT_FORMAT"] = "3"
    _storage.reset_io_stats()
    convert.import_source(_formats.open_source(tmp_path / "v1"), tmp_path / "b")
    assert sorted(os.listdir(tmp_path / "b")) == ["data", "manifest.json"]
    assert os.listdir(tmp_path / "b" / "data") == ["p0.0"]
    man, ref = manifest(tmp_path / "b"), manifest(tmp_path / "v3")
    assert man["format_version"] == 3 and man["segment_bytes"] == 1 << 30
    assert man["streams"] == ref["streams"] == {"0": os.path.getsize(tmp_path / "b" / "data" / "p0.0")}
    fields = ("path", "kind", "dtype", "shape", "chunk_shape", "store", "codec", "entry_bytes", "runs", "nbytes")
    assert [{f: leaf.get(f) for f in fields} for leaf in man["leaves"]] == [
        {f: leaf.get(f) for f in fields} for leaf in ref["leaves"]]
    assert (tmp_path / "b/data/p0.0").read_bytes() == (tmp_path / "v3/data/p0.0").read_bytes()
    assert _storage.io_stats()["writes"] == 13  # an entry per chunk (a leaf without elements: none)
    report = jaxckpt.verify(tmp_path / "b")
    assert report.ok and report.chunks == 13, report.summary()
    same_values(tmp_path / "v1", tmp_path / "b")
    assert jaxckpt.metadata(tmp_path / "b").metadata == {"run": "a"}


def test_from_orbax_in_format_3(tmp_path, format3):
    rows = np.arange(1024 * 512, dtype=np.float32).reshape(1024, 512)
    tree = {"w": sharded(rows, (4,), ("x",), ("x", None)),
            "emb": sharded(rows[:512].astype(ml_dtypes.bfloat16), (2, 2), ("a", "b"), (None, "b")),
            "b": np.linspace(-1, 1, 100, dtype=np.float32), "rng": jax.random.key(3), "step": 12}
    step = _orbax_step(tmp_path / "orbax", tree)
    convert.from_orbax(step, tmp_path / "b")
    recs = leaves_of(tmp_path / "b")
    assert {p: (r.get("store"), r.get("chunk_shape")) for p, r in recs.items()} == {
        "b": ("stream", [100]), "emb": ("stream", [512, 256]), "rng": ("stream", [2]),
        "step": (None, None), "w": ("stream", [256, 512])}
    assert check_entries(tmp_path / "b", {"w": rows, "emb": rows[:512].astype(ml_dtypes.bfloat16),
                                          "b": tree["b"], "rng": jax.random.key_data(tree["rng"])}) == 8
    assert jaxckpt.verify(tmp_path / "b").ok
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                          if isinstance(x, jax.Array) else x, tree)
    out = jaxckpt.restore(tmp_path / "b", target)
    assert out["w"].sharding == tree["w"].sharding
    assert_bit_equal(out["w"], rows)
    assert_bit_equal(out["emb"], rows[:512].astype(ml_dtypes.bfloat16))
    assert_bit_equal(out["b"], tree["b"])
    assert (jax.random.key_data(out["rng"]) == jax.random.key_data(tree["rng"])).all() and out["step"] == 12


def test_from_safetensors_in_format_3(tmp_path, format3):
    tensors = {"w": np.random.default_rng(0).standard_normal((300, 257)).astype(np.float32),
               "h": np.arange(10, dtype=np.float16), "q": np.arange(12, dtype=np.int8).reshape(3, 4),
               "s": np.array(2.5, np.float32)}
    st_numpy.save_file(tensors, str(tmp_path / "m.safetensors"))
    convert.import_source(_formats.open_source(tmp_path / "m.safetensors"), tmp_path / "b")
    assert manifest(tmp_path / "b")["format_version"] == 3
    jaxckpt.save(tmp_path / "ref", tensors)  # whole host arrays: the same chunks, the same stream
    assert manifest(tmp_path / "b")["streams"] == manifest(tmp_path / "ref")["streams"] == {"0": 3 * 64 + 300 * 257 * 4 + 4}
    assert (tmp_path / "b/data/p0.0").read_bytes() == (tmp_path / "ref/data/p0.0").read_bytes()
    report = jaxckpt.verify(tmp_path / "b")
    assert report.ok and report.chunks == 4, report.summary()
    out = jaxckpt.restore(tmp_path / "b")
    for name, want in tensors.items():
        assert_bit_equal(out[name], want)


def test_relayout_from_format_1_to_3_and_back(tmp_path, monkeypatch):
    """v1 -> v3 onto column chunks (strided views, cast to bfloat16; segments of 4 KiB, so
    entries straddle data objects) -> v1 onto row chunks: the same values all the way."""
    x = np.random.default_rng(1).standard_normal((96, 80)).astype(np.float32)
    tree = {"w": sharded(x, (2,), ("x",), ("x", None)), "b": np.arange(5, dtype=np.int32), "step": 3,
            "lr": np.float32(0.1)}
    monkeypatch.setenv("JAXCKPT_FORMAT", "1")
    jaxckpt.save(tmp_path / "a", tree)
    assert manifest(tmp_path / "a")["format_version"] == 1
    monkeypatch.setenv("JAXCKPT_FORMAT", "3")
    monkeypatch.setattr(_snapshot, "SEGMENT_BYTES", 4096)
    cols = NamedSharding(AbstractMesh((2, 2), ("a", "b")), P(None, "b"))
    convert.relayout(tmp_path / "a", tmp_path / "b", shardings={"w": cols, "b": None, "step": None, "lr": None},
                     dtype="bfloat16")
    man = manifest(tmp_path / "b")
    assert man["format_version"] == 3 and man["segment_bytes"] == 4096
    entry = 96 * 40 * 2 + 4  # a column block of bfloat16, then its crc32c
    assert leaves_of(tmp_path / "b")["b"]["runs"] == [[0, 0, 1, 0]]  # 24 bytes, then zeros up to 64
    assert leaves_of(tmp_path / "b")["lr"]["runs"] == [[0, 0, 1, 64]]  # a bfloat16 scalar: 6 bytes
    assert leaves_of(tmp_path / "b")["w"]["runs"] == [[0, 0, 2, 128]]  # stride: the entry rounded up to 64
    assert man["streams"] == {"0": 128 + 7744 + entry} and entry == 7684
    assert sorted(os.listdir(tmp_path / "b" / "data")) == ["p0.0", "p0.1", "p0.2", "p0.3"]
    cast = x.astype(ml_dtypes.bfloat16)
    lr = np.frombuffer((tmp_path / "b/data/p0.0").read_bytes()[64:70], ml_dtypes.bfloat16)
    assert lr[0] == np.float32(0.1).astype(ml_dtypes.bfloat16)
    assert (tmp_path / "b/data/p0.0").read_bytes()[66:70] == crc32c.crc32c(lr[:1].tobytes()).to_bytes(4, "little")
    assert jaxckpt.verify(tmp_path / "b").ok
    out = jaxckpt.restore(tmp_path / "b", {"w": jax.ShapeDtypeStruct(x.shape, ml_dtypes.bfloat16,
                                                                    sharding=NamedSharding(mesh((2, 2), ("a", "b")),
                                                                                           P(None, "b"))),
                                           "b": tree["b"], "step": 0, "lr": np.float32(0)})
    assert_bit_equal(out["w"], cast) and out["step"] == 3
    lr = jaxckpt.restore(tmp_path / "b")["lr"]  # (the target's float32 would cast it back)
    assert type(lr) is ml_dtypes.bfloat16 and lr == np.float32(0.1).astype(ml_dtypes.bfloat16)
    monkeypatch.setenv("JAXCKPT_FORMAT", "1")
    rows = NamedSharding(AbstractMesh((4,), ("m",)), P("m"))
    convert.relayout(tmp_path / "b", tmp_path / "c", shardings={"w": rows, "b": None, "step": None, "lr": None})
    assert manifest(tmp_path / "c")["format_version"] == 1
    assert leaves_of(tmp_path / "c")["w"]["chunk_shape"] == [24, 80]
    assert jaxckpt.verify(tmp_path / "c").ok
    same_values(tmp_path / "b", tmp_path / "c")


def test_relayout_in_place_from_format_1_to_3(tmp_path, format3):
    x = np.arange(512 * 1024, dtype=np.float32).reshape(512, 1024)
    os.environ["JAXCKPT_FORMAT"] = "1"
    jaxckpt.save(tmp_path / "a", {"w": x, "n": np.int64(4)})
    assert manifest(tmp_path / "a")["format_version"] == 1
    os.environ["JAXCKPT_FORMAT"] = "3"
    convert.relayout(tmp_path / "a", tmp_path / "a", shardings={"w": NamedSharding(AbstractMesh((4,), ("m",)), P("m")),
                                                                "n": None}, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["a"] and sorted(os.listdir(tmp_path / "a")) == ["data", "manifest.json"]
    assert leaves_of(tmp_path / "a")["w"]["runs"] == [[0, 0, 4, 64]]  # after n's entry
    out = jaxckpt.restore(tmp_path / "a")
    assert_bit_equal(out["w"], x) and out["n"] == np.int64(4) and type(out["n"]) is np.int64


def test_the_writer_holds_one_leaf_at_a_time_in_format_3(tmp_path, format3):
    shapes = [(512, 1024), (300,), (768, 512), (16, 16)]
    leaves = [_template(f"l{i}", s, (s[0] // 2,) + s[1:]) for i, s in enumerate(shapes)]
    alive, order = [], []

    def chunk_data(i, rec):
        gc.collect()
        order.append((i, [r() is not None for r in alive]))
        data = np.full(rec.shape, i, np.float32)
        alive.append(weakref.ref(data))
        return data if i % 2 else lambda index: data[_layout.index_to_slices(index)]

    _stream.write_checkpoint(tmp_path / "c", {"dict": [[f"l{i}", {"leaf": i}] for i in range(4)]}, leaves, chunk_data)
    assert order == [(0, []), (1, [False]), (2, [False, False]), (3, [False, False, False])]
    assert check_entries(tmp_path / "c", {f"l{i}": np.full(s, i, np.float32) for i, s in enumerate(shapes)}) == 8


def test_a_failed_format_3_write_leaves_nothing_behind(tmp_path, format3):
    def chunk_data(i, rec):
        if i == 1:
            raise OSError("disk on fire")
        return lambda index: np.zeros(_layout.index_shape(index), np.float32)

    leaves = [_template("a", (512, 1024), (256, 1024)), _template("b", (4,), (4,))]
    with pytest.raises(jaxckpt.CheckpointError, match="leaf 'b' failed: disk on fire"):
        _stream.write_checkpoint(tmp_path / "c", {"dict": [["a", {"leaf": 0}], ["b", {"leaf": 1}]]}, leaves,
                                 chunk_data)
    assert os.listdir(tmp_path) == []


def test_values_only_in_format_3(tmp_path, format3):
    """No array holds an element: no data object, an empty stream list."""
    leaves = [_template("e", (0, 4), (1, 4)), LeafRecord(path="v", kind="value", value=3)]
    _stream.write_checkpoint(tmp_path / "c", {"dict": [["e", {"leaf": 0}], ["v", {"leaf": 1}]]}, leaves,
                             lambda i, rec: np.zeros(rec.shape, np.float32))
    man = manifest(tmp_path / "c")
    assert man["streams"] == {} and leaves_of(tmp_path / "c")["e"]["runs"] == []
    assert sorted(os.listdir(tmp_path / "c")) == ["manifest.json"]
    out = jaxckpt.restore(tmp_path / "c")
    assert_bit_equal(out["e"], np.zeros((0, 4), np.float32)) and out["v"] == 3
    assert jaxckpt.verify(tmp_path / "c").ok


def test_the_writer_casts_strided_chunks_into_the_entries_save_writes(tmp_path, format3):
    """Column chunks of a row-major array (strided views), cast to bfloat16: the same data
    object, byte for byte, as ``save`` writes for the same array sharded by columns."""
    x = np.random.default_rng(0).standard_normal((1024, 768)).astype(np.float32)
    leaves = [_template("x", x.shape, (1024, 256), "bfloat16")]
    _stream.write_checkpoint(tmp_path / "c", {"dict": [["x", {"leaf": 0}]]}, leaves, lambda i, rec: x)
    m = mesh((3,), ("b",))
    jaxckpt.save(tmp_path / "ref", {"x": jax.device_put(x.astype(ml_dtypes.bfloat16), NamedSharding(m, P(None, "b")))})
    assert leaves_of(tmp_path / "c")["x"]["runs"] == leaves_of(tmp_path / "ref")["x"]["runs"] == [[0, 0, 3, 0]]
    assert (tmp_path / "c/data/p0.0").read_bytes() == (tmp_path / "ref/data/p0.0").read_bytes()
    assert_bit_equal(jaxckpt.restore(tmp_path / "c")["x"], x.astype(ml_dtypes.bfloat16))


def test_the_writer_pads_uneven_edge_chunks_with_zeros(tmp_path, format3):
    x = np.arange(1001 * 300, dtype=np.float32).reshape(1001, 300)
    leaves = [_template("x", x.shape, (501, 300))]
    _stream.write_checkpoint(tmp_path / "c", {"dict": [["x", {"leaf": 0}]]}, leaves,
                             lambda i, rec: lambda index: x[_layout.index_to_slices(index)])
    assert check_entries(tmp_path / "c", {"x": x}) == 2  # the edge chunk's entry: 501 rows, 500 of them x's
    assert leaves_of(tmp_path / "c")["x"]["entry_bytes"] == 501 * 300 * 4 + 4
    assert jaxckpt.verify(tmp_path / "c").ok
    assert_bit_equal(jaxckpt.restore(tmp_path / "c")["x"], x)
