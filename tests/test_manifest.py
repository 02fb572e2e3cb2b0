"""The manifest is untrusted input: every bad field is refused with a clear error."""

import json

import numpy as np
import pytest

import jaxckpt
from jaxckpt import _manifest


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
    "unreferenced_leaf": (lambda d: d.update(structure={"dict": [["w", {"leaf": 0}]]}),
                          "does not reference every leaf"),
    "bad_value": (lambda d: _leaf(d, "step").update(value={"x": 1}), "inline value of type dict"),
    "chunk_of_no_process": (lambda d: _leaf(d, "w").update(chunks=[[3, 0]]), "lies outside the packed data"),
    "chunk_past_the_end": (lambda d: _leaf(d, "w").update(chunks=[[0, 1 << 30]]), "lies outside the packed data"),
    "chunk_count": (lambda d: _leaf(d, "w").update(chunks=[]), "chunks do not match"),
    "packed_table": (lambda d: d.update(packed=[{"process": 5, "nbytes": 10, "chunk_bytes": 10}]),
                     "packed entry"),
    "duplicate_path": (lambda d: d["leaves"].append(dict(_leaf(d, "step"))), "duplicate leaf path 'step'"),
}


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
    man = _manifest.Manifest(1, {"leaf": 0}, (rec,), {"m": 1}, 1, packed=(_manifest.PackedArray(0, 128, 128),))
    back = _manifest.parse(man.to_bytes(), "x")
    assert back.leaves == (rec,)
    assert back.packed == man.packed
    assert back.metadata == {"m": 1}
