"""Format 3 (issue 22) on the read side: checkpoints built by hand (``_streams.plan``,
``dataobjects.StreamWriter``, a manifest per /work/notes/f3_shared.md), then restored,
inspected and verified; and the manifest's v3 fields refused when malformed."""

import json
import math
import os

import jax
import numpy as np
import pytest
from conftest import assert_bit_equal, mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt import _layout, _manifest, _streams, _tree
from jaxckpt._errors import CheckpointError, CorruptCheckpointError
from jaxckpt._storage import dataobjects, io_stats, kvstore, reset_io_stats
from jaxckpt._storage import location as _location


def _chunk_payloads(x: np.ndarray, chunk_shape):
    """Each chunk's payload in C order of the grid: full chunk_shape, edges zero padded."""
    out = []
    for cell in _layout.chunk_cells(x.shape, chunk_shape):
        region = _layout.chunk_region(cell, chunk_shape, x.shape)
        full = np.zeros(chunk_shape, x.dtype.newbyteorder("<"))
        full[tuple(slice(0, b - a) for a, b in region)] = x[_layout.index_to_slices(region)]
        out.append(full)
    return out


def build(path, tree, chunk_shapes, writers, *, segment_bytes=4096, process_count=2, shardings=None,
          metadata=None, data=""):
    """Write ``tree`` (numpy arrays and inline values) as a format-3 checkpoint at
    ``path``: leaf ``p``'s chunks of ``chunk_shapes[p]``, chunk ``i`` written by process
    ``writers[p][i]`` (default: all process 0). Returns the manifest."""
    flat, _ = _tree.flatten(tree)
    arrays = [(p, np.asarray(x)) for p, x in flat if isinstance(x, np.ndarray)]
    payloads, lists = {}, []
    for p, x in arrays:
        cs = tuple(chunk_shapes.get(p, x.shape))
        payloads[p] = _chunk_payloads(x, cs)
        w = writers.get(p, [0] * len(payloads[p]))
        lists.append((math.prod(cs) * x.dtype.itemsize, w))
    layout = _streams.plan(lists)
    loc = _location.resolve(path)
    root = (loc.child(data) if data else loc).child("data")
    for proc, length in layout.streams.items():
        with dataobjects.StreamWriter(root, proc, length, segment_bytes) as w:
            for (p, x), runs in zip(arrays, layout.runs):
                stride = _streams.stride_for(_streams.entry_bytes_for(payloads[p][0].nbytes))
                for r_proc, first, count, offset in runs:
                    if r_proc == proc:
                        for i in range(count):
                            w.write_entry(offset + i * stride, payloads[p][first + i])
    runs = dict(zip([p for p, _ in arrays], layout.runs))
    records = []
    for p, x in flat:
        if not isinstance(x, np.ndarray):
            records.append(_manifest.LeafRecord(path=p, kind="value", value=x))
            continue
        cs = tuple(chunk_shapes.get(p, x.shape))
        records.append(_manifest.LeafRecord(
            path=p, kind="array", dtype=x.dtype.name, shape=x.shape, store="stream", chunk_shape=cs,
            storage_dtype=x.dtype.name, nbytes=x.nbytes, codec="raw",
            entry_bytes=_streams.entry_bytes_for(math.prod(cs) * x.dtype.itemsize), runs=runs[p],
            sharding=(shardings or {}).get(p)))
    man = _manifest.Manifest(3, _tree.describe(tree), tuple(records), metadata or {}, process_count, {},
                             data=data, segment_bytes=segment_bytes, streams=layout.streams)
    kvstore.write_blob(loc, "manifest.json", man.to_bytes())
    return man


def _tree_a():
    rng = np.random.default_rng(0)
    return {
        "w": rng.standard_normal((16, 12)).astype(np.float32),  # chunks (4, 6): 8 of them
        "e": np.arange(10 * 3, dtype=np.int16).reshape(10, 3),  # (4, 3): edge chunk padded
        "s": np.array(2.5),  # 0-d
        "b": np.arange(7, dtype=np.uint8),  # one chunk, odd size
        "step": 7,
    }


def _target(tree):
    return {k: np.zeros_like(v) if isinstance(v, np.ndarray) else v for k, v in tree.items()}


_CHUNKS_A = {"w": (4, 6), "e": (4, 3), "b": (7,)}
_WRITERS_A = {"w": [0, 1, 0, 1, 1, 1, 0, 0], "e": [1, 1, 0]}


@pytest.fixture
def ckpt_a(tmp_path):
    path = tmp_path / "a"
    path.mkdir()
    tree = _tree_a()
    man = build(str(path), tree, _CHUNKS_A, _WRITERS_A, segment_bytes=4096)
    return str(path), tree, man


def test_manifest_round_trips(ckpt_a):
    path, _, man = ckpt_a
    with open(f"{path}/manifest.json", "rb") as f:
        data = f.read()
    assert _manifest.parse(data, path) == man
    doc = json.loads(data)
    assert doc["format_version"] == 3 and doc["segment_bytes"] == 4096
    assert set(doc["streams"]) == {"0", "1"}
    w = next(leaf for leaf in doc["leaves"] if leaf["path"] == "w")
    assert w["store"] == "stream" and w["codec"] == "raw" and w["entry_bytes"] == 4 * 6 * 4 + 4
    rec = next(r for r in man.leaves if r.path == "w")
    assert "key" not in w and w["runs"] == [list(r) for r in rec.runs] and w["runs"][0][:3] == [0, 0, 1]


def test_restore_numpy_bit_for_bit(ckpt_a):
    path, tree, _ = ckpt_a
    out = jaxckpt.restore(path, _target(tree))
    for k in ("w", "e", "b"):
        assert_bit_equal(out[k], tree[k])
    assert_bit_equal(out["s"], tree["s"])
    assert out["step"] == 7


def test_restore_without_target(ckpt_a):
    path, tree, _ = ckpt_a
    out = jaxckpt.restore(path)
    for k in ("w", "e", "b", "s"):
        assert_bit_equal(out[k], tree[k])


def test_restore_sharded_on_8_devices(tmp_path):
    host = np.arange(32 * 16, dtype=np.float32).reshape(32, 16)
    m = mesh((4, 2), ("x", "y"))
    sharding = NamedSharding(m, P("x", "y"))
    path = tmp_path / "s"
    path.mkdir()
    # the saved chunks are exactly the shards: one entry per device, spread on 4 writers
    build(str(path), {"w": host}, {"w": (8, 8)}, {"w": [0, 1, 2, 3, 0, 1, 2, 3]}, process_count=4,
          shardings={"w": _layout.sharding_to_json(sharding)})
    reset_io_stats()
    out = jaxckpt.restore(str(path), {"w": jax.ShapeDtypeStruct(host.shape, host.dtype, sharding=sharding)})
    assert out["w"].sharding == sharding
    assert_bit_equal(out["w"], host)
    assert io_stats()["reads"] == 8
    assert io_stats()["bytes_read"] == host.nbytes


def test_reshard_reads_each_chunk_once(tmp_path):
    # chunks of 4 rows; the target's slices are 12 rows (devices 0..3 of an 8-row... ) : slice
    # [0, 12) spans chunks 0..2, chunk 2 ([8, 12)) is whole in it; with 8 slices of 6 rows,
    # chunk [4, 8) serves slices [0, 6) and [6, 12)
    host = np.arange(48 * 5, dtype=np.int32).reshape(48, 5)
    path = tmp_path / "r"
    path.mkdir()
    build(str(path), {"w": host}, {"w": (4, 5)}, {"w": [k % 3 for k in range(12)]}, process_count=3)
    sharding = NamedSharding(mesh((8,), ("x",)), P("x", None))  # slices of 6 rows
    reset_io_stats()
    out = jaxckpt.restore(str(path), {"w": jax.ShapeDtypeStruct(host.shape, host.dtype, sharding=sharding)})
    assert_bit_equal(out["w"], host)
    stats = io_stats()
    assert stats["reads"] == 12  # every chunk once, though 6 of them serve two slices
    assert stats["bytes_read"] == host.nbytes


def test_metadata(ckpt_a):
    path, tree, _ = ckpt_a
    info = jaxckpt.metadata(path)
    assert info.format_version == 3
    assert info.tree["w"].shape == (16, 12) and info.tree["w"].dtype == np.float32
    assert info.tree["w"].nbytes == tree["w"].nbytes
    assert info.tree["e"].shape == (10, 3) and info.tree["s"].shape == () and info.tree["step"] == 7


def test_open_lazy_slices(ckpt_a):
    path, tree, _ = ckpt_a
    view = jaxckpt.open(path)
    reset_io_stats()
    assert_bit_equal(view["w"][5:11, 2:9], tree["w"][5:11, 2:9])
    assert io_stats()["reads"] == 4  # rows 4..11 x cols 0..11: four chunks
    assert_bit_equal(view["e"][9:, 1:], tree["e"][9:, 1:])  # in the padded edge chunk
    assert_bit_equal(view["b"][2:5], tree["b"][2:5])
    assert view["step"] == 7


def test_straddling_entries(tmp_path):
    # segments of 4096 bytes, entries of 1604: some entry straddles two data objects
    host = np.arange(40 * 100, dtype=np.float32).reshape(40, 100)
    path = tmp_path / "t"
    path.mkdir()
    man = build(str(path), {"w": host}, {"w": (4, 100)}, {"w": [0] * 10}, process_count=1)
    assert man.streams[0] > 4096 * 3
    assert len(list((path / "data").iterdir())) == -(-man.streams[0] // 4096)
    out = jaxckpt.restore(str(path), {"w": np.zeros_like(host)})
    assert_bit_equal(out["w"], host)
    assert jaxckpt.verify(str(path)).ok


def _flip(path, process, offset):
    name = f"{path}/data/p{process}.{offset // 4096}"
    with open(name, "r+b") as f:
        f.seek(offset % 4096)
        b = f.read(1)
        f.seek(offset % 4096)
        f.write(bytes([b[0] ^ 0x10]))
    return name


def test_flipped_byte_names_leaf_and_data_object(ckpt_a):
    path, tree, man = ckpt_a
    rec = next(r for r in man.leaves if r.path == "w")
    proc, offset = _streams.locate(rec.runs, 5, _streams.stride_for(rec.entry_bytes))
    name = _flip(path, proc, offset + 3)
    with pytest.raises(CorruptCheckpointError) as e:
        jaxckpt.restore(path, _target(tree))
    assert "leaf 'w'" in str(e.value) and name in str(e.value) and "digest mismatch" in str(e.value)
    # the other leaves still read
    view = jaxckpt.open(path)
    assert_bit_equal(view["e"][:], tree["e"])
    assert_bit_equal(view["w"][:4], tree["w"][:4])  # chunks 0, 1 only


def test_verify_ok(ckpt_a):
    path, _, man = ckpt_a
    reset_io_stats()
    report = jaxckpt.verify(path)
    assert report.ok, report.summary()
    n_entries = sum(c for r in man.leaves if r.kind != "value" for _, _, c, _ in r.runs)
    assert report.chunks == n_entries
    assert io_stats()["reads"] == n_entries  # every entry once
    assert report.bytes_read == sum(r.entry_bytes - 4 for r in man.leaves if r.kind != "value"
                                    for _, _, c, _ in r.runs for _ in range(c))


def test_verify_names_leaf_of_flipped_entry(ckpt_a):
    path, _, man = ckpt_a
    rec = next(r for r in man.leaves if r.path == "e")
    proc, offset = _streams.locate(rec.runs, 2, _streams.stride_for(rec.entry_bytes))
    _flip(path, proc, offset)
    report = jaxckpt.verify(path)
    assert not report.ok
    assert report.unrestorable == ["e"]
    (d,) = report.damaged
    assert d["file"] == f"data/p{proc}.{offset // 4096}"
    assert d["leaves"] == ["e"] and d["chunks"] == ["cell [2, 0]"] and d["unrestorable"]
    assert "digest mismatch" in d["message"]
    assert "leaf 'e' chunk cell [2, 0]" in report.summary()


def test_verify_missing_and_short_data_objects(ckpt_a):
    path, _, man = ckpt_a
    os.remove(f"{path}/data/p1.0")
    with open(f"{path}/data/p0.0", "r+b") as f:
        f.truncate(100)
    with open(f"{path}/data/p7.0", "wb") as f:
        f.write(b"x")
    report = jaxckpt.verify(path)
    files = {d["file"]: d for d in report.damaged}
    assert "is missing" in files["data/p1.0"]["message"]
    assert {"file": "data/p0.0", "message": "data/p0.0 has 100 bytes, expected 676", "leaves": [], "chunks": [],
            "unrestorable": False} in report.damaged  # and each entry it cuts off is damaged (test_format3_faults)
    assert files["data/p7.0"]["unrestorable"] is False
    assert report.unrestorable == ["e", "s", "w"]  # b's entry lies in the 100 bytes p0.0 kept
    assert_bit_equal(jaxckpt.open(path)["b"][...], ckpt_a[1]["b"])
    assert files["data/p1.0"]["leaves"] == ["e", "w"]
    assert files["data/p1.0"]["chunks"] == ["cell [0, 0]", "cell [0, 1]"]  # the first chunk of each there
    assert "data/p0.0 has 100 bytes, expected" in report.summary()


# --- parse refuses malformed v3 fields ------------------------------------------------


def _doc(ckpt_a):
    path, _, _ = ckpt_a
    with open(f"{path}/manifest.json", "rb") as f:
        doc = json.loads(f.read())
    del doc["checksum"]
    return doc


def _refused(doc, where="/c"):
    with pytest.raises(CorruptCheckpointError) as e:
        _manifest.parse(json.dumps(doc).encode(), where)
    return str(e.value).removeprefix(f"Checkpoint '{where}': invalid manifest: ")


def _leaf(doc, path):
    return next(leaf for leaf in doc["leaves"] if leaf["path"] == path)


def test_parse_accepts_without_checksum(ckpt_a):
    _manifest.parse(json.dumps(_doc(ckpt_a)).encode(), "/c")


def test_parse_refuses_v3_fields_in_older_versions(ckpt_a):
    doc = _doc(ckpt_a)
    doc["format_version"] = 1
    assert _refused(doc) == "field 'segment_bytes' needs format_version 3"
    del doc["segment_bytes"]
    assert _refused(doc) == "field 'streams' needs format_version 3"
    del doc["streams"]
    assert _refused(doc) == "leaf 'b': store 'stream' needs format_version 3"


def test_parse_refuses_malformed_top_level(ckpt_a):
    doc = _doc(ckpt_a)
    for name in ("segment_bytes", "streams"):
        d = dict(doc)
        del d[name]
        assert _refused(d) == f"field '{name}' is missing (format_version 3)"
    assert _refused({**doc, "segment_bytes": 100}) == "segment_bytes 100 is not between 4096 and 5497558138880"
    assert _refused({**doc, "segment_bytes": True}) == "segment_bytes True is not between 4096 and 5497558138880"
    assert _refused({**doc, "streams": []}) == "streams is not an object"
    assert _refused({**doc, "streams": {**doc["streams"], "2": 64}}) == "3 streams for 2 processes"
    assert _refused({**doc, "streams": {"0": doc["streams"]["0"], "01": 5}}) == (
        "streams: key '01' is not a process below process_count 2")
    assert _refused({**doc, "streams": {**doc["streams"], "1": 0}}) == (
        "streams: process 1's length 0 is not between 1 and 1125899906842624")
    assert _refused({**doc, "streams": {**doc["streams"], "1": doc["streams"]["1"] + 64}}).startswith(
        f"stream of process 1: {doc['streams']['1'] + 64} bytes, but its last entry")
    assert _refused({**doc, "packed": [{"process": 0, "nbytes": 64, "chunk_bytes": 64}]}) == (
        "packed arrays in format_version 3 (its small leaves are streamed)")


def test_parse_refuses_malformed_leaf_fields(ckpt_a):
    doc = _doc(ckpt_a)

    def leaf_refused(**change):
        d = json.loads(json.dumps(doc))
        leaf = _leaf(d, "w")
        for k, v in change.items():
            if v is None:
                del leaf[k]
            else:
                leaf[k] = v
        return _refused(d)

    assert leaf_refused(store="file") == "leaf 'w': store 'file' in format_version 3 (its array leaves are 'stream')"
    assert leaf_refused(store="packed") == (
        "leaf 'w': store 'packed' in format_version 3 (its array leaves are 'stream')")
    assert leaf_refused(key="0") == "leaf 'w': data key '0' (a 'stream' leaf has none)"
    assert leaf_refused(codec="lz77") == "leaf 'w': codec 'lz77' (this jaxckpt reads raw, zstd, blosc, int8, int4)"
    assert leaf_refused(codec=None) == "leaf 'w': codec None (this jaxckpt reads raw, zstd, blosc, int8, int4)"
    assert leaf_refused(entry_bytes=99) == "leaf 'w': entry_bytes 99, but its chunks are 96 bytes and a crc32c of 4"
    assert leaf_refused(runs=None) == "leaf 'w': runs is not a list"
    runs = _leaf(doc, "w")["runs"]
    assert leaf_refused(runs=runs + [[0, 8, 1, 0]] * 4) == "leaf 'w': 9 runs for 8 chunks"
    assert leaf_refused(runs=[[0, 0, 1]] + runs[1:]) == (
        "leaf 'w': run #0 [0, 0, 1] is not [process, first, count, offset] of integers")
    assert leaf_refused(runs=[[0, 0, True, 0]] + runs[1:]) == (
        "leaf 'w': run #0 [0, 0, True, 0] is not [process, first, count, offset] of integers")
    assert leaf_refused(runs=runs[1:]) == (
        f"leaf 'w': run #0 {runs[1]}: starts at chunk 1, but the runs before it end at chunk 0 (runs cover "
        "every chunk once, in order)")
    assert leaf_refused(runs=runs[:-1]) == "leaf 'w': runs cover 6 chunks, but the leaf has 8"
    bad = [[5, *runs[0][1:]]] + runs[1:]
    assert leaf_refused(runs=bad) == f"leaf 'w': run #0 {bad[0]}: process 5 has no stream"
    bad = [[*runs[0][:3], 32]] + runs[1:]
    assert leaf_refused(runs=bad) == f"leaf 'w': run #0 {bad[0]}: offset 32 is not a non-negative multiple of 64"
    bad = [[*runs[0][:3], 1 << 40]] + runs[1:]
    assert leaf_refused(runs=bad).startswith(f"leaf 'w': run #0 {bad[0]}: its entries end at byte ")
    d = json.loads(json.dumps(doc))
    e_runs = _leaf(d, "e")["runs"]
    assert e_runs[1][0] == runs[0][0] == 0  # both in process 0's stream
    e_runs[1][3] = w0 = runs[0][3]  # e's last chunk onto w's first entry
    assert _refused(d) == (f"leaf 'w': run #0 (bytes {w0}..{w0 + 100}) overlaps leaf 'e' run #1 "
                           f"(bytes {w0}..{w0 + 28}) in the stream of process 0")


def test_parse_v1_v2_unchanged_store_message(ckpt_a):
    doc = _doc(ckpt_a)
    doc["format_version"] = 2
    doc["data"] = "d/x"
    del doc["segment_bytes"], doc["streams"]
    assert _refused(doc) == "leaf 'b': store 'stream' needs format_version 3"


# --- round trip through jaxckpt.save (the write helper's side) ---------------------------


def test_round_trip_through_save(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXCKPT_FORMAT", "3")
    rng = np.random.default_rng(1)
    host = rng.standard_normal((64, 24)).astype(np.float32)
    sharding = NamedSharding(mesh((4, 2), ("x", "y")), P("x", "y"))
    tree = {
        "w": jax.device_put(host, sharding),
        "small": np.arange(5, dtype=np.int8),
        "bf": np.linspace(0, 1, 9).astype(jax.numpy.bfloat16),
        "s": np.array(3.0),
        "step": 11,
        "key": jax.random.key(3),
    }
    path = str(tmp_path / "rt")
    jaxckpt.save(path, tree)
    with open(f"{path}/manifest.json", "rb") as f:
        man = _manifest.parse(f.read(), path)
    assert man.format_version == 3 and all(r.store == "stream" for r in man.leaves if r.kind != "value")
    assert os.listdir(f"{path}/data")
    monkeypatch.delenv("JAXCKPT_FORMAT")  # read whatever the switch says
    out = jaxckpt.restore(path, tree)
    assert out["w"].sharding == sharding
    assert_bit_equal(out["w"], host)
    for k in ("small", "bf", "s"):
        assert_bit_equal(out[k], tree[k])
    assert out["step"] == 11
    assert_bit_equal(jax.random.key_data(out["key"]), jax.random.key_data(tree["key"]))
    # onto another layout: rows of 16 over 4 devices, columns whole
    other = NamedSharding(mesh((4,), ("x",)), P("x", None))
    again = jaxckpt.restore(path, {**tree, "w": jax.ShapeDtypeStruct(host.shape, host.dtype, sharding=other)})
    assert_bit_equal(again["w"], host)
    assert_bit_equal(jaxckpt.open(path)["w"][3:40, 5:20], host[3:40, 5:20])
    report = jaxckpt.verify(path)
    assert report.ok, report.summary()


def test_stats_and_diff_read_each_entry_once(tmp_path):
    host = np.arange(256 * 64, dtype=np.float32).reshape(256, 64)  # 64 KiB: above a whole-leaf read
    paths = []
    for name in ("x", "y"):
        path = tmp_path / name
        path.mkdir()
        build(str(path), {"w": host + (name == "y")}, {"w": (32, 64)}, {"w": [0] * 8}, process_count=1)
        paths.append(str(path))
    reset_io_stats()
    stats = jaxckpt.open(paths[0]).stats("w")
    assert stats.count == host.size and stats.mean == pytest.approx(host.mean())
    assert io_stats()["reads"] == 8
    report = jaxckpt.diff(*paths)
    assert not report.identical and "w" in report.differences()


def test_object_store_with_data_prefix():
    host = np.arange(40 * 100, dtype=np.float32).reshape(40, 100)  # entries straddle segments
    path = "memory://f3read/ckpt"
    man = build(path, {"w": host, "n": 3}, {"w": (4, 100)}, {"w": [0, 1] * 5}, data="d/tok")
    assert man.format_version == 3 and man.data == "d/tok"
    reset_io_stats()
    assert_bit_equal(jaxckpt.restore(path, {"w": np.zeros_like(host), "n": 0})["w"], host)
    assert io_stats()["reads"] == 10
    assert_bit_equal(jaxckpt.open(path)["w"][7:13, 1:2], host[7:13, 1:2])
    assert jaxckpt.verify(path).ok


def test_reader_reads_whole_chunks_into_place(ckpt_a, monkeypatch):
    from jaxckpt import _reader
    path, tree, man = ckpt_a
    recs = {r.path: r for r in man.leaves}
    allocated = []
    real = _reader._buffer
    monkeypatch.setattr(_reader, "_buffer", lambda *a: allocated.append(a[2]) or real(*a))
    reader = _reader.Reader(_location.resolve(path), man)
    one = ((4, 8), (6, 12))  # exactly one chunk of w
    rows = ((0, 8), (0, 3))  # two whole chunks of e, each contiguous within the slice
    block = ((4, 8), (3, 12))  # two chunks of w, neither contiguous within the slice
    reader.add(recs["w"], one)
    reader.add(recs["e"], rows)
    reader.add(recs["w"], block)
    reset_io_stats()
    reader.run()
    assert io_stats()["reads"] == 4  # chunk (1, 1) of w serves two slices: read once
    # the slices' own buffers, then one temporary chunk per chunk that is not read into place
    # (the shared one, and w's (1, 0)): the others are read straight into their slices
    assert allocated == [(4, 6), (4, 9), (8, 3), (4, 6), (4, 6)]
    out = reader.get(recs["w"], one)
    assert out.ctypes.data % 64 == 0
    assert_bit_equal(out, tree["w"][4:8, 6:12])
    assert_bit_equal(reader.get(recs["e"], rows), tree["e"][:8])
    assert_bit_equal(reader.get(recs["w"], block), tree["w"][4:8, 3:12])


def test_read_fault_point_per_entry(ckpt_a, monkeypatch):
    from jaxckpt import _storage
    path, tree, man = ckpt_a
    rec = next(r for r in man.leaves if r.path == "w")
    proc, offset = _streams.locate(rec.runs, 3, _streams.stride_for(rec.entry_bytes))
    seen = []

    def hook(op, key):
        seen.append((op, key))
        if (op, key) == ("read", f"p{proc}@{offset}"):
            raise OSError("injected")

    monkeypatch.setattr(_storage, "fault_hook", hook)
    assert_bit_equal(jaxckpt.open(path)["w"][:4, :6], tree["w"][:4, :6])  # chunk 0 only
    assert [k for op, k in seen if op == "read"] == [f"p{rec.runs[0][0]}@{rec.runs[0][3]}"]
    with pytest.raises(CheckpointError, match=r"reading leaf 'w' chunk cell \[1, 1\] failed: injected"):  # not corruption
        jaxckpt.open(path)["w"][4:8]
