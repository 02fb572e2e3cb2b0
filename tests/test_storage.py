"""Locations and key safety."""

import collections
import concurrent.futures

import numpy as np
import pytest
import tensorstore as ts
from conftest import assert_bit_equal, sharded

import jaxckpt
from jaxckpt import CheckpointError, _dtypes
from jaxckpt._storage import kvstore as _kvstore
from jaxckpt._storage import location as _location


def test_resolve_paths_and_urls(tmp_path):
    loc = _location.resolve(tmp_path / "c")
    assert loc.local == str(tmp_path / "c") and loc.kvstore == {"driver": "file", "path": f"{tmp_path}/c/"}
    s3 = _location.resolve("s3://bucket/runs/a/")
    assert s3.kvstore == {"driver": "s3", "bucket": "bucket", "path": "runs/a/"} and s3.url == "s3://bucket/runs/a"
    assert _location.resolve("gs://b/x").kvstore == {"driver": "gcs", "bucket": "b", "path": "x/"}
    assert _location.resolve("memory://m").child("7").kvstore == {"driver": "memory", "path": "m/7/"}
    spec = _location.resolve({"driver": "s3", "bucket": "b", "path": "p", "endpoint": "http://127.0.0.1:1"})
    assert spec.kvstore["endpoint"] == "http://127.0.0.1:1" and spec.kvstore["path"] == "p/"
    with pytest.raises(CheckpointError, match="unsupported checkpoint location 'ftp://x'"):
        _location.resolve("ftp://x")


def test_epath_paths_resolve_like_strings(tmp_path):
    # etils.epath (what orbax and many JAX codebases pass around) treats local and cloud
    # paths alike; jaxckpt takes them anywhere it takes a path.
    from etils import epath

    import jaxckpt

    assert _location.resolve(epath.Path("gs://b/runs") / "7").kvstore == {
        "driver": "gcs", "bucket": "b", "path": "runs/7/"}
    assert _location.resolve(epath.Path("s3://b/x")).kvstore == {"driver": "s3", "bucket": "b", "path": "x/"}
    local = epath.Path(tmp_path) / "ckpt"
    jaxckpt.save(local, {"a": np.arange(3)})
    assert jaxckpt.restore(local)["a"].tolist() == [0, 1, 2]
    with jaxckpt.CheckpointManager(epath.Path(tmp_path) / "run") as mgr:
        mgr.save(1, {"a": 1})
    assert jaxckpt.CheckpointManager(epath.Path(tmp_path) / "run", read_only=True).all_steps() == [1]


@pytest.mark.parametrize("key,ok", [("0", True), ("a/b.c-d_e", True), ("..", False), ("a/../b", False),
                                    ("/abs", False), ("a//b", False), ("", False), ("a\\b", False)])
def test_safe_keys(key, ok):
    assert _location.is_safe_key(key) is ok


def test_unsupported_zarr_dtypes_are_stored_as_unsigned():
    assert _dtypes.storage_dtype_name("uint4") == "uint8"
    assert _dtypes.storage_dtype_name("float8_e4m3") == "uint8"
    assert _dtypes.storage_dtype_name("bfloat16") == "bfloat16"


# --- one tensorstore context per store, KvStore handles reused ----------------------


def count_handles(monkeypatch):
    """Count ``ts.Context`` and ``ts.KvStore.open`` calls from now on, with jaxckpt's
    handle caches emptied first."""
    counts = {"contexts": 0, "kvstores": 0}
    real_context, real_open = ts.Context, ts.KvStore.open

    def context(*args, **kwargs):
        counts["contexts"] += 1
        return real_context(*args, **kwargs)

    def kv_open(*args, **kwargs):
        counts["kvstores"] += 1
        return real_open(*args, **kwargs)

    monkeypatch.setattr(ts, "Context", context)
    monkeypatch.setattr(ts.KvStore, "open", staticmethod(kv_open))
    monkeypatch.setattr(_kvstore, "_contexts", collections.OrderedDict(), raising=False)
    monkeypatch.setattr(_kvstore, "_kvstores", collections.OrderedDict(), raising=False)
    return counts


def save_restore_and_read(path):
    """A save, a restore, metadata and 10 lazy reads of one checkpoint."""
    big = np.arange(512 * 1024, dtype=np.float32).reshape(512, 1024)  # 2 MiB: its own zarr3 array
    small = np.arange(6, dtype=np.int32)  # packed
    tree = {"big": sharded(big, (4,), ("x",), ("x", None)), "small": small}
    jaxckpt.save(path, tree)
    back = jaxckpt.restore(path, tree)
    assert_bit_equal(back["big"], big)
    assert jaxckpt.metadata(path).tree["big"].shape == (512, 1024)
    view = jaxckpt.open(path)
    for i in range(5):
        assert_bit_equal(view["big"][100 * i, 1:3], big[100 * i, 1:3])  # partial chunks: tensorstore
        assert_bit_equal(view["small"][i], small[i])


def test_one_context_per_location(tmp_path, monkeypatch):
    counts = count_handles(monkeypatch)
    save_restore_and_read(tmp_path / "c")
    assert counts == {"contexts": 1, "kvstores": 0}  # local blobs and listings skip tensorstore
    save_restore_and_read(tmp_path / "d")  # every local path is the same store
    assert counts == {"contexts": 1, "kvstores": 0}


def test_context_cache_is_thread_safe_and_bounded(monkeypatch):
    counts = count_handles(monkeypatch)
    loc = _location.resolve("s3://some-bucket/a")
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda _: _kvstore.context(loc), range(64)))
    assert all(c is got[0] for c in got) and counts["contexts"] == 1
    assert _kvstore.context(_location.resolve("s3://some-bucket/b/c")) is got[0]  # path does not matter
    assert _kvstore.context(_location.resolve("s3://other-bucket/a")) is not got[0]

    # the memory kvstore's data lives in its context: it outlives any eviction
    monkeypatch.setattr(_kvstore, "_MAX_CONTEXTS", 2)
    monkeypatch.setattr(_kvstore, "_MAX_KVSTORES", 2)
    mem = _location.resolve("memory://cache-test")
    _kvstore.write_blob(mem, "k", b"kept")
    for i in range(5):
        _kvstore.context(_location.resolve(f"s3://bucket-{i}/x"))
        _kvstore.write_blob(mem.child(str(i)), "k", b"x")
    assert len(_kvstore._contexts) == 2 and len(_kvstore._kvstores) == 2
    assert _kvstore.read_blob(mem, "k") == b"kept"


@pytest.mark.parametrize("message,cause", [
    # tensorstore 0.1.86, a read from a bucket on a server that rejects the key (moto)
    ("PERMISSION_DENIED: InvalidAccessKeyId: The AWS Access Key Id you provided does not exist in our "
     "records. [http_response_code='403'] [x-amzn-requestid='MSDJ'] [http_response_body='<?xml "
     "version=\\\"1.0\\\" encoding=\\\"utf-8\\\"?>\\n<Error><Code>InvalidAccessKeyId</Code>"
     "<Message>The AWS Access Key Id you provided does not exist in our records.</Message>"
     "<RequestId>MSDJ</RequestId><HostId>9G']",
     "PERMISSION_DENIED: InvalidAccessKeyId: The AWS Access Key Id you provided does not exist in our "
     "records."),
    # an XML body tensorstore did not summarise
    ("UNKNOWN: HTTP response code: 500 with body: <?xml version=\"1.0\"?><Error><Code>InternalError</Code>"
     "<Message>We encountered an internal error.</Message></Error>",
     "UNKNOWN: HTTP response code: 500 with body: InternalError: We encountered an internal error."),
    ("DEADLINE_EXCEEDED: All 32 retry attempts failed [source locations='x.cc:1']",
     "DEADLINE_EXCEEDED: All 32 retry attempts failed"),
])
def test_storage_errors_keep_a_short_cause(message, cause):
    loc = _location.resolve("s3://bucket/runs/a")
    err = _kvstore.storage_error(loc, "reading", "manifest.json", ValueError(message))
    assert isinstance(err, CheckpointError)
    assert str(err) == f"Reading 'manifest.json' in 's3://bucket/runs/a' failed: {cause}"


@pytest.mark.parametrize("layout", [pytest.param(1, marks=pytest.mark.format1), 3])
def test_fault_hook_set_on_storage_reaches_the_io_layer(tmp_path, monkeypatch, layout):
    # tests (and older callers) set _storage.fault_hook; the fault points live in _iostats
    import jaxckpt
    from jaxckpt import _storage

    seen = []
    monkeypatch.setattr(_storage, "fault_hook", lambda op, key: seen.append((op, key)))
    assert _storage.fault_hook is _storage.fault_hook
    jaxckpt.save(tmp_path / "c", {"big": np.zeros(1 << 18, np.float32), "small": np.ones(3)})
    if layout == 1:  # big's chunk file (jaxckpt's own writer), the packed small leaf (tensorstore)
        assert ("write", "0") in seen and any(k.startswith("packed/p0") for _, k in seen)
    else:  # format 3: each entry of process 0's stream, big's (1 MiB + crc32c, rounded up to 64) then small's
        assert [k for op, k in seen if op == "write"] == ["p0@0", f"p0@{(1 << 20) + 64}"]
        seen.clear()
        jaxckpt.restore(tmp_path / "c")
        assert sorted(k for op, k in seen if op == "read") == ["p0@0", f"p0@{(1 << 20) + 64}"]
    monkeypatch.undo()
    assert _storage.fault_hook is None


def test_a_long_storage_cause_keeps_its_end():
    """A cause past 500 characters keeps its head and its tail: a digest mismatch named
    after four long data object paths (a deep directory) still says what went wrong."""
    from jaxckpt._storage.kvstore import storage_cause

    where = " and ".join(f"/very/deep/run/dir/{'x' * 100}/2/data/p0.{i} bytes [0, 65536)" for i in range(4))
    cause = storage_cause(f"DATA_LOSS: entry at offset 0 of stream p0 (data object {where}): digest mismatch, "
                          "stored digest is 0x00000001 but computed digest is 0x00000002")
    assert len(cause) <= 500 and cause.startswith("DATA_LOSS: entry at offset 0 of stream p0 (data object /very/")
    assert cause.endswith("): digest mismatch, stored digest is 0x00000001 but computed digest is 0x00000002")
    assert storage_cause("short") == "short"
