"""Checkpoints on an S3 API (a local moto server): manifest as the commit marker."""

import jax
import numpy as np
import pytest
from conftest import assert_bit_equal, sharded

import jaxckpt


def keys(s3, prefix):
    out = s3.client.list_objects_v2(Bucket="jaxckpt-test", Prefix=prefix)
    return sorted(o["Key"] for o in out.get("Contents", []))


def test_save_restore_overwrite_on_s3(s3_server):
    spec = s3_server("runs/a/ckpt")
    big = np.arange(1 << 19, dtype=np.float32)
    tree = {"big": sharded(big, (4,), ("x",), ("x",)), "small": np.arange(5), "step": 3}
    jaxckpt.save(spec, tree)
    assert "runs/a/ckpt/manifest.json" in keys(s3_server, "runs/a/ckpt/")
    back = jaxckpt.restore(spec, tree)
    assert_bit_equal(back["big"], big)
    assert back["step"] == 3
    assert jaxckpt.metadata(spec).tree["big"].shape == big.shape
    with pytest.raises(jaxckpt.CheckpointError, match="already exists"):
        jaxckpt.save(spec, {"x": 1})
    jaxckpt.save(spec, {"x": 1}, overwrite=True)
    assert jaxckpt.restore(spec) == {"x": 1}
    assert keys(s3_server, "runs/a/ckpt/") == ["runs/a/ckpt/manifest.json"]  # old data cleared


def test_uncommitted_prefix_is_not_a_checkpoint(s3_server):
    spec = s3_server("runs/b/ckpt")
    jaxckpt.save(spec, {"w": np.ones(4)})
    s3_server.client.delete_object(Bucket="jaxckpt-test", Key="runs/b/ckpt/manifest.json")
    with pytest.raises(jaxckpt.CheckpointNotFoundError):
        jaxckpt.restore(spec)
    # a dead attempt's data does not block a new save of the same path
    jaxckpt.save(spec, {"w": np.zeros(4)})
    assert_bit_equal(jaxckpt.restore(spec)["w"], np.zeros(4))


def test_manager_on_s3(s3_server):
    spec = s3_server("runs/c")
    with jaxckpt.CheckpointManager(spec, max_to_keep=2) as mgr:
        for i in range(4):
            mgr.save(i, {"x": np.full(3, i), "k": jax.random.key(i)})
        mgr.wait_until_finished()
        assert mgr.all_steps() == [2, 3]
    assert {k.split("/")[2] for k in keys(s3_server, "runs/c/")} == {"2", "3"}
    mgr = jaxckpt.CheckpointManager(spec)
    assert mgr.latest_step() == 3
    assert_bit_equal(mgr.restore()["x"], np.full(3, 3))
