"""Locations and key safety."""

import pytest

from jaxckpt import CheckpointError, _storage


def test_resolve_paths_and_urls(tmp_path):
    loc = _storage.resolve(tmp_path / "c")
    assert loc.local == str(tmp_path / "c") and loc.kvstore == {"driver": "file", "path": f"{tmp_path}/c/"}
    s3 = _storage.resolve("s3://bucket/runs/a/")
    assert s3.kvstore == {"driver": "s3", "bucket": "bucket", "path": "runs/a/"} and s3.url == "s3://bucket/runs/a"
    assert _storage.resolve("gs://b/x").kvstore == {"driver": "gcs", "bucket": "b", "path": "x/"}
    assert _storage.resolve("memory://m").child("7").kvstore == {"driver": "memory", "path": "m/7/"}
    spec = _storage.resolve({"driver": "s3", "bucket": "b", "path": "p", "endpoint": "http://127.0.0.1:1"})
    assert spec.kvstore["endpoint"] == "http://127.0.0.1:1" and spec.kvstore["path"] == "p/"
    with pytest.raises(CheckpointError, match="unsupported checkpoint location 'ftp://x'"):
        _storage.resolve("ftp://x")


@pytest.mark.parametrize("key,ok", [("0", True), ("a/b.c-d_e", True), ("..", False), ("a/../b", False),
                                    ("/abs", False), ("a//b", False), ("", False), ("a\\b", False)])
def test_safe_keys(key, ok):
    assert _storage.is_safe_key(key) is ok


def test_unsupported_zarr_dtypes_are_stored_as_unsigned():
    assert _storage.storage_dtype_name("uint4") == "uint8"
    assert _storage.storage_dtype_name("float8_e4m3") == "uint8"
    assert _storage.storage_dtype_name("bfloat16") == "bfloat16"
