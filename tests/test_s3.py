"""Checkpoints on an S3 API (a local moto server): manifest as the commit marker."""

import os
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from conftest import assert_bit_equal, sharded
from test_storage import count_handles, save_restore_and_read

import jaxckpt
from jaxckpt import _snapshot


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
    assert {k.split("/")[2] for k in keys(s3_server, "runs/c/")} == {"2", "3", ".history"}
    mgr = jaxckpt.CheckpointManager(spec)
    assert mgr.latest_step() == 3
    assert_bit_equal(mgr.restore()["x"], np.full(3, 3))


@pytest.mark.parametrize("handles", [pytest.param(1, marks=pytest.mark.format1), 2])
def test_one_context_per_store_on_s3(s3_server, monkeypatch, handles):
    counts = count_handles(monkeypatch)
    save_restore_and_read(s3_server(f"runs/d{handles}/ckpt"))
    # a handle per location, opened once: the checkpoint, and in format 3 its data objects'
    # prefix (d/<token>/data, read by byte range; formats 1/2 open their arrays through zarr)
    assert counts == {"contexts": 1, "kvstores": handles}
    # another prefix of the same bucket: its own KvStore handle, the same context
    jaxckpt.save(s3_server(f"runs/e{handles}/ckpt"), {"x": np.arange(3)})
    assert counts == {"contexts": 1, "kvstores": handles + 1}


MISSING = "NOT_FOUND: NoSuchBucket: The specified bucket does not exist"


def test_missing_bucket_is_a_checkpoint_error_naming_the_url(s3_server):
    spec = dict(s3_server("runs/x/ckpt"), bucket="jaxckpt-no-such-bucket")
    url = "s3://jaxckpt-no-such-bucket/runs/x/ckpt"
    for call in (jaxckpt.restore, jaxckpt.metadata, jaxckpt.open):
        with pytest.raises(jaxckpt.CheckpointError) as e:
            call(spec)
        assert type(e.value) is jaxckpt.CheckpointError
        assert str(e.value) == f"Reading 'manifest.json' in '{url}' failed: {MISSING}"
    with pytest.raises(jaxckpt.CheckpointError) as e:
        jaxckpt.save(spec, {"x": 1})
    # listing goes through boto3 (one level, with a delimiter): S3's own code and message
    assert str(e.value) == f"Listing '{url}' failed: NoSuchBucket: The specified bucket does not exist"


@pytest.fixture(scope="module")
def s3_with_auth():
    """A second moto server that checks credentials (none are valid there)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = os.path.join(os.path.dirname(sys.executable), "moto_server")
    server = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env=dict(os.environ, INITIAL_NO_AUTH_ACTION_COUNT="0"))
    try:
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(10)


def test_rejected_credentials_are_a_checkpoint_error(s3_server, s3_with_auth):
    spec = dict(s3_server("runs/y/ckpt"), endpoint=s3_with_auth)
    with pytest.raises(jaxckpt.CheckpointError) as e:
        jaxckpt.restore(spec)
    assert str(e.value) == (
        "Reading 'manifest.json' in 's3://jaxckpt-test/runs/y/ckpt' failed: PERMISSION_DENIED: "
        "InvalidAccessKeyId: The AWS Access Key Id you provided does not exist in our records.")


def test_discovery_lists_one_level_on_s3(s3_server, monkeypatch):
    import botocore.client

    spec = s3_server("runs/listing")
    for step in (1, 2, 3):
        jaxckpt.save(dict(spec, path=f"runs/listing/{step}"),
                     {f"w{i}": sharded(np.full(1 << 18, i, np.float32), (8,), ("x",), ("x",)) for i in range(4)})
    assert len(keys(s3_server, "runs/listing/")) == 3 * (1 + 1)  # manifest; one data object (4 MiB)
    calls = []
    real = botocore.client.BaseClient._make_api_call

    def spy(self, name, params):
        out = real(self, name, params)
        if name == "ListObjectsV2":
            calls.append((params.get("Delimiter"), len(out.get("Contents", [])), len(out.get("CommonPrefixes", []))))
        return out

    monkeypatch.setattr(botocore.client.BaseClient, "_make_api_call", spy)
    with jaxckpt.CheckpointManager(spec, read_only=True) as mgr:
        assert mgr.all_steps() == [1, 2, 3]
    # one request, the three step prefixes: not the keys under them
    assert calls == [("/", 0, 3)]


@pytest.mark.slow
def test_two_hundred_steps_are_discovered_with_one_listing(s3_server, monkeypatch):
    import botocore.client

    spec = s3_server("runs/many")
    jaxckpt.save(dict(spec, path="runs/many/0"), {"w": np.ones(100, np.float32), "s": 1})
    made = keys(s3_server, "runs/many/0/")
    for step in range(1, 200):  # copies of step 0's objects: 199 more committed steps
        for k in made:
            s3_server.client.copy_object(Bucket="jaxckpt-test", Key=k.replace("/0/", f"/{step}/", 1),
                                         CopySource={"Bucket": "jaxckpt-test", "Key": k})
    calls = []
    real = botocore.client.BaseClient._make_api_call

    def spy(self, name, params):
        calls.append((name, params.get("Prefix")))
        return real(self, name, params)

    monkeypatch.setattr(botocore.client.BaseClient, "_make_api_call", spy)
    with jaxckpt.CheckpointManager(spec, read_only=True) as mgr:
        assert mgr.all_steps() == list(range(200))
    assert calls == [("ListObjectsV2", "runs/many/")]  # one delimiter listing, no probe per step
    restored = jaxckpt.CheckpointManager(spec, read_only=True).restore(199)
    assert restored["s"] == 1 and restored["w"].tolist() == [1.0] * 100


def test_retention_deletes_a_step_in_one_batch_request(s3_server, monkeypatch):
    import botocore.client

    spec = s3_server("runs/batched")
    calls = []
    real = botocore.client.BaseClient._make_api_call

    def spy(self, name, params):
        if name == "DeleteObjects":
            calls.append(len(params["Delete"]["Objects"]))
        return real(self, name, params)

    monkeypatch.setattr(botocore.client.BaseClient, "_make_api_call", spy)
    monkeypatch.setattr(_snapshot, "SEGMENT_BYTES", 1 << 19)  # 4 MiB of entries: 9 data objects
    tree = {f"w{i}": sharded(np.full(1 << 18, i, np.float32), (8,), ("x",), ("x",)) for i in range(4)}
    with jaxckpt.CheckpointManager(spec, max_to_keep=1) as mgr:
        mgr.save(1, tree)
        mgr.wait_until_finished()
        step_1 = keys(s3_server, "runs/batched/1/")
        mgr.save(2, tree)
        mgr.wait_until_finished()
        assert mgr.all_steps() == [2]
    assert not keys(s3_server, "runs/batched/1/")
    data = [k for k in step_1 if "/data/p0." in k]
    assert len(data) == 9 and len(step_1) == 10  # and the manifest, unlisted first
    # step 1: its data objects under its data prefix, removed in one request
    assert calls == [9]


def test_dead_data_prefixes_are_listed_as_attempts_and_collected(s3_server):
    spec = s3_server("runs/dead")
    with jaxckpt.CheckpointManager(spec) as mgr:
        mgr.save(1, {"w": np.ones(8, np.float32)})
    dead = "runs/dead/1/d/1700000000-0123456789ab/packed/p0/c/0"
    s3_server.client.put_object(Bucket="jaxckpt-test", Key=dead, Body=b"x" * 10)
    with jaxckpt.CheckpointManager(spec, read_only=True) as reader:
        (attempt,) = reader.attempts()
    assert (attempt["step"], attempt["name"], attempt["kind"], attempt["writer_alive"]) == (
        1, "1/d/1700000000-0123456789ab", "data", False)
    assert dead in keys(s3_server, "runs/dead/1/")
    jaxckpt.CheckpointManager(spec).close()  # a writer starting removes what no manifest names
    assert dead not in keys(s3_server, "runs/dead/1/")
    assert jaxckpt.CheckpointManager(spec, read_only=True).restore(1)["w"].tolist() == [1.0] * 8
