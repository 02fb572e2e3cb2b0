"""Crash-safe commit, overwrite and delete on an object store (a local moto S3 server).

Each save attempt writes under its own data prefix ``<ckpt>/d/<token>/`` and the
manifest, written last, names it (format version 3; 2 with ``JAXCKPT_FORMAT=1``); the
replaced data is deleted only after the new manifest (docs/format.md, "Commit"). Here:
the object-store fixtures (format 2 and 3), the
layout, an overwrite killed (SIGKILL) at every phase, concurrent writers of one
checkpoint, deleting a step, and dead attempts removed by the next writer manager only.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
from conftest import assert_bit_equal, mesh, sharded
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt import _claims, _commit, _manifest, _storage, convert
from jaxckpt._storage import location as _location

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
V2 = os.path.join(FIXTURES, "v2")
sys.path.insert(0, FIXTURES)
from test_format_versions import assert_fixture  # noqa: E402

BUCKET = "jaxckpt-test"
N = 1 << 18  # elements per row of the big leaf: 4 rows, one 1 MiB chunk each


def keys(s3, prefix):
    pages = s3.client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return sorted(o["Key"] for page in pages for o in page.get("Contents", []))


def prefixes(s3, prefix):
    """The data prefixes (``d/<token>``) under checkpoint ``prefix`` (not the claims beside
    them, ``d/<token>.claim``)."""
    return sorted({k[len(prefix):].split("/")[1] for k in keys(s3, prefix)
                   if k[len(prefix):].startswith("d/") and not k.endswith(_claims.CLAIM_SUFFIX)})


def named(spec):
    return _commit.read_manifest(_location.resolve(spec)).data.split("/")[1]


def values(v):
    """The host values of a tree whose every chunk differs between versions ``v``."""
    return {"big": (np.arange(4 * N, dtype=np.float32) + v * 1e6).reshape(4, N),
            "small": np.arange(6, dtype=np.int32) + v * 1000, "step": v}


def tree(v):
    t = values(v)
    t["big"] = sharded(t["big"], (4,), ("x",), ("x", None))
    return t


def assert_is(got, v):
    want = values(v)
    assert_bit_equal(got["big"], want["big"])
    assert_bit_equal(got["small"], want["small"])
    assert got["step"] == v


# --- the format-2 fixture (DESIGN.md rule 8) -------------------------------------------


@pytest.mark.parametrize("name", ["v2", "v3-store"])
def test_object_store_fixtures_uploaded_to_s3_restore(s3_server, name):
    here = os.path.join(FIXTURES, name)
    for root, _, files in os.walk(here):
        for f in files:
            rel = os.path.relpath(os.path.join(root, f), here).replace(os.sep, "/")
            with open(os.path.join(root, f), "rb") as fh:
                s3_server.client.put_object(Bucket=BUCKET, Key=f"fixtures/{name}/{rel}", Body=fh.read())
    spec = s3_server(f"fixtures/{name}")
    assert_fixture(jaxckpt.restore(spec))
    assert jaxckpt.verify(spec).ok


# --- layout ------------------------------------------------------------------------------


@pytest.mark.parametrize("version", [pytest.param(2, marks=pytest.mark.format1), 3])
def test_s3_data_lies_under_the_prefix_the_manifest_names(s3_server, tmp_path, version):
    # format 3: d/<token>/data/p<k>.<n>; with JAXCKPT_FORMAT=1, format 2: d/<token>/arrays, packed
    under, local = ({"arrays", "packed"}, ["arrays", "manifest.json", "packed"]) if version == 2 else (
        {"data"}, ["data", "manifest.json"])
    spec = s3_server(f"layout{version}/ckpt")
    jaxckpt.save(spec, tree(1))
    man = _commit.read_manifest(_location.resolve(spec))
    assert man.format_version == version and man.data.startswith("d/")
    top = {k.split("/")[2] for k in keys(s3_server, f"layout{version}/ckpt/")}
    assert top == {"manifest.json", "d"}
    assert {k.split("/", 4)[4].split("/")[0] for k in keys(s3_server, f"layout{version}/ckpt/{man.data}/")} == under
    assert_is(jaxckpt.restore(spec), 1)
    assert jaxckpt.verify(spec).ok and jaxckpt.metadata(spec).format_version == version
    assert_bit_equal(jaxckpt.open(spec)["big"][2, :5], values(1)["big"][2, :5])
    # convert writes a data prefix too, reading one
    dest = s3_server(f"layout{version}/relaid")
    convert.relayout(spec, dest, shardings=NamedSharding(mesh((2,), ("y",)), P(None, "y")))
    relaid = _commit.read_manifest(_location.resolve(dest))
    assert relaid.data.startswith("d/") and relaid.format_version == version
    assert_is(jaxckpt.restore(dest), 1)
    assert jaxckpt.verify(dest).ok
    convert.relayout(spec, tmp_path / "local")  # and onto a local disk: format 1 or 3, at the root
    assert sorted(os.listdir(tmp_path / "local")) == local
    assert _commit.read_manifest(_location.resolve(str(tmp_path / "local"))).format_version == (
        1 if version == 2 else 3)
    assert_is(jaxckpt.restore(tmp_path / "local"), 1)


@pytest.mark.format1
def test_local_checkpoints_keep_format_1_and_its_layout(tmp_path):
    jaxckpt.save(tmp_path / "c", tree(1))
    assert sorted(os.listdir(tmp_path / "c")) == ["arrays", "manifest.json", "packed"]
    doc = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert doc["format_version"] == 1 and "data" not in doc
    jaxckpt.save(tmp_path / "c", tree(2), overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["c"]
    assert_is(jaxckpt.restore(tmp_path / "c"), 2)


def _manifest_with(edit):
    with open(os.path.join(V2, "manifest.json"), "rb") as f:
        doc = json.loads(f.read())
    edit(doc)
    return json.dumps(doc).encode()


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(data="d/../../x"), "data prefix 'd/../../x' is not 'd/<name>'"),
    (lambda d: d.update(data="../x"), "data prefix '../x' is not"),
    (lambda d: d.update(data="/abs"), "data prefix '/abs' is not"),
    (lambda d: d.update(data="d/.."), "data prefix 'd/..' is not"),
    (lambda d: d.update(data="d/a/b"), "data prefix 'd/a/b' is not"),
    (lambda d: d.update(data="arrays"), "data prefix 'arrays' is not"),
    (lambda d: d.update(data="d/" + "x" * 65), "is not 'd/<name>'"),
    (lambda d: d.update(data=["d/x"]), "data prefix \\['d/x'\\] is not"),
    (lambda d: d.pop("data"), "data prefix None is not"),
    (lambda d: d.update(format_version=1), "field 'data' \\(a data prefix\\) needs format_version 2"),
    (lambda d: d.update(format_version=9), "format_version 9 is not supported \\(this jaxckpt reads 1, 2, 3, 4\\)"),
])
def test_data_prefix_is_validated_as_untrusted_input(edit, message):
    with pytest.raises(jaxckpt.CorruptCheckpointError, match=message):
        _manifest.parse(_manifest_with(edit), "x")


def test_data_prefix_is_not_part_of_info():
    man = _manifest.parse(_manifest_with(lambda d: None), "x")
    assert man.data.startswith("d/") and "data" not in man.info
    assert _manifest.parse(man.to_bytes(), "x") == man


# --- an overwrite killed at every phase ---------------------------------------------------

CHILD = """
import json, os, signal, sys, time
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import jax, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import jaxckpt
from jaxckpt import _storage
args = json.loads(sys.argv[1])
N = {n}
def tree(v):
    big = (np.arange(4 * N, dtype=np.float32) + v * 1e6).reshape(4, N)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("x",))
    return {{"big": jax.device_put(big, NamedSharding(mesh, P("x", None))),
             "small": np.arange(6, dtype=np.int32) + v * 1000, "step": v}}
seen = []
def hook(op, key):
    if op == args["point"]:
        seen.append(key)
        if len(seen) == args["nth"]:
            if args.get("hold"):
                print("HOLD", flush=True)
                time.sleep(600)
            os.kill(os.getpid(), signal.SIGKILL)
if args.get("manager"):
    mgr = jaxckpt.CheckpointManager(args["spec"], async_save=False)
    mgr.save(1, tree(1))
    _storage.fault_hook = hook
    mgr.save(2, tree(2))
else:
    _storage.fault_hook = hook
    jaxckpt.save(args["spec"], tree(args["value"]), overwrite=True)
print("SURVIVED", flush=True)
"""


def _child(**args):
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(CHILD.format(n=N)), json.dumps(args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# (fault point, which call of it, what restores after the kill: 1 = old, 2 = new, and how
# many data prefixes no manifest names are left: the killed attempt's, or the old data).
# Killed at its third entry, an attempt has uploaded nothing yet but its claim: its data
# object is one part (4 MiB), sent once all five entries are in.
PHASES = [("write", 3, 1, 0), ("commit:before-manifest", 1, 1, 1), ("commit:after-manifest", 1, 2, 1),
          ("commit:after-old-delete", 1, 2, 0)]


@pytest.mark.slow
def test_overwrite_killed_at_each_phase_restores_old_or_new_and_the_next_save_cleans(s3_server, monkeypatch):
    specs = [s3_server(f"crash/{i}") for i in range(len(PHASES) + 1)]
    for spec in specs[:-1]:
        jaxckpt.save(spec, tree(1))
    # the last one has no checkpoint yet: a first save killed before its manifest
    cases = PHASES + [("commit:before-manifest", 1, None, 1)]
    children = [_child(spec=spec, point=point, nth=nth, value=2) for spec, (point, nth, _, _) in zip(specs, cases)]
    for child, (point, _, _, _) in zip(children, cases):
        out, err = child.communicate(timeout=180)
        assert child.returncode == -signal.SIGKILL, (point, out, err)
    for i, (spec, (point, _, want, n_dead)) in enumerate(zip(specs, cases)):
        prefix = f"crash/{i}/"
        if want is None:
            with pytest.raises(jaxckpt.CheckpointNotFoundError):
                jaxckpt.restore(spec)
        else:
            assert_is(jaxckpt.restore(spec), want)  # never a mix, never nothing
            assert jaxckpt.verify(spec).ok, point
        dead = [p for p in prefixes(s3_server, prefix) if want is None or p != named(spec)]
        assert len(dead) == n_dead, (point, prefixes(s3_server, prefix))
        # the next overwrite works; a young prefix it did not write stays (its writer
        # might be alive), one older than the grace period goes
        jaxckpt.save(spec, tree(3), overwrite=True)
        assert_is(jaxckpt.restore(spec), 3)
        assert set(prefixes(s3_server, prefix)) == {named(spec), *dead}, point
        monkeypatch.setattr(_claims, "ATTEMPT_GRACE_S", -1.0)
        jaxckpt.save(spec, tree(4), overwrite=True)
        monkeypatch.undo()
        assert prefixes(s3_server, prefix) == [named(spec)], point
        assert [k for k in keys(s3_server, prefix) if k.endswith(_claims.CLAIM_SUFFIX)] == [], point
        assert_is(jaxckpt.restore(spec), 4)


def test_failed_overwrite_keeps_the_old_checkpoint_and_removes_its_own_data(s3_server, monkeypatch):
    spec = s3_server("failed/ckpt")
    jaxckpt.save(spec, tree(1))

    def boom(op, key):
        if op == "write":
            raise OSError("injected")

    monkeypatch.setattr(_storage, "fault_hook", boom)
    with pytest.raises(jaxckpt.CheckpointError, match="injected"):
        jaxckpt.save(spec, tree(2), overwrite=True)
    monkeypatch.setattr(_storage, "fault_hook", None)
    assert_is(jaxckpt.restore(spec), 1)
    assert prefixes(s3_server, "failed/ckpt/") == [named(spec)]


# --- two writers of one checkpoint ---------------------------------------------------------


def _race(spec, order):
    """Writers 5 and 6 overwrite ``spec`` at once, their chunk writes in lockstep.

    ``order="both-read-old"``: both read the old manifest before either PUTs; 5 PUTs
    first. ``"free"``: their commits race."""
    lockstep = threading.Barrier(2, timeout=60)
    first_done = threading.Event()

    def hook(op, key):
        me = threading.current_thread().name
        if op == "write":
            lockstep.wait()  # every chunk write of one is issued with one of the other's
        elif order == "both-read-old" and op == "commit:before-manifest":
            lockstep.wait()
            if me == "writer-6":
                assert first_done.wait(60)
        elif op == "commit:after-old-delete" and me == "writer-5":
            first_done.set()

    errors = []

    def run(v):
        try:
            jaxckpt.save(spec, tree(v), overwrite=True)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    _storage.fault_hook = hook
    try:
        threads = [threading.Thread(target=run, args=(v,), name=f"writer-{v}") for v in (5, 6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        _storage.fault_hook = None
    assert not errors, errors


@pytest.mark.parametrize("order", ["both-read-old", "free", "free"])
def test_concurrent_overwrites_restore_exactly_one_writers_values(s3_server, order, monkeypatch):
    spec = s3_server(f"race/{order}-{os.urandom(3).hex()}")
    prefix = spec["path"] + "/"
    jaxckpt.save(spec, tree(1))
    old = named(spec)
    _race(spec, order)
    got = jaxckpt.restore(spec)
    winner = got["step"]
    assert winner in (5, 6)
    assert_is(got, winner)  # every chunk from the one writer the manifest names
    if order == "both-read-old":
        assert winner == 6
    assert old not in prefixes(s3_server, prefix)  # the replaced data went, after a commit
    assert jaxckpt.verify(spec).ok
    monkeypatch.setattr(_claims, "ATTEMPT_GRACE_S", -1.0)
    jaxckpt.save(spec, tree(7), overwrite=True)  # the loser's prefix is a dead attempt
    assert prefixes(s3_server, prefix) == [named(spec)]


# --- deleting steps and dead attempts in a manager directory ---------------------------------


def test_delete_unlists_the_step_before_deleting_its_data(s3_server, monkeypatch):
    spec = s3_server("del")
    with jaxckpt.CheckpointManager(spec, async_save=False) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"x": np.full(4, step)})
        seen = []

        def hook(op, key):
            if op == "delete:after-manifest":
                with jaxckpt.CheckpointManager(spec, read_only=True) as reader:
                    seen.append((reader.all_steps(), len(keys(s3_server, "del/1/d/"))))
                if key.endswith("/2"):
                    raise OSError("killed while deleting")

        monkeypatch.setattr(_storage, "fault_hook", hook)
        mgr.delete(1)
        assert seen == [([2, 3], 1)]  # unlisted while its data (its one data object) was still there
        assert keys(s3_server, "del/1/") == []
        with pytest.raises(OSError, match="killed while deleting"):
            mgr.delete(2)
        monkeypatch.setattr(_storage, "fault_hook", None)
        assert mgr.all_steps() == [3] and keys(s3_server, "del/2/d/")  # unlisted, data left behind
    with jaxckpt.CheckpointManager(spec) as mgr:  # the next writer removes it
        assert mgr.all_steps() == [3]
        assert keys(s3_server, "del/2/") == []
        assert_bit_equal(mgr.restore(3)["x"], np.full(4, 3))


def test_dead_attempts_are_removed_by_the_next_writer_manager_not_while_theirs_lives(s3_server):
    spec = s3_server("mgr")
    child = _child(spec=spec, manager=True, point="commit:before-manifest", nth=1, hold=True)
    line = child.stdout.readline()
    assert line.strip() == "HOLD", child.stderr.read()
    try:
        attempt = prefixes(s3_server, "mgr/2/")
        assert len(attempt) == 1 and "mgr/2/manifest.json" not in keys(s3_server, "mgr/2/")
        # the writer is alive: a second writer is refused, and nothing is removed
        with pytest.raises(jaxckpt.CheckpointError, match="is being written by another CheckpointManager"):
            jaxckpt.CheckpointManager(spec)
        with jaxckpt.CheckpointManager(spec, read_only=True) as reader:
            assert reader.all_steps() == [1]
        assert prefixes(s3_server, "mgr/2/") == attempt
    finally:
        child.kill()
        child.communicate(timeout=30)
    # a dead attempt inside a committed step too (a writer killed after its PUT, before
    # its old-data delete, leaves one): put one there by hand
    stray = f"mgr/1/d/1000000000-{'0' * 12}/arrays/0/zarr.json"
    s3_server.client.put_object(Bucket=BUCKET, Key=stray, Body=b"{}")
    with jaxckpt.CheckpointManager(spec) as mgr:  # the killed writer's pid is gone: its attempts are dead
        assert mgr.all_steps() == [1]
        assert keys(s3_server, "mgr/2/") == [] and stray not in keys(s3_server, "mgr/1/")
        assert_is(mgr.restore(1), 1)
        mgr.save(2, tree(2))
        mgr.wait_until_finished()
        assert_is(mgr.restore(2), 2)


def test_a_writers_start_sweeps_many_steps_from_one_walk_and_still_finds_the_dead(s3_server, monkeypatch):
    """The start's sweep for dead attempts walks the directory's keys once (1,000 a
    request) instead of listing every step twice; only a step whose shape is not a clean
    commit is listed again, and its dead attempt still goes."""
    from jaxckpt._storage import kvstore as _kvstore

    spec = s3_server("walk")
    with jaxckpt.CheckpointManager(spec, async_save=False) as mgr:
        for step in range(1, 41):
            mgr.save(step, {"x": np.full(4, step)})
    stray = f"walk/7/d/1000000000-{'0' * 12}/data/p0.0"
    s3_server.client.put_object(Bucket=BUCKET, Key=stray, Body=b"dead")
    listed = []
    real = _kvstore.list_children
    monkeypatch.setattr(_kvstore, "list_children", lambda root: listed.append(str(root)) or real(root))
    with jaxckpt.CheckpointManager(spec) as mgr:
        assert stray not in keys(s3_server, "walk/7/")
        assert_bit_equal(mgr.restore(7)["x"], np.full(4, 7))
        assert mgr.latest_step() == 40
    swept = [p for p in listed if "/7" in p]
    assert len(listed) < 12 and swept, listed  # not two per step (80 for these 40): step 7 alone looked at again


@pytest.mark.parametrize("read_only", [False, True])
def test_a_restore_after_the_start_reads_no_manifest_the_start_read(s3_server, monkeypatch, read_only):
    """Round trips on the way to the first step (issue 34): a writer restores its own
    step from the manifest it holds (no read); a read-only manager reads the manifest
    once after it marks the step, and that read is the restore's."""
    spec = s3_server(f"known-{read_only}")
    _commit_steps(spec, (1, 2))
    from jaxckpt._storage import kvstore as _kvstore

    reads = []
    real = _kvstore.read_blob

    def read_blob(root, key):
        if key == _manifest.MANIFEST:
            reads.append(str(root))
        return real(root, key)

    monkeypatch.setattr(_kvstore, "read_blob", read_blob)
    with jaxckpt.CheckpointManager(spec, read_only=read_only) as mgr:
        started = len(reads)
        assert_bit_equal(mgr.restore(None)["x"], np.full(4, 2))
        assert_bit_equal(mgr.restore(1)["x"], np.full(4, 1))
        after = [r.rstrip("/").rsplit("/", 1)[-1] for r in reads[started:]]
    assert started == (1 if read_only else 2), reads  # the newest (and a writer's orbax-run check, beside it)
    # step 1 is read once when first asked about (the lazy listing); a reader reads each
    # step it restores again after marking it, and the restore takes that read
    assert after == (["2", "1", "1"] if read_only else ["1"]), reads


def test_a_read_only_restore_of_a_step_deleted_after_the_start_says_so(s3_server):
    spec = s3_server("known-deleted")
    _commit_steps(spec, (1, 2))
    with jaxckpt.CheckpointManager(spec, read_only=True) as reader:
        with jaxckpt.CheckpointManager(spec, async_save=False) as writer:
            writer.delete(2)
        with pytest.raises(jaxckpt.CheckpointNotFoundError, match=r"^Step 2 in '.*' was deleted$"):
            reader.restore(2)
        assert_bit_equal(reader.restore(1)["x"], np.full(4, 1))


def test_a_writers_start_on_an_object_store_lists_beside_the_lease(s3_server, monkeypatch):
    """The listing and the newest manifest are read while the lead takes the lease and
    sweeps (an explicit point: the lease waits until the listing was asked for; in
    sequence it would wait out its 10 s and find it not asked)."""
    from jaxckpt._manager import lease as _lease

    spec = s3_server("beside")
    _commit_steps(spec, (1, 2, 3))
    listed = threading.Event()
    real_listed, real_acquire = _commit.listed_steps, _lease.Lease.acquire
    monkeypatch.setattr(_commit, "listed_steps", lambda d: listed.set() or real_listed(d))
    seen = []

    def acquire(where, *a, **k):
        seen.append(listed.wait(10))
        return real_acquire(where, *a, **k)

    monkeypatch.setattr(_lease.Lease, "acquire", staticmethod(acquire))
    with jaxckpt.CheckpointManager(spec, async_save=False) as mgr:
        assert seen == [True]
        assert mgr.all_steps() == [1, 2, 3]
        assert_bit_equal(mgr.restore(None)["x"], np.full(4, 3))
        mgr.save(4, {"x": np.full(4, 4)})
    with jaxckpt.CheckpointManager(spec, read_only=True) as mgr:
        assert mgr.all_steps() == [1, 2, 3, 4]


def _commit_steps(spec, steps):
    with jaxckpt.CheckpointManager(spec, async_save=False) as mgr:
        for step in steps:
            mgr.save(step, {"x": np.full(4, step)})
