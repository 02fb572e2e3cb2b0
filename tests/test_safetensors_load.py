"""Reading safetensors files and sharded exports (``jaxckpt/_safetensors.py``): restore
onto any sharding reading only each slice's bytes, metadata, open, hostile headers."""

import json
import os
import sys

import jax
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy as st_numpy  # a test dependency (pyproject [test])
from conftest import assert_bit_equal, mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt import _storage
from jaxckpt._formats import safetensors as _safetensors
from jaxckpt._storage import location as _location


def _tensors():
    rng = np.random.default_rng(0)
    # Rows long enough that the half rows a column split leaves apart are more than
    # MAX_GAP_BYTES apart: each quarter is then read exactly.
    return {
        "params.dense.kernel": rng.standard_normal((64, 4096)).astype(np.float32),
        "params.dense.bias": rng.standard_normal((16, 8192)).astype(ml_dtypes.bfloat16),
        "params.embed": rng.integers(-128, 128, (8, 16384)).astype(np.int8),
        "mask": rng.integers(0, 2, (8, 16384)).astype(np.bool_),
    }


def _tree(tensors, fn):
    out = {}
    for name, x in tensors.items():
        *outer, last = name.split(".")
        node = out
        for p in outer:
            node = node.setdefault(p, {})
        node[last] = fn(x)
    return out


@pytest.fixture
def st_file(tmp_path):
    tensors = _tensors()
    path = tmp_path / "model.safetensors"
    st_numpy.save_file(tensors, str(path), metadata={"step": "100", "note": "hi"})
    return path, tensors


def _write_raw(path, header, data=b"", length=None):
    """A safetensors file from a header (dict or raw bytes) and data bytes."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write((len(raw) if length is None else length).to_bytes(8, "little") + raw + data)
    return path


def _restore_counting(path, target=None, **kw):
    _storage.reset_io_stats()
    out = jaxckpt.restore(path, target, **kw)
    return out, _storage.io_stats()


# --- restore ------------------------------------------------------------------------


@pytest.mark.parametrize("whole", [False, True])
def test_restore_onto_2x2_mesh_is_bit_exact_and_reads_each_quarter_once(st_file, monkeypatch, whole):
    """Per device slice (big leaves), or, for small leaves a process holds entirely, the
    whole tensor in one read and one placement (``_restore.WHOLE_LEAF_BYTES``)."""
    path, tensors = st_file
    monkeypatch.setattr(jaxckpt._restore, "WHOLE_LEAF_BYTES", (1 << 20) if whole else 0)
    sharding = NamedSharding(mesh((2, 2), ("a", "b")), P("a", "b"))
    target = _tree(tensors, lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding))
    out, stats = _restore_counting(path, target)
    total = sum(x.nbytes for x in tensors.values())
    for name, x in tensors.items():
        arr = _tree_get(out, name)
        assert arr.sharding == sharding
        assert_bit_equal(arr, x)
        for shard in arr.addressable_shards:  # each device holds its own quarter
            assert_bit_equal(shard.data, x[shard.index])
    # four devices, each a distinct quarter: every byte once, not four times over
    assert stats["bytes_read"] == total
    # a quarter of an (R, C) tensor is R/2 runs of C/2 elements, one read each
    want = len(tensors) if whole else sum(x.shape[0] // 2 * 4 for x in tensors.values())
    assert stats["reads"] == want


def _tree_get(tree, name):
    for p in name.split("."):
        tree = tree[p]
    return tree


def test_column_sharded_restore_reads_each_distinct_slice_once(st_file, monkeypatch):
    path, tensors = st_file
    monkeypatch.setattr(jaxckpt._restore, "WHOLE_LEAF_BYTES", 0)  # per slice, as for a big leaf
    x = tensors["params.dense.kernel"]
    sharding = NamedSharding(mesh((2, 2), ("a", "b")), P(None, "b"))
    target = {"params": {"dense": {"kernel": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)}}}
    out, stats = _restore_counting(path, target, partial=True)
    assert_bit_equal(out["params"]["dense"]["kernel"], x)
    # two distinct column halves (each on two devices): each read once, 64 rows each
    assert stats["bytes_read"] == x.nbytes
    assert stats["reads"] == 2 * 64


def test_replicated_and_numpy_restores_read_each_tensor_in_one_read(st_file):
    path, tensors = st_file
    out, stats = _restore_counting(path)  # no target: numpy arrays in nested dicts
    assert set(out) == {"params", "mask"}
    for name, x in tensors.items():
        got = _tree_get(out, name)
        assert isinstance(got, np.ndarray)
        assert_bit_equal(got, x)
    assert stats == {"bytes_read": sum(x.nbytes for x in tensors.values()), "reads": len(tensors),
                     "bytes_written": 0, "writes": 0}
    sharding = NamedSharding(mesh((2, 2), ("a", "b")), P())
    out, stats = _restore_counting(path, shardings=sharding)
    assert_bit_equal(out["params"]["embed"], tensors["params.embed"])
    assert stats["reads"] == len(tensors)


def test_close_runs_share_one_read_through_a_scratch_gap(tmp_path, monkeypatch):
    monkeypatch.setattr(jaxckpt._restore, "WHOLE_LEAF_BYTES", 0)  # per slice, as for a big leaf
    x = np.arange(8 * 16, dtype=np.float32).reshape(8, 16)
    path = tmp_path / "small.safetensors"
    st_numpy.save_file({"w": x}, str(path))
    sharding = NamedSharding(mesh((1, 2), ("a", "b")), P(None, "b"))
    out, stats = _restore_counting(path, {"w": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)})
    assert_bit_equal(out["w"], x)
    # each half: 8 runs of 32 bytes, 32 bytes apart, read as one span of 8*32 + 7*32 bytes
    assert stats["reads"] == 2
    assert stats["bytes_read"] == 2 * (8 * 32 + 7 * 32)


def test_sharded_directory_with_index(tmp_path):
    tensors = _tensors()
    names = sorted(tensors)
    files = {"model-00001-of-00002.safetensors": names[:2], "model-00002-of-00002.safetensors": names[2:]}
    for file, part in files.items():
        st_numpy.save_file({n: tensors[n] for n in part}, str(tmp_path / file), metadata={"format": "np"})
    index = {"metadata": {"total_size": sum(x.nbytes for x in tensors.values())},
             "weight_map": {n: f for f, part in files.items() for n in part}}
    (tmp_path / _safetensors.INDEX_FILE).write_text(json.dumps(index))
    sharding = NamedSharding(mesh((2, 2), ("a", "b")), P("b", "a"))
    target = _tree(tensors, lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding))
    out, stats = _restore_counting(tmp_path, target)
    for name, x in tensors.items():
        assert_bit_equal(_tree_get(out, name), x)
    assert stats["bytes_read"] == sum(x.nbytes for x in tensors.values())
    info = jaxckpt.metadata(tmp_path)
    assert info.info["files"] == sorted(files)
    assert info.metadata == {"format": "np"}
    assert_bit_equal(jaxckpt.restore(tmp_path)["mask"], tensors["mask"])


def test_key_map_with_the_original_dotted_names(st_file):
    path, tensors = st_file
    x, b = tensors["params.dense.kernel"], tensors["params.dense.bias"]
    sharding = NamedSharding(mesh((2, 2), ("a", "b")), P("a", "b"))
    target = {"encoder": {"w": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                          "b": jax.ShapeDtypeStruct(b.shape, np.float32, sharding=sharding)}}
    names = {"encoder/w": "params.dense.kernel", "encoder/b": "params.dense.bias"}
    out = jaxckpt.restore(path, target, key_map=names.get, partial=True)
    assert_bit_equal(out["encoder"]["w"], x)
    assert_bit_equal(out["encoder"]["b"], b.astype(np.float32))  # bf16 -> f32 cast on the host
    out = jaxckpt.restore(path, {"dense": {"kernel": x, "bias": b}}, key_map={"dense": "params.dense"},
                          partial=True)
    assert_bit_equal(out["dense"]["kernel"], x)
    with pytest.raises(jaxckpt.TreeMismatchError, match="mask"):  # strict without partial
        jaxckpt.restore(path, target, key_map=names.get)


def test_directory_with_one_file_and_scalars_and_empty_tensors(tmp_path):
    tensors = {"step": np.array(7, np.int64), "empty": np.zeros((0, 3), np.float16),
               "layers.0.w": np.ones((2, 2), np.float64)}
    st_numpy.save_file(tensors, str(tmp_path / "weights.safetensors"))
    out = jaxckpt.restore(tmp_path)
    assert_bit_equal(out["step"], tensors["step"])
    assert_bit_equal(out["empty"], tensors["empty"])
    assert_bit_equal(out["layers"]["0"]["w"], tensors["layers.0.w"])
    # a list in the target matches the same key path
    target = {"step": np.int64(0), "empty": np.zeros((0, 3), np.float16), "layers": [{"w": np.zeros((2, 2))}]}
    out = jaxckpt.restore(tmp_path, target)
    assert_bit_equal(out["layers"][0]["w"], tensors["layers.0.w"])


def test_names_that_do_not_form_a_tree_fall_back_to_flat_keys(tmp_path):
    a, ab = np.arange(3, dtype=np.int32), np.arange(4, dtype=np.int32)
    st_numpy.save_file({"a": a, "a.b": ab}, str(tmp_path / "m.safetensors"))  # leaf and prefix
    out = jaxckpt.restore(tmp_path)
    assert set(out) == {"a", "a.b"}
    assert_bit_equal(out["a.b"], ab)
    assert jaxckpt.open(tmp_path).keys() == ["a", "a.b"]
    st_numpy.save_file({"x.y": a, "x/y": ab}, str(tmp_path / "m.safetensors"))  # one path twice
    assert jaxckpt.open(tmp_path).keys() == ["x%2Fy", "x.y"]
    out = jaxckpt.restore(tmp_path, {"x.y": np.zeros(3, np.int32), "x/y": np.zeros(4, np.int32)})
    assert_bit_equal(out["x/y"], ab)


# --- metadata and open ------------------------------------------------------------


def test_metadata_and_open_list_tensors_and_read_lazy_slices(st_file):
    path, tensors = st_file
    info = jaxckpt.metadata(path)
    assert info.metadata == {"step": "100", "note": "hi"}
    assert info.format_version == 1 and info.info["format"] == "safetensors"
    leaf = info.tree["params"]["dense"]["bias"]
    assert (leaf.shape, leaf.dtype, leaf.sharding) == ((16, 8192), np.dtype(ml_dtypes.bfloat16), None)
    assert leaf.nbytes == 16 * 8192 * 2
    view = jaxckpt.open(path)
    assert view.format == "safetensors"
    assert view.keys() == ["mask", "params/dense/bias", "params/dense/kernel", "params/embed"]
    x = tensors["params.dense.kernel"]
    _storage.reset_io_stats()
    assert_bit_equal(view["params/dense/kernel"][3:5, 10:20], x[3:5, 10:20])
    assert _storage.io_stats()["bytes_read"] == 2 * 10 * 4  # two runs of ten floats
    assert_bit_equal(view["params"]["embed"][5], tensors["params.embed"][5])
    assert view.summary()["bytes"] == sum(t.nbytes for t in tensors.values())


def test_lazy_slices_of_a_3d_tensor_read_within_the_tensor(tmp_path):
    x = np.arange(5 * 6 * 7, dtype=np.int16).reshape(5, 6, 7)
    st_numpy.save_file({"t": x}, str(tmp_path / "t.safetensors"))
    view = jaxckpt.open(tmp_path / "t.safetensors")
    rng = np.random.default_rng(1)
    for _ in range(50):
        box = tuple(slice(*sorted(rng.integers(0, d + 1, 2))) for d in x.shape)
        _storage.reset_io_stats()
        assert_bit_equal(view["t"][box], x[box])
        assert x[box].nbytes <= _storage.io_stats()["bytes_read"] <= x.nbytes
    _storage.reset_io_stats()
    assert_bit_equal(view["t"][1:3, :, :], x[1:3])
    assert _storage.io_stats()["bytes_read"] == x[1:3].nbytes  # whole rows: one contiguous run


# --- what is not claimed, and hostile input ---------------------------------------


def test_directories_without_one_safetensors_file_are_not_claimed(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    assert _safetensors.open_source(_location.resolve(tmp_path)) is None
    with pytest.raises(jaxckpt.CheckpointNotFoundError):
        jaxckpt.restore(tmp_path)
    assert _safetensors.open_source(_location.resolve(tmp_path / "notes.txt")) is None
    for name in ("a.safetensors", "b.safetensors"):  # two files and no index: ambiguous
        st_numpy.save_file({"w": np.zeros(2, np.float32)}, str(tmp_path / name))
    assert _safetensors.open_source(_location.resolve(tmp_path)) is None
    assert _safetensors.open_source(_location.resolve("memory://x")) is None


def _entry(dtype="F32", shape=(2,), offsets=(0, 8)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


HOSTILE = {
    "length beyond the file": (json.dumps({"w": _entry()}).encode(), b"\0" * 8, 1 << 20, "beyond the file"),
    "length over the cap": (b"{}", b"", 1 << 63, "beyond the file"),
    "overlapping offsets": ({"w": _entry(), "v": _entry(offsets=(4, 12))}, b"\0" * 12, None,
                            "tensor '[vw]' overlaps tensor '[vw]'"),
    "offsets past the end": ({"w": _entry(offsets=(8, 16))}, b"\0" * 8, None, "tensor 'w'.*outside"),
    "size disagrees with shape": ({"w": _entry(shape=(3,))}, b"\0" * 8, None, "tensor 'w'.*span 8"),
    "unknown dtype": ({"w": _entry(dtype="C64")}, b"\0" * 8, None, "tensor 'w': unknown dtype 'C64'"),
    "negative dimension": ({"w": _entry(shape=(-2,))}, b"\0" * 8, None, "tensor 'w': shape"),
    "bool dimension": ({"w": _entry(shape=(True, 2))}, b"\0" * 8, None, "tensor 'w': shape"),
    "huge shape": ({"w": _entry(shape=(1 << 40, 1 << 40))}, b"", None, "tensor 'w': .* bytes is more than"),
    "offsets not a pair": ({"w": _entry(offsets=(0,))}, b"\0" * 8, None, "tensor 'w': data_offsets"),
    "deep JSON": (b"[" * 100_000, b"", None, "nested too deeply"),
    "deep metadata": (b'{"__metadata__": {"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}", b"", None,
                      "nested too deeply"),
    "metadata not strings": ({"__metadata__": {"a": 1}}, b"", None, "__metadata__"),
    "not an object": (b"[1, 2]", b"", None, "not a JSON object"),
    "not JSON": (b"{nope", b"", None, "not JSON"),
    "repeated name": (b'{"w": ' + json.dumps(_entry()).encode() + b', "w": '
                      + json.dumps(_entry()).encode() + b"}", b"\0" * 8, None, "appears twice"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_headers_are_corrupt_checkpoints(tmp_path, case):
    header, data, length, message = HOSTILE[case]
    path = _write_raw(tmp_path / "bad.safetensors", header, data, length)
    for call in (jaxckpt.metadata, jaxckpt.restore, jaxckpt.open):
        with pytest.raises(jaxckpt.CorruptCheckpointError, match=message) as err:
            call(path)
        assert str(path) in str(err.value)


def test_a_file_shorter_than_a_header_is_corrupt(tmp_path):
    path = tmp_path / "short.safetensors"
    path.write_bytes(b"\1\0")
    with pytest.raises(jaxckpt.CorruptCheckpointError, match="too short"):
        jaxckpt.metadata(path)


def test_hostile_index_files(tmp_path):
    st_numpy.save_file({"w": np.zeros(2, np.float32)}, str(tmp_path / "x.safetensors"))
    inner = tmp_path / "inner"
    inner.mkdir()
    st_numpy.save_file({"v": np.zeros(2, np.float32)}, str(inner / "a.safetensors"))
    index = inner / _safetensors.INDEX_FILE
    cases = {
        "../x.safetensors": "tensor 'w': file '../x.safetensors' is not a plain file name",
        "/etc/passwd": "is not a plain file name",
        "..": "is not a plain file name",
        "missing.safetensors": "file 'missing.safetensors' does not exist",
    }
    for file, message in cases.items():
        index.write_text(json.dumps({"weight_map": {"w": file}}))
        with pytest.raises(jaxckpt.CorruptCheckpointError, match=message) as err:
            jaxckpt.restore(inner)
        assert str(index) in str(err.value)
    index.write_text(json.dumps({"weight_map": {"w": "a.safetensors"}}))  # the file holds 'v'
    with pytest.raises(jaxckpt.CorruptCheckpointError, match="tensor 'v' is not in"):
        jaxckpt.restore(inner)
    index.write_text(json.dumps({"weight_map": {"w": "a.safetensors", "v": "a.safetensors"}}))
    with pytest.raises(jaxckpt.CorruptCheckpointError, match="lack: w"):
        jaxckpt.restore(inner)
    index.write_text("[" * 100_000)
    with pytest.raises(jaxckpt.CorruptCheckpointError, match="nested too deeply"):
        jaxckpt.restore(inner)


def test_data_that_changes_after_open_is_caught_on_read(tmp_path):
    x = np.arange(64, dtype=np.float32)
    path = tmp_path / "m.safetensors"
    st_numpy.save_file({"w": x, "flags": np.ones(4, np.bool_)}, str(path))
    view = jaxckpt.open(path)
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    begin = 8 + n + json.loads(raw[8:8 + n])["flags"]["data_offsets"][0]
    with open(path, "r+b") as f:
        f.seek(begin)
        f.write(b"\2")
    with pytest.raises(jaxckpt.CorruptCheckpointError, match="tensor 'flags': a bool byte"):
        view["flags"][:]
    os.truncate(path, len(raw) - 8)  # after the view checked the header
    with pytest.raises(jaxckpt.CorruptCheckpointError, match="tensor 'w': the file ends early"):
        view["w"][:]
    with pytest.raises(jaxckpt.CorruptCheckpointError, match="tensor 'w': data_offsets .* outside"):
        jaxckpt.restore(path, {"w": x, "flags": np.ones(4, np.bool_)})


def test_big_endian_hosts_are_refused_clearly(st_file, monkeypatch):
    path, tensors = st_file
    monkeypatch.setattr(sys, "byteorder", "big")
    with pytest.raises(jaxckpt.CheckpointError, match="big-endian hosts are not supported"):
        jaxckpt.restore(path)
    view = jaxckpt.open(path)  # metadata is fine, and single bytes have no order
    assert_bit_equal(view["params/embed"][:], tensors["params.embed"])
