"""Bounded staging memory (issue 12, item 7): a snapshot staged and written in waves
within a ``StagingBudget`` (``CheckpointManager(max_staging_bytes=...)``)."""

import json
import os
import shutil
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_bit_equal, sharded

import jaxckpt
from jaxckpt import _checkpoint, _snapshot, _storage, _tree
from jaxckpt._storage import zarr as _zarr

MiB = 1 << 20
BUDGET = 4 * MiB


def _save_in_waves(path, tree, budget, copy=True):
    """What an async ``CheckpointManager(max_staging_bytes=...).save`` does: the first
    wave staged, the writes and the commit in a background thread, the other waves
    staged here; returns (writer thread, its errors) once every wave is staged."""
    snap = _snapshot.snapshot(tree, copy_host_arrays=copy, budget=budget)
    errors = []

    def write():
        try:
            _checkpoint.save_snapshot(path, snap)
        except BaseException as e:  # noqa: BLE001 - the test reads it
            errors.append(e)

    writer = threading.Thread(target=write)
    writer.start()
    snap.stage_rest()
    return writer, errors


def _write_keys(tmp_path, tree, layout):
    """Each leaf's key at the write fault point: its key (format 1), or its first entry's
    ``p<k>@<offset>`` (format 3: the layout of the same tree saved once, unhooked)."""
    if layout == "1":
        return {path: str(i) for i, (path, _) in enumerate(_tree.flatten(tree)[0])}
    jaxckpt.save(tmp_path / "layout", tree)
    man = json.loads((tmp_path / "layout" / "manifest.json").read_text())
    shutil.rmtree(tmp_path / "layout")
    return {leaf["path"]: f"p{leaf['runs'][0][0]}@{leaf['runs'][0][3]}" for leaf in man["leaves"] if leaf.get("runs")}


def _mixed_state():
    rng = np.random.default_rng(0)
    return {
        # 1.2 MB each: big leaves (a file of their own), two per wave (cap = budget / 2)
        "host": [rng.standard_normal(300_000).astype(np.float32) for _ in range(6)],
        "oversized": rng.standard_normal(1_500_000),  # 12 MB: one chunk, bigger than the budget
        "sharded": sharded(np.arange(1 << 19, dtype=np.float32), (4,), ("x",), ("x",)),
        "sharded2d": sharded(rng.standard_normal((512, 1024)).astype(jnp.bfloat16), (2, 2), ("a", "b"),
                             ("a", "b")),
        "small": {"i": np.arange(10), "s": np.float16(2.5), "j": jnp.ones(3)},
        "key": jax.random.key(3),
        "step": 7,
        "fortran": np.asfortranarray(rng.standard_normal((600, 400))),  # not C-contiguous: copied
    }


def _assert_restores(path, tree):
    out = jaxckpt.restore(path)
    flat_in, _ = _tree.flatten(tree)
    flat_out = dict(_tree.flatten(out)[0])
    for key, leaf in flat_in:
        got = flat_out[key]
        if isinstance(leaf, (int, str)):
            assert got == leaf
        elif _snapshot.is_prng(leaf):
            assert_bit_equal(jax.random.key_data(got), jax.random.key_data(leaf))
        else:
            assert_bit_equal(got, leaf)


def _writes_observed(monkeypatch, budget):
    """The budget's bytes in flight at every chunk write."""
    seen = []
    monkeypatch.setattr(_storage, "fault_hook", lambda op, key: seen.append(budget.in_flight))
    return seen


@pytest.mark.parametrize("layout", ["1", "3"])
def test_waves_write_a_bit_exact_checkpoint_within_the_budget(tmp_path, monkeypatch, layout):
    monkeypatch.setenv("JAXCKPT_FORMAT", layout)
    tree = _mixed_state()
    budget = _snapshot.StagingBudget(BUDGET)
    seen = _writes_observed(monkeypatch, budget)
    writer, errors = _save_in_waves(tmp_path / "c", tree, budget)
    writer.join()
    assert errors == []
    _assert_restores(tmp_path / "c", tree)
    if layout == "1":  # only the oversized chunk (staged alone) ever passes the budget
        assert budget.peak == tree["oversized"].nbytes
        assert max(seen) <= max(BUDGET, tree["oversized"].nbytes)
    else:  # format 3 cuts it into chunks of 3 MB (fine_chunk_shape): nothing passes the budget
        man = json.loads((tmp_path / "c" / "manifest.json").read_text())
        assert next(r["chunk_shape"] for r in man["leaves"] if r["path"] == "oversized") == [375_000]
        assert 0 < budget.peak <= BUDGET and max(seen) <= BUDGET
    assert budget.in_flight == 0


def test_without_the_oversized_chunk_the_peak_stays_within_the_budget(tmp_path, monkeypatch):
    tree = _mixed_state()
    del tree["oversized"]
    budget = _snapshot.StagingBudget(BUDGET)
    seen = _writes_observed(monkeypatch, budget)
    writer, errors = _save_in_waves(tmp_path / "c", tree, budget)
    writer.join()
    assert errors == []
    _assert_restores(tmp_path / "c", tree)
    assert 0 < budget.peak <= BUDGET and max(seen) <= BUDGET


def test_device_shards_are_staged_in_waves(tmp_path, monkeypatch):
    # what happens on GPU/TPU: jax shards need a device-to-host copy and count
    monkeypatch.setattr(_snapshot, "_on_cpu", lambda data: False)
    tree = {"w": [sharded(np.full((1024, 512), i, np.float32), (4,), ("x",), ("x", None)) for i in range(6)],
            "b": sharded(np.arange(4 << 20, dtype=np.uint8), (2,), ("x",), (None,))}  # replicated
    budget = _snapshot.StagingBudget(BUDGET)
    snap = _snapshot.snapshot(tree, copy_host_arrays=False, budget=budget)
    assert len(snap.waves._todo) >= 2  # more than one wave is left to stage
    writer = threading.Thread(target=_checkpoint.save_snapshot, args=(tmp_path / "c", snap))
    writer.start()
    snap.stage_rest()
    writer.join()
    _assert_restores(tmp_path / "c", tree)
    assert budget.peak <= BUDGET


def test_a_device_chunk_smaller_than_its_shard_is_staged_from_a_slice():
    x = sharded(np.arange(64 * 8, dtype=np.int32).reshape(64, 8), (2,), ("x",), ("x", None))
    data = x.addressable_shards[1].data
    leaf = _snapshot._ArrayLeaf(0, {}, [], {((32, 64), (0, 8)): data})
    chunk = _snapshot._Chunk(((40, 48), (0, 8)), 8 * 8 * 4, (0,), ((32, 64), (0, 8)))
    whole = _snapshot._Chunk(((32, 64), (0, 8)), 32 * 8 * 4, (0,), ((32, 64), (0, 8)))
    assert_bit_equal(np.asarray(_snapshot._start_host(leaf, chunk, False)), np.asarray(x)[40:48])
    own = _snapshot._start_host(leaf, whole, False)
    assert own is not data  # the host copy is cached on an array the snapshot owns
    assert_bit_equal(np.asarray(own), np.asarray(x)[32:])


@pytest.mark.parametrize("layout", ["1", "3"])
def test_mutating_host_arrays_once_save_returns_changes_nothing_saved(tmp_path, monkeypatch, layout):
    monkeypatch.setenv("JAXCKPT_FORMAT", layout)
    tree = {f"a{i}": np.full(300_000, i, np.float32) for i in range(8)}
    expected = {k: v.copy() for k, v in tree.items()}
    last = _write_keys(tmp_path, tree, layout)["a7"]
    released = threading.Event()
    late = []

    def hold_last(op, key):  # the last wave is written only after the caller mutated everything
        if op == "write" and key == last:
            late.append(released.wait(10))

    monkeypatch.setattr(_storage, "fault_hook", hold_last)
    budget = _snapshot.StagingBudget(BUDGET)
    writer, errors = _save_in_waves(tmp_path / "c", tree, budget)
    for v in tree.values():
        v[...] = -1
    released.set()
    writer.join()
    assert errors == [] and late == [True]
    _assert_restores(tmp_path / "c", expected)
    assert budget.peak <= BUDGET


@pytest.mark.parametrize("layout", ["1", "3"])
def test_a_failure_in_wave_two_commits_nothing_and_leaves_no_staging(tmp_path, monkeypatch, layout):
    monkeypatch.setenv("JAXCKPT_FORMAT", layout)
    tree = {f"a{i}": np.full(300_000, i, np.float32) for i in range(8)}
    keys = _write_keys(tmp_path, tree, layout)
    written = []

    def fail_in_wave_two(op, key):
        if op == "write":
            written.append(key)
            if key == keys["a3"]:  # waves: (a0 a1) (a2 a3) ...; a2 is written first
                raise OSError("disk on fire")

    monkeypatch.setattr(_storage, "fault_hook", fail_in_wave_two)
    budget = _snapshot.StagingBudget(BUDGET)
    writer, errors = _save_in_waves(tmp_path / "c", tree, budget)  # returns: the writer stopped it
    writer.join()
    assert len(errors) == 1 and isinstance(errors[0], jaxckpt.CheckpointError)
    assert "disk on fire" in str(errors[0])
    assert keys["a2"] in written and keys["a7"] not in written
    assert os.listdir(tmp_path) == []  # no checkpoint, no staging directory
    assert budget.in_flight == 0


def test_a_failed_staging_fails_the_save_not_the_caller(tmp_path, monkeypatch):
    tree = {f"a{i}": np.full(300_000, i, np.float32) for i in range(8)}
    real = _snapshot._start_host
    calls = []

    def fail_late(leaf, chunk, copy):
        calls.append(1)
        if len(calls) == 5:
            raise MemoryError("no host memory")
        return real(leaf, chunk, copy)

    monkeypatch.setattr(_snapshot, "_start_host", fail_late)
    budget = _snapshot.StagingBudget(BUDGET)
    writer, errors = _save_in_waves(tmp_path / "c", tree, budget)
    writer.join()
    assert len(errors) == 1 and "no host memory" in str(errors[0])
    assert os.listdir(tmp_path) == []
    assert budget.in_flight == 0


def test_a_writer_in_the_callers_thread_stages_the_waves_itself(tmp_path):
    tree = _mixed_state()
    budget = _snapshot.StagingBudget(BUDGET)
    snap = _snapshot.snapshot(tree, copy_host_arrays=False, budget=budget)
    _checkpoint.save_snapshot(tmp_path / "c", snap)  # no stage_rest(): a blocking save
    _assert_restores(tmp_path / "c", tree)
    # not copying host arrays, only the Fortran-ordered one needs a (C-ordered) copy
    assert tree["fortran"].nbytes <= budget.peak <= BUDGET // 2 and budget.in_flight == 0


@pytest.mark.format1
def test_each_array_is_created_once(tmp_path, monkeypatch):
    created = []
    real = _zarr.open_array

    def counting(spec, ctx, *, create):
        if create:
            created.append(spec["kvstore"]["path"])
        return real(spec, ctx, create=create)

    monkeypatch.setattr(_zarr, "open_array", counting)
    tree = {f"a{i}": np.full(300_000, i, np.float32) for i in range(8)} | {"small": np.arange(3)}
    writer, errors = _save_in_waves(tmp_path / "c", tree, _snapshot.StagingBudget(BUDGET))
    writer.join()
    assert errors == []
    assert len(created) == len(set(created)) == 9  # 8 big leaves and the packed array
    _assert_restores(tmp_path / "c", tree)


def test_saves_sharing_a_budget_take_turns(tmp_path):
    budget = _snapshot.StagingBudget(BUDGET)
    trees = [{f"a{i}": np.full(300_000, i + 10 * n, np.float32) for i in range(8)} for n in range(2)]
    first = _save_in_waves(tmp_path / "c0", trees[0], budget)
    second = _save_in_waves(tmp_path / "c1", trees[1], budget)  # waits for the first's room
    for writer, errors in (first, second):
        writer.join()
        assert errors == []
    for n, tree in enumerate(trees):
        _assert_restores(tmp_path / f"c{n}", tree)
    assert budget.peak <= BUDGET and budget.in_flight == 0


def test_without_a_budget_nothing_is_staged_in_waves():
    snap = _snapshot.snapshot({"x": np.ones(300_000)}, copy_host_arrays=True)
    assert snap.waves is None and snap.file_shards[0][0][1].nbytes == 2_400_000
    snap.stage_rest()  # nothing to do
    snap.close()


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "1M"])
def test_a_budget_is_a_positive_int(bad):
    with pytest.raises(ValueError, match="max_staging_bytes"):
        _snapshot.StagingBudget(bad)
    assert _snapshot.staging_budget(None) is None


def test_manager_saves_in_waves(tmp_path, monkeypatch):
    tree = _mixed_state()
    expected = {k: v.copy() for k, v in enumerate(tree["host"])}
    released = threading.Event()

    def hold(op, key):
        if op == "write" and threading.current_thread().name.startswith("jaxckpt"):
            released.wait(0.05)

    monkeypatch.setattr(_storage, "fault_hook", hold)
    with jaxckpt.CheckpointManager(tmp_path, max_staging_bytes=BUDGET) as mgr:
        mgr.save(1, tree)
        for v in tree["host"]:
            v[...] = 0
        released.set()
        mgr.wait_until_finished()
        assert mgr._staging.peak <= tree["oversized"].nbytes
        out = mgr.restore(1)
    for k, v in expected.items():
        assert_bit_equal(out["host"][k], v)
    assert_bit_equal(out["oversized"], tree["oversized"])
    assert mgr.info(1)["blocking_seconds"] > 0


@pytest.mark.parametrize("layout", ["1", "3"])
def test_manager_failure_in_a_wave_surfaces_later_and_commits_nothing(tmp_path, monkeypatch, layout):
    monkeypatch.setenv("JAXCKPT_FORMAT", layout)
    tree = {f"a{i}": np.full(300_000, i, np.float32) for i in range(8)}
    keys = _write_keys(tmp_path, tree, layout)

    def fail(op, key):
        if op == "write" and key == keys["a3"]:
            raise OSError("disk on fire")

    monkeypatch.setattr(_storage, "fault_hook", fail)
    mgr = jaxckpt.CheckpointManager(tmp_path, max_staging_bytes=BUDGET)
    assert mgr.save(1, tree)  # returns: the failure is the writer's
    with pytest.raises(jaxckpt.CheckpointError, match="disk on fire"):
        mgr.wait_until_finished()
    mgr.close()
    assert mgr.all_steps() == []
    assert [n for n in os.listdir(tmp_path) if n not in (".jaxckpt-writer.json", "history.jsonl")] == []


# --- several processes: each writes all its waves, then the usual agreement -------------


def _run_processes(scenario, path, nproc=2):
    import json
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--process", str(port), str(nproc), str(i),
                               scenario, str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for i in range(nproc)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=120))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    results = []
    for out, err in outs:
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        assert lines, err[-3000:]
        results.append(json.loads(lines[-1][7:]))
    return results


def test_processes_write_their_waves_then_commit_once(tmp_path):
    results = _run_processes("ok", tmp_path / "c")
    for r in results:
        assert r["errors"] == [] and r["same"], r
        assert r["waves"] > 2 and r["peak"] <= r["budget"] and r["in_flight"] == 0
    assert os.listdir(tmp_path) == ["c"]


@pytest.mark.slow
def test_a_process_failing_in_wave_two_fails_every_process(tmp_path):
    results = _run_processes("fail", tmp_path / "c")
    assert all(r["errors"] and "injected in wave two" in r["errors"][0] for r in results), results
    assert all(r["in_flight"] == 0 for r in results)
    assert os.listdir(tmp_path) == []


def _process_main(port, nproc, pid, scenario, path):
    """One process of a job saving in waves (run by the two tests above). Its jax shards
    are staged as accelerator shards are (``_on_cpu`` patched): copied, counted, and
    replicated chunks (shared by the processes) sliced from their shard."""
    import json

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid, initialization_timeout=60)
    _snapshot._on_cpu = lambda data: False
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
    rng = np.random.default_rng(0)
    host = {f"s{i}": rng.standard_normal((64, 4096)).astype(np.float32) for i in range(4)}  # sharded, 1 MiB
    host |= {f"r{i}": rng.standard_normal(1 << 19).astype(np.float32) for i in range(3)}  # replicated, 2 MiB
    tree = {k: jax.make_array_from_callback(v.shape, jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec("x" if k[0] == "s" else None)), lambda idx, v=v: v[idx])
        for k, v in host.items()}
    tree |= {"np": [rng.standard_normal(1 << 18) for _ in range(4)], "step": 5}  # 2 MiB each, in every process
    saved = [a.copy() for a in tree["np"]]
    if scenario == "fail" and pid == 1:
        writes = []

        def fail(op, key):
            writes.append(op)
            if writes.count("write") == 4:
                raise OSError("injected in wave two")

        _storage.fault_hook = fail
    budget = _snapshot.StagingBudget(3 * MiB)
    snap = _snapshot.snapshot(tree, copy_host_arrays=True, budget=budget)
    result = {"waves": len(snap.waves._todo) + 1, "budget": budget.max_bytes}
    errors = []

    def write():
        try:
            _checkpoint.save_snapshot(path, snap, timeout_s=30)
        except jaxckpt.CheckpointError as e:
            errors.append(str(e))

    writer = threading.Thread(target=write)
    writer.start()
    snap.stage_rest()
    for a in tree["np"]:
        a[...] = 0
    writer.join()
    result |= {"errors": errors, "peak": budget.peak, "in_flight": budget.in_flight}
    if not errors:
        back = jaxckpt.restore(path)
        result["same"] = (all(np.asarray(back[k]).tobytes() == v.tobytes() for k, v in host.items())
                          and all(b.tobytes() == a.tobytes() for b, a in zip(back["np"], saved)) and back["step"] == 5)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["--process"]:
        _process_main(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6])
