"""Checkpoints at plain ``gs://`` URLs on a local GCS emulator (gcp-storage-emulator).

The ``gcs_server`` fixture points tensorstore's ``gcs`` driver at 127.0.0.1 with
``TENSORSTORE_GCS_HTTP_URL`` and bypasses Google auth with ``GOOGLE_AUTH_TOKEN_FOR_TESTING``
(tensorstore's first auth step: a fixed bearer token; no credentials file, no metadata
server). No library option is needed: ``gs://bucket/p`` resolves to
``{"driver": "gcs", "bucket": ..., "path": ...}`` and works as is.

The emulator itself needs one fix (made by the fixture, see ``conftest._GCS_EMULATOR``):
it ignores the list parameters ``startOffset``/``endOffset`` that tensorstore lists a
prefix with, and unpatched, a listing under ``run/2/`` returned ``run/1/...`` objects
(a save there failed with "exists and is not a jaxckpt checkpoint") and a shorter foreign
name aborted the interpreter (``std::out_of_range`` in tensorstore).
Its 404 for a missing bucket has a body tensorstore cannot parse, so that case is
reported as "INTERNAL: Failed to parse response metadata" (real GCS sends a JSON error).
"""

import jax
import numpy as np
import pytest
from conftest import assert_bit_equal, sharded

import jaxckpt
from jaxckpt import _commit
from jaxckpt._storage import location as _location


def test_gs_url_resolves_to_a_gcs_kvstore():
    loc = _location.resolve("gs://my-bucket/runs/a/")
    assert loc.kvstore == {"driver": "gcs", "bucket": "my-bucket", "path": "runs/a/"}
    assert loc.local is None
    assert loc.url == "gs://my-bucket/runs/a"
    assert loc.child("7").url == "gs://my-bucket/runs/a/7"
    assert _location.resolve("gs://my-bucket").kvstore == {"driver": "gcs", "bucket": "my-bucket", "path": ""}


def test_save_restore_metadata_verify_on_gcs(gcs_server):
    url = gcs_server("run/1")
    big = np.arange(1 << 20, dtype=np.float32).reshape(1024, 1024)  # 4 MiB, in 8 shards
    small = {f"s{i}": np.arange(5 + i, dtype=np.int32) * i for i in range(4)}
    tree = {
        "big": sharded(big, (4, 2), ("x", "y"), ("x", "y")),
        "small": small,
        "bf16": np.linspace(-1, 1, 7).astype(jax.numpy.bfloat16),
        "key": jax.random.key(3),
        "step": 3, "lr": 0.25, "name": "adam", "none": None,  # inline values
    }
    jaxckpt.save(url, tree)
    man = jaxckpt.metadata(url)
    assert man.format_version == 3
    data = _commit.read_manifest(_location.resolve(url)).data
    # the manifest and one data object, uploaded whole (every chunk an entry of process 0's stream)
    assert gcs_server.keys("run/1/") == [f"run/1/{data}/data/p0.0", "run/1/manifest.json"]

    back = jaxckpt.restore(url, tree)
    assert_bit_equal(back["big"], big)
    assert back["big"].sharding == tree["big"].sharding
    for k, v in small.items():
        assert_bit_equal(back["small"][k], v)
    assert_bit_equal(back["bf16"], tree["bf16"])
    assert_bit_equal(jax.random.key_data(back["key"]), jax.random.key_data(tree["key"]))
    assert (back["step"], back["lr"], back["name"], back["none"]) == (3, 0.25, "adam", None)

    plain = jaxckpt.restore(url)  # no target: host arrays and the inline values
    assert_bit_equal(plain["big"], big)
    assert plain["step"] == 3

    meta = jaxckpt.metadata(url).tree
    assert meta["big"].shape == (1024, 1024) and meta["big"].dtype == np.float32
    assert meta["small"]["s3"].shape == (8,)

    view = jaxckpt.open(url)
    assert_bit_equal(view["big"][1000, 3:9], big[1000, 3:9])

    report = jaxckpt.verify(url)
    assert report.ok, report.problems
    assert report.bytes_read >= big.nbytes


def test_overwrite_and_missing_on_gcs(gcs_server):
    url = gcs_server("run/2")
    with pytest.raises(jaxckpt.CheckpointNotFoundError):
        jaxckpt.restore(url)
    jaxckpt.save(url, {"w": np.ones(4)})
    with pytest.raises(jaxckpt.CheckpointError, match="already exists"):
        jaxckpt.save(url, {"x": 1})
    jaxckpt.save(url, {"x": 1}, overwrite=True)
    assert jaxckpt.restore(url) == {"x": 1}


def test_manager_on_gcs(gcs_server):
    url = gcs_server("train/run")  # not "run": run/1 and run/2 above would look like steps
    with jaxckpt.CheckpointManager(url, max_to_keep=2) as mgr:
        for step in (10, 20, 30):
            mgr.save(step, {"x": sharded(np.full(1 << 18, step, np.float32), (8,), ("x",), ("x",)),
                            "step": step})
        mgr.wait_until_finished()
        assert mgr.all_steps() == [20, 30]
    steps = {k.split("/")[2] for k in gcs_server.keys("train/run/")}
    assert "10" not in steps and {"20", "30"} <= steps  # the oldest step's objects are gone
    mgr = jaxckpt.CheckpointManager(url, read_only=True)
    assert mgr.all_steps() == [20, 30]
    assert mgr.latest_step() == 30
    back = mgr.restore()
    assert_bit_equal(back["x"], np.full(1 << 18, 30, np.float32))
    assert back["step"] == 30
    for step in (20, 30):
        assert jaxckpt.verify(f"{url}/{step}").ok


def test_missing_bucket_is_a_checkpoint_error_naming_the_url(gcs_server):
    url = "gs://jaxckpt-no-such-bucket/run/x"
    for call in (jaxckpt.restore, jaxckpt.metadata, jaxckpt.open, lambda u: jaxckpt.save(u, {"x": 1})):
        with pytest.raises(jaxckpt.CheckpointError) as e:
            call(url)
        assert type(e.value) is jaxckpt.CheckpointError
        assert f"'{url}' failed" in str(e.value)
