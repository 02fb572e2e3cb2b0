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

import sys
import tracemalloc

import crc32c
import jax
import numpy as np
import pytest
from conftest import assert_bit_equal, sharded

import jaxckpt
from jaxckpt import _claims, _commit, _snapshot
from jaxckpt._storage import dataobjects as _dataobjects
from jaxckpt._storage import gcs as _gcs
from jaxckpt._storage import kvstore as _kvstore
from jaxckpt._storage import location as _location
from jaxckpt._storage import uploads as _uploads


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


# --- format 3's data objects in composed parts (issue 22) --------------------------------


def composes(monkeypatch):
    """The compose requests sent from now on: ``(destination, number of sources)``."""
    sent, real = [], _gcs._post

    def post(path, body, doing, bound):
        sent.append((path.split("/o/", 1)[1].removesuffix("/compose").replace("%2F", "/"), len(body["sourceObjects"])))
        return real(path, body, doing, bound)

    monkeypatch.setattr(_gcs, "_post", post)
    return sent


def test_crc32c_of_a_concatenation():
    a, b = np.random.default_rng(0).bytes(1000), np.random.default_rng(1).bytes(777)
    assert _gcs.crc32c_combine(crc32c.crc32c(a), crc32c.crc32c(b), len(b)) == crc32c.crc32c(a + b)
    assert _gcs.crc32c_combine(crc32c.crc32c(a), 0, 0) == crc32c.crc32c(a)
    assert _gcs.crc32c_combine(0, crc32c.crc32c(b), len(b)) == crc32c.crc32c(b)


def test_a_stream_goes_up_in_parts_never_assembled_whole(gcs_server, monkeypatch):
    # 24 entries of 1 MiB in segments of 8 MiB and parts of 1 MiB. Before issue 22's GCS
    # parts, the writer held every segment whole in memory (24 MiB) until close.
    monkeypatch.setattr(_uploads, "PART_BYTES", 1 << 20)
    sent = composes(monkeypatch)
    root = _location.resolve(gcs_server("parts/stream")).child("data")
    stride, payload = 1 << 20, (1 << 20) - 64
    data = np.random.default_rng(5).integers(0, 255, (24, payload), dtype=np.uint8)
    length = 23 * stride + payload + _dataobjects.CRC_BYTES
    tracemalloc.start()
    try:
        with _dataobjects.StreamWriter(root, 0, length, 8 << 20) as w:
            for i in range(24):
                w.write_entry(i * stride, data[i])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 12 << 20, f"{peak / 2**20:.1f} MiB held for a 24 MiB stream"
    assert gcs_server.keys("parts/stream/") == [f"parts/stream/data/p0.{n}" for n in range(3)]
    assert sorted(sent) == [(f"parts/stream/data/p0.{n}", 8) for n in range(3)]
    for i in (0, 7, 8, 23):  # the first, one at a segment's end and the next, the last
        back = np.empty(payload, np.uint8)
        _dataobjects.read_entry(root, 0, i * stride, payload, back, 8 << 20)
        assert_bit_equal(back, data[i])


def big_tree(v):
    return {"big": np.arange(1 << 21, dtype=np.float32).reshape(4, -1) + v, "step": np.int64(v)}


def test_a_save_composes_in_rounds_and_leaves_no_parts(gcs_server, monkeypatch):
    monkeypatch.setattr(_snapshot, "SEGMENT_BYTES", 6 << 20)
    monkeypatch.setattr(_uploads, "PART_BYTES", 1)  # raised to gcs.MIN_PART_BYTES, 256 KiB
    monkeypatch.setattr(_gcs, "COMPOSE_SOURCES", 4)
    sent = composes(monkeypatch)
    url = gcs_server("parts/save")
    jaxckpt.save(url, big_tree(1))
    data = _commit.read_manifest(_location.resolve(url)).data
    assert gcs_server.keys("parts/save/") == [f"parts/save/{data}/data/p0.{n}" for n in (0, 1)] + [
        "parts/save/manifest.json"]
    # p0.0 (6 MiB): 24 parts -> 6 -> 2 -> 1; p0.1 (2 MiB and the step): 9 parts -> 3 -> 1
    p00, p01 = (f"parts/save/{data}/data/p0.{n}" for n in (0, 1))
    assert sorted(n for dest, n in sent if dest.startswith(p00)) == sorted([4] * 6 + [4, 2] + [2])
    assert sorted(n for dest, n in sent if dest.startswith(p01)) == [1, 3, 4, 4]
    assert [dest for dest, _ in sent if dest in (p00, p01)] != []
    back = jaxckpt.restore(url)
    assert_bit_equal(back["big"], big_tree(1)["big"])
    assert back["step"] == 1
    assert jaxckpt.verify(url).ok


def data_prefixes(gcs_server, prefix):
    return sorted({k[len(prefix):].split("/")[1] for k in gcs_server.keys(prefix + "d/")
                   if not k.endswith(_claims.CLAIM_SUFFIX)})


@pytest.mark.parametrize("fault", ["part", "compose", "crc32c"])
def test_a_failed_part_or_compose_fails_the_save_and_leaves_nothing(gcs_server, monkeypatch, fault):
    monkeypatch.setattr(_snapshot, "SEGMENT_BYTES", 6 << 20)
    monkeypatch.setattr(_uploads, "PART_BYTES", 2 << 20)
    url = gcs_server(f"parts/failed-{fault}")
    jaxckpt.save(url, big_tree(1))
    old = _commit.read_manifest(_location.resolve(url)).data
    real_write, real_post = _gcs.ObjectUpload._write, _gcs._post

    def write(self, name, data):
        if fault == "part" and name.endswith("p0.0.part2"):
            raise jaxckpt.CheckpointError(f"Writing '{self.root.url}/{name}' failed: refused")
        real_write(self, name, data)

    def post(path, body, doing, bound):
        if fault == "compose":
            raise jaxckpt.CheckpointError(f"{doing} failed: HTTP 503: refused")
        made = real_post(path, body, doing, bound)
        return {**made, "crc32c": "AAAAAA=="} if fault == "crc32c" else made

    monkeypatch.setattr(_gcs.ObjectUpload, "_write", write)
    monkeypatch.setattr(_gcs, "_post", post)
    want = {"part": r"p0\.0\.part2' failed: refused", "compose": r"p0\.0' \(composing 3 parts\) failed: HTTP 503",
            "crc32c": r"p0\.\d' failed: the composed object has \d+ bytes and crc32c AAAAAA=="}[fault]
    with pytest.raises(jaxckpt.CheckpointError, match=want):
        jaxckpt.save(url, big_tree(2), overwrite=True)
    assert data_prefixes(gcs_server, f"parts/failed-{fault}/") == [old[2:]]  # no new data, no parts
    assert _commit.read_manifest(_location.resolve(url)).data == old
    assert_bit_equal(jaxckpt.restore(url)["big"], big_tree(1)["big"])


def test_a_crashed_upload_leaves_its_parts_to_the_dead_attempt_clean_up(gcs_server, monkeypatch):
    monkeypatch.setattr(_snapshot, "SEGMENT_BYTES", 6 << 20)
    monkeypatch.setattr(_uploads, "PART_BYTES", 2 << 20)
    url, prefix = gcs_server("parts/crash"), "parts/crash/"
    jaxckpt.save(url, big_tree(1))
    # a crash during the compose: the process is gone, nothing is cleaned up
    monkeypatch.setattr(_commit, "abort", lambda *a, **kw: None)
    monkeypatch.setattr(_gcs.ObjectUpload, "abort", lambda self: None)

    def crash(*a):
        raise OSError("crashed")

    monkeypatch.setattr(_gcs, "_post", crash)
    with pytest.raises(jaxckpt.CheckpointError, match="crashed$"):
        jaxckpt.save(url, big_tree(2), overwrite=True)
    monkeypatch.undo()
    dead = [p for p in data_prefixes(gcs_server, prefix) if f"d/{p}" != _commit.read_manifest(_location.resolve(url)).data]
    assert len(dead) == 1
    parts = [k for k in gcs_server.keys(f"{prefix}d/{dead[0]}/") if ".part" in k]
    assert parts and all(k.startswith(f"{prefix}d/{dead[0]}/data/p0.") for k in parts)
    # older than the grace period and its claim gone (its process is), the next save removes it
    _kvstore.delete_blob(_location.resolve(url), f"d/{dead[0]}{_claims.CLAIM_SUFFIX}")
    monkeypatch.setattr(_claims, "ATTEMPT_GRACE_S", -1.0)
    jaxckpt.save(url, big_tree(3), overwrite=True)
    assert not [k for k in gcs_server.keys(prefix) if ".part" in k]
    assert data_prefixes(gcs_server, prefix) == [_commit.read_manifest(_location.resolve(url)).data[2:]]
    assert_bit_equal(jaxckpt.restore(url)["big"], big_tree(3)["big"])


def test_upload_file_composes_parts_and_without_a_token_puts_whole(gcs_server, monkeypatch, tmp_path):
    monkeypatch.setattr(_uploads, "PART_BYTES", 1 << 20)
    sent = composes(monkeypatch)
    path = tmp_path / "p0.0"
    path.write_bytes(np.random.default_rng(2).bytes((3 << 20) + 5))
    root = _location.resolve(gcs_server("parts/file"))
    _uploads.upload_file(root, "p0.0", str(path))
    assert sent == [("parts/file/p0.0", 4)]
    assert gcs_server.keys("parts/file/") == ["parts/file/p0.0"]
    assert _kvstore.read_blob(root, "p0.0") == path.read_bytes()
    # without the token and without google-auth (the gcs extra), no composing: one upload
    monkeypatch.delenv(_gcs.TOKEN_ENV)
    monkeypatch.setitem(sys.modules, "google.auth", None)
    monkeypatch.setattr(_gcs, "_found", [])
    assert not _gcs.composing(root)
    assert _gcs._found == [None]
    assert _uploads.parted_object(root, "p0.1") is None


def test_a_compose_request_fails_clearly_and_within_the_bound(gcs_server, monkeypatch):
    import socket
    import time

    root = _location.resolve(gcs_server("parts/refused"))
    upload = _gcs.ObjectUpload(root, "p0.0")
    with pytest.raises(jaxckpt.CheckpointError, match=r"p0\.0' \(composing 2 parts\) failed: HTTP 404"):
        upload._compose(["p0.0.part1", "p0.0.part2"], "p0.0", 0)  # no such parts
    monkeypatch.setenv("JAXCKPT_IO_TIMEOUT_S", "1")
    with socket.socket() as silent:  # takes the connection, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        monkeypatch.setenv(_gcs.URL_ENV, f"http://127.0.0.1:{silent.getsockname()[1]}")
        started = time.monotonic()
        with pytest.raises(jaxckpt.CheckpointError, match=r"failed: no answer from the store in 1 s"):
            upload._compose(["p0.0.part1"], "p0.0", 0)
        assert time.monotonic() - started < 1.5


def without_google_auth(monkeypatch):
    """This process as if the gcs extra were not installed: google-auth does not import
    and jaxckpt sees no token for a compose request (tensorstore keeps its own auth)."""
    monkeypatch.setattr(_gcs, "TOKEN_ENV", "JAXCKPT_TEST_NO_SUCH_TOKEN")
    monkeypatch.setitem(sys.modules, "google.auth", None)
    monkeypatch.setattr(_gcs, "_found", [])


def test_without_google_auth_a_save_puts_small_objects_one_by_one_never_its_stream(gcs_server, monkeypatch):
    # issue 30, defect 4: without a token for compose each data object goes up whole (one
    # upload through tensorstore), and the writer held every object of the stream (1 GiB
    # each) until the end: a 16 MiB state took 16 MiB more. Now the stream is cut into
    # objects of WHOLE_OBJECT_BYTES (here 1 MiB) put as they fill, WHOLE_UPLOADS at once.
    monkeypatch.setattr(_uploads, "WHOLE_OBJECT_BYTES", 1 << 20, raising=False)
    without_google_auth(monkeypatch)
    sent = composes(monkeypatch)
    url = gcs_server("whole/ckpt")
    state = {"big": np.arange(1 << 22, dtype=np.float32).reshape(4, -1) + 7, "step": np.int64(7)}
    tracemalloc.start()
    try:
        jaxckpt.save(url, state)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < (4 + 2) << 20, f"{peak / 2**20:.1f} MiB held to save 16 MiB"
    man = _commit.read_manifest(_location.resolve(url))
    assert man.segment_bytes == 1 << 20 and man.streams[0] >= 16 << 20 and sent == []
    count = -(-man.streams[0] // (1 << 20))
    assert sorted(gcs_server.keys(f"whole/ckpt/{man.data}/")) == sorted(
        f"whole/ckpt/{man.data}/data/p0.{n}" for n in range(count))
    back = jaxckpt.restore(url)
    assert_bit_equal(back["big"], state["big"]) and back["step"] == 7
    assert jaxckpt.verify(url).ok


def test_a_process_that_cut_its_stream_finer_fails_the_save(gcs_server, monkeypatch):
    # GCS lists no sizes: a process whose data objects are smaller than process 0's
    # layout (the gcs extra missing there only) is seen by the objects it has no place for
    from jaxckpt import _checkpoint, _writer

    def finer(staging, snap):
        table = _writer.write_data(staging, snap)
        _kvstore.write_blob(staging.child("data"), "p0.1", b"x")
        return table

    monkeypatch.setattr(_checkpoint, "write_data", finer)
    url = gcs_server("whole/finer")
    with pytest.raises(jaxckpt.CheckpointError, match=r"^data object data/p0\.1 is not in process 0's layout "
                                                     r"\(data objects of 1073741824 bytes\): install jaxckpt's "
                                                     r"extras \(s3, gcs\) alike in every process of the job$"):
        jaxckpt.save(url, big_tree(1))
    with pytest.raises(jaxckpt.CheckpointNotFoundError):
        jaxckpt.restore(url)
