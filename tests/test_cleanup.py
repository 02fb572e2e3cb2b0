"""The manager's clean-up helpers (jaxckpt/_manager/cleanup.py) on a real directory: who
holds the writer lease, and the uncommitted attempts with their sizes."""

import json
import os

import numpy as np

import jaxckpt
from jaxckpt._manager import cleanup
from jaxckpt._storage import location as _location


def test_writer_lease_names_the_live_holder_and_none_after_close(tmp_path):
    loc = _location.resolve(str(tmp_path))
    assert cleanup.writer_lease(loc) == (None, True)
    with jaxckpt.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"x": np.ones(3)})
        mgr.wait_until_finished()
        holder, gone = cleanup.writer_lease(loc)
        assert holder["pid"] == os.getpid() and gone is False
    assert cleanup.writer_lease(loc) == (None, True)


def test_an_unreadable_lease_counts_as_a_live_holder(tmp_path):
    (tmp_path / ".jaxckpt-writer.json").write_text("{not json")
    assert cleanup.writer_lease(_location.resolve(str(tmp_path))) == ({}, False)


def test_attempts_lists_a_dead_plain_save_with_its_bytes(tmp_path):
    jaxckpt.save(tmp_path / "1", {"x": np.ones(3)})
    hidden = tmp_path / ".2.jaxckpt-tmp-dead"
    (hidden / "arrays").mkdir(parents=True)
    (hidden / "arrays" / "chunk").write_bytes(b"x" * 100)
    entries = cleanup.attempts(_location.resolve(str(tmp_path)))
    assert [(e["step"], e["name"], e["kind"], e["bytes"]) for e in entries] == [
        (2, ".2.jaxckpt-tmp-dead", "tmp", 100)]
    json.dumps([{k: v for k, v in e.items() if k != "writer"} for e in entries])  # plain values


# --- leftovers of killed writers (issue 30, defect 9) ------------------------------------

# A persistent copy of a data object longer than its manifest's size (a directory per
# host) uploads a temporary copy of its first bytes, made in the manager's directory;
# on S3 in parts (here 5 MiB, S3's least). Killed as it starts uploading a part.
COPY = """
import json, sys
from jaxckpt._manager import tiers
from jaxckpt._storage import location, uploads
uploads.PART_BYTES = 1
src, dest, scratch = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
tiers.copy_object(src, location.resolve(dest), "d/1700000000-0123456789ab/data/p0.0", 6 << 20, scratch)
"""


def killed(code, *args, fault):
    import signal
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root, JAX_PLATFORMS="cpu", JAXCKPT_FAULT=fault)
    run = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == -signal.SIGKILL, run.stderr[-3000:]


def pending_uploads(s3_server, prefix):
    listed = s3_server.client.list_multipart_uploads(Bucket="jaxckpt-test", Prefix=prefix)
    return sorted(u["Key"] for u in listed.get("Uploads", []))


def test_a_killed_copy_leaves_no_temporary_file_and_no_upload_once_a_manager_starts(tmp_path, s3_server):
    from jaxckpt import _claims, _commit

    local, persist = tmp_path / "run", s3_server("clean/persist")
    local.mkdir()
    src = tmp_path / "p0.0"
    src.write_bytes(np.random.default_rng(0).bytes(7 << 20))
    killed(COPY, str(src), json.dumps({**persist, "path": "clean/persist/1/"}), str(local), fault="upload:part")
    scratch = [n for n in os.listdir(local) if n.startswith(".jaxckpt-upload-")]
    assert len(scratch) == 1 and os.path.getsize(local / scratch[0]) == 6 << 20
    assert pending_uploads(s3_server, "clean/") == ["clean/persist/1/d/1700000000-0123456789ab/data/p0.0"]
    # a live plain save's upload of step 2 there (its claim names this process): kept
    live = _location.resolve(persist).child("2")
    _claims.write_claim(live, "1700000000-fedcba987654")
    s3_server.client.create_multipart_upload(Bucket="jaxckpt-test",
                                             Key="clean/persist/2/d/1700000000-fedcba987654/data/p0.0")
    # a writer taking both directories over (a manager's start, `jaxckpt gc --yes`)
    jaxckpt.CheckpointManager(local, persistent_directory=persist, persistent_interval_steps=1).close()
    assert [n for n in os.listdir(local) if n.startswith(".jaxckpt-upload-")] == []
    assert pending_uploads(s3_server, "clean/") == ["clean/persist/2/d/1700000000-fedcba987654/data/p0.0"]
    _commit.abort(live, live, "1700000000-fedcba987654")
    s3_server.client.abort_multipart_upload(
        Bucket="jaxckpt-test", Key="clean/persist/2/d/1700000000-fedcba987654/data/p0.0",
        UploadId=s3_server.client.list_multipart_uploads(Bucket="jaxckpt-test", Prefix="clean/")["Uploads"][0]["UploadId"])


def test_a_live_copys_temporary_file_is_kept_and_listed_as_in_use(tmp_path):
    from jaxckpt import _claims

    mine = tmp_path / f"{_claims.scratch_prefix()}x1y2z3"
    dead = tmp_path / ".jaxckpt-upload-somehost-1-2-abcd1234"  # another host's: by its age
    mine.write_bytes(b"m" * 10)
    dead.write_bytes(b"d" * 20)
    os.utime(dead, (0, 0))
    got = cleanup.attempts(_location.resolve(str(tmp_path)))
    assert [(a["name"], a["kind"], a["bytes"], a["writer_alive"]) for a in got] == sorted(
        [(mine.name, "upload", 10, True), (dead.name, "upload", 20, False)])
    assert got[[a["name"] for a in got].index(mine.name)]["writer"]["pid"] == os.getpid()
    jaxckpt.CheckpointManager(tmp_path).close()
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith(".jaxckpt-upload-")) == [mine.name]


def test_a_writers_sweep_of_dead_step_data_removes_only_what_no_manifest_names():
    # _manager.deaddata on an object store (memory://): an attempt's data prefix that the
    # step's manifest does not name goes, the named data stays; dry_run lists, removes nothing
    from jaxckpt._manager import deaddata
    from jaxckpt._storage import kvstore, location

    jaxckpt.save("memory://deaddata/1", {"w": np.arange(4)})
    directory = location.resolve("memory://deaddata")
    kvstore.write_blob(directory.child("1/d/1700000000-deadbeef0000/data"), "p0.0", b"x" * 10)
    assert deaddata.remove_dead_step_data(directory, dry_run=True) == ["1/d/1700000000-deadbeef0000"]
    assert deaddata.remove_dead_step_data(directory) == ["1/d/1700000000-deadbeef0000"]
    assert deaddata.remove_dead_step_data(directory) == []
    np.testing.assert_array_equal(jaxckpt.restore("memory://deaddata/1")["w"], np.arange(4))
