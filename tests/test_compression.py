"""Lossless compression (issue 23): ``save(compression=...)`` on format 3's entries."""

import json
import os
import struct
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import assert_bit_equal, mesh, sharded
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt import _codecs, _dtypes, _reader, _writer
from jaxckpt._storage import codecs as _tscodecs


def _state():
    rng = np.random.default_rng(7)
    w = (rng.standard_normal((256, 128)) * 0.02).astype(np.float32)
    return {
        "params": {"w": sharded(w, (4, 2), ("a", "b"), ("a", "b")),
                   "b": rng.standard_normal(128).astype(ml_dtypes.bfloat16)},
        "opt": {"mu": sharded(np.zeros((256, 128), np.float32), (4,), ("x",), ("x", None)),
                "nu": np.abs(rng.standard_normal((64, 33))).astype(np.float32),
                "count": np.int32(5)},
        "flags": rng.integers(0, 2, (100,)).astype(bool),
        "bytes8": rng.integers(-128, 127, (1000,)).astype(np.int8),
        "rng": jax.random.key(3),
        "step": 11,
    }


def _leaves(d):
    with open(os.path.join(d, "manifest.json")) as f:
        return {leaf["path"]: leaf for leaf in json.load(f)["leaves"]}


@pytest.mark.parametrize("compression", ["zstd", ("zstd", 19), "blosc", ("blosc", 9)])
def test_every_leaf_kind_round_trips_bit_for_bit(tmp_path, compression):
    state = _state()
    jaxckpt.save(tmp_path / "c", state, compression=compression)
    back = jaxckpt.restore(tmp_path / "c", state)
    for path in ("params/w", "params/b", "opt/mu", "opt/nu", "flags", "bytes8"):
        keys = path.split("/")
        a, b = state, back
        for k in keys:
            a, b = a[k], b[k]
        assert_bit_equal(b, a)
    assert back["opt"]["count"] == 5 and back["step"] == 11
    assert_bit_equal(jax.random.key_data(back["rng"]), jax.random.key_data(state["rng"]))
    name = compression if isinstance(compression, str) else compression[0]
    leaves = _leaves(tmp_path / "c")
    assert {p: leaf["codec"] for p, leaf in leaves.items() if leaf["kind"] != "value"} == {
        p: name for p in ("params/w", "params/b", "opt/mu", "opt/nu", "opt/count", "flags", "bytes8", "rng")}
    level = _codecs.codec(compression).level
    assert leaves["params/w"]["codec_config"] == (
        {"level": level, "checksum": False} if name == "zstd" else
        {"cname": "lz4", "clevel": level, "shuffle": "shuffle", "typesize": 4, "blocksize": 0})
    assert jaxckpt.verify(tmp_path / "c").ok


def test_all_zero_chunks_cost_nothing_and_negative_zero_is_kept(tmp_path):
    state = {"mu": sharded(np.zeros((256, 128), np.float32), (4,), ("x",), ("x", None)),
             "neg": np.full((64,), -0.0, np.float32), "w": np.arange(4096, dtype=np.float32)}
    jaxckpt.save(tmp_path / "c", state, compression="zstd")
    leaves = _leaves(tmp_path / "c")
    assert leaves["mu"]["sizes"] == [0] * len(leaves["mu"]["runs"]) and len(leaves["mu"]["runs"]) == 4
    assert leaves["neg"]["sizes"][0] > 0  # -0.0 is not all-zero bytes: stored
    back = jaxckpt.restore(tmp_path / "c")
    assert_bit_equal(back["mu"], np.zeros((256, 128), np.float32))
    assert np.signbit(back["neg"]).all() and not back["neg"].any()
    assert_bit_equal(back["w"], state["w"])
    info = jaxckpt.metadata(tmp_path / "c").tree
    assert (info["mu"].codec, info["mu"].stored_bytes, info["mu"].nbytes) == ("zstd", 0, 256 * 128 * 4)
    assert info["w"].stored_bytes == leaves["w"]["sizes"][0] < 4096 * 4  # an arange compresses


def test_a_mapping_compresses_only_what_it_matches_first_match_wins(tmp_path):
    state = _state()
    jaxckpt.save(tmp_path / "c", state, compression={"opt/nu": "raw", "opt/*": ("zstd", 5), "params/w": "blosc"})
    leaves = _leaves(tmp_path / "c")
    got = {p: leaf["codec"] for p, leaf in leaves.items() if leaf["kind"] != "value"}
    assert got == {"params/w": "blosc", "params/b": "raw", "opt/mu": "zstd", "opt/nu": "raw",
                   "opt/count": "zstd", "flags": "raw", "bytes8": "raw", "rng": "raw"}
    assert "sizes" not in leaves["opt/nu"] and "codec_config" not in leaves["opt/nu"]
    back = jaxckpt.restore(tmp_path / "c", state)
    assert_bit_equal(back["opt"]["nu"], state["opt"]["nu"])
    assert_bit_equal(back["params"]["w"], state["params"]["w"])


def test_compressed_leaves_restore_onto_another_layout(tmp_path):
    w = np.random.default_rng(1).standard_normal((256, 128)).astype(np.float32)
    jaxckpt.save(tmp_path / "c", {"w": sharded(w, (4, 2), ("a", "b"), ("a", "b"))}, compression="zstd")
    target = {"w": jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=NamedSharding(mesh((2, 2), ("p", "q")),
                                                                                 P(None, ("p", "q"))))}
    back = jaxckpt.restore(tmp_path / "c", target)
    assert back["w"].sharding == target["w"].sharding
    assert_bit_equal(back["w"], w)
    view = jaxckpt.open(tmp_path / "c")
    assert_bit_equal(view["w"][100:140, 30:100], w[100:140, 30:100])  # a slice across chunks
    assert view["w"].codec == "zstd" and 0 < view["w"].stored_nbytes <= w.nbytes + 8 * 4096


def test_a_flipped_byte_names_the_leaf_and_chunk(tmp_path):
    w = np.random.default_rng(2).standard_normal((256, 128)).astype(np.float32)
    jaxckpt.save(tmp_path / "c", {"w": sharded(w, (4,), ("x",), ("x", None)), "s": np.arange(3.0)},
                 compression="zstd")
    leaf = _leaves(tmp_path / "c")["w"]
    process, first, _, offset = leaf["runs"][2]
    with open(tmp_path / "c" / "data" / f"p{process}.0", "r+b") as f:
        f.seek(offset + 20)
        byte = f.read(1)
        f.seek(offset + 20)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(jaxckpt.CorruptCheckpointError, match=r"leaf 'w' chunk cell \[2, 0\] could not be read: "
                                                             r"DATA_LOSS: .*digest mismatch"):
        jaxckpt.restore(tmp_path / "c")
    report = jaxckpt.verify(tmp_path / "c")
    assert [(p["leaf"], p["chunk"]) for p in report.problems] == [("w", "cell [2, 0]")]
    assert_bit_equal(jaxckpt.restore(tmp_path / "c", partial=True, target={"s": np.zeros(3)})["s"], np.arange(3.0))


def test_an_entry_that_does_not_decode_is_corrupt_not_a_crash(tmp_path):
    # the checksum matches (recomputed), the payload is not a zstd frame: the decoder's error
    import crc32c

    jaxckpt.save(tmp_path / "c", {"w": np.arange(1000, dtype=np.float32)}, compression="zstd")
    leaf = _leaves(tmp_path / "c")["w"]
    size, offset = leaf["sizes"][0], leaf["runs"][0][3]
    junk = bytes(i % 251 for i in range(size - 4))
    with open(tmp_path / "c" / "data" / "p0.0", "r+b") as f:
        f.seek(offset)
        f.write(junk + crc32c.crc32c(junk).to_bytes(4, "little"))
    with pytest.raises(jaxckpt.CorruptCheckpointError, match=r"leaf 'w' chunk cell \[0\] could not be read: the zstd "
                                                             r"entry does not decode"):
        jaxckpt.restore(tmp_path / "c")


_BLOSC_BYTES = {"cname": "lz4", "clevel": 5, "shuffle": "noshuffle", "typesize": 1, "blocksize": 0}


def _blosc_bomb(length, declared):
    """A blosc entry of ``length`` bytes whose header declares ``declared`` decoded bytes
    and that decodes to them: every block of its table is the same compressed block of ones."""
    ones = _tscodecs.encode("blosc", _BLOSC_BYTES, np.ones(1 << 18, np.uint8))  # two blocks
    version, lz, flags, typesize, _, block, _ = struct.unpack_from("<BBBBiii", ones)
    first, second = struct.unpack_from("<ii", ones, 16)
    k = declared // block
    body = (struct.pack("<BBBBiii", version, lz, flags, typesize, k * block, block, length)
            + struct.pack(f"<{k}i", *[16 + 4 * k] * k) + ones[first:second])
    assert len(body) <= length
    return body + bytes(length - len(body))


def _write_entry(d, leaf, payload):
    """Put ``payload`` (and its own crc32c: only what it says is a lie) in ``leaf``'s one entry."""
    import crc32c

    offset = leaf["runs"][0][3]
    assert len(payload) == leaf["sizes"][0] - 4
    with open(os.path.join(d, "data", "p0.0"), "r+b") as f:
        f.seek(offset)
        f.write(payload + crc32c.crc32c(payload).to_bytes(4, "little"))


# A restore in a process of its own, its address space capped 1 GiB above what it holds
# after importing jaxckpt: an allocation past that fails (tensorstore then aborts the
# process with std::bad_alloc). Prints its error and its peak RSS before and after (KiB).
_RESTORE_CAPPED = """
import json, resource, sys
import jaxckpt
with open("/proc/self/status") as f:
    held = next(int(line.split()[1]) << 10 for line in f if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (held + (1 << 30), resource.RLIM_INFINITY))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    jaxckpt.restore(sys.argv[1])
    error = None
except Exception as e:
    error = [type(e).__name__, str(e)]
print("RESULT " + json.dumps({"error": error, "peak_kib": [before, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss]}))
"""


def test_a_blosc_entry_declaring_more_than_its_chunk_is_corrupt_before_any_allocation(tmp_path):
    # a 1 MiB chunk whose entry (its crc32c its own) declares 1.9 GB decoded, and decodes to them
    w = np.random.default_rng(3).integers(0, 256, 1 << 20).astype(np.uint8)
    jaxckpt.save(tmp_path / "c", {"w": w, "s": np.arange(3.0)}, compression={"w": "blosc"})
    leaf = _leaves(tmp_path / "c")["w"]
    declared = 14495 * (1 << 17)  # 1,899,888,640 bytes
    _write_entry(tmp_path / "c", leaf, _blosc_bomb(leaf["sizes"][0] - 4, declared))
    root = os.path.dirname(os.path.dirname(os.path.abspath(jaxckpt.__file__)))
    run = subprocess.run([sys.executable, "-c", _RESTORE_CAPPED, str(tmp_path / "c")], capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, PYTHONPATH=root, JAX_PLATFORMS="cpu"))
    assert run.returncode == 0, run.stderr[-2000:]  # not aborted
    result = json.loads(next(line for line in run.stdout.splitlines() if line.startswith("RESULT "))[7:])
    why = f"the blosc entry does not decode: it declares {declared} decoded bytes, but its chunk has {1 << 20}"
    assert result["error"] == ["CorruptCheckpointError",
                               f"Checkpoint '{tmp_path / 'c'}': leaf 'w' chunk cell [0] could not be read: {why}"]
    print("peak RSS of the restore (KiB, before and after):", result["peak_kib"])
    with pytest.raises(jaxckpt.CorruptCheckpointError, match=r"leaf 'w' chunk cell \[0\] could not be read: the "
                                                             r"blosc entry does not decode: it declares 1899888640 "):
        jaxckpt.restore(tmp_path / "c")
    report = jaxckpt.verify(tmp_path / "c")
    assert not report.ok
    assert report.problems == [{"leaf": "w", "chunk": "cell [0]", "message": f"data/p0.0: {why}"}]
    assert_bit_equal(jaxckpt.restore(tmp_path / "c", partial=True, target={"s": np.zeros(3)})["s"], np.arange(3.0))


@pytest.mark.parametrize("codec, edit, message", [
    ("blosc", lambda e: e[:4] + struct.pack("<i", 4097) + e[8:], "it declares 4097 decoded bytes, "
                                                                 "but its chunk has 4096"),
    ("blosc", lambda e: e[:12] + struct.pack("<i", len(e) - 1) + e[16:], r"it declares \d+ encoded bytes, "
                                                                         r"but it has \d+"),
    ("blosc", lambda e: e[:8] + struct.pack("<i", 1 << 30) + e[12:], "it declares blocks of 1073741824 bytes, "
                                                                     "for a chunk of 4096"),
    # zstd: a frame with no content size (descriptor 0: a window byte follows), one that lies
    ("zstd", lambda e: b"\x28\xb5\x2f\xfd\x00\x50" + e[8:], "its frame does not declare its decoded size"),
    ("zstd", lambda e: b"\x28\xb5\x2f\xfd\x80\x50" + struct.pack("<I", 1 << 30) + e[8:],
     "it declares 1073741824 decoded bytes, but its chunk has 4096"),
    ("zstd", lambda e: b"\x00" + e[1:], "it does not start with a zstd frame"),
])
def test_a_codec_header_that_disagrees_with_its_chunk_is_corrupt(tmp_path, codec, edit, message):
    w = np.random.default_rng(8).integers(0, 4, 4096).astype(np.uint8)
    jaxckpt.save(tmp_path / "c", {"w": w}, compression=codec)
    leaf = _leaves(tmp_path / "c")["w"]
    with open(tmp_path / "c" / "data" / "p0.0", "rb") as f:
        f.seek(leaf["runs"][0][3])
        entry = f.read(leaf["sizes"][0] - 4)
    hostile = edit(entry)
    _write_entry(tmp_path / "c", leaf, hostile[:len(entry)] + bytes(max(0, len(entry) - len(hostile))))
    with pytest.raises(jaxckpt.CorruptCheckpointError, match=r"leaf 'w' chunk cell \[0\] could not be read: the "
                             + codec + " entry does not decode: " + message):
        jaxckpt.restore(tmp_path / "c")
    report = jaxckpt.verify(tmp_path / "c")
    assert [(p["leaf"], p["chunk"]) for p in report.problems] == [("w", "cell [0]")]
    assert report.problems[0]["message"].startswith(f"data/p0.0: the {codec} entry does not decode: ")


@pytest.mark.parametrize("name, payload, message", [
    ("blosc", bytes(10), "the blosc entry does not decode: it has 10 bytes, less than its 16-byte header"),
    ("zstd", b"\x28\xb5\x2f\xfd\x80", "the zstd entry does not decode: it does not start with a zstd frame"),
    ("zstd", b"\x28\xb5\x2f\xfd\x80\x50\x00", "the zstd entry does not decode: it has 7 bytes, less than its frame "
                                                "header"),
])
def test_short_entries_are_refused_before_tensorstore_sees_them(name, payload, message):
    config = _codecs.codec(name).config(1)
    with pytest.raises(ValueError) as e:
        _tscodecs.decode(name, config, np.frombuffer(payload, np.uint8), (4096,), np.dtype(np.uint8))
    assert str(e.value) == message


def _edit_manifest(d, fn):
    path = os.path.join(d, "manifest.json")
    with open(path) as f:
        doc = json.load(f)
    fn({leaf["path"]: leaf for leaf in doc["leaves"]})
    doc.pop("checksum")
    with open(path, "w") as f:
        json.dump(doc, f)


@pytest.mark.parametrize("edit, message", [
    (lambda ls: ls["w"].update(sizes=[1 << 40]), r"leaf 'w': size 1099511627776 of chunk 0 is not 0 or from 5 to "),
    (lambda ls: ls["w"].update(sizes=[]), r"leaf 'w': sizes is not a list of its 1 chunks' entry sizes"),
    (lambda ls: ls["w"].pop("sizes"), r"leaf 'w': sizes is not a list of its 1 chunks' entry sizes"),
    (lambda ls: ls["w"]["codec_config"].update(level=99), r"leaf 'w': codec_config .* is not one jaxckpt writes "
                                                          r"for zstd"),
    (lambda ls: ls["w"]["codec_config"].update(checksum=True), r"is not one jaxckpt writes for zstd"),
    (lambda ls: ls["s"].update(sizes=[8]), r"leaf 's': sizes with codec 'raw'"),
    (lambda ls: ls["s"].update(codec_config={"level": 3}), r"leaf 's': codec_config with codec 'raw'"),
    (lambda ls: ls["w"]["runs"][0].__setitem__(3, 1 << 20), r"leaf 'w': run #0 \[0, 0, 1, 1048576\]: its entry ends "
                                                            r"at byte \d+, past the end of process 0's stream"),
    (lambda ls: ls["w"]["runs"][0].__setitem__(3, 3), r"offset 3 is not a non-negative multiple of 64"),
])
def test_hostile_compressed_records_are_refused(tmp_path, edit, message):
    jaxckpt.save(tmp_path / "c", {"w": np.arange(1000, dtype=np.float32), "s": np.arange(2.0)},
                 compression={"w": "zstd"})
    _edit_manifest(tmp_path / "c", edit)
    with pytest.raises(jaxckpt.CorruptCheckpointError, match=message):
        jaxckpt.restore(tmp_path / "c")


def test_overlapping_compressed_entries_are_refused(tmp_path):
    jaxckpt.save(tmp_path / "c", {"a": np.arange(1000, dtype=np.float32), "b": np.arange(999, dtype=np.float32)},
                 compression="zstd")

    def overlap(ls):
        ls["b"]["runs"][0][3] = ls["a"]["runs"][0][3]

    _edit_manifest(tmp_path / "c", overlap)
    with pytest.raises(jaxckpt.CorruptCheckpointError, match=r"leaf '.': run #0 \(bytes 0\.\.\d+\) overlaps leaf"):
        jaxckpt.restore(tmp_path / "c")


@pytest.mark.parametrize("value, message", [
    ("lz4", "compression: 'lz4' is not a codec: use one of zstd, blosc (or (name, level)), or 'raw'"),
    (("zstd", 0), "compression: level 0 of zstd is not an int from 1 to 22"),
    (("blosc", 10), "compression: level 10 of blosc is not an int from 0 to 9"),
    (("zstd", True), "compression: level True of zstd is not an int from 1 to 22"),
    ({}, "compression: an empty mapping (give None for no compression)"),
    ({"opt/*": "gzip"}, "compression['opt/*']: 'gzip' is not a codec"),
    ({3: "zstd"}, "compression: pattern 3 is not a non-empty str"),
])
def test_bad_compression_arguments_are_clear_errors_and_write_nothing(tmp_path, value, message):
    with pytest.raises(ValueError) as e:
        jaxckpt.save(tmp_path / "c", {"w": np.ones(4)}, compression=value)
    assert str(e.value).startswith(message)
    assert not os.path.exists(tmp_path / "c")


@pytest.mark.format1
def test_compression_needs_format_3(tmp_path):
    with pytest.raises(jaxckpt.CheckpointError, match=r"compression= is not supported with JAXCKPT_FORMAT=1 "
                                                      r"\(compression needs format 3\)"):
        jaxckpt.save(tmp_path / "c", {"w": np.ones(4)}, compression="zstd")
    assert not os.path.exists(tmp_path / "c")


def test_show_and_the_notebook_view_give_codec_and_stored_size(tmp_path):
    state = {"opt": {"mu": np.zeros((256, 256), np.float32)}, "w": np.ones((64, 64), np.float32)}
    jaxckpt.save(tmp_path / "c", state, compression={"opt/*": "zstd"})
    out = subprocess.run([sys.executable, "-m", "jaxckpt", "show", str(tmp_path / "c")], capture_output=True,
                         text=True, check=True).stdout.splitlines()
    assert out[0] == f"{tmp_path / 'c'}: 2 leaves, 272.0 KiB (16.0 KiB stored, zstd), format version 3"
    assert "opt/mu  float32[256, 256]  host  256.0 KiB (zstd: 0 B stored)" in out
    view = jaxckpt.open(tmp_path / "c")
    assert {p: (view[p].codec, view[p].stored_nbytes, view[p].nbytes) for p in view.keys()} == {
        "opt/mu": ("zstd", 0, 256 * 256 * 4), "w": ("raw", 64 * 64 * 4 + 4, 64 * 64 * 4)}
    html = view._repr_html_()
    assert '<span title="16,388 bytes stored">(16.0 KiB stored, zstd)</span>' in html


def test_two_processes_save_compressed_and_two_restore(tmp_path):
    from test_multihost import run_job

    path = str(tmp_path / "ckpt")
    run_job(2, 2, "save", {"mesh": (4,), "names": ("x",), "spec": ["x", None], "path": path,
                           "compression": {"big": "zstd", "small": "blosc"}})
    leaves = _leaves(path)
    assert (leaves["big"]["codec"], leaves["small"]["codec"], leaves["repl"]["codec"]) == ("zstd", "blosc", "raw")
    writers = {run[0] for run in leaves["big"]["runs"]}
    assert writers == {0, 1}  # each process encoded and placed its own chunks
    restored = run_job(2, 2, "restore", {"mesh": (2, 2), "names": ("a", "b"), "spec": [None, "a"], "path": path})
    assert restored[0].get("ok") and restored[1].get("ok"), restored
    big = jaxckpt.restore(path, partial=True, target={"big": np.zeros((64, 4096), np.float32)})["big"]
    assert_bit_equal(big, np.arange(64 * 4096, dtype=np.float32).reshape(64, 4096))


def test_codec_helpers_round_trip_every_storage_dtype():
    for dtype in (np.float32, np.float64, ml_dtypes.bfloat16, np.int8, np.uint32, np.bool_):
        x = (np.random.default_rng(0).standard_normal((16, 24)) * 9).astype(dtype)
        for name in _codecs.NAMES:
            c = _codecs.codec(name)
            enc = _tscodecs.encode(name, c.config(np.dtype(dtype).itemsize), x)
            back = _tscodecs.decode(name, c.config(np.dtype(dtype).itemsize), enc, x.shape, np.dtype(dtype))
            assert_bit_equal(back, x)
    assert _tscodecs.encode("zstd", {"level": 3, "checksum": False}, jnp.zeros(8).__array__()) is None


# ml_dtypes' narrow types, several of which numpy spells alike (``dtype.str`` is ``'<V1'``
# for int4 and most float8 types): each must be encoded and decoded as itself.
_NARROW = [n for n in ("int4", "uint4", "int2", "uint2", "float4_e2m1fn", "float8_e3m4", "float8_e4m3",
                       "float8_e4m3b11fnuz", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
                       "float8_e8m0fnu") if n in _dtypes.DTYPES]


def _narrow_values(name, rng, shape=(256, 256)):
    dtype = _dtypes.DTYPES[name]
    if dtype.kind in "iuV" and name.startswith(("int", "uint")):
        info = ml_dtypes.iinfo(dtype)
        return rng.integers(int(info.min), int(info.max) + 1, shape).astype(dtype)
    return (rng.standard_normal(shape) * 3).astype(dtype)


def _narrow_state(names, shape=(256, 256)):
    rng = np.random.default_rng(5)
    return {f"{i:02d}_{name}": _narrow_values(name, rng, shape) for i, name in enumerate(names)}  # saved in order


def _check_narrow_round_trip(where, state):
    back = jaxckpt.restore(where)
    assert sorted(back) == sorted(state)
    for k, v in state.items():
        assert_bit_equal(back[k], v)
    int4 = next(k for k in state if k.endswith("int4"))
    assert_bit_equal(jaxckpt.open(where)[int4][...], state[int4])  # the int4 leaf read alone
    alone = jaxckpt.restore(where, partial=True, target={int4: np.zeros_like(state[int4])})
    assert_bit_equal(alone[int4], state[int4])
    report = jaxckpt.verify(where)
    assert (report.ok, report.problems) == (True, [])


@pytest.mark.parametrize("compression", ["zstd", "blosc"])
@pytest.mark.parametrize("pair", [(a, b) for n in ("int4", "uint4") for f in _NARROW if f.startswith("float8")
                                  for a, b in ((n, f), (f, n))], ids="-".join)
def test_int4_and_float8_leaves_compress_side_by_side_bit_for_bit(tmp_path, monkeypatch, compression, pair):
    # one thread encodes (and one decodes) every leaf: the second leaf's dtype meets the
    # first one's scratch array (on c1abc6a: a failed save, or wrong values and verify ok)
    monkeypatch.setattr(_writer, "WRITE_THREADS", 1)
    monkeypatch.setattr(_reader, "DIRECT_READ_THREADS", 1)
    state = _narrow_state(pair, (64, 64))
    jaxckpt.save(tmp_path / "c", state, compression=compression)
    _check_narrow_round_trip(tmp_path / "c", state)


@pytest.mark.parametrize("reverse", [False, True], ids=["int4-first", "int4-last"])
def test_every_narrow_dtype_compresses_beside_the_others(tmp_path, monkeypatch, reverse):
    monkeypatch.setattr(_writer, "WRITE_THREADS", 1)
    monkeypatch.setattr(_reader, "DIRECT_READ_THREADS", 1)
    state = _narrow_state(_NARROW[::-1] if reverse else _NARROW)
    jaxckpt.save(tmp_path / "c", state, compression="zstd")
    _check_narrow_round_trip(tmp_path / "c", state)


def test_int4_and_float8_leaves_compress_side_by_side_on_an_object_store(s3_server, monkeypatch):
    monkeypatch.setattr(_writer, "WRITE_THREADS", 1)
    monkeypatch.setattr(_reader, "REMOTE_READ_THREADS", 1)
    state = _narrow_state(_NARROW)
    spec = s3_server("compression/narrow")
    jaxckpt.save(spec, state, compression="zstd")
    _check_narrow_round_trip(spec, state)


def test_one_thread_encodes_and_decodes_every_narrow_dtype_as_itself():
    rng = np.random.default_rng(9)
    chunks = {name: _narrow_values(name, rng, (32, 16)).view(_dtypes.DTYPES[_dtypes.storage_dtype_name(name)])
              for name in _NARROW}  # as the writer hands them over: the storage dtype
    for codec in _codecs.NAMES:
        config = _codecs.codec(codec).config(1)
        encoded = {name: _tscodecs.encode(codec, config, x) for name, x in chunks.items()}
        for name in [*_NARROW, *_NARROW[::-1]]:
            x = chunks[name]
            assert_bit_equal(_tscodecs.decode(codec, config, encoded[name], x.shape, x.dtype), x)


@pytest.mark.parametrize("compression", ["zstd", "blosc"])
def test_complex_leaves_compress_bit_for_bit_and_zero_chunks_cost_nothing(tmp_path, compression):
    rng = np.random.default_rng(4)
    c64 = (rng.standard_normal((256, 48)) + 1j * rng.standard_normal((256, 48))).astype(np.complex64)
    state = {"c64": sharded(c64, (4,), ("x",), ("x", None)),
             "c128": (rng.standard_normal(300) + 1j * rng.standard_normal(300)).astype(np.complex128),
             "zeros": np.zeros((64, 8), np.complex128),
             "negzero": np.full(16, complex(-0.0, 0.0), np.complex64)}
    jaxckpt.save(tmp_path / "c", state, compression=compression)
    leaves = _leaves(tmp_path / "c")
    assert {p: leaf["codec"] for p, leaf in leaves.items()} == dict.fromkeys(state, compression)
    assert leaves["zeros"]["sizes"] == [0] and leaves["negzero"]["sizes"][0] > 0
    back = jaxckpt.restore(tmp_path / "c")
    for k, v in state.items():
        assert_bit_equal(back[k], v)
    assert np.signbit(back["negzero"].real).all()
    assert jaxckpt.verify(tmp_path / "c").ok


# --- quantize (lossy, opt-in) ---------------------------------------------------------


def _adam_like():
    rng = np.random.default_rng(11)
    return {"params": {"w": rng.standard_normal((256, 300)).astype(np.float32)},
            "opt": {"mu": sharded((rng.standard_normal((256, 300)) * 1e-3).astype(np.float32), (4,), ("x",),
                                  ("x", None)),
                    "nu": (rng.standard_normal((256, 300)) ** 2 * 1e-6).astype(ml_dtypes.bfloat16),
                    "count": np.int32(4)}}


def test_quantized_moments_come_back_within_their_bounds_params_exact(tmp_path):
    from jaxckpt import _quantize

    state = _adam_like()
    jaxckpt.save(tmp_path / "c", state, quantize={"opt/mu": "int8", "opt/nu": "int4"}, compression={"params/*": "zstd"})
    leaves = _leaves(tmp_path / "c")
    assert (leaves["opt/mu"]["codec"], leaves["opt/nu"]["codec"], leaves["params/w"]["codec"]) == ("int8", "int4", "zstd")
    mu_chunk = tuple(leaves["opt/mu"]["chunk_shape"])
    assert leaves["opt/mu"]["entry_bytes"] == _quantize.encoded_nbytes(mu_chunk, "int8") + 4
    back = jaxckpt.restore(tmp_path / "c", state)
    assert_bit_equal(back["params"]["w"], state["params"]["w"])
    mu, mu0 = np.asarray(back["opt"]["mu"]), np.asarray(state["opt"]["mu"])
    assert back["opt"]["mu"].sharding == state["opt"]["mu"].sharding and mu.dtype == np.float32
    # within half a step of each block's scale (absmax / 127), so of the largest block's; not exact
    assert np.abs(mu - mu0).max() <= np.abs(mu0).max() / 254 * 1.001 and not np.array_equal(mu, mu0)
    nu, nu0 = back["opt"]["nu"].astype(np.float32), state["opt"]["nu"].astype(np.float32)
    assert back["opt"]["nu"].dtype == ml_dtypes.bfloat16
    assert ((nu > 0) == (nu0 > 0)).all()  # a positive second moment never comes back as 0
    assert back["opt"]["count"] == 4
    assert jaxckpt.verify(tmp_path / "c").ok
    view = jaxckpt.open(tmp_path / "c")
    assert view["opt/mu"].stored_nbytes < mu0.nbytes * 0.3 and view["opt/nu"].stored_nbytes < nu0.size * 2 * 0.3


@pytest.mark.parametrize("quantize, message", [
    ({"params/*": "int8"}, "quantize=: leaf 'params/w' is under 'params'; only optimizer moments may be quantized"),
    ({"opt/*": "int8"}, "quantize=: leaf 'opt/count' is int32; int8 stores only float32, bfloat16, float16"),
    ({"opt/mu": "int2"}, "quantize="),
    ("int8", "quantize= takes None, a mapping"),
])
def test_quantize_refuses_what_it_cannot_store_and_writes_nothing(tmp_path, quantize, message):
    with pytest.raises((ValueError, TypeError)) as e:
        jaxckpt.save(tmp_path / "c", _adam_like(), quantize=quantize)
    assert str(e.value).startswith(message), str(e.value)
    assert not os.path.exists(tmp_path / "c")


def _nested_adam_state():
    """docs/compression.md's state (params, an optax Adam state, a step) one level down."""
    import optax

    params = {"dense": {"kernel": jnp.ones((64, 32)), "bias": jnp.zeros(32)}}
    return {"state": {"params": params, "opt_state": optax.adam(1e-3).init(params), "step": 0}}


DOCS_RULES = {"opt_state/*/mu/*": "int8", "opt_state/*/nu/*": "int4"}  # docs/compression.md's at c1abc6a
DOCS_REFUSAL = ("quantize= pattern 'opt_state/*/mu/*' matches no array leaf of the state (nothing would be stored "
                "quantized); the nearest key paths: 'state/opt_state/0/mu/dense/bias', "
                "'state/opt_state/0/mu/dense/kernel'; 'state/opt_state/*/mu/*' would match 2 leaves")


def test_a_pattern_that_matches_no_leaf_fails_the_save_naming_what_would_match(tmp_path):
    # issue 31: on c1abc6a the docs' own patterns, on the state nested one level down,
    # matched nothing and the save stored every leaf exactly without a word
    with pytest.raises(ValueError) as e:
        jaxckpt.save(tmp_path / "c", _nested_adam_state(), quantize=DOCS_RULES)
    assert str(e.value) == DOCS_REFUSAL
    assert not os.path.exists(tmp_path / "c")
    rules = {"*/mu/*": "int8", "*/nu/*": "int4"}  # the docs' patterns now: wherever the state sits
    for name, state in (("flat", _nested_adam_state()["state"]), ("nested", _nested_adam_state())):
        jaxckpt.save(tmp_path / name, state, quantize=rules)
        codecs = {p: leaf["codec"] for p, leaf in _leaves(tmp_path / name).items() if leaf["kind"] == "array"}
        pre = "state/" if name == "nested" else ""
        assert codecs == {f"{pre}params/dense/kernel": "raw", f"{pre}params/dense/bias": "raw",
                          f"{pre}opt_state/0/count": "raw",
                          f"{pre}opt_state/0/mu/dense/kernel": "int8", f"{pre}opt_state/0/mu/dense/bias": "int8",
                          f"{pre}opt_state/0/nu/dense/kernel": "int4", f"{pre}opt_state/0/nu/dense/bias": "int4"}


def test_a_manager_refuses_a_pattern_that_matches_nothing_before_writing(tmp_path):
    with jaxckpt.CheckpointManager(tmp_path / "m", quantize=DOCS_RULES, async_save=True) as mgr:
        with pytest.raises(ValueError) as e:
            mgr.save(0, _nested_adam_state())
        assert str(e.value) == DOCS_REFUSAL
        mgr.wait_until_finished()
        assert mgr.all_steps() == [] and mgr.latest_step() is None
    assert sorted(n for n in os.listdir(tmp_path / "m") if n[:1].isdigit()) == []


def test_params_nested_at_any_depth_are_never_quantized(tmp_path):
    # issue 31: on c1abc6a only a top-level 'params' key was guarded
    with pytest.raises(ValueError) as e:
        jaxckpt.save(tmp_path / "c", _nested_adam_state(), quantize={"*kernel": "int8"})
    assert str(e.value) == ("quantize=: leaf 'state/params/dense/kernel' is under 'params'; only optimizer moments "
                            "may be quantized, never params: narrow the pattern that matched it")
    assert not os.path.exists(tmp_path / "c")


def test_nnx_params_are_never_quantized_and_nnx_moments_are(tmp_path):
    import optax
    from flax import nnx

    model = nnx.Linear(64, 32, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    state = {"model": nnx.state(model), "opt": nnx.state(opt)}
    with pytest.raises(ValueError) as e:  # on c1abc6a: saved, the weights stored as int8
        jaxckpt.save(tmp_path / "c", state, quantize={"*kernel*": "int8"})
    assert str(e.value) == ("quantize=: leaf 'model/kernel/value' is an nnx.Param; only optimizer moments may "
                            "be quantized, never params: narrow the pattern that matched it")
    assert not os.path.exists(tmp_path / "c")
    jaxckpt.save(tmp_path / "ok", state, quantize={"*/mu/*": "int8", "*/nu/*": "int4"})
    codecs = {p: leaf["codec"] for p, leaf in _leaves(tmp_path / "ok").items() if leaf["kind"] == "array"}
    assert codecs == {"model/bias/value": "raw", "model/kernel/value": "raw", "opt/step/value": "raw",
                      "opt/opt_state/0/count/value": "raw",
                      "opt/opt_state/0/mu/bias/value": "int8", "opt/opt_state/0/mu/kernel/value": "int8",
                      "opt/opt_state/0/nu/bias/value": "int4", "opt/opt_state/0/nu/kernel/value": "int4"}


def test_a_non_finite_moment_fails_the_save_naming_the_leaf(tmp_path):
    state = _adam_like()
    state["opt"]["nu"] = state["opt"]["nu"].copy()
    state["opt"]["nu"][3, 7] = np.nan
    with pytest.raises(jaxckpt.CheckpointError, match=r"leaf 'opt/nu': quantize: .* holds 1 non-finite values"):
        jaxckpt.save(tmp_path / "c", state, quantize={"opt/nu": "int4"})
    assert not os.path.exists(tmp_path / "c")


@pytest.mark.format1
def test_quantize_needs_format_3(tmp_path):
    with pytest.raises(jaxckpt.CheckpointError, match=r"quantize= is not supported with JAXCKPT_FORMAT=1"):
        jaxckpt.save(tmp_path / "c", _adam_like(), quantize={"opt/mu": "int8"})


def test_a_manifest_claiming_a_quantized_int_leaf_is_refused(tmp_path):
    jaxckpt.save(tmp_path / "c", {"opt": {"n": np.arange(256, dtype=np.int32)}})

    def lie(ls):
        ls["opt/n"].update(codec="int8", entry_bytes=4 * 2 + 256 + 4)

    _edit_manifest(tmp_path / "c", lie)
    with pytest.raises(jaxckpt.CorruptCheckpointError, match=r"leaf 'opt/n': quantize=: leaf 'opt/n' is int32"):
        jaxckpt.restore(tmp_path / "c")


def test_the_manager_compresses_quantizes_and_stops_after_the_lossy_limit(tmp_path, caplog):
    state = _adam_like()
    q = jaxckpt.Quantize({"opt/mu": "int8", "opt/nu": "int4"}, max_lossy_resumes=2)
    with jaxckpt.CheckpointManager(tmp_path / "m", compression={"params/*": "zstd"}, quantize=q) as mgr:

        def saved(step):
            mgr.save(step, state)
            mgr.wait_until_finished()
            man = jaxckpt.metadata(tmp_path / "m" / str(step))
            codecs = (man.tree["params"]["w"].codec, man.tree["opt"]["mu"].codec, man.tree["opt"]["nu"].codec)
            return codecs, man.info.get("lossy_resumes")

        assert saved(0) == (("zstd", "int8", "int4"), 0)
        mgr.restore(0, state)  # a lossy resume: 1
        assert saved(1) == (("zstd", "int8", "int4"), 1)
        with caplog.at_level("WARNING", logger="jaxckpt"):
            mgr.restore(1, state)  # 2: the limit
        assert "2 lossy resumes (the limit, max_lossy_resumes=2): quantized leaves are saved exactly" in caplog.text
        assert saved(2) == (("zstd", "raw", "raw"), 2)  # exact from now on, the count carried
        back = mgr.restore(2, state)  # exact: still 2
        assert saved(3) == (("zstd", "raw", "raw"), 2)
        assert_bit_equal(back["params"]["w"], state["params"]["w"])
    with jaxckpt.CheckpointManager(tmp_path / "m2", quantize={"opt/mu": "int8"}, async_save=True) as mgr:
        mgr.save(0, state)
        mgr.wait_until_finished()
        assert jaxckpt.metadata(tmp_path / "m2" / "0").info["lossy_resumes"] == 0


def test_the_manager_refuses_bad_codec_options_when_made(tmp_path):
    with pytest.raises(ValueError, match=r"compression: 'lz4' is not a codec"):
        jaxckpt.CheckpointManager(tmp_path / "m", compression="lz4")
    with pytest.raises(TypeError, match=r"quantize= takes None, a mapping"):
        jaxckpt.CheckpointManager(tmp_path / "m", quantize="int8")


def test_read_once_hands_over_compressed_leaves_decoded(tmp_path):
    # two processes save with zstd; the restore reads each saved chunk once per job,
    # decodes it, and the exchange hands the decoded slices over
    from test_multihost import read_once_job

    res = read_once_job(tmp_path, read_once="1", compression="zstd")
    assert res[0]["same"] and res[1]["same"], res
    with open(tmp_path / "ckpt" / "manifest.json") as f:
        codecs = {leaf["codec"] for leaf in json.load(f)["leaves"] if leaf["kind"] != "value"}
    assert codecs == {"zstd"}


def _random_leaves(n, shape=(256, 1024)):
    """``n`` float32 leaves of random values (zstd barely shrinks them): one 1 MiB chunk each."""
    rng = np.random.default_rng(30)
    return {f"w{i:02d}": rng.standard_normal(shape, dtype=np.float32) for i in range(n)}


def test_a_compressed_save_holds_a_few_encoded_chunks_at_once_not_its_share(tmp_path, monkeypatch):
    # Issue 30, defect 3: c1abc6a encoded every chunk of the process's share first and held
    # the lot until written (here ~15 MiB of Python bytes). Now each chunk is encoded to
    # learn its size, dropped (nothing kept: ENCODED_KEEP_BYTES 0), and encoded again as
    # it is written: at most one chunk per writer thread is held, whatever the state's size.
    import tracemalloc

    from jaxckpt import _writer

    monkeypatch.setattr(_writer, "ENCODED_KEEP_BYTES", 0, raising=False)
    state = _random_leaves(16)
    chunk = 256 * 1024 * 4
    jaxckpt.save(tmp_path / "warm", {"w": state["w00"]}, compression="zstd")  # scratch arrays, threads
    tracemalloc.start()
    try:
        jaxckpt.save(tmp_path / "c", state, compression="zstd")
        _, traced = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    stored = sum(sum(leaf["sizes"]) for leaf in _leaves(tmp_path / "c").values())
    bound = _writer.WRITE_THREADS * (chunk + 4096)  # an encoded chunk is at most a little more than the chunk
    assert stored > 3 * bound  # the share is many times the bound
    assert traced < bound + (1 << 20), (traced, bound)  # Python-side buffers (the encoded bytes are bytes)
    _writer.ENCODED.reset()
    jaxckpt.save(tmp_path / "c2", state, compression="zstd")
    assert 0 < _writer.ENCODED.peak <= bound and _writer.ENCODED.now == 0, _writer.ENCODED.peak
    for d in ("c", "c2"):
        back = jaxckpt.restore(tmp_path / d)
        for k, v in state.items():
            assert_bit_equal(back[k], v)


def test_encoded_chunks_kept_for_the_write_stay_within_their_bound(tmp_path, monkeypatch):
    # a small share is encoded once (kept from sizing to writing) up to ENCODED_KEEP_BYTES,
    # the rest encoded again: the bytes held are that bound plus the chunks in flight
    from jaxckpt import _writer

    keep = 3 << 20
    monkeypatch.setattr(_writer, "ENCODED_KEEP_BYTES", keep)
    encodes = []
    real = _tscodecs.encode
    monkeypatch.setattr(_tscodecs, "encode", lambda *a: encodes.append(1) or real(*a))
    state = _random_leaves(12)
    _writer.ENCODED.reset()
    jaxckpt.save(tmp_path / "c", state, compression="zstd")
    chunk = 256 * 1024 * 4
    assert _writer.ENCODED.peak <= keep + _writer.WRITE_THREADS * (chunk + 4096), _writer.ENCODED.peak
    assert _writer.ENCODED.now == 0
    assert 12 + 1 <= len(encodes) <= 12 + 12 - 2  # some (at least 2, at most 3 of ~0.93 MiB) kept
    back = jaxckpt.restore(tmp_path / "c")
    for k, v in state.items():
        assert_bit_equal(back[k], v)


@pytest.mark.parametrize("budget_mib, pattern", [(4, "np_big"), (4, "*"), (1, "*")])
def test_a_view_beside_compressed_chunks_bigger_than_half_the_budget_does_not_hold_the_save(tmp_path, budget_mib,
                                                                                              pattern):
    """A CPU jax leaf (staged as a view: no budget) and a 6 MiB numpy leaf of 3 MiB chunks
    compressed, async, within 4 (or 1) MiB: the first wave (the view and the first chunk
    to size) is held by the writer until every chunk is sized, and held the first chunk's
    budget with it, so the second never fit: ``save`` never returned (a breaker's case).
    Now a held wave gives its sized chunks' budget back."""
    import threading

    import jax

    rng = np.random.default_rng(0)
    state = {"jx": jax.numpy.asarray(rng.standard_normal((512, 512)).astype(np.float32)),
             "np_big": rng.standard_normal((1536, 1024)).astype(np.float32)}
    mgr = jaxckpt.CheckpointManager(tmp_path / "m", compression={pattern: "zstd"}, max_staging_bytes=budget_mib << 20)
    done = threading.Event()

    def save():
        mgr.save(0, state)
        mgr.wait_until_finished()
        done.set()

    saver = threading.Thread(target=save, daemon=True)
    saver.start()
    saver.join(60)
    assert done.is_set(), "the save did not finish within 60 s"
    back = mgr.restore(0)
    mgr.close()
    for k in state:
        assert_bit_equal(back[k], np.asarray(state[k]))


@pytest.mark.parametrize("async_save", [False, True])
def test_the_manager_compresses_and_quantizes_within_max_staging_bytes(tmp_path, async_save):
    # Issue 30, defects 3 and 11: c1abc6a built this manager and then failed every save
    # ("compression= is not supported with max_staging_bytes"). The numpy leaves are
    # copied (async) or staged in waves of 2 MiB: compressed chunks are staged twice (to be
    # sized, then written), raw, all-zero and quantized ones once; every value comes back
    from jaxckpt import _writer

    state = _random_leaves(6)
    state["zeros"] = np.zeros((256, 1024), np.float32)
    state["ints"] = np.arange(256 * 1024, dtype=np.int32).reshape(256, 1024)
    state["nu"] = np.abs(_random_leaves(1)["w00"]) + 1e-3
    state["dev"] = sharded(_random_leaves(1, (512, 1024))["w00"], (4,), ("x",), ("x", None))
    budget = 2 << 20
    with jaxckpt.CheckpointManager(tmp_path / "m", compression={"w*": "zstd", "zeros": "zstd", "dev": "blosc"},
                                   quantize={"nu": "int8"}, max_staging_bytes=budget, async_save=async_save) as mgr:
        mgr.save(1, state)
        mgr.wait_until_finished()
        _writer.ENCODED.reset()
        mgr.save(2, state)
        mgr.wait_until_finished()
        assert mgr._staging.peak <= budget and mgr._staging.in_flight == 0
        assert _writer.ENCODED.now == 0 and _writer.ENCODED.peak <= _writer.WRITE_THREADS * ((1 << 20) + 4096)
        for step in (1, 2):
            back = mgr.restore(step)
            for k in state:
                if k == "nu":
                    assert np.abs(back[k] - state[k]).max() <= np.abs(state[k]).max() / 254 * 1.001  # int8's bound
                else:
                    assert_bit_equal(back[k], state[k])
    leaves = _leaves(tmp_path / "m" / "2")
    assert {k: leaves[k]["codec"] for k in ("w00", "zeros", "ints", "nu", "dev")} == {
        "w00": "zstd", "zeros": "zstd", "ints": "raw", "nu": "int8", "dev": "blosc"}
    assert leaves["zeros"]["sizes"] == [0]  # all zero: stored nowhere
    assert jaxckpt.verify(tmp_path / "m" / "2").ok


@pytest.mark.parametrize("point,nth", [("encode", 3), ("encode", 9), ("write", 2)])
def test_a_compressed_save_in_waves_that_fails_gives_its_budget_and_encoded_bytes_back(tmp_path, point, nth):
    # a failure while sizing (encode 3 of 6), while writing (encode 9: the second pass) or
    # at a write: the waves held for the stream are freed, nothing encoded stays counted,
    # and the next save of the same manager commits
    from jaxckpt import _storage, _writer

    state = _random_leaves(6)
    hits = []

    def hook(op, key):
        if op == point:
            hits.append(key)
            if len(hits) == nth:
                raise OSError("injected")

    with jaxckpt.CheckpointManager(tmp_path / "m", compression="zstd", max_staging_bytes=2 << 20) as mgr:
        _storage.fault_hook = hook
        try:
            mgr.save(0, state)
            with pytest.raises(jaxckpt.CheckpointError, match=r"failed: .*injected"):
                mgr.wait_until_finished()
        finally:
            _storage.fault_hook = None
        assert mgr._staging.in_flight == 0 and _writer.ENCODED.now == 0
        mgr.save(1, state)
        mgr.wait_until_finished()
        assert mgr.all_steps() == [1]
        back = mgr.restore(1)
    for k, v in state.items():
        assert_bit_equal(back[k], v)


def _zstd_of_ones(nbytes):
    """A zstd frame of ``nbytes`` bytes of 1 that declares its content size: run-length
    blocks of at most 128 KiB, 4 bytes each (4 GiB in 128 KiB)."""
    block, blocks, left = 1 << 17, [], nbytes
    while left:
        n = min(block, left)
        left -= n
        blocks.append(((n << 3) | (1 << 1) | int(not left)).to_bytes(3, "little") + b"\x01")
    return b"\x28\xb5\x2f\xfd" + bytes([(3 << 6) | 0x20]) + nbytes.to_bytes(8, "little") + b"".join(blocks)


_READ_CAPPED = """
import json, resource, sys
import jaxckpt
with open("/proc/self/status") as f:
    held = next(int(line.split()[1]) << 10 for line in f if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (held + (1 << 30), resource.RLIM_INFINITY))
out = {}
report = jaxckpt.verify(sys.argv[1])
out["verify"] = [p["message"] for p in report.problems]
try:
    out["open"] = jaxckpt.open(sys.argv[1])["w"][:4].tolist()
except Exception as e:
    out["open"] = [type(e).__name__, str(e)]
print("RESULT " + json.dumps(out))
"""


def test_a_chunk_declared_bigger_than_memory_allows_fails_verify_and_open_with_an_error_not_an_abort(tmp_path):
    """A 130 KB file whose manifest declares one 4 GiB zstd chunk of ones (a true one: it
    decodes to exactly that). verify and open, with 1 GiB of address space left, hit a
    failed allocation inside tensorstore's decoder: the process aborted (std::bad_alloc,
    no Python error; a breaker's case). Now numpy asks for the chunk first and the
    failure is an error naming the leaf."""
    import crc32c

    size = 4 << 30
    payload = _zstd_of_ones(size)
    entry = payload + crc32c.crc32c(payload).to_bytes(4, "little")
    d = tmp_path / "bomb"
    os.makedirs(d / "data")
    (d / "data" / "p0.0").write_bytes(entry)
    man = {"format": "jaxckpt", "format_version": 3, "library_version": "0.1.0", "jax_version": "0.10.2",
           "tensorstore_version": "0.1.86", "created": "2026-12-04T17:12:17+00:00", "created_unix": 1796404337.0,
           "bytes": size, "write_seconds": 0.01, "process_count": 1, "segment_bytes": 1 << 30,
           "streams": {"0": len(entry)}, "packed": [], "metadata": {}, "structure": {"dict": [["w", {"leaf": 0}]]},
           "leaves": [{"path": "w", "kind": "array", "dtype": "uint8", "shape": [size], "sharding": None,
                       "store": "stream", "chunk_shape": [size], "nbytes": size, "codec": "zstd",
                       "entry_bytes": size + 4, "runs": [[0, 0, 1, 0]], "codec_config": {"level": 3, "checksum": False},
                       "sizes": [len(entry)]}]}
    (d / "manifest.json").write_text(json.dumps(man))
    root = os.path.dirname(os.path.dirname(os.path.abspath(jaxckpt.__file__)))
    run = subprocess.run([sys.executable, "-c", _READ_CAPPED, str(d)], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=root, JAX_PLATFORMS="cpu"))
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
    out = json.loads(next(ln for ln in run.stdout.splitlines() if ln.startswith("RESULT "))[7:])
    assert out["verify"] == [f"data/p0.0: leaf 'w': could not allocate {2 * size} bytes to decode a chunk"], out
    assert out["open"] == ["CheckpointError", f"Checkpoint '{d}': leaf 'w': could not allocate {2 * size} bytes to "
                           "decode a chunk"], out
