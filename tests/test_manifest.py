"""The manifest is untrusted input: every bad field is refused with a clear error."""

import json
import os

import numpy as np
import pytest

import jaxckpt
from jaxckpt import _manifest
from jaxckpt._storage import location as _location


@pytest.fixture
def saved(ckpt):
    jaxckpt.save(ckpt, {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "big": np.zeros(1 << 19, np.float32),
                        "step": 4})
    return ckpt


def _rewrite(ckpt, fn):
    path = ckpt / "manifest.json"
    doc = json.loads(path.read_text())
    fn(doc)
    path.write_text(json.dumps(doc))


def _leaf(doc, path):
    return next(r for r in doc["leaves"] if r["path"] == path)


BAD = {
    "escape_key": (lambda d: _leaf(d, "big").update(key="../../etc"), "not a relative path inside"),
    "absolute_key": (lambda d: _leaf(d, "big").update(key="/etc/passwd"), "not a relative path inside"),
    "huge_shape": (lambda d: _leaf(d, "w").update(shape=[1 << 40, 1 << 40]), "nbytes"),
    "negative_dim": (lambda d: _leaf(d, "w").update(shape=[-3, 4]), "shape"),
    "nbytes_lie": (lambda d: _leaf(d, "w").update(nbytes=4), "nbytes 4 does not equal"),
    "bad_dtype": (lambda d: _leaf(d, "w").update(dtype="object"), "unknown dtype 'object'"),
    "bad_kind": (lambda d: _leaf(d, "w").update(kind="pickle"), "unknown kind 'pickle'"),
    "chunk_rank": (lambda d: _leaf(d, "w").update(chunk_shape=[3]), "chunk_shape"),
    "zero_chunk": (lambda d: _leaf(d, "w").update(chunk_shape=[0, 4]), "chunk_shape"),
    "too_many_chunks": (lambda d: _leaf(d, "big").update(shape=[1 << 21], nbytes=4 << 21, chunk_shape=[1]),
                        "chunks is too many"),
    "bad_version": (lambda d: d.update(format_version=99), "format_version 99 is not supported"),
    "not_ours": (lambda d: d.update(format="orbax"), "not a jaxckpt manifest"),
    "bad_structure": (lambda d: d.update(structure={"leaf": 7}), "structure references leaf 7"),
    "unreferenced_leaf": (lambda d: d.update(structure={"dict": [["w", {"leaf": d["leaves"].index(_leaf(d, "w"))}]]}),
                          "does not reference every leaf"),
    "leaf_elsewhere": (lambda d: d.update(structure={"dict": [["big", {"leaf": 1}], ["step", {"leaf": 0}],
                                                              ["w", {"leaf": 2}]]}),
                       "structure puts leaf #0 at 'step', but its record's path is 'big'"),
    "bad_value": (lambda d: _leaf(d, "step").update(value={"x": 1}), "inline value of type dict"),
    "chunk_of_no_process": (lambda d: _leaf(d, "w").update(chunks=[[3, 0]]), "lies outside the packed data"),
    "chunk_past_the_end": (lambda d: _leaf(d, "w").update(chunks=[[0, 1 << 30]]), "lies outside the packed data"),
    "chunk_count": (lambda d: _leaf(d, "w").update(chunks=[]), "chunks do not match"),
    "packed_table": (lambda d: d.update(packed=[{"process": 5, "nbytes": 10, "chunk_bytes": 10}]),
                     "packed entry"),
    "duplicate_path": (lambda d: d["leaves"].append(dict(_leaf(d, "step"))), "duplicate leaf path 'step'"),
    # issue 12: fields a flipped byte or a hostile writer get wrong that nothing else would catch
    "value_missing": (lambda d: _leaf(d, "step").pop("value"), "leaf 'step': inline value is missing"),
    "unaligned_chunk": (lambda d: _leaf(d, "w").update(chunks=[[0, 8]]),
                        "leaf 'w': chunk [0, 8] does not start on a 64-byte boundary"),
    "packed_size_lie": (lambda d: d.update(packed=[{"process": 0, "nbytes": 128, "chunk_bytes": 128}]),
                        "packed entry of process 0: nbytes 128, but its chunks end at 64"),
    "unknown_impl": (lambda d: _leaf(d, "w").update(kind="prng_key", impl="nope", key_ndim=0),
                     "leaf 'w': unknown PRNG key implementation 'nope'"),
    "key_of_float_data": (lambda d: _leaf(d, "w").update(kind="prng_key", impl="threefry2x32", key_ndim=1,
                                                         shape=[6, 2], chunk_shape=[6, 2]),
                          "threefry2x32 keys are uint32 data of trailing shape (2,), not float32 of shape (2,)"),
    "scalar_not_bool": (lambda d: _leaf(d, "w").update(scalar="yes"), "leaf 'w': scalar 'yes'"),
    "sharding_type": (lambda d: _leaf(d, "w").update(sharding={"type": "pickled"}), "leaf 'w': sharding {'type'"),
    "mesh_size_zero": (lambda d: _leaf(d, "w").update(sharding={"type": "named", "axis_names": ["x"],
                                                                "axis_sizes": [0], "spec": ["x"]}),
                       "leaf 'w': sharding {'type': 'named'"),
    "mesh_size_str": (lambda d: _leaf(d, "w").update(sharding={"type": "named", "axis_names": ["x"],
                                                               "axis_sizes": ["2"], "spec": ["x"]}),
                      "leaf 'w': sharding {'type': 'named'"),
}


@pytest.mark.format1
@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_manifest_is_refused(saved, name):
    fn, message = BAD[name]
    _rewrite(saved, fn)
    with pytest.raises(jaxckpt.CorruptCheckpointError, match="invalid manifest") as err:
        jaxckpt.restore(saved)
    assert message in str(err.value)
    assert str(saved) in str(err.value)
    with pytest.raises(jaxckpt.CorruptCheckpointError):
        jaxckpt.metadata(saved)


def test_truncated_and_binary_manifests(saved):
    path = saved / "manifest.json"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(jaxckpt.CorruptCheckpointError, match="not JSON"):
        jaxckpt.restore(saved)
    path.write_bytes(b"\x80\x04\x95pickle")
    with pytest.raises(jaxckpt.CorruptCheckpointError, match="not JSON"):
        jaxckpt.restore(saved)


def test_round_trip_of_a_record():
    rec = _manifest.LeafRecord(path="a/b", kind="array", dtype="int4", shape=(4, 2), store="packed", key="3",
                               chunk_shape=(2, 2), storage_dtype="int4", nbytes=8, chunks=((0, 0), (0, 64)))
    structure = {"dict": [["a", {"dict": [["b", {"leaf": 0}]]}]]}
    man = _manifest.Manifest(1, structure, (rec,), {"m": 1}, 1, packed=(_manifest.PackedArray(0, 128, 128),))
    back = _manifest.parse(man.to_bytes(), "x")
    assert back.leaves == (rec,)
    assert back.packed == man.packed
    assert back.metadata == {"m": 1}


# --- limits on untrusted input (issue 8) ----------------------------------------------

BIG_INT = "9" * 5000


def _nest(depth, inner=1):
    for _ in range(depth):
        inner = [inner]
    return inner


def _with_big_int(doc_fn):
    """Put a 5,000-digit integer where ``doc_fn`` puts the marker (json cannot dump one)."""
    def edit(text):
        doc = json.loads(text)
        doc_fn(doc)
        return json.dumps(doc).replace('"@BIG@"', BIG_INT)
    return edit


def _edit_json(fn):
    def edit(text):
        doc = json.loads(text)
        fn(doc)
        return json.dumps(doc, allow_nan=True)
    return edit


HOSTILE = {
    # nesting
    "deep_lists": (lambda t: "[" * 100_000 + "]" * 100_000, "nested too deeply"),
    "deep_objects": (lambda t: '{"a":' * 100_000 + "1" + "}" * 100_000, "nested too deeply"),
    "deep_metadata": (_edit_json(lambda d: d.update(metadata={"m": _nest(150)})),
                      "field 'metadata' is nested deeper than 100 levels"),
    "deep_extra_field": (_edit_json(lambda d: d.update(notes=_nest(150))),
                         "field 'notes' is nested deeper than 100 levels"),
    "deep_structure": (_edit_json(lambda d: d.update(structure=_nest_structure(d["structure"], 150))),
                       "structure is nested deeper than 100 levels"),
    # huge integers
    "big_process_count": (_with_big_int(lambda d: d.update(process_count="@BIG@")), "integer of 5000"),
    "big_version": (_with_big_int(lambda d: d.update(format_version="@BIG@")), "integer of 5000"),
    "big_shape": (_with_big_int(lambda d: _leaf(d, "w").update(shape=["@BIG@", 4])), "integer of 5000"),
    "big_nbytes": (_with_big_int(lambda d: _leaf(d, "w").update(nbytes="@BIG@")), "integer of 5000"),
    "big_metadata": (_with_big_int(lambda d: d.update(metadata={"x": "@BIG@"})), "integer of 5000"),
    "big_inline_value": (_with_big_int(lambda d: _leaf(d, "step").update(value="@BIG@")), "integer of 5000"),
    "41_digits": (_edit_json(lambda d: d.update(metadata={"x": 10**41})), "integer of 42 characters"),
    # duplicate keys: json would keep the last one silently
    "duplicate_key": (lambda t: t.replace('"format_version":1,', '"format_version":9,"format_version":1,', 1),
                      "key 'format_version' appears twice"),
    # versions that equal 1 in Python
    "version_float": (_edit_json(lambda d: d.update(format_version=1.0)), "format_version 1.0 is not"),
    "version_true": (_edit_json(lambda d: d.update(format_version=True)), "format_version True is not"),
    "version_str": (_edit_json(lambda d: d.update(format_version="1")), "format_version '1' is not"),
    # NaN / Infinity where integers belong
    "nan_shape": (_edit_json(lambda d: _leaf(d, "w").update(shape=[float("nan"), 4])), "shape [nan, 4]"),
    "inf_chunk_shape": (_edit_json(lambda d: _leaf(d, "w").update(chunk_shape=[float("inf"), 4])),
                        "chunk_shape [inf, 4]"),
    "nan_nbytes": (_edit_json(lambda d: _leaf(d, "w").update(nbytes=float("nan"))), "nbytes nan"),
    "inf_process_count": (_edit_json(lambda d: d.update(process_count=float("-inf"))), "process_count -inf"),
    # well-formed JSON of the wrong types must not escape as TypeError
    "list_dtype": (_edit_json(lambda d: _leaf(d, "w").update(dtype=["float32"])), "TypeError"),
    # per-leaf caps
    "over_16_tib": (_edit_json(lambda d: _leaf(d, "big").update(
        shape=[(1 << 42) + 1], chunk_shape=[1 << 19], nbytes=(1 << 44) + 4)), "nbytes 17592186044420"),
    "chunk_past_its_array": (_edit_json(lambda d: _leaf(d, "big").update(chunk_shape=[1 << 20])),
                             "chunk_shape [1048576] does not fit"),
}


def _nest_structure(structure, depth):
    for _ in range(depth):
        structure = {"list": [structure]}
    return structure


@pytest.mark.format1
@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_manifest_fails_only_with_corrupt_checkpoint_error(saved, name):
    edit, message = HOSTILE[name]
    path = saved / "manifest.json"
    path.write_text(edit(path.read_text()))
    for read in (jaxckpt.restore, jaxckpt.metadata):
        with pytest.raises(jaxckpt.CorruptCheckpointError) as err:
            read(saved)
        assert type(err.value) is jaxckpt.CorruptCheckpointError
        assert f"Checkpoint '{saved}': invalid manifest" in str(err.value)
        assert message in str(err.value)
        assert len(str(err.value)) < 1000  # hostile fields are not echoed whole


def test_manifest_over_the_size_cap_is_not_read(saved, monkeypatch):
    with open(saved / "manifest.json", "r+b") as f:
        f.truncate(_manifest.MAX_MANIFEST_BYTES + 1)  # sparse: no bytes are written

    def no_read(*args):
        raise AssertionError("the manifest was read")

    monkeypatch.setattr("jaxckpt._storage.kvstore.read_blob", no_read)
    with pytest.raises(jaxckpt.CorruptCheckpointError) as err:
        jaxckpt.restore(saved)
    assert type(err.value) is jaxckpt.CorruptCheckpointError
    assert f"Checkpoint '{saved}': invalid manifest: {_manifest.MAX_MANIFEST_BYTES + 1} bytes is more than" \
        in str(err.value)
    monkeypatch.setattr(_manifest, "MAX_MANIFEST_BYTES", 100)  # the same check in parse()
    with pytest.raises(jaxckpt.CorruptCheckpointError, match="'x': invalid manifest: 101 bytes is more than"):
        _manifest.parse(b" " * 101, "x")


def test_manifest_that_is_not_a_regular_file(saved):
    path = saved / "manifest.json"
    path.unlink()
    os.mkfifo(path)  # open() of a FIFO would block forever
    with pytest.raises(jaxckpt.CorruptCheckpointError, match="manifest.json is not a regular file") as err:
        jaxckpt.restore(saved)
    assert str(saved) in str(err.value)


def test_limits_still_accept_the_largest_allowed_values(saved):
    path = saved / "manifest.json"
    doc = json.loads(path.read_text())
    doc["metadata"] = {"x": 10**40 - 1, "deep": _nest(99), "nan": float("nan")}
    doc["structure"] = _nest_structure(doc["structure"], 100 - 1)  # leaves end at depth 100
    for rec in doc["leaves"]:
        rec["path"] = "0/" * 99 + rec["path"]
    del doc["checksum"]  # edited: read as a manifest written before manifests had checksums
    path.write_text(json.dumps(doc, allow_nan=True))
    info = jaxckpt.metadata(saved)
    assert info.metadata["x"] == 10**40 - 1 and np.isnan(info.metadata["nan"])
    tree = jaxckpt.restore(saved)
    for _ in range(99):
        (tree,) = tree
    assert tree["step"] == 4


def test_inline_int_the_reader_would_refuse_fails_at_save(ckpt):
    with pytest.raises(jaxckpt.CheckpointError) as err:
        jaxckpt.save(ckpt, {"a": {"n": -(10**40)}})
    assert type(err.value) is jaxckpt.CheckpointError
    assert "Leaf 'a/n': an int of more than 40 digits cannot be saved" in str(err.value)
    assert not ckpt.exists()
    jaxckpt.save(ckpt, {"a": {"n": 10**40 - 1}})
    assert jaxckpt.restore(ckpt) == {"a": {"n": 10**40 - 1}}


def _bad_step(directory, step, text):
    (directory / str(step)).mkdir()
    (directory / str(step) / "manifest.json").write_text(text)


def test_manager_skips_and_reports_steps_with_bad_manifests(tmp_path, caplog):
    directory = tmp_path / "run"
    jaxckpt.save(directory / "3", {"w": np.arange(4.0), "step": 3})
    _bad_step(directory, 5, "[" * 100_000)
    _bad_step(directory, 7, '{"format": "jaxckpt", "format_version": ' + BIG_INT + "}")
    (directory / "²").mkdir()  # str.isdigit() says yes, int() says no
    with caplog.at_level("WARNING", logger="jaxckpt"):
        mgr = jaxckpt.CheckpointManager(directory, async_save=False)
    try:
        assert mgr.all_steps() == [3]
        assert mgr.restore()["step"] == 3
    finally:
        mgr.close()
    warnings = [r.getMessage() for r in caplog.records if r.name == "jaxckpt" and r.levelname == "WARNING"]
    assert any(f"Skipping step 5 at '{directory / '5'}'" in w and "nested too deeply" in w for w in warnings)
    assert any(f"Skipping step 7 at '{directory / '7'}'" in w and "integer of 5000" in w for w in warnings)

    from jaxckpt import _commit

    found, skipped = _commit.discover(_location.resolve(str(directory)))
    assert sorted(found) == [3] and sorted(skipped) == [5, 7]
    assert f"Checkpoint '{directory / '5'}': invalid manifest" in skipped[5]


def test_a_packed_array_of_17_billion_chunks_is_refused_at_once(tmp_path):
    # format 1: a 375-byte manifest whose packed array is 1 TiB in 64-byte chunks (c1abc6a's
    # verify walked its 17 billion chunks until memory ran out)
    from test_format3_faults import _verify_capped

    n = 1 << 40
    doc = {"format": "jaxckpt", "format_version": 1, "process_count": 1,
           "packed": [{"process": 0, "nbytes": n, "chunk_bytes": 64}], "structure": {"dict": [["a", {"leaf": 0}]]},
           "leaves": [{"path": "a", "kind": "array", "dtype": "uint8", "shape": [n], "store": "packed", "key": "0",
                       "chunk_shape": [n], "nbytes": n, "chunks": [[0, 0]]}]}
    path = tmp_path / "hostile"
    path.mkdir()
    (path / "manifest.json").write_text(json.dumps(doc))
    said = f"Checkpoint '{path}': invalid manifest: packed entry {{'process': 0, 'nbytes': {n}, 'chunk_bytes': 64}}"
    report = _verify_capped(path)
    assert (report["ok"], report["problems"]) == (False, [{"leaf": None, "chunk": "manifest.json", "message": said}])
    with pytest.raises(jaxckpt.CorruptCheckpointError) as err:
        jaxckpt.metadata(path)
    assert str(err.value) == said
