"""Format 3's save path (issue 22; the default, ``JAXCKPT_FORMAT=3`` here): the files written, the
manifest's stream fields (exact runs for hand-computed trees), every entry's bytes (the
chunk's C-order bytes and their crc32c), segments, waves, faults, the switch, and round
trips once restored."""

import json
import os

import crc32c
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import assert_bit_equal, mesh, run_workers, sharded
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt import _checkpoint, _layout, _snapshot, _storage, _streams, _writer
from jaxckpt._manifest import LeafRecord
from jaxckpt._storage import objectnames as _objectnames

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def format3(monkeypatch):
    monkeypatch.setenv("JAXCKPT_FORMAT", "3")


def files_under(path):
    return sorted(os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs)


def manifest_of(path):
    with open(os.path.join(path, "manifest.json")) as f:
        return json.load(f)


def stream_bytes(path, process, man):
    """Process ``process``'s whole stream: its segments, concatenated in order."""
    n = _objectnames.objects_per_process({process: man["streams"][str(process)]}, man["segment_bytes"])[process]
    out = b""
    for k in range(n):
        with open(os.path.join(path, "data", f"p{process}.{k}"), "rb") as f:
            out += f.read()
    return out


def check_entries(path, expected):
    """Every chunk of every array leaf is an entry of its writer's stream: the chunk's
    C-order bytes (edge chunks padded with zeros) and their crc32c, zeros between entries
    (``expected``: leaf path -> its values as numpy, in the storage dtype's bytes)."""
    man = manifest_of(path)
    streams = {int(p): stream_bytes(path, int(p), man) for p in man["streams"]}
    assert {p: len(s) for p, s in streams.items()} == {int(p): n for p, n in man["streams"].items()}
    covered = {p: bytearray(len(s)) for p, s in streams.items()}
    count = 0
    for leaf in man["leaves"]:
        if leaf["kind"] == "value":
            continue
        assert leaf["store"] == "stream" and leaf["codec"] == "raw" and "key" not in leaf
        values = np.ascontiguousarray(expected[leaf["path"]])
        chunk_shape = tuple(leaf["chunk_shape"])
        payload = int(np.prod(chunk_shape)) * values.dtype.itemsize
        assert leaf["entry_bytes"] == payload + 4
        stride = _streams.stride_for(leaf["entry_bytes"])
        grid = _layout.chunk_grid_shape(values.shape, chunk_shape)
        for flat, cell in enumerate(_layout.chunk_cells(values.shape, chunk_shape) if values.size else []):
            region = _layout.chunk_region(cell, chunk_shape, values.shape)
            assert _layout.chunk_flat_index(cell, grid) == flat
            full = np.zeros(chunk_shape, values.dtype)
            full[tuple(slice(0, b - a) for a, b in region)] = values[_layout.index_to_slices(region)]
            p, offset = _streams.locate([tuple(r) for r in leaf["runs"]], flat, stride)
            want = full.tobytes() + crc32c.crc32c(full.tobytes()).to_bytes(4, "little")
            assert streams[p][offset:offset + len(want)] == want, (leaf["path"], flat)
            covered[p][offset:offset + len(want)] = b"\1" * len(want)
            count += 1
    for p, s in streams.items():  # the gaps (alignment padding) are zeros
        assert all(b == 0 for b, c in zip(s, covered[p]) if not c)
    return count


def small_tree():
    return {
        "a": sharded(np.arange(32, dtype=np.float32).reshape(8, 4), (4,), ("x",), ("x",)),
        "b": np.array([1, -2, 3], np.int16),
        "c": jax.random.key(1),
        "d": 7,
        "e": sharded(np.arange(16, dtype=np.float32), (8,), ("x",), ()),  # replicated over 8 devices
    }


def test_a_small_state_is_its_manifest_and_one_data_object(tmp_path):
    path = str(tmp_path / "ckpt")
    jaxckpt.save(path, small_tree())
    assert files_under(path) == ["data/p0.0", "manifest.json"]


def test_the_manifest_records_streams_and_exact_runs(tmp_path):
    path = str(tmp_path / "ckpt")
    jaxckpt.save(path, small_tree(), metadata={"m": 1})
    man = manifest_of(path)
    assert man["format_version"] == 3 and man["packed"] == [] and "data" not in man
    # a: 4 chunks of 2x4 float32 (32 bytes, entries of 36 every 64); b: 6 bytes at 256;
    # c: the key's 2 uint32 at 320; e: 64 bytes (stride 128) at 384, ending at 452
    assert man["segment_bytes"] == 1 << 30 and man["streams"] == {"0": 452}
    leaves = {leaf["path"]: leaf for leaf in man["leaves"]}
    assert leaves["a"]["runs"] == [[0, 0, 4, 0]] and leaves["a"]["entry_bytes"] == 36
    assert leaves["a"]["chunk_shape"] == [2, 4]
    assert leaves["b"]["runs"] == [[0, 0, 1, 256]] and leaves["b"]["entry_bytes"] == 10
    assert leaves["c"]["runs"] == [[0, 0, 1, 320]] and leaves["c"]["entry_bytes"] == 12
    assert leaves["c"]["kind"] == "prng_key" and leaves["c"]["dtype"] == "uint32"
    assert leaves["e"]["runs"] == [[0, 0, 1, 384]] and leaves["e"]["entry_bytes"] == 68
    assert leaves["d"] == {"path": "d", "kind": "value", "value": 7}
    assert os.path.getsize(os.path.join(path, "data", "p0.0")) == 452
    info = jaxckpt.metadata(path)
    assert info.format_version == 3 and info.metadata == {"m": 1}


def test_every_entry_is_the_chunks_bytes_and_their_crc32c(tmp_path):
    path = str(tmp_path / "ckpt")
    tree = small_tree()
    jaxckpt.save(path, tree)
    expected = {k: np.asarray(jax.random.key_data(v) if k == "c" else v) for k, v in tree.items() if k != "d"}
    assert check_entries(path, expected) == 4 + 1 + 1 + 1


def test_segments_cut_the_stream_and_an_entry_straddles_two(tmp_path, monkeypatch):
    monkeypatch.setattr(_snapshot, "SEGMENT_BYTES", 4096)
    path = str(tmp_path / "ckpt")
    w = np.random.default_rng(0).standard_normal((8, 300)).astype(np.float32)
    jaxckpt.save(path, {"w": sharded(w, (8,), ("x",), ("x",))})
    man = manifest_of(path)
    # 8 chunks of 1200 bytes: entries of 1204 every 1216; the 4th (at 3648) straddles 4096
    assert man["segment_bytes"] == 4096 and man["streams"] == {"0": 7 * 1216 + 1204}
    assert man["leaves"][0]["runs"] == [[0, 0, 8, 0]]
    n = _objectnames.objects_per_process({0: 9716}, 4096)[0]
    assert n == -(-9716 // 4096) == 3
    assert files_under(path) == ["data/p0.0", "data/p0.1", "data/p0.2", "manifest.json"]
    assert [os.path.getsize(os.path.join(path, "data", f"p0.{k}")) for k in range(3)] == [4096, 4096, 1524]
    assert check_entries(path, {"w": w}) == 8


def test_staged_in_waves_writes_the_same_bytes(tmp_path):
    tree = {"x": np.arange(3000, dtype=np.float64), "y": np.arange(500, dtype=np.int32),
            "z": sharded(np.arange(64, dtype=np.float32), (8,), ("x",), ("x",))}
    plain, waved = str(tmp_path / "plain"), str(tmp_path / "waved")
    jaxckpt.save(plain, tree)
    budget = _snapshot.StagingBudget(4096)
    snap = _snapshot.snapshot(tree, copy_host_arrays=True, budget=budget)
    assert snap.waves is not None
    assert snap.streams == {int(p): n for p, n in manifest_of(plain)["streams"].items()}
    _checkpoint.save_snapshot(waved, snap)
    assert budget.in_flight == 0 and budget.peak <= 4096 + 3000 * 8
    assert manifest_of(waved)["leaves"] == manifest_of(plain)["leaves"]
    with open(os.path.join(plain, "data", "p0.0"), "rb") as a, open(os.path.join(waved, "data", "p0.0"), "rb") as b:
        assert a.read() == b.read()


def test_io_stats_count_each_entrys_payload_once(tmp_path):
    _storage.reset_io_stats()
    jaxckpt.save(str(tmp_path / "ckpt"), small_tree())
    stats = _storage.io_stats()
    assert stats["writes"] == 7 and stats["bytes_written"] == 4 * 32 + 6 + 8 + 64


def test_a_failed_write_fails_the_save_and_commits_nothing(tmp_path, monkeypatch):
    seen = []

    def hook(op, key):
        seen.append((op, key))
        if (op, key) == ("write", "p0@256"):
            raise OSError("injected")

    monkeypatch.setattr(_storage, "fault_hook", hook)
    path = tmp_path / "ckpt"
    with pytest.raises(jaxckpt.CheckpointError, match="injected"):
        jaxckpt.save(str(path), small_tree())
    assert ("write", "p0@0") in seen and not path.exists() and os.listdir(tmp_path) == []


def test_a_stream_missing_at_the_commit_fails_the_save(tmp_path, monkeypatch):
    # what process 0 sees when a process of the job saved without the switch
    def write_data(staging, snap):
        _writer.write_data(staging, snap)
        os.remove(os.path.join(staging.local, "data", "p0.0"))

    monkeypatch.setattr(_checkpoint, "write_data", write_data)
    with pytest.raises(jaxckpt.CheckpointError, match=r"^process 0's data object data/p0.0 is missing, its "
                                                     r"layout 452: was JAXCKPT_FORMAT set alike in every process "
                                                     r"of the job\?$"):
        jaxckpt.save(str(tmp_path / "ckpt"), small_tree())
    assert os.listdir(tmp_path) == []


def test_streams_process_0_did_not_write_fail_the_save(tmp_path, monkeypatch):
    # what process 0 sees with JAXCKPT_FORMAT=1 when another process of the job wrote format 3
    def write_data(staging, snap):
        _writer.write_data(staging, snap)
        os.makedirs(os.path.join(staging.local, "data"))

    monkeypatch.setenv("JAXCKPT_FORMAT", "1")
    monkeypatch.setattr(_checkpoint, "write_data", write_data)
    with pytest.raises(jaxckpt.CheckpointError, match=r"^a process of the job wrote format 3's data objects, process 0 "
                                                     r"did not \(JAXCKPT_FORMAT=1\): set JAXCKPT_FORMAT alike in "
                                                     r"every process of the job$"):
        jaxckpt.save(str(tmp_path / "ckpt"), small_tree())
    assert os.listdir(tmp_path) == []


def test_directories_per_host_need_every_hosts_group():
    with pytest.raises(jaxckpt.CheckpointError, match="per host needs every host's group"):
        _snapshot.snapshot({"a": np.ones(3)}, copy_host_arrays=False, group=(0,))


@pytest.mark.parametrize("value", [None, "", "3", " 3 "])
def test_format_3_unless_the_switch_says_1(tmp_path, monkeypatch, value):
    if value is None:
        monkeypatch.delenv("JAXCKPT_FORMAT")
    else:
        monkeypatch.setenv("JAXCKPT_FORMAT", value)
    path = str(tmp_path / "ckpt")
    jaxckpt.save(path, small_tree())
    man = manifest_of(path)
    assert man["format_version"] == 3 and man["streams"] == {"0": 452} and "segment_bytes" in man
    assert files_under(path) == ["data/p0.0", "manifest.json"] and not man["packed"]


def test_the_switch_set_to_1_writes_the_older_layout(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXCKPT_FORMAT", "1")
    path = str(tmp_path / "ckpt")
    jaxckpt.save(path, small_tree())
    man = manifest_of(path)
    assert man["format_version"] == 1 and "streams" not in man and "segment_bytes" not in man
    assert not os.path.exists(os.path.join(path, "data")) and man["packed"]
    assert {f.split(os.sep)[0] for f in files_under(path)} == {"packed", "manifest.json"}  # all small leaves


@pytest.mark.parametrize("value", ["2", "yes", "1.0"])
def test_any_other_value_of_the_switch_is_refused_before_anything_is_written(tmp_path, monkeypatch, value):
    monkeypatch.setenv("JAXCKPT_FORMAT", value)
    with pytest.raises(jaxckpt.CheckpointError) as e:
        jaxckpt.save(str(tmp_path / "ckpt"), small_tree())
    assert str(e.value) == (f"JAXCKPT_FORMAT='{value}': set it to 3 (format 3, the default) or 1 (the layout of "
                            "formats 1 and 2, for readers older than format 3)")
    assert os.listdir(tmp_path) == []


def test_an_edge_chunk_is_padded_to_the_full_chunk_with_zeros():
    rec = LeafRecord(path="x", kind="array", dtype="float32", shape=(6, 3), chunk_shape=(4, 3),
                     storage_dtype="float32", store="stream")
    data = np.arange(6, dtype=np.float32).reshape(2, 3)
    payload = _writer.entry_payload(rec, data)
    assert payload.shape == (4, 3) and payload.flags.c_contiguous
    assert payload.tobytes() == data.tobytes() + bytes(24)
    whole = np.arange(12, dtype=np.float32).reshape(4, 3)
    assert np.shares_memory(_writer.entry_payload(rec, whole), whole)  # no copy for a whole chunk
    strided = np.arange(24, dtype=np.float32).reshape(4, 6)[:, ::2]
    assert _writer.entry_payload(rec, strided).tobytes() == np.ascontiguousarray(strided).tobytes()
    scalar = LeafRecord(path="s", kind="array", dtype="bfloat16", storage_dtype="uint16", store="stream")
    one = np.asarray(jnp.bfloat16(1.5))
    assert _writer.entry_payload(scalar, one).shape == () and _writer.entry_payload(scalar, one).tobytes() == one.tobytes()


# --- round trips (the read side: helper "read") ---------------------------------------------


def _roundtrip_tree():
    m = mesh((4, 2), ("a", "b"))
    rng = np.random.default_rng(1)
    big = rng.standard_normal((512, 1024)).astype(np.float32)  # 2 MiB: a big leaf in formats 1/2
    return {
        "big": jax.device_put(big, NamedSharding(m, P("a", "b"))),
        "repl": jax.device_put(rng.standard_normal((64, 16)).astype(jnp.bfloat16), NamedSharding(m, P())),
        "small": jax.device_put(np.arange(24, dtype=np.int8).reshape(8, 3), NamedSharding(m, P("a"))),
        "host": np.arange(10, dtype=np.uint16),
        "scalar": np.float64(2.5),
        "key": jax.random.split(jax.random.key(3), 4),
        "inline": {"step": 12, "name": "run", "none": None, "blob": b"\x00\x01"},
        "empty": np.zeros((0, 3), np.float32),
    }


def test_round_trip_bit_for_bit(tmp_path):
    path = str(tmp_path / "ckpt")
    tree = _roundtrip_tree()
    jaxckpt.save(path, tree)
    back = jaxckpt.restore(path, tree)
    for k in ("big", "repl", "small", "host", "empty"):
        assert_bit_equal(back[k], tree[k])
        if isinstance(tree[k], jax.Array):
            assert back[k].sharding == tree[k].sharding
    assert type(back["scalar"]) is np.float64 and back["scalar"] == 2.5
    assert_bit_equal(jax.random.key_data(back["key"]), jax.random.key_data(tree["key"]))
    assert back["inline"] == tree["inline"]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.int4, np.bool_, np.complex128,
                                   np.uint64, np.float16])
def test_round_trip_dtypes(tmp_path, dtype):
    rng = np.random.default_rng(2)
    if np.dtype(dtype) == np.bool_:
        values = rng.integers(0, 2, (16, 6)).astype(bool)
    elif np.dtype(dtype).name == "int4":
        values = rng.integers(-8, 8, (16, 6)).astype(dtype)
    else:
        values = rng.standard_normal((16, 6)).astype(np.float64).astype(dtype)
    tree = {"s": sharded(values, (8,), ("x",), ("x",)), "h": values, "k": values[3, 2]}
    path = str(tmp_path / "ckpt")
    jaxckpt.save(path, tree)
    back = jaxckpt.restore(path, tree)
    assert_bit_equal(back["s"], tree["s"])  # (64-bit types are 32-bit in jax without x64)
    assert_bit_equal(back["h"], values)
    assert_bit_equal(back["k"], values[3, 2])


def test_restore_onto_another_mesh(tmp_path):
    path = str(tmp_path / "ckpt")
    tree = _roundtrip_tree()
    jaxckpt.save(path, tree)
    other = mesh((2, 4), ("p", "q"))
    target = {**tree,
              "big": jax.ShapeDtypeStruct((512, 1024), np.float32, sharding=NamedSharding(other, P("q", "p"))),
              "repl": jax.ShapeDtypeStruct((64, 16), jnp.bfloat16, sharding=NamedSharding(other, P(None, "p")))}
    back = jaxckpt.restore(path, target)
    assert back["big"].sharding == target["big"].sharding
    assert_bit_equal(back["big"], tree["big"])
    assert_bit_equal(back["repl"], tree["repl"])
    numpy_back = jaxckpt.restore(path)  # no target: numpy
    assert_bit_equal(numpy_back["small"], tree["small"])


def test_a_saved_checkpoint_verifies_and_a_flipped_byte_costs_its_leaf(tmp_path):
    path = str(tmp_path / "ckpt")
    jaxckpt.save(path, small_tree())
    report = jaxckpt.verify(path)
    assert report.ok and report.chunks == 7, report.summary()
    with open(os.path.join(path, "data", "p0.0"), "r+b") as f:  # leaf a's chunk 2: bytes [128, 164)
        f.seek(130)
        byte = f.read(1)
        f.seek(130)
        f.write(bytes([byte[0] ^ 1]))
    report = jaxckpt.verify(path)
    assert not report.ok and report.unrestorable == ["a"]


@pytest.mark.parametrize("staging", [None, 1000])
def test_a_manager_saves_format_3_in_the_background(tmp_path, staging):
    mgr = jaxckpt.CheckpointManager(str(tmp_path / "run"), max_staging_bytes=staging)
    for step in range(2):
        state = {"w": sharded(np.arange(512, dtype=np.float32).reshape(64, 8) + step, (8,), ("x",), ("x",)),
                 "h": np.arange(300) + step, "step": step}
        mgr.save(step, state)
    back = mgr.restore(1, state)
    mgr.close()
    assert_bit_equal(back["w"], state["w"])
    assert_bit_equal(back["h"], state["h"])
    assert back["step"] == 1
    assert manifest_of(str(tmp_path / "run" / "1"))["format_version"] == 3


# --- two real processes --------------------------------------------------------------------


def test_two_processes_write_one_stream_each(tmp_path, monkeypatch):
    worker = os.path.join(ROOT, "tests", "mp_worker.py")
    path = str(tmp_path / "ckpt")
    args = {"mesh": (4,), "names": ("x",), "spec": ["x", None], "path": path}
    res = run_workers(worker, 2, lambda i, port: [port, 2, i, 2, "save", json.dumps(args)], 90,
                      "a format-3 save", env={"JAXCKPT_FORMAT": "3"})
    man = manifest_of(path)
    assert man["format_version"] == 3 and man["process_count"] == 2
    assert sorted(man["streams"]) == ["0", "1"]
    assert files_under(path) == ["data/p0.0", "data/p1.0", "manifest.json"]
    big = np.arange(64 * 4096, dtype=np.float32).reshape(64, 4096)
    expected = {"big": big, "small": np.arange(8 * 16, dtype=np.int32).reshape(8, 16),
                "repl": np.arange(16, dtype=np.float32), "host": np.ones(3, np.int8) * 7}
    entries = check_entries(path, expected)
    leaves = {leaf["path"]: leaf for leaf in man["leaves"]}
    # each process writes the shards its devices hold: big's rows 0-31 on 0, 32-63 on 1,
    # each the first entries of its stream (chunks of 16 x 4096 float32)
    assert leaves["big"]["runs"] == [[0, 0, 2, 0], [1, 2, 2, 0]] and leaves["big"]["entry_bytes"] == 262148
    arrays = [(p, int(np.prod(_layout.chunk_grid_shape(leaf["shape"], leaf["chunk_shape"]))), leaf["entry_bytes"],
               leaf["runs"]) for p, leaf in leaves.items() if p in expected]
    streams = {int(p): n for p, n in man["streams"].items()}
    assert _streams.validate(arrays, streams, path)  # no overlaps, each stream ends at its last entry
    payloads = sum(int(np.prod(leaf["chunk_shape"])) * np.dtype(expected[p].dtype).itemsize
                   * sum(r[2] for r in leaf["runs"]) for p, leaf in leaves.items() if p in expected)
    assert sum(res[i]["written"] for i in range(2)) == payloads  # every chunk once, in all
    assert entries == sum(sum(r[2] for r in leaf["runs"]) for p, leaf in leaves.items() if p in expected)
    # restored in two processes onto another mesh, without the switch (the manifest says 3)
    monkeypatch.delenv("JAXCKPT_FORMAT")
    back = run_workers(worker, 2, lambda i, port: [port, 2, i, 2, "restore", json.dumps(
        {"mesh": (2, 2), "names": ("p", "q"), "spec": [None, ["p", "q"]], "path": path})], 90, "its restore")
    assert all(back[i].get("ok") for i in range(2)), back


MISMATCH_WORKER = '''
import json, os, sys
port, pid, switch = sys.argv[1], int(sys.argv[2]), sys.argv[3]
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
if switch:
    os.environ["JAXCKPT_FORMAT"] = switch
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid, initialization_timeout=60)
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import jaxckpt
mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
x = jax.make_array_from_callback((8, 4096), NamedSharding(mesh, P("x")), lambda i: np.ones((8, 4096), np.float32)[i])
try:
    jaxckpt.save(sys.argv[4], {"x": x, "y": np.arange(5)}, timeout_s=20)
    print("RESULT " + json.dumps({"error": None}))
except jaxckpt.CheckpointError as e:
    print("RESULT " + json.dumps({"error": str(e)}))
'''


@pytest.mark.parametrize("switches", [("1", ""), ("", "1")])
def test_a_job_whose_processes_disagree_on_the_switch_commits_nothing(tmp_path, monkeypatch, switches):
    # one process unset (format 3, the default), the other JAXCKPT_FORMAT=1
    monkeypatch.delenv("JAXCKPT_FORMAT")
    worker = tmp_path / "worker.py"
    worker.write_text(MISMATCH_WORKER)
    path = tmp_path / "ckpt"
    res = run_workers(str(worker), 2, lambda i, port: [port, i, switches[i], path], 90, "a mismatched job")
    want = ("a process of the job wrote format 3's data objects, process 0 did not (JAXCKPT_FORMAT=1): "
            "set JAXCKPT_FORMAT alike in every process of the job" if switches[0] == "1"
            else "process 1's data object data/p1.0 is missing, its layout 65604: was JAXCKPT_FORMAT set alike "
            "in every process of the job?")
    assert res[0]["error"] is not None and res[1]["error"] is not None, res
    assert want in res[0]["error"] and want in res[1]["error"], res
    assert os.listdir(tmp_path) == ["worker.py"]  # nothing committed, the staging directory removed
