"""``verify_before_delete=True``: a new step is read back and checksummed before it
counts; one that fails is reported, deleted and never the latest, and retention keeps
the older steps it would have replaced."""

import os

import numpy as np
import pytest
from conftest import assert_bit_equal

import jaxckpt
from jaxckpt import _verify


def state(i):
    return {"w": np.full((512, 1024), i, np.float32), "b": np.arange(16, dtype=np.int32) * i, "step": i}


def flip_a_byte(step_dir):
    """Silent corruption after the commit: one byte of the big leaf's chunk (format 3: in
    the middle of the data object, inside the big leaf's entries)."""
    stream = os.path.join(step_dir, "data", "p0.0")
    if os.path.exists(stream):
        with open(stream, "r+b") as f:
            f.seek(os.path.getsize(stream) // 2)
            byte = f.read(1)
            f.seek(os.path.getsize(stream) // 2)
            f.write(bytes([byte[0] ^ 0xFF]))
        return stream
    for root, _dirs, files in os.walk(os.path.join(step_dir, "arrays")):
        for name in files:
            if name != "zarr.json":
                path = os.path.join(root, name)
                with open(path, "r+b") as f:
                    f.seek(100)
                    byte = f.read(1)
                    f.seek(100)
                    f.write(bytes([byte[0] ^ 0xFF]))
                return path
    raise AssertionError("no chunk file")


# what verify says of the flipped byte, per layout
PROBLEM = {"1": r"arrays/\w+/c/0/0: .*digest mismatch.* \(leaves 'w'\)$",
           "3": r"data/p0\.0: DATA_LOSS: entry at offset 128 of stream p0 \(data object .*/2/data/p0\.0 bytes "
                r"\[128, 2097284\)\): digest mismatch, .* \(leaves 'w'\)$"}


@pytest.mark.parametrize("layout", ["1", "3"])
@pytest.mark.parametrize("async_save", [True, False])
def test_a_step_that_fails_verification_is_reported_deleted_and_not_the_latest(tmp_path, monkeypatch, async_save,
                                                                               layout):
    monkeypatch.setenv("JAXCKPT_FORMAT", layout)
    real_verify = _verify.verify
    verified = []

    def corrupting_verify(path, **kw):
        if str(path).endswith(os.sep + "2"):
            flip_a_byte(str(path))
        verified.append(os.path.basename(str(path)))
        return real_verify(path, **kw)

    monkeypatch.setattr(_verify, "verify", corrupting_verify)
    mgr = jaxckpt.CheckpointManager(tmp_path, max_to_keep=1, verify_before_delete=True, async_save=async_save)
    mgr.save(1, state(1))
    mgr.wait_until_finished()
    with pytest.raises(jaxckpt.CheckpointError,
                       match=r"Saving step 2 to '.*' failed: step 2 failed verification after its commit: "
                             + PROBLEM[layout]):
        mgr.save(2, state(2))
        mgr.wait_until_finished()
    assert mgr.all_steps() == [1] and mgr.latest_step() == 1  # step 1 was not deleted for step 2
    assert sorted(n for n in os.listdir(tmp_path) if not n.startswith(".")) == ["1", "history.jsonl"]
    assert_bit_equal(mgr.restore()["w"], state(1)["w"])
    mgr.save(3, state(3))  # the run goes on; step 3 verifies, then retention deletes step 1
    mgr.close()
    assert verified == ["1", "2", "3"]
    with jaxckpt.CheckpointManager(tmp_path, read_only=True) as reader:
        assert reader.all_steps() == [3]
        assert_bit_equal(reader.restore()["w"], state(3)["w"])


def test_without_verification_a_corrupt_step_would_have_replaced_the_good_one(tmp_path):
    """The failure mode the option exists for: retention trusts the commit."""
    with jaxckpt.CheckpointManager(tmp_path, max_to_keep=1) as mgr:
        mgr.save(1, state(1))
        mgr.save(2, state(2))
    flip_a_byte(str(tmp_path / "2"))
    with jaxckpt.CheckpointManager(tmp_path, read_only=True) as reader:
        assert reader.all_steps() == [2]
        with pytest.raises(jaxckpt.CorruptCheckpointError):
            reader.restore()
