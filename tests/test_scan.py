"""verify, diff and stats (jaxckpt/_verify.py, _diff.py): every chunk streamed, bounded memory."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import jax
import ml_dtypes
import numpy as np
import pytest
from conftest import sharded

import jaxckpt
from jaxckpt import _diff, _reader
from jaxckpt._storage import location as _location
from jaxckpt._storage import zarr as _zarr

SMALL = 900 * 256  # float32 elements: 900 KiB, packed (six of them fill two stored chunks)


def _mixed_tree(changed=None):
    w = np.arange(512 * 1024, dtype=np.float32).reshape(512, 1024)  # 2 MiB: 4 row chunks
    v = (np.arange(256 * 2048, dtype=np.float32) % 7).reshape(256, 2048)  # 2 MiB: 2x2 chunks
    if changed is not None:
        changed(w)
    return {
        "params": {"w": sharded(w, (4,), ("x",), ("x", None)),
                   "v": sharded(v, (2, 2), ("a", "b"), ("a", "b")),
                   "small": {f"s{i}": np.full((SMALL,), i, np.float32) for i in range(6)},
                   "b16": np.linspace(-2, 2, 12).astype(ml_dtypes.bfloat16).reshape(3, 4)},
        "rng": jax.random.key(3), "step": 12, "name": "run", "empty": np.zeros((0, 4), np.float32),
    }


@pytest.fixture
def mixed(ckpt):
    jaxckpt.save(ckpt, _mixed_tree())
    return ckpt


def _manifest(path):
    """The manifest's JSON, to edit: without its checksum, read as one written before them."""
    doc = json.loads((path / "manifest.json").read_text())
    del doc["checksum"]
    return doc


def _record(path, leaf):
    return next(r for r in _manifest(path)["leaves"] if r["path"] == leaf)


def _flip(file, at):
    data = bytearray(file.read_bytes())
    data[at] ^= 0x40
    file.write_bytes(bytes(data))


# --- verify -------------------------------------------------------------------------


@pytest.mark.format1
def test_verify_ok_on_a_mixed_checkpoint(mixed):
    calls = []
    report = jaxckpt.verify(mixed, progress=lambda done, total: calls.append((done, total)))
    man = _manifest(mixed)
    packed = man["packed"]
    assert len(packed) == 1 and -(-packed[0]["nbytes"] // packed[0]["chunk_bytes"]) == 2  # two stored chunks
    assert (report.ok, report.problems, report.leaves) == (True, [], 13)
    assert report.chunks == 4 + 4 + 2  # w's row chunks, v's 2x2 chunks, two packed chunks
    assert report.bytes_read == (2 << 20) * 2 + packed[0]["nbytes"]
    assert calls[0] == (0, report.bytes_read) and calls[-1] == (report.bytes_read, report.bytes_read)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)
    out = report.to_json()
    assert json.loads(json.dumps(out)) == out and out["path"] == str(mixed) and out["ok"] is True


@pytest.mark.format1
def test_flipped_byte_in_a_direct_chunk_file_names_leaf_and_cell(mixed):
    key = _record(mixed, "params/w")["key"]
    _flip(mixed / "arrays" / key / "c" / "1" / "0", 1000)
    report = jaxckpt.verify(mixed)
    assert report.ok is False
    [problem] = report.problems
    assert (problem["leaf"], problem["chunk"]) == ("params/w", "cell [1, 0]")
    assert problem["message"].startswith(f"arrays/{key}/c/1/0: DATA_LOSS")
    assert "digest mismatch" in problem["message"]
    assert report.bytes_read == (4 << 20) - (512 << 10) + _manifest(mixed)["packed"][0]["nbytes"]


@pytest.mark.format1
def test_flipped_byte_read_through_tensorstore_names_leaf_and_cell(mixed, monkeypatch):
    monkeypatch.setattr(_reader, "DIRECT_READS", False)
    key = _record(mixed, "params/v")["key"]
    _flip(mixed / "arrays" / key / "c" / "1" / "1", 7)
    [problem] = jaxckpt.verify(mixed).problems
    assert (problem["leaf"], problem["chunk"]) == ("params/v", "cell [1, 1]")
    assert problem["message"].startswith(f"arrays/{key}/c/1/1: ") and "digest mismatch" in problem["message"].lower()


@pytest.mark.format1
def test_flipped_byte_in_an_edge_chunk_names_leaf_and_cell(ckpt):
    import tensorstore as ts

    host = np.arange(10 * 32768, dtype=np.float32).reshape(10, 32768)
    jaxckpt.save(ckpt, {"w": host})
    shutil.rmtree(ckpt / "arrays" / "0")  # rewritten in chunks of 4, 4 and (stored as 4) 2 rows
    spec = _zarr.array_spec(_location.resolve(ckpt), "0", (10, 32768), (4, 32768), "float32")
    ts.open(spec, create=True).result().write(host).result()
    doc = _manifest(ckpt)
    doc["leaves"][0]["chunk_shape"] = [4, 32768]
    (ckpt / "manifest.json").write_text(json.dumps(doc))
    assert jaxckpt.verify(ckpt).ok
    _flip(ckpt / "arrays" / "0" / "c" / "2" / "0", 5)
    [problem] = jaxckpt.verify(ckpt).problems
    assert (problem["leaf"], problem["chunk"]) == ("w", "cell [2, 0]")
    assert problem["message"].startswith("arrays/0/c/2/0: ")


@pytest.mark.format1
def test_flipped_byte_in_a_packed_chunk_names_the_leaves_it_holds(mixed):
    man = _manifest(mixed)
    chunk_bytes = man["packed"][0]["chunk_bytes"]
    s4 = _record(mixed, "params/small/s4")
    offset = s4["chunks"][0][1] + 100  # inside s4, in the second stored chunk
    assert offset // chunk_bytes == 1
    _flip(mixed / "packed" / "p0" / "c" / "1", offset - chunk_bytes)
    report = jaxckpt.verify(mixed)
    expected = []
    for rec in man["leaves"]:
        if rec.get("store") == "packed" and rec["chunks"]:
            start = rec["chunks"][0][1]
            if start < 2 * chunk_bytes and start + rec["nbytes"] > chunk_bytes:
                expected.append((rec["path"], f"packed p0 offset {start} (cell [0{', 0' * (len(rec['shape']) - 1)}])"))
    assert ("params/small/s4", f"packed p0 offset {offset - 100} (cell [0])") in expected
    assert [(p["leaf"], p["chunk"]) for p in report.problems] == sorted(expected)
    assert all(p["message"].startswith("packed/p0/c/1: ") for p in report.problems)
    assert report.ok is False


@pytest.mark.format1
def test_truncated_deleted_and_stray_chunk_files(mixed):
    key = _record(mixed, "params/w")["key"]
    chunks = mixed / "arrays" / key / "c"
    with open(chunks / "2" / "0", "r+b") as f:
        f.truncate(1000)
    os.remove(chunks / "3" / "0")
    os.makedirs(chunks / "7")
    (chunks / "7" / "0").write_bytes(b"stray")
    (mixed / "packed" / "p0" / "c" / "9").write_bytes(b"stray")
    report = jaxckpt.verify(mixed)
    size = 128 * 1024 * 4 + 4
    assert report.problems == [
        {"leaf": "params/w", "chunk": f"arrays/{key}/c/7/0", "message": f"unexpected file arrays/{key}/c/7/0"},
        {"leaf": "params/w", "chunk": "cell [2, 0]", "message": f"arrays/{key}/c/2/0 has 1000 bytes, expected {size}"},
        {"leaf": "params/w", "chunk": "cell [3, 0]", "message": f"arrays/{key}/c/3/0 is missing"},
        {"leaf": None, "chunk": "packed/p0/c/9", "message": "unexpected file packed/p0/c/9"},
    ]
    assert report.ok is False and report.chunks == 10


@pytest.mark.format1
def test_overlapping_packed_offsets_are_reported(mixed):
    doc = _manifest(mixed)
    by_path = {r["path"]: r for r in doc["leaves"]}
    s1, s2 = by_path["params/small/s1"], by_path["params/small/s2"]
    a = s1["chunks"][0][1]
    s2["chunks"][0][1] = a + 64  # s2 now starts inside s1
    (mixed / "manifest.json").write_text(json.dumps(doc))
    report = jaxckpt.verify(mixed)
    end1, end2 = a + SMALL * 4, a + 64 + SMALL * 4
    assert report.problems == [{
        "leaf": "params/small/s2", "chunk": f"packed p0 offset {a + 64} (cell [0])",
        "message": f"bytes [{a + 64}, {end2}) of packed p0 overlap bytes [{a}, {end1}) of leaf "
                   f"'params/small/s1' (packed p0 offset {a} (cell [0]))"}]


def test_a_bad_manifest_is_a_problem_not_an_exception(mixed):
    doc = _manifest(mixed)
    doc["leaves"][0]["nbytes"] += 1
    (mixed / "manifest.json").write_text(json.dumps(doc))
    report = jaxckpt.verify(mixed)
    assert (report.ok, report.leaves, report.chunks, report.bytes_read) == (False, 0, 0, 0)
    [problem] = report.problems
    assert (problem["leaf"], problem["chunk"]) == (None, "manifest.json")
    assert "invalid manifest" in problem["message"] and "nbytes" in problem["message"]


def test_not_a_checkpoint_raises(tmp_path):
    (tmp_path / "plain").mkdir()
    with pytest.raises(jaxckpt.CheckpointNotFoundError, match="manifest.json is missing"):
        jaxckpt.verify(tmp_path / "plain")
    with pytest.raises(jaxckpt.CheckpointNotFoundError):
        jaxckpt.verify(tmp_path / "nothing-here")


@pytest.mark.format1
def test_verify_on_an_object_store_reads_through_tensorstore():
    x = np.arange(512 * 1024, dtype=np.float32).reshape(512, 1024)
    jaxckpt.save("memory://scan/ckpt", {"x": sharded(x, (4,), ("x",), ("x", None)), "s": np.ones(3)},
                 overwrite=True)
    report = jaxckpt.verify("memory://scan/ckpt")
    assert (report.ok, report.chunks, report.bytes_read) == (True, 5, (2 << 20) + 64)


# --- stats --------------------------------------------------------------------------


def _expected_stats(x):
    x = np.asarray(x)
    if x.dtype == ml_dtypes.bfloat16:
        x = x.astype(np.float32)
    nan = int(np.isnan(x).sum()) if x.dtype.kind == "f" else 0
    inf = int(np.isinf(x).sum()) if x.dtype.kind == "f" else 0
    f = x[np.isfinite(x)] if x.dtype.kind == "f" else x.reshape(-1)
    return nan, inf, f.min().item(), f.max().item(), f.astype(np.float64).mean(), f.astype(np.float64).std()


def test_stats_equal_numpy(ckpt):
    rng = np.random.default_rng(0)
    f32 = rng.standard_normal((512, 1024)).astype(np.float32) * 100  # 2 MiB: 4 chunks
    f32[3, 7] = f32[400, 9] = np.nan
    f32[200, 0], f32[511, 1023] = np.inf, -np.inf
    tree = {
        "f32": sharded(f32, (4,), ("x",), ("x", None)),
        "b16": np.array([1.5, -3, np.nan, np.inf, 0.25, 7], ml_dtypes.bfloat16),
        "i32": sharded(rng.integers(-10**9, 10**9, (64, 8), dtype=np.int32), (2, 2), ("a", "b"), ("a", "b")),
        "bool": rng.integers(0, 2, (33,)).astype(bool),
        "rng": jax.random.key(0), "step": 3, "empty": np.zeros((0,), np.float32),
    }
    jaxckpt.save(ckpt, tree)
    stats = jaxckpt.open(ckpt).stats()
    assert sorted(stats) == ["b16", "bool", "empty", "f32", "i32", "rng", "step"]
    for name in ("f32", "b16", "i32", "bool"):
        s, x = stats[name], np.asarray(tree[name])
        nan, inf, lo, hi, mean, std = _expected_stats(x)
        assert (s.path, s.numeric, s.count, s.nan, s.inf, s.min, s.max) == (name, True, x.size, nan, inf, lo, hi)
        assert type(s.min) is type(lo)
        assert s.mean == pytest.approx(mean, rel=1e-12, abs=1e-12)
        assert s.std == pytest.approx(std, rel=1e-12)
    assert (stats["f32"].nan, stats["f32"].inf, stats["b16"].nan, stats["b16"].inf) == (2, 2, 1, 1)
    assert (stats["bool"].min, stats["bool"].max) == (False, True)
    assert (stats["rng"].numeric, stats["rng"].kind, stats["step"].numeric, stats["step"].kind) == (
        False, "prng_key", False, "value")
    assert (stats["step"].value, stats["step"].to_json()["value"], stats["rng"].value) == (3, 3, None)  # issue 31
    assert (stats["empty"].count, stats["empty"].mean, stats["empty"].min) == (0, None, None)
    assert jaxckpt.open(ckpt).stats("f32") == stats["f32"]
    assert json.loads(json.dumps(stats["f32"].to_json()))["shape"] == [512, 1024]


def test_stats_of_a_prefix_and_of_a_sub_view(mixed):
    view = jaxckpt.open(mixed)
    small = view.stats("params/small")
    assert sorted(small) == [f"params/small/s{i}" for i in range(6)]
    assert [(s.min, s.max, s.mean, s.std, s.count) for s in small.values()] == [
        (float(i), float(i), float(i), 0.0, SMALL) for i in range(6)]
    assert view["params"].stats("small/s3").path == "params/small/s3"
    with pytest.raises(KeyError, match="'nope' is not a key path"):
        view.stats("nope")


def test_summary_and_rows(mixed):
    view = jaxckpt.open(mixed)
    assert view.summary() == {
        "leaves": 13, "arrays": 11, "bytes": (4 << 20) + 6 * SMALL * 4 + 24 + 8,
        "by_dtype": {"bfloat16": 24, "float32": (4 << 20) + 6 * SMALL * 4, "key<threefry2x32>": 8},
        "by_subtree": {"empty": 0, "name": 0, "params": (4 << 20) + 6 * SMALL * 4 + 24, "rng": 8, "step": 0},
    }
    assert [r["path"] for r in view.rows()][:2] == ["empty", "name"]
    assert view["params"].summary()["by_subtree"]["small"] == 6 * SMALL * 4


# --- diff ---------------------------------------------------------------------------


def test_diff_of_different_shardings_of_the_same_values_is_identical(tmp_path, mixed):
    tree = _mixed_tree()
    w = np.asarray(tree["params"]["w"])
    tree["params"]["w"] = sharded(w, (2, 4), ("a", "b"), ("b", "a"))  # 8 chunks, another grid
    tree["params"]["v"] = np.asarray(tree["params"]["v"])  # one host chunk
    jaxckpt.save(tmp_path / "other", tree)
    assert _record(tmp_path / "other", "params/w")["chunk_shape"] == [128, 512]
    calls = []
    report = jaxckpt.diff(mixed, tmp_path / "other", progress=lambda d, t: calls.append((d, t)))
    assert report.identical and report.changed == [] and report.added == report.removed == []
    assert report.arrays["params/w"] == {"elements": 512 * 1024, "differ": 0, "max_abs": 0.0, "max_rel": 0.0}
    assert sorted(report.arrays) == sorted(
        ["empty", "params/w", "params/v", "params/b16"] + [f"params/small/s{i}" for i in range(6)])
    assert report.keys == {"rng": {"keys": 1, "differ": 0}}  # keys compared as keys, not as numbers
    assert calls[-1][0] == calls[-1][1] == 2 * ((4 << 20) + 6 * SMALL * 4 + 24 + 8)


def test_diff_of_one_changed_element(tmp_path, mixed):
    def change(w):
        w[300, 5] = 2000.0  # was 300 * 1024 + 5

    jaxckpt.save(tmp_path / "other", _mixed_tree(change))
    report = jaxckpt.diff(mixed, tmp_path / "other")
    old = 300 * 1024 + 5.0
    assert not report.identical
    assert report.arrays["params/w"] == {"elements": 512 * 1024, "differ": 1, "max_abs": old - 2000.0,
                                         "max_rel": (old - 2000.0) / old}
    assert [k for k, d in report.arrays.items() if d["differ"]] == ["params/w"]


def test_diff_lists_added_removed_and_changed(tmp_path):
    a = {"x": np.zeros((4, 4), np.float32), "y": np.ones(3, np.int32), "gone": 1, "step": 5,
         "k": jax.random.key(0), "z": np.ones(2, np.float32)}
    b = {"x": np.zeros((2, 8), np.float32), "y": np.ones(3, np.float32), "new": 2.5, "step": 6,
         "k": jax.random.key(0, impl="rbg"), "z": np.ones(2, np.float32)}
    jaxckpt.save(tmp_path / "a", a)
    jaxckpt.save(tmp_path / "b", b)
    report = jaxckpt.diff(tmp_path / "a", tmp_path / "b")
    assert (report.added, report.removed) == (["new"], ["gone"])
    assert report.changed == [
        {"leaf": "k", "field": "shape", "a": (2,), "b": (4,)},
        {"leaf": "k", "field": "impl", "a": "threefry2x32", "b": "rbg"},
        {"leaf": "step", "field": "value", "a": 5, "b": 6},
        {"leaf": "x", "field": "shape", "a": (4, 4), "b": (2, 8)},
        {"leaf": "y", "field": "dtype", "a": "int32", "b": "float32"},
    ]
    # equal shapes are still compared, across dtypes
    assert report.arrays == {"y": {"elements": 3, "differ": 0, "max_abs": 0.0, "max_rel": 0.0},
                             "z": {"elements": 2, "differ": 0, "max_abs": 0.0, "max_rel": 0.0}}
    out = report.to_json()
    assert out["changed"][0] == {"leaf": "k", "field": "shape", "a": [2], "b": [4]}
    assert out["identical"] is False and json.loads(json.dumps(out)) == out


def test_diff_nan_and_inf_rules(tmp_path):
    a = np.array([np.nan, 1.0, np.nan, 0.0, -0.0, np.inf, 4.0], np.float32)
    b = np.array([np.nan, 1.0, 2.0, 0.0, 0.0, np.inf, 5.0], np.float32)
    jaxckpt.save(tmp_path / "a", {"v": a, "f": float("nan")})
    jaxckpt.save(tmp_path / "b", {"v": b, "f": float("nan")})
    report = jaxckpt.diff(tmp_path / "a", tmp_path / "b")
    assert report.changed == []
    assert report.arrays["v"] == {"elements": 7, "differ": 2, "max_abs": float("inf"), "max_rel": float("inf")}
    assert report.to_json()["arrays"]["v"]["max_abs"] == "inf"
    b[2] = np.nan
    jaxckpt.save(tmp_path / "b", {"v": b, "f": float("nan")}, overwrite=True)
    report = jaxckpt.diff(tmp_path / "a", tmp_path / "b")
    assert report.arrays["v"] == {"elements": 7, "differ": 1, "max_abs": 1.0, "max_rel": 0.2}


def test_diff_blocks_fold_like_one_pass(monkeypatch):
    x = np.arange(10, dtype=np.float32)
    y = x.copy()
    y[[2, 9]] = [5, 4.5]
    monkeypatch.setattr(_diff, "FOLD_BLOCK", 3)
    assert _diff._diff_block(x, y) == (2, 4.5, 0.6)
    m = _diff._Moments()
    for block in _diff._blocks(x):
        m.merge(_diff._block_moments(x[block]))
    assert (m.n, m.lo, m.hi, m.mean) == (10, 0.0, 9.0, 4.5)
    assert m.m2 / m.n == pytest.approx(x.astype(np.float64).var(), rel=1e-15)


# --- memory -------------------------------------------------------------------------

_PEAK_SCRIPT = textwrap.dedent("""
    import gc, json, sys
    import jaxckpt
    from jaxckpt import _verify

    def mem():
        out = {}
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    out[line.split(":")[0]] = int(line.split()[1]) * 1024
        return out

    jaxckpt.verify(sys.argv[2])  # warm up: imports, thread pools, tensorstore context
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the high-water mark
    base = mem()["VmRSS"]
    report = jaxckpt.verify(sys.argv[1])
    print(json.dumps({"ok": report.ok, "bytes": report.bytes_read, "growth": mem()["VmHWM"] - base,
                      "budget": _verify.SCAN_BUDGET_BYTES}))
""")


@pytest.mark.format1
def test_verify_memory_stays_within_a_few_chunks(tmp_path):  # Linux /proc (CI and this machine)
    # 256 MiB in 8 chunks of 32 MiB: the budget holds two chunk buffers at once
    big = {f"w{i}": sharded(np.full((4096, 8192), i, np.float32), (4,), ("x",), ("x", None)) for i in range(2)}
    jaxckpt.save(tmp_path / "big", big)
    del big
    jaxckpt.save(tmp_path / "tiny", {"w": np.ones((512, 1024), np.float32)})
    chunk = 32 << 20
    assert _record(tmp_path / "big", "w0")["chunk_shape"] == [1024, 8192]
    script = tmp_path / "peak.py"
    script.write_text(_PEAK_SCRIPT)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": repo}
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "big"), str(tmp_path / "tiny")],
                         capture_output=True, text=True, env=env, check=True, timeout=300)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["ok"] is True and result["bytes"] == 256 << 20
    assert result["budget"] == 2 * chunk
    assert result["growth"] < 3 * chunk, result  # the whole checkpoint is 8 chunks


def test_stats_and_diff_read_foreign_formats_through_their_source(tmp_path):
    # a safetensors file is read through its own reader, in row blocks (bounded memory)
    from safetensors.numpy import save_file

    w = np.linspace(-3, 3, 4096 * 64, dtype=np.float32).reshape(4096, 64)
    b = np.arange(10, dtype=np.int32)
    save_file({"params.w": w, "params.b": b}, str(tmp_path / "m.safetensors"))
    view = jaxckpt.open(tmp_path / "m.safetensors")
    s = view.stats("params/w")
    assert (s.min, s.max, s.count) == (-3.0, 3.0, w.size)
    assert s.mean == pytest.approx(float(w.astype(np.float64).mean()), abs=1e-12)
    jaxckpt.save(tmp_path / "ours", {"params": {"w": w, "b": b}})
    report = jaxckpt.diff(tmp_path / "ours", tmp_path / "m.safetensors")
    assert report.identical and report.arrays["params/w"]["elements"] == w.size


def test_verify_says_a_foreign_checkpoint_is_not_its_format(tmp_path):
    from safetensors.numpy import save_file

    save_file({"w": np.ones(3, np.float32)}, str(tmp_path / "m.safetensors"))
    with pytest.raises(jaxckpt.CheckpointError, match=f"'{tmp_path / 'm.safetensors'}' is a safetensors "
                                                      "checkpoint: verify reads jaxckpt checkpoints and "
                                                      "orbax-checkpoint steps"):
        jaxckpt.verify(tmp_path / "m.safetensors")
