"""Issue 20 item 6, as the user met it: ``jaxckpt verify`` of a checkpoint with many
small leaves (packed together) and one big array printed one line per leaf of a damaged
chunk (52 for one bad byte, 130 for a bad ``zarr.json``) and ``leaf 'None'`` for damage
no leaf owns; ``jaxckpt diff`` printed 17-digit floats, no summary, and PRNG keys as
float statistics of their key data."""

import json

import jax
import numpy as np
import pytest
from conftest import assert_bit_equal

import jaxckpt
from jaxckpt import cli

LAYERS = 26  # a bias and a scale each: 52 small leaves, packed with the key into one chunk


def state(big=None, rng=0, rngs=()):
    keys = jax.random.split(jax.random.key(7), 8)
    for i in rngs:  # another key at position i
        keys = keys.at[i].set(jax.random.key(100 + i))
    return {"layers": {f"l{i:02d}": {"b": np.arange(16, dtype=np.float32) + i, "s": np.float32(i)}
                       for i in range(LAYERS)},
            "big": np.ones((1024, 1024), np.float32) if big is None else big,  # 4 MiB: chunk files
            "rng": jax.random.key(rng), "rngs": keys, "step": 3}


PACKED = sorted([f"layers/l{i:02d}/{k}" for i in range(LAYERS) for k in "bs"] + ["rng", "rngs"])
FIRST_FIVE = "'layers/l00/b', 'layers/l00/s', 'layers/l01/b', 'layers/l01/s', 'layers/l02/b'"


@pytest.fixture
def saved(ckpt):
    jaxckpt.save(ckpt, state())
    doc = json.loads((ckpt / "manifest.json").read_text())
    assert sorted(r["path"] for r in doc["leaves"] if r.get("store") == "packed") == PACKED
    assert [p["nbytes"] <= p["chunk_bytes"] for p in doc["packed"]] == [True]  # one stored chunk
    return ckpt


def _flip(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def _verify(capsys, path):
    code = cli.run(["verify", str(path)])
    out = capsys.readouterr().out
    assert "leaf 'None'" not in out and "None" not in out, out
    return code, out, out.splitlines()


@pytest.mark.format1
def test_one_bad_byte_in_the_packed_chunk_is_one_entry_naming_its_leaves(saved, capsys):
    _flip(saved / "packed" / "p0" / "c" / "0", 10)
    code, out, lines = _verify(capsys, saved)
    assert code == 1 and len(lines) == 3, out  # was 54 lines: one per leaf of the chunk
    assert lines[0].startswith(f"{saved}: CORRUPT (56 leaves, 2 chunks, 4.0 MiB in "), out
    assert lines[0].endswith("s): 1 damaged file, 54 of 56 leaves cannot be restored"), out
    assert lines[1].startswith(f"  packed/p0/c/0: Reading '{saved}/packed/p0' failed: DATA_LOSS: "), out
    assert "Digest mismatch" in lines[1], out
    assert lines[2] == f"    54 leaves cannot be restored: {FIRST_FIVE} and 49 more", out
    report = jaxckpt.verify(saved)
    [damaged] = report.damaged
    assert (damaged["file"], damaged["leaves"], damaged["unrestorable"]) == ("packed/p0/c/0", PACKED, True)
    assert damaged["message"] == lines[1].strip() and report.unrestorable == PACKED
    # the per-leaf list stays as it was: one problem per leaf of the chunk
    assert sorted(p["leaf"] for p in report.problems) == PACKED
    assert {p["message"] for p in report.problems} == {damaged["message"]}
    # what it says holds: those leaves do not restore, the big array does
    with pytest.raises(jaxckpt.CorruptCheckpointError, match="Digest mismatch"):
        jaxckpt.restore(saved)
    assert_bit_equal(jaxckpt.open(saved)["big"][...], np.ones((1024, 1024), np.float32))


@pytest.mark.format1
def test_one_bad_chunk_of_a_big_leaf_keeps_its_one_line(saved, capsys):
    doc = json.loads((saved / "manifest.json").read_text())
    key = next(r["key"] for r in doc["leaves"] if r["path"] == "big")
    _flip(saved / "arrays" / key / "c" / "0" / "0", 100)
    code, out, lines = _verify(capsys, saved)
    assert code == 1 and len(lines) == 2, out
    assert lines[0].endswith("s): 1 damaged file, 1 of 56 leaves cannot be restored"), out
    assert lines[1].startswith(f"  leaf 'big' chunk cell [0, 0]: arrays/{key}/c/0/0: DATA_LOSS"), out


@pytest.mark.format1
@pytest.mark.parametrize("array", ["packed", "big"])
def test_a_bad_zarr_json_is_one_entry_and_restores_are_unaffected(saved, capsys, array):
    doc = json.loads((saved / "manifest.json").read_text())
    name = "packed/p0/zarr.json" if array == "packed" else (
        f"arrays/{next(r['key'] for r in doc['leaves'] if r['path'] == 'big')}/zarr.json")
    (saved / name).write_text("{}")
    code, out, lines = _verify(capsys, saved)
    assert code == 1 and len(lines) == 3, out  # was 108 lines for the packed one
    assert lines[0].endswith("s): 1 damaged file, every leaf restorable"), out
    assert lines[1].startswith(f"  {name}: Opening array '{saved / name[:-len('/zarr.json')]}' failed: "), out
    leaves = f"54 leaves: {FIRST_FIVE} and 49 more" if array == "packed" else "1 leaf: 'big'"
    assert lines[2] == f"    restores are unaffected; other zarr readers cannot read {leaves}", out
    [damaged] = jaxckpt.verify(saved).damaged
    assert (damaged["file"], damaged["unrestorable"]) == (name, False)
    assert damaged["leaves"] == (PACKED if array == "packed" else ["big"])
    assert_bit_equal(jaxckpt.restore(saved)["layers"]["l07"]["b"], np.arange(16, dtype=np.float32) + 7)


@pytest.mark.format1
def test_a_manifest_checksum_mismatch_is_one_entry_naming_the_file(saved, capsys):
    _assert_a_checksum_mismatch_is_one_entry(saved, capsys)


def _assert_a_checksum_mismatch_is_one_entry(saved, capsys):
    path = saved / "manifest.json"
    path.write_text(path.read_text().replace('"value":3', '"value":4', 1))  # the step, edited
    code, out, lines = _verify(capsys, saved)
    assert code == 1 and len(lines) == 3, out
    assert lines[0].startswith(f"{saved}: CORRUPT (0 leaves, 0 chunks, 0 B in "), out
    assert lines[0].endswith("s): 1 damaged file"), out
    assert lines[1].startswith(f"  manifest.json: Checkpoint '{saved}': invalid manifest: checksum mismatch"), out
    assert lines[2] == "    no leaf can be restored without a valid manifest", out


@pytest.mark.format1
def test_a_stray_file_names_the_file_and_no_leaf(saved, capsys):
    (saved / "packed" / "p0" / "c" / "9").write_bytes(b"stray")
    code, out, lines = _verify(capsys, saved)
    assert code == 1 and lines[1:] == ["  unexpected file packed/p0/c/9"], out  # was: leaf 'None' chunk ...
    assert lines[0].endswith("s): 1 damaged file, every leaf restorable"), out


@pytest.fixture
def saved3(ckpt, monkeypatch):
    monkeypatch.setenv("JAXCKPT_FORMAT", "3")
    jaxckpt.save(ckpt, state())
    return ckpt


def test_format3_a_manifest_checksum_mismatch_is_one_entry_naming_the_file(saved3, capsys):
    _assert_a_checksum_mismatch_is_one_entry(saved3, capsys)


def test_format3_a_stray_data_object_names_the_file_and_no_leaf(saved3, capsys):
    (saved3 / "data" / "p0.9").write_bytes(b"stray")
    code, out, lines = _verify(capsys, saved3)
    assert code == 1 and lines[1:] == ["  unexpected file data/p0.9"], out
    assert lines[0].endswith("s): 1 damaged file, every leaf restorable"), out


def test_format3_one_bad_byte_in_a_small_leaf_costs_that_leaf_only(saved3, capsys):
    # format 1 packed this leaf with 53 others in one chunk: one flipped byte cost all 54
    man = json.loads((saved3 / "manifest.json").read_text())
    run = next(r["runs"][0] for r in man["leaves"] if r["path"] == "layers/l00/b")
    _flip(saved3 / "data" / "p0.0", run[3] + 1)
    code, out, lines = _verify(capsys, saved3)
    assert code == 1 and len(lines) == 2, out
    assert lines[0].startswith(f"{saved3}: CORRUPT (56 leaves, 55 chunks, 4.0 MiB in "), out
    assert lines[0].endswith("s): 1 damaged file, 1 of 56 leaves cannot be restored"), out
    assert lines[1].startswith(f"  leaf 'layers/l00/b' chunk cell [0]: data/p0.0: DATA_LOSS: entry at offset "
                               f"{run[3]} of stream p0 "), out
    assert "): digest mismatch, stored digest is 0x" in lines[1], out
    assert all(f"'{p}'" not in out for p in PACKED if p != "layers/l00/b"), out
    with pytest.raises(jaxckpt.CorruptCheckpointError, match=r"leaf 'layers/l00/b' chunk cell \[0\]"):
        jaxckpt.open(saved3)["layers/l00/b"][...]
    for i in (1, 25):  # its neighbours restore (format 1 lost all 54 leaves of the chunk)
        assert_bit_equal(jaxckpt.open(saved3)[f"layers/l{i:02d}/b"][...], state()["layers"][f"l{i:02d}"]["b"])


def test_diff_prints_a_summary_readable_numbers_and_keys_as_keys(tmp_path, capsys):
    big = np.ones((1024, 1024), np.float32)
    big[3, 4] = np.nextafter(np.float32(1), np.float32(2))  # 1 + 2**-23
    jaxckpt.save(tmp_path / "a", state())
    jaxckpt.save(tmp_path / "b", state(big=big, rng=1, rngs=(5,)))
    assert cli.run(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    assert capsys.readouterr().out.splitlines() == [
        "≠ big: 1 of 1048576 elements differ, max |a-b| 1.19e-07, max rel 1.19e-07",
        "≠ rng: the key differs",
        "≠ rngs: 1 of 8 keys differ",
        "3 of 56 leaves differ: 1 value, 2 keys; 53 equal",
    ]
    report = jaxckpt.diff(tmp_path / "a", tmp_path / "b")
    assert report.keys == {"rng": {"keys": 1, "differ": 1}, "rngs": {"keys": 8, "differ": 1}}
    assert "rng" not in report.arrays and "rngs" not in report.arrays  # no float statistics of key data
    assert report.arrays["big"] == {"elements": 1 << 20, "differ": 1, "max_abs": 2.0 ** -23,
                                    "max_rel": 2.0 ** -23 / (1 + 2.0 ** -23)}
    assert report.differences() == {"big": "value", "rng": "key", "rngs": "key"}
    assert cli.run(["diff", str(tmp_path / "a"), str(tmp_path / "a")]) == 0
    assert capsys.readouterr().out == "identical (56 leaves)\n"
