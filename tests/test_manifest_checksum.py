"""The manifest's checksum of itself (issue 19, library manners): chunks carry crc32c of
their own bytes, and the manifest's own values (inline leaves, metadata, the step, the
data prefix) are covered by a sha256 over its bytes, its last field."""

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from conftest import assert_bit_equal

import jaxckpt
from jaxckpt import _manifest
from jaxckpt._storage import kvstore as _kvstore
from jaxckpt._storage import location as _location

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIG = np.arange(1 << 18, dtype=np.float32)  # 1 MiB: a file of its own
SMALL = np.arange(16, dtype=np.int32)


def tree(step):
    return {"big": BIG * step, "small": SMALL * step, "step": 12345 + step, "lr": 0.25}


def test_a_flipped_digit_of_an_inline_value_is_corrupt(ckpt):
    jaxckpt.save(ckpt, tree(0))
    path = ckpt / "manifest.json"
    data = path.read_bytes()
    assert data.count(b'"value":12345') == 1
    path.write_bytes(data.replace(b'"value":12345', b'"value":12344'))  # one bit: "5" 0x35 -> "4" 0x34
    for read in (jaxckpt.restore, jaxckpt.metadata, jaxckpt.open):
        with pytest.raises(jaxckpt.CorruptCheckpointError) as err:
            read(ckpt)
        assert type(err.value) is jaxckpt.CorruptCheckpointError
        assert str(err.value).startswith(f"Checkpoint '{ckpt}': invalid manifest: checksum mismatch: "
                                         "the manifest's bytes changed after it was written (recorded sha256:")
    path.write_bytes(data)
    back = jaxckpt.restore(ckpt)
    assert back["step"] == 12345 and back["lr"] == 0.25
    assert_bit_equal(back["big"], BIG * 0)


def test_every_single_bit_flip_in_the_manifest_is_refused(ckpt):
    """Before the checksum, flips in the digits of an inline value were read as another
    value (tests/test_corruption.py counted them); now every byte is covered, the
    checksum's own name included."""
    jaxckpt.save(ckpt, {"small": SMALL, "step": 3, "name": "run"}, metadata={"lr": 0.5})
    original = (ckpt / "manifest.json").read_bytes()
    accepted = []
    for i in range(len(original) * 8):
        data = bytearray(original)
        data[i // 8] ^= 1 << (i % 8)
        try:
            _manifest.parse(bytes(data), "x")
        except jaxckpt.CorruptCheckpointError:
            continue
        accepted.append(bytes(data[max(0, i // 8 - 20): i // 8 + 20]))
    assert accepted == []


@pytest.mark.parametrize("damage, message", [
    (lambda b: b.replace(b'"checksum":', b'"checksuo":'),
     "field 'checksuo' holds a checksum: the manifest's checksum field is damaged"),
    (lambda b: b.replace(b'"checksum":"sha256:', b'"checksum":"sha257:'),
     "checksum 'sha257:"),
    (lambda b: b[:-1] + b' }', "the checksum is not the manifest's last field, as written: the manifest was edited"),
    (lambda b: json.dumps(json.loads(b), indent=1).encode(),
     "the checksum is not the manifest's last field, as written: the manifest was edited"),
])
def test_a_damaged_or_moved_checksum_is_corrupt(ckpt, damage, message):
    jaxckpt.save(ckpt, tree(1))
    path = ckpt / "manifest.json"
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(jaxckpt.CorruptCheckpointError, match=re.escape(f"Checkpoint '{ckpt}': invalid manifest: {message}")):
        jaxckpt.restore(ckpt)


def test_a_manifest_without_checksum_reads_as_before(ckpt):
    """Written before manifests had checksums (tests/fixtures/v1, v2), or by a tool that
    removed it: read, validated and restored as before."""
    jaxckpt.save(ckpt, tree(2))
    doc = json.loads((ckpt / "manifest.json").read_text())
    assert doc["checksum"].startswith("sha256:") and list(doc)[-1] == "checksum"
    del doc["checksum"]
    (ckpt / "manifest.json").write_text(json.dumps(doc))
    back = jaxckpt.restore(ckpt)
    assert back["step"] == 12347
    assert_bit_equal(back["big"], BIG * 2)
    assert "checksum" not in jaxckpt.metadata(ckpt).info


def test_the_checksum_is_computed_when_written_never_carried_over(ckpt):
    """A manifest changed with dataclasses.replace (the persistent tier's copy) gets a
    checksum of its own bytes; the parsed info never holds the old one."""
    jaxckpt.save(ckpt, tree(3))
    man = _manifest.parse((ckpt / "manifest.json").read_bytes(), str(ckpt))
    assert _manifest.CHECKSUM_FIELD not in man.info
    stale = dict(man.info, checksum="sha256:" + "0" * 64, copied_from="elsewhere")
    # an object store's copy: data under a prefix (version 2, or 3, what a save writes, as is)
    data = dataclasses.replace(man, info=stale, data="d/1-abc", format_version=max(2, man.format_version)).to_bytes()
    again = _manifest.parse(data, "copy")
    assert again.info["copied_from"] == "elsewhere" and again.data == "d/1-abc"
    body = json.dumps({k: v for k, v in json.loads(data).items() if k != "checksum"},
                      separators=(",", ":"), allow_nan=True).encode()
    assert json.loads(data)["checksum"] == _manifest.checksum(body)
    assert data.count(b'"checksum"') == 1


def test_the_persistent_copy_has_a_valid_checksum_of_its_own(tmp_path):
    durable = tmp_path / "durable"
    with jaxckpt.CheckpointManager(tmp_path / "local", persistent_directory=durable,
                                   persistent_interval_steps=1) as mgr:
        mgr.save(1, tree(1))
        mgr.wait_until_finished()
    local = (tmp_path / "local" / "1" / "manifest.json").read_bytes()
    copied = (durable / "1" / "manifest.json").read_bytes()
    assert json.loads(copied)["copied_from"] == str(tmp_path / "local" / "1")
    assert json.loads(copied)["checksum"] != json.loads(local)["checksum"]
    assert _manifest.parse(copied, str(durable / "1")).info["step"] == 1
    back = jaxckpt.restore(durable / "1")
    assert back["step"] == 12346
    assert_bit_equal(back["big"], BIG)


def test_verify_reports_a_checksum_mismatch(ckpt):
    jaxckpt.save(ckpt, tree(4))
    path = ckpt / "manifest.json"
    path.write_bytes(path.read_bytes().replace(b'"lr","kind":"value","value":0.25', b'"lr","kind":"value","value":0.75'))
    report = jaxckpt.verify(ckpt)
    assert not report.ok and [(p["leaf"], p["chunk"]) for p in report.problems] == [(None, "manifest.json")]
    assert "invalid manifest: checksum mismatch" in report.problems[0]["message"]
    out = subprocess.run([sys.executable, "-m", "jaxckpt", "verify", str(ckpt)], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu"))
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert f"{ckpt}: CORRUPT" in out.stdout and "checksum mismatch" in out.stdout, out.stdout


def test_manifests_swapped_between_two_object_store_checkpoints_are_caught():
    """Same layout, other values. Each manifest names its own save's data prefix
    (d/<token>/), covered by the checksum: over the other checkpoint it finds no data."""
    for name, step in (("a", 1), ("b", 2)):
        jaxckpt.save(f"memory://swap/{name}", tree(step))
    a, b = _location.resolve("memory://swap/a"), _location.resolve("memory://swap/b")
    man_a, man_b = _kvstore.read_blob(a, "manifest.json"), _kvstore.read_blob(b, "manifest.json")
    _kvstore.write_blob(a, "manifest.json", man_b)
    _kvstore.write_blob(b, "manifest.json", man_a)
    for url in ("memory://swap/a", "memory://swap/b"):
        with pytest.raises(jaxckpt.CorruptCheckpointError, match=re.escape(f"Checkpoint '{url}': leaf ")):
            jaxckpt.restore(url)
        assert not jaxckpt.verify(url).ok


def test_a_manager_step_swapped_with_another_step_is_caught(tmp_path):
    """Local steps of one manager (format 1: data at the root) are told apart by the step
    the manager records, which the checksum now covers too."""
    with jaxckpt.CheckpointManager(tmp_path / "run", async_save=False) as mgr:
        mgr.save(1, tree(1))
        mgr.save(2, tree(2))
    one, two = tmp_path / "run" / "1" / "manifest.json", tmp_path / "run" / "2" / "manifest.json"
    saved_one = one.read_bytes()
    shutil.copy(two, one)
    with pytest.raises(jaxckpt.CorruptCheckpointError, match="records step 2, but it is the directory of step 1"):
        jaxckpt.restore(tmp_path / "run" / "1")
    one.write_bytes(saved_one.replace(b'"step":1,', b'"step":2,'))  # the step edited to match: the checksum
    with pytest.raises(jaxckpt.CorruptCheckpointError, match="checksum mismatch"):
        jaxckpt.restore(tmp_path / "run" / "1")
