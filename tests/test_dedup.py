"""CheckpointManager(dedup=True) (issue 35): runs whose bytes a retained step holds are
referred to, not written again; every listed step restores bit for bit whatever was
deleted; the pool keeps exactly what some manifest on disk names."""

import json
import os
import random
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_bit_equal

import jaxckpt
from jaxckpt import _commit, _manifest
from jaxckpt._manager import dedup as _dedup

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = np.arange(256 * 512, dtype=np.float32).reshape(256, 512)  # 512 KiB: "the frozen base"


def _pool(d):
    p = os.path.join(d, _manifest.POOL_DIR)
    return sorted(os.listdir(p)) if os.path.isdir(p) else []


def _named(d):
    """The pool entries the manifests on disk name."""
    out = set()
    for name in os.listdir(d):
        if _commit.parse_step_name(name) is not None:
            try:
                man = _commit.read_manifest(jaxckpt._storage.location.resolve(os.path.join(d, name)))
            except jaxckpt.CorruptCheckpointError:
                continue  # a damaged step (a test damaged it)
            out |= _dedup.pools_of(man)
    return out


def _settle(mgr):
    mgr.wait_until_finished()
    mgr._deleter.wait()


def test_a_frozen_base_is_written_once_and_every_step_restores_exactly(tmp_path):
    d = str(tmp_path / "run")
    base = {"w": jnp.asarray(BASE), "b": jnp.ones((64,), jnp.bfloat16)}
    with jaxckpt.CheckpointManager(d, max_to_keep=2, dedup=True) as mgr:
        for step in range(5):
            mgr.save(step, {"base": base, "lora": jnp.full((8, 16), step, jnp.float32), "step": step})
            _settle(mgr)
        assert mgr.all_steps() == [3, 4]
        first = mgr.info(0 + 3)["dedup"]
        assert first["referred_steps"] == [0]
        # the base (its entries: payload and crc32c) is referred to; only the adapter is written
        assert first["referred_bytes"] == (BASE.nbytes + 4) + (64 * 2 + 4)
        assert first["written_bytes"] == 8 * 16 * 4 + 4
        for step in (3, 4):
            got = mgr.restore(step)
            assert_bit_equal(got["base"]["w"], BASE)
            assert_bit_equal(got["base"]["b"], np.ones((64,), jnp.bfloat16))
            assert_bit_equal(got["lora"], np.full((8, 16), step, np.float32))
            assert got["step"] == step
    # step 0 is gone, its pool entry stays: steps 3 and 4 read its bytes
    assert set(_pool(d)) == _named(d) and len(_pool(d)) == 3
    assert sorted(n for n in os.listdir(d) if n.isdigit()) == ["3", "4"]
    assert os.listdir(os.path.join(d, "3")) == ["manifest.json"]
    # a plain restore of the step's directory, and verify, with no knowledge of its history
    got = jaxckpt.restore(os.path.join(d, "4"))
    assert_bit_equal(got["base"]["w"], BASE)
    report = jaxckpt.verify(os.path.join(d, "4"))
    assert report.ok, report
    assert_bit_equal(np.asarray(jaxckpt.open(os.path.join(d, "4"))["base/w"][1:3]), BASE[1:3])  # a lazy view


def test_equal_values_in_new_arrays_are_found_by_their_hash(tmp_path):
    d = str(tmp_path / "run")
    with jaxckpt.CheckpointManager(d, dedup=True) as mgr:
        mgr.save(0, {"w": jnp.asarray(BASE)})
        _settle(mgr)
        mgr.save(1, {"w": jnp.asarray(BASE.copy())})  # another array, the same bytes
        _settle(mgr)
        assert mgr.info(1)["dedup"]["referred_steps"] == [0]
        changed = BASE.copy()
        changed.view(np.uint32)[77, 3] ^= 1  # one bit
        mgr.save(2, {"w": jnp.asarray(changed)})
        _settle(mgr)
        assert mgr.info(2)["dedup"]["referred_bytes"] == 0
        assert_bit_equal(mgr.restore(1)["w"], BASE)
        assert_bit_equal(mgr.restore(2)["w"], changed)
        man = _commit.read_manifest(jaxckpt._storage.location.resolve(os.path.join(d, "2")))
        (rec,) = man.leaves
        assert len(rec.hashes) == len(rec.runs) == 1 and len(rec.hashes[0]) == 32


def test_a_new_manager_goes_on_referring_to_the_latest_step(tmp_path):
    d = str(tmp_path / "run")
    with jaxckpt.CheckpointManager(d, dedup=True) as mgr:
        mgr.save(0, {"w": jnp.asarray(BASE), "x": jnp.zeros(4)})
    with jaxckpt.CheckpointManager(d, dedup=True, max_to_keep=1) as mgr:
        mgr.save(1, {"w": jnp.asarray(BASE), "x": jnp.ones(4)})
        _settle(mgr)
        assert mgr.all_steps() == [1]
        assert mgr.info(1)["dedup"]["referred_steps"] == [0]
        assert_bit_equal(mgr.restore(1)["w"], BASE)
    assert set(_pool(d)) == _named(d) and len(_pool(d)) == 2


def test_a_leaf_that_keeps_changing_stops_being_hashed_and_is_still_saved_exactly(tmp_path):
    d = str(tmp_path / "run")
    values = {}
    with jaxckpt.CheckpointManager(d, dedup=True, max_to_keep=3) as mgr:
        for step in range(12):
            values[step] = BASE + step
            mgr.save(step, {"w": jnp.asarray(values[step])})
            _settle(mgr)
        hashed = [bool(_commit.read_manifest(jaxckpt._storage.location.resolve(os.path.join(d, str(s))))
                       .leaves[0].hashes) for s in mgr.all_steps()]
        habit = mgr._dedup._habits["w"]
        assert habit.backoff > 1 and not all(hashed)  # hashing backed off
        for step in mgr.all_steps():
            assert_bit_equal(mgr.restore(step)["w"], values[step])


@pytest.mark.parametrize("kwargs, name", [
    ({"peer_copies": 1}, "peer_copies"),
    ({"compression": "zstd"}, "compression"),
    ({"max_staging_bytes": 1 << 20}, "max_staging_bytes"),
])
def test_options_dedup_does_not_support_yet_are_refused(tmp_path, kwargs, name):
    with pytest.raises(jaxckpt.CheckpointError) as e:
        jaxckpt.CheckpointManager(str(tmp_path / "run"), dedup=True, **kwargs)
    assert str(e.value) == f"dedup=True with {name} is not supported yet: pass one or the other"
    assert not os.path.exists(tmp_path / "run" / _manifest.POOL_DIR)


def _expected_state(rng, prev):
    """A random next state: each leaf kept (the same array), copied (new array, same
    values) or changed, from ``prev`` (path -> (jax array, numpy values))."""
    out = {}
    for name, shape, dtype in (("a", (64, 32), np.float32), ("b", (7, 5), np.int32), ("c", (300,), np.uint8)):
        how = rng.choice(["keep", "copy", "change"]) if name in prev else "change"
        if how == "keep":
            out[name] = prev[name]
        elif how == "copy":
            out[name] = (jnp.asarray(prev[name][1].copy()), prev[name][1])
        else:
            values = (np.random.default_rng(rng.randrange(1 << 30)).integers(0, 200, shape)).astype(dtype)
            out[name] = (jnp.asarray(values), values)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_random_saves_deletes_and_resaves_keep_every_listed_step_exact(tmp_path, seed):
    rng = random.Random(seed)
    d = str(tmp_path / "run")
    keep = rng.choice([None, 1, 2, 3])
    expected, step, prev = {}, 0, {}
    mgr = jaxckpt.CheckpointManager(d, dedup=True, max_to_keep=keep)
    try:
        for _ in range(24):
            op = rng.choices(["save", "delete", "resave", "reopen"], [6, 2, 1, 1])[0]
            listed = mgr.all_steps()
            if op == "delete" and listed:
                s = rng.choice(listed)
                mgr.delete(s)
                expected.pop(s)
            elif op == "resave" and set(range(step)) - set(listed):
                s = rng.choice(sorted(set(range(step)) - set(listed)))
                prev = _expected_state(rng, prev)
                mgr.save(s, {k: v[0] for k, v in prev.items()}, force=True)
                expected[s] = {k: v[1] for k, v in prev.items()}
            elif op == "reopen":
                mgr.close()
                mgr = jaxckpt.CheckpointManager(d, dedup=True, max_to_keep=keep)
            else:
                prev = _expected_state(rng, prev)
                mgr.save(step, {k: v[0] for k, v in prev.items()})
                expected[step] = {k: v[1] for k, v in prev.items()}
                step += 1
            _settle(mgr)
            listed = mgr.all_steps()
            for s in listed:
                got = mgr.restore(s)
                for k, v in expected[s].items():
                    assert_bit_equal(got[k], v)
            assert _named(d) <= set(_pool(d))  # nothing a listed step names is gone
            expected = {s: v for s, v in expected.items() if s in listed}
        mgr._dedup.sweep()
        assert set(_pool(d)) == _named(d)  # and nothing else is kept
    finally:
        mgr.close()


WORKER = """
import json, os, sys
import numpy as np, jax.numpy as jnp, jaxckpt
d, first, last = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
base = jnp.asarray(np.arange(256 * 512, dtype=np.float32).reshape(256, 512))
with jaxckpt.CheckpointManager(d, max_to_keep=2, dedup=True) as mgr:
    for step in range(first, last):
        mgr.save(step, {"base": base, "head": jnp.full((16,), step, jnp.float32)})
        mgr.wait_until_finished()
        print("COMMITTED", step, flush=True)
    mgr._deleter.wait()
print("DONE", flush=True)
"""


@pytest.mark.parametrize("point", ["data:start:3", "write:3", "commit:before-manifest:2",
                                   "commit:after-rename:3", "delete:after-rename:1", "delete:middle:2",
                                   "sweep:delete:1"])
def test_a_crash_at_any_point_leaves_every_listed_step_restorable(tmp_path, point):
    d = str(tmp_path / "run")
    env = {**os.environ, "JAXCKPT_FAULT": point, "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-c", WORKER, d, "0", "6"], env=env, capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == -9, (out.returncode, out.stdout, out.stderr[-3000:])  # killed at the point
    # a fresh writer: every listed step restores exactly, saves on, and sweeps what the crash left
    env.pop("JAXCKPT_FAULT")
    out = subprocess.run([sys.executable, "-c", WORKER, d, "10", "12"], env=env, capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    with jaxckpt.CheckpointManager(d, read_only=True) as mgr:
        assert mgr.all_steps() == [10, 11]
        for s in mgr.all_steps():
            got = mgr.restore(s)
            assert_bit_equal(got["base"], np.arange(256 * 512, dtype=np.float32).reshape(256, 512))
            assert_bit_equal(got["head"], np.full((16,), s, np.float32))
    assert set(_pool(d)) == _named(d)


def test_a_referring_manifest_is_validated_before_anything_is_read(tmp_path):
    d = str(tmp_path / "run")
    with jaxckpt.CheckpointManager(d, dedup=True) as mgr:
        mgr.save(0, {"w": jnp.asarray(BASE)})
        mgr.save(1, {"w": jnp.asarray(BASE)})
    path = os.path.join(d, "1", "manifest.json")
    with open(path, "rb") as f:
        good = json.loads(f.read())
    assert good["format_version"] == 4 and len(good["refs"]) == 1 and "data" not in good

    def damaged(change):
        doc = json.loads(json.dumps(good))
        doc.pop("checksum")
        change(doc)
        with open(path, "w") as f:
            json.dump(doc, f)
        with pytest.raises(jaxckpt.CorruptCheckpointError) as e:
            jaxckpt.restore(os.path.join(d, "1"))
        return str(e.value).split("invalid manifest: ", 1)[1]

    assert damaged(lambda m: m["refs"][0].update(pool="../../etc")) == \
        "ref #0: pool '../../etc' is not a pool entry's name"
    assert damaged(lambda m: m.update(pool="a/b")) == "pool 'a/b' is not a pool entry's name"
    assert damaged(lambda m: m["refs"][0].update(length=64)).startswith("leaf 'w': run #0 ")
    assert damaged(lambda m: m.update(refs=[])) == "leaf 'w': run #0 [1, 0, 1, 0]: process 1 has no stream"
    assert damaged(lambda m: m["leaves"][0].update(hashes=["x" * 32])) == \
        "leaf 'w': hashes is not a list of 32-digit hex strings, one per run"
    assert damaged(lambda m: m.update(data="d/x")) == \
        "field 'data' in format_version 4 (its data objects are in the pool entry 'pool' names)"
    assert damaged(lambda m: m.update(format_version=3)) == "field 'pool' needs format_version 4"


def test_on_an_object_store_deletes_keep_what_later_steps_refer_to(s3_server):
    spec = s3_server("dedup/run")
    client = s3_server.client

    def pool():
        keys = [o["Key"] for page in client.get_paginator("list_objects_v2").paginate(
            Bucket="jaxckpt-test", Prefix="dedup/run/.jaxckpt-data/") for o in page.get("Contents", [])]
        return sorted({k.split("/")[3] for k in keys})

    base = jnp.asarray(BASE)
    with jaxckpt.CheckpointManager(spec, max_to_keep=1, dedup=True) as mgr:
        for step in range(4):
            mgr.save(step, {"base": base, "head": jnp.full((16,), step, jnp.float32)})
            _settle(mgr)
        assert mgr.all_steps() == [3]
        assert mgr.info(3)["dedup"]["referred_steps"] == [0]
        assert len(pool()) == 2  # step 0's (the base) and step 3's; steps 1 and 2's swept
        got = mgr.restore(3)
        assert_bit_equal(got["base"], BASE)
        assert_bit_equal(got["head"], np.full((16,), 3, np.float32))
        mgr.save(4, {"base": base + 1, "head": jnp.zeros((16,))})  # the base changes: step 0's bytes go
        _settle(mgr)
        assert mgr.info(4)["dedup"]["referred_bytes"] == 0
        assert len(pool()) == 1
        assert_bit_equal(mgr.restore(4)["base"], BASE + 1)
    keys = [o["Key"] for o in client.list_objects_v2(Bucket="jaxckpt-test", Prefix="dedup/run/4/")["Contents"]]
    assert keys == ["dedup/run/4/manifest.json"]
    assert jaxckpt.verify(spec | {"path": "dedup/run/4/"}).ok


def test_a_referring_step_is_diffed_exported_and_relaid_out_as_a_full_one(tmp_path):
    from jaxckpt import convert

    d = str(tmp_path / "run")
    with jaxckpt.CheckpointManager(d, max_to_keep=1, dedup=True) as mgr:
        mgr.save(0, {"w": jnp.asarray(BASE), "x": jnp.zeros(4)})
        mgr.save(1, {"w": jnp.asarray(BASE), "x": jnp.ones(4)})
        _settle(mgr)
        assert mgr.all_steps() == [1] and mgr.info(1)["dedup"]["referred_steps"] == [0]
    step = os.path.join(d, "1")
    out = str(tmp_path / "copy")
    convert.relayout(step, out)
    convert.to_safetensors(step, str(tmp_path / "st"))
    report = jaxckpt.diff(step, out)  # values read from both: the referred bytes and the copy's
    assert report.arrays["w"]["differ"] == 0 and report.arrays["x"]["differ"] == 0
    report = jaxckpt.diff(os.path.join(d, "1"), str(tmp_path / "copy"))
    assert not report.added and not report.removed
    import shutil

    shutil.rmtree(d)  # the copies stand alone
    got = jaxckpt.restore(out)
    assert_bit_equal(got["w"], BASE)
    assert_bit_equal(got["x"], np.ones(4, np.float32))
    assert jaxckpt.metadata(out).format_version == 3
    from safetensors.numpy import load_file

    files = sorted(os.listdir(tmp_path / "st"))
    tensors = load_file(str(tmp_path / "st" / files[0]))
    assert_bit_equal(tensors["w"], BASE)


@pytest.mark.parametrize("reshard", [False, True])
def test_several_processes_each_refer_to_their_own_rows(tmp_path, reshard):
    from conftest import run_workers

    d = str(tmp_path / "run")
    worker = os.path.join(ROOT, "tests", "mp_dedup_worker.py")
    args = {"path": d, "steps": [0, 1, 2, 3], "max_to_keep": 2, "delete": [2], "reshard": reshard}
    results = run_workers(worker, 2, lambda i, port: [port, 2, i, json.dumps(args)], 240)
    man = _commit.read_manifest(jaxckpt._storage.location.resolve(os.path.join(d, "3")))
    base = next(rec for rec in man.leaves if rec.path == "base")
    for r in results.values():
        assert r["steps"] == [3] and r["exact"], r
        # the base's every entry (each process's rows) referred to, and nothing at step 0
        whole = base.stored_nbytes
        assert whole == 512 * 256 * 4 + 4 * len([c for _, _, n, _ in base.runs for c in range(n)])
        assert r["referred"] == {"0": 0, "1": whole, "2": whole, "3": whole}, r
    assert man.process_count == 2 and {r.step for r in man.refs} == {0} and len(man.refs) == 2
    assert all(stream >= 2 for stream, _, _, _ in base.runs) and len(base.hashes) == len(base.runs)
    assert set(_pool(d)) == _named(d)
    got = jaxckpt.restore(os.path.join(d, "3"))  # one process, another mesh
    assert_bit_equal(got["base"], np.arange(512 * 256, dtype=np.float32).reshape(512, 256))


def test_a_reader_in_the_middle_of_a_restore_keeps_its_step_and_the_bytes_it_refers_to(tmp_path):
    import threading

    from jaxckpt import _storage

    d = str(tmp_path / "run")
    base = jnp.asarray(BASE)
    with jaxckpt.CheckpointManager(d, max_to_keep=1, dedup=True, async_save=False) as mgr:
        mgr.save(0, {"base": base, "head": jnp.zeros(4)})
        mgr.save(1, {"base": base + 1, "head": jnp.ones(4)})  # step 1 refers to nothing
        mgr._deleter.wait()
        assert mgr.all_steps() == [1]
        reading, release, got = threading.Event(), threading.Event(), {}

        def hook(op, key):
            if op == "read" and threading.current_thread().name != "MainThread" and not reading.is_set():
                reading.set()
                assert release.wait(60)

        def read():
            with jaxckpt.CheckpointManager(d, read_only=True) as reader:
                got["state"] = reader.restore(1)

        _storage.fault_hook = hook
        try:
            t = threading.Thread(target=read, name="reader")
            t.start()
            assert reading.wait(60)
            # the writer moves on: step 1 is dropped by retention while the reader reads it
            b2 = base + 2
            mgr.save(2, {"frozen": b2, "head": jnp.full(4, 2.0)})  # a new leaf: hashed
            mgr._deleter.wait()
            assert os.path.exists(os.path.join(d, "1", "manifest.json"))  # deferred: a live reader
            assert _named(d) <= set(_pool(d))
            release.set()
            t.join(60)
        finally:
            _storage.fault_hook = None
        assert_bit_equal(got["state"]["base"], BASE + 1)
        mgr.save(3, {"frozen": b2, "head": jnp.full(4, 3.0)})  # equal hash: refers to step 2's
        mgr._deleter.wait()
        assert mgr.all_steps() == [3] and not os.path.exists(os.path.join(d, "1"))
        assert mgr.info(3)["dedup"]["referred_steps"] == [2]
        assert set(_pool(d)) == _named(d) and len(_pool(d)) == 2
        assert_bit_equal(mgr.restore(3)["frozen"], BASE + 2)


def test_a_step_whose_manifest_does_not_validate_keeps_what_it_may_name_and_no_more(tmp_path, caplog):
    d = str(tmp_path / "run")
    with jaxckpt.CheckpointManager(d, dedup=True, async_save=False) as mgr:
        mgr.save(0, {"w": jnp.asarray(BASE)})
        mgr.save(1, {"w": jnp.asarray(BASE + 1)})
        mgr.save(2, {"w": jnp.asarray(BASE + 1)})  # refers to step 1's bytes
    os.makedirs(os.path.join(d, _manifest.POOL_DIR, "deadbeef0000", "data"))  # an attempt that died
    with open(os.path.join(d, "1", "manifest.json"), "r+b") as f:
        f.write(b"{not json")
    before = _pool(d)
    with jaxckpt.CheckpointManager(d, dedup=True, max_to_keep=2, async_save=False) as mgr:
        assert mgr._dedup.sweep() == []  # step 1 may name any entry there is now
        assert "the manifest of step 1 in " in caplog.text and "the 4 pool entries there now are kept" in caplog.text
        assert_bit_equal(mgr.restore(2)["w"], BASE + 1)  # step 2 still reads step 1's bytes
        for step in range(3, 9):  # a state that changes at every step: each save's entry is new
            mgr.save(step, {"w": jnp.asarray(BASE + step)})
        mgr._deleter.wait()
        # what existed when step 1 was found damaged stays; later entries no step names go
        assert set(_pool(d)) == set(before) | _named(d) and len(_pool(d)) == len(before) + 2
        assert caplog.text.count("does not validate") == 1
        assert mgr.all_steps() == [7, 8]


def test_a_sweep_while_a_save_hashes_leaves_that_save_no_ref_to_what_it_removed(tmp_path):
    # the save chose its refs from the index before the sweep, and takes them after: the
    # refs whose pool entry the sweep removed are dropped, their bytes written instead
    import threading

    d = str(tmp_path / "run")
    x2 = np.random.default_rng(2).standard_normal((256, 512)).astype(np.float32)
    with jaxckpt.CheckpointManager(d, dedup=True) as mgr:
        mgr.save(1, {"a": jnp.asarray(BASE)})
        mgr.save(2, {"x": jnp.asarray(x2)})  # a new leaf: hashed, nothing to compare with
        _settle(mgr)
        entered, go = threading.Event(), threading.Event()
        hashing = _dedup.content_hash

        def paused(rec, chunks):
            entered.set()
            assert go.wait(60)
            return hashing(rec, chunks)

        _dedup.content_hash = paused
        try:
            mgr.save(3, {"x": jnp.asarray(x2.copy())})  # another array, step 2's bytes
            assert entered.wait(60)
            import shutil

            shutil.rmtree(os.path.join(d, "2"))  # step 2 deleted meanwhile (as a delete does, by hand)
            mgr._dedup.forget(2)
            removed = mgr._dedup.sweep()
            assert len(removed) == 1 and removed[0] not in _named(d)
        finally:
            go.set()
            _dedup.content_hash = hashing
        mgr.wait_until_finished()
        assert mgr.info(3)["dedup"]["referred_bytes"] == 0
        assert_bit_equal(mgr.restore(3)["x"], x2)


@pytest.mark.parametrize("ops, keep", [
    # the step the next save compares with is deleted: process 0 sweeps its entry, and every
    # process must forget it (process 1 referred to the gone entry)
    ([["save", 0, "A", False], ["save", 1, "B", False], ["delete", 1], ["save", 2, "B", False]], None),
    # retention drops it at once (a force re-save of an older step, max_to_keep=1)
    ([["save", 5, "A", False], ["save", 3, "B", True], ["save", 6, "B", False]], 1),
])
def test_several_processes_never_refer_to_a_step_deleted_since(tmp_path, ops, keep):
    from conftest import run_workers

    d = str(tmp_path / "run")
    worker = os.path.join(ROOT, "tests", "mp_dedup_worker.py")
    args = {"path": d, "ops": ops, "max_to_keep": keep}
    results = run_workers(worker, 2, lambda i, port: [port, 2, i, json.dumps(args)], 240)
    for r in results.values():
        assert r["exact"], r
    assert set(_pool(d)) == _named(d)
    last = max(int(n) for n in os.listdir(d) if n.isdigit())
    assert_bit_equal(jaxckpt.restore(os.path.join(d, str(last)))["base"],
                     np.arange(512 * 256, dtype=np.float32).reshape(512, 256)[::-1])


def test_a_writer_that_lost_its_lease_removes_nothing_from_the_pool(tmp_path):
    d = str(tmp_path / "run")
    with jaxckpt.CheckpointManager(d, dedup=True, async_save=False) as mgr:
        mgr.save(0, {"w": jnp.asarray(BASE)})
        os.makedirs(os.path.join(d, _manifest.POOL_DIR, "0123456789ab", "data"))  # another writer's, in flight
        lease = os.path.join(d, ".jaxckpt-writer.json")
        with open(lease) as f:
            holder = json.load(f)
        with open(lease, "w") as f:  # taken over (this writer was stopped past its lease period)
            json.dump({**holder, "token": "f" * 32, "pid": holder["pid"] + 1}, f)
        with pytest.raises(jaxckpt.CheckpointError) as e:
            mgr._dedup.sweep()
        assert str(e.value) == f"removing unreferenced data in '{d}': the writer lease is another writer's now"
        assert "0123456789ab" in _pool(d)
        mgr._lease._lost = "the writer lease was taken over"  # as its renewal learns it
        with pytest.raises(jaxckpt.CheckpointError, match="the writer lease was taken over$"):
            mgr._dedup.sweep()
        assert "0123456789ab" in _pool(d)
        with open(lease, "w") as f:  # its own again, for a clean close
            json.dump(holder, f)


def test_an_array_sharing_a_host_buffer_that_changed_in_place_is_saved_as_it_is_now(tmp_path):
    raw = np.zeros(BASE.nbytes + 4096, np.uint8)
    off = (-raw.ctypes.data) % 4096
    host = raw[off:off + BASE.nbytes].view(np.float32).reshape(BASE.shape)
    host[...] = BASE
    w = jax.device_put(host)  # zero-copy on CPU: w shares host's bytes
    with jaxckpt.CheckpointManager(str(tmp_path / "run"), dedup=True, async_save=False) as mgr:
        mgr.save(0, {"w": w})
        host += 1  # the buffer's owner changed it in place: the same jax.Array, other bytes
        mgr.save(1, {"w": w})
        assert mgr.info(1)["dedup"]["referred_bytes"] == 0
        assert_bit_equal(mgr.restore(1)["w"], BASE + 1)
        host += 1
        mgr.save(2, {"w": w})
        assert_bit_equal(mgr.restore(2)["w"], BASE + 2)
        assert_bit_equal(mgr.restore(1)["w"], BASE + 1)


def test_a_manager_remembers_only_the_leaves_it_still_saves(tmp_path):
    with jaxckpt.CheckpointManager(str(tmp_path / "run"), dedup=True, max_to_keep=1, async_save=False) as mgr:
        for step in range(40):
            mgr.save(step, {f"w{step}": jnp.full((8,), step), "b": jnp.zeros(4)})
        assert sorted(mgr._dedup._habits) == ["b", "w39"]


def test_verify_before_delete_reads_a_referring_step_back_and_damaged_shared_bytes_stop_the_refs(tmp_path):
    d = str(tmp_path / "run")
    base = jnp.asarray(BASE)
    with jaxckpt.CheckpointManager(d, dedup=True, verify_before_delete=True, async_save=False) as mgr:
        mgr.save(0, {"base": base, "head": jnp.zeros(4)})
        mgr.save(1, {"base": base, "head": jnp.ones(4)})
        assert mgr.info(1)["dedup"]["referred_steps"] == [0]
        man = _commit.read_manifest(jaxckpt._storage.location.resolve(os.path.join(d, "0")))
        obj = os.path.join(d, _manifest.POOL_DIR, man.pool, "data", "p0.0")
        with open(obj, "r+b") as f:  # the base's bytes, shared by steps 0 and 1, rot
            f.seek(1000)
            byte = f.read(1)
            f.seek(1000)
            f.write(bytes([byte[0] ^ 1]))
        with pytest.raises(jaxckpt.CheckpointError, match="^Saving step 2 .* failed: step 2 failed verification"):
            mgr.save(2, {"base": base, "head": jnp.full(4, 2.0)})  # refers to the damaged bytes: deleted
        assert mgr.all_steps() == [0, 1] and not os.path.exists(os.path.join(d, "2"))
        mgr.save(3, {"base": base, "head": jnp.full(4, 3.0)})  # refers to nothing: writes the base again
        assert mgr.info(3)["dedup"]["referred_bytes"] == 0
        assert_bit_equal(mgr.restore(3)["base"], BASE)
        mgr.save(4, {"base": base, "head": jnp.full(4, 4.0)})  # and refers to that copy from then on
        assert mgr.info(4)["dedup"]["referred_steps"] == [3]

