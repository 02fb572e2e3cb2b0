"""CheckpointManager: async saves in a donating loop, discovery, retention, failures."""

import os
import signal
import subprocess
import sys
import textwrap
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_bit_equal, mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt import _storage
from jaxckpt._storage import kvstore as _kvstore

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def visible(path):
    """What a directory listing shows besides the writer's lease file and the run history."""
    return sorted(n for n in os.listdir(path) if n not in (".jaxckpt-writer.json", "history.jsonl"))


class FakeClock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


def test_async_saves_in_a_donating_jitted_loop_are_exact(tmp_path):
    m = mesh((4, 2), ("data", "model"))
    w_sharding = NamedSharding(m, P("data", "model"))
    state = {
        "w": jax.device_put(jnp.arange(64 * 32, dtype=jnp.float32).reshape(64, 32), w_sharding),
        "b": jax.device_put(jnp.zeros(32, jnp.bfloat16), NamedSharding(m, P())),
        "step": jnp.int32(0),
        "rng": jax.random.key(0),
    }

    @jax.jit
    def train_step(s):
        rng, sub = jax.random.split(s["rng"])
        noise = jax.random.normal(sub, s["w"].shape)
        return {"w": s["w"] * 1.01 + noise, "b": s["b"] + 1, "step": s["step"] + 1, "rng": rng}

    step_fn = jax.jit(train_step, donate_argnums=0)
    expected = {}
    with jaxckpt.CheckpointManager(tmp_path, max_pending=2) as mgr:
        for i in range(1, 9):
            state = step_fn(state)
            expected[i] = jax.tree.map(lambda x: np.array(jax.random.key_data(x) if jax.dtypes.issubdtype(
                x.dtype, jax.dtypes.prng_key) else x), state)
            assert mgr.save(i, state, metrics={"i": i})
        # the loop keeps going (and donating) while saves are in flight
        for _ in range(3):
            state = step_fn(state)
        mgr.wait_until_finished()
        assert mgr.all_steps() == list(range(1, 9))
        target = jax.tree.map(lambda x: x, state)
        for i in range(1, 9):
            back = mgr.restore(i, target)
            assert back["w"].sharding == w_sharding
            for k in ("w", "b", "step"):
                assert_bit_equal(back[k], expected[i][k])
            assert_bit_equal(jax.random.key_data(back["rng"]), expected[i]["rng"])
            assert mgr.metrics(i) == {"i": i}
        info = mgr.info(8)
        assert info["bytes"] == 64 * 32 * 4 + 32 * 2 + 4 + 8
        assert info["blocking_seconds"] <= info["total_seconds"]


def test_discovery_ignores_everything_but_committed_steps(tmp_path):
    with jaxckpt.CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(3, {"x": np.ones(2)})
        mgr.save(5, {"x": np.ones(2) * 5})
    (tmp_path / "7").mkdir()  # empty step dir
    (tmp_path / "9").mkdir()
    (tmp_path / "9" / "arrays").mkdir()  # data but no manifest
    os.system(f"cp -r {tmp_path / '5'} {tmp_path / '11'}")
    manifest = tmp_path / "11" / "manifest.json"
    manifest.write_bytes(manifest.read_bytes()[:50])  # truncated manifest
    (tmp_path / "notes").mkdir()
    (tmp_path / "013").mkdir()
    stale = tmp_path / ".12.jaxckpt-tmp-abc"
    stale.mkdir()
    (stale / "junk").write_text("x")
    foreign = tmp_path / ".hidden-by-user"
    foreign.mkdir()

    with jaxckpt.CheckpointManager(tmp_path, max_to_keep=1, async_save=False) as mgr:
        assert not stale.exists()  # our own stale attempt is cleaned on start
        assert mgr.all_steps() == [3, 5] and mgr.latest_step() == 5
        assert_bit_equal(mgr.restore()["x"], np.ones(2) * 5)
        mgr.save(6, {"x": np.zeros(1)})
        assert mgr.all_steps() == [6]
    # retention never touched what is not a committed step
    assert sorted(os.listdir(tmp_path)) == [".hidden-by-user", "013", "11", "6", "7", "9", "history.jsonl",
                                            "notes"]


def test_interval_force_and_duplicates(tmp_path):
    with jaxckpt.CheckpointManager(tmp_path, save_interval_steps=5) as mgr:
        assert mgr.should_save(10) and not mgr.should_save(11)
        assert mgr.save(11, {"a": 1}) is False
        assert mgr.save(11, {"a": 1}, force=True) is True
        with pytest.raises(jaxckpt.CheckpointError, match=r"Step 10 is older than step 11 in '.*': it could "
                           r"never be restored as the latest; pass force=True to save it anyway"):
            mgr.save(10, {"a": 2})
        assert mgr.save(10, {"a": 2}, force=True) is True
        with pytest.raises(jaxckpt.CheckpointError, match="Step 10 is already (being saved|committed)"):
            mgr.save(10, {"a": 3}, force=True)
        mgr.wait_until_finished()
        assert not mgr.should_save(10)
        with pytest.raises(jaxckpt.CheckpointError, match=r"Step 10 is already committed in '.*'"):
            mgr.save(10, {"a": 3}, force=True)
        assert mgr.all_steps() == [10, 11]
        assert mgr.restore(10) == {"a": 2}


def test_background_failure_surfaces_on_next_call(tmp_path, monkeypatch):
    def fail_step_2(op, key):
        if threading.current_thread().name.startswith("jaxckpt-save") and fail["on"]:
            raise OSError("injected: no space left on device")

    fail = {"on": False}
    monkeypatch.setattr(_storage, "fault_hook", fail_step_2)
    mgr = jaxckpt.CheckpointManager(tmp_path)
    mgr.save(1, {"x": np.ones(3)})
    mgr.wait_until_finished()
    fail["on"] = True
    assert mgr.save(2, {"x": np.ones(3) * 2}) is True  # returns; the failure is in the background
    with pytest.raises(jaxckpt.CheckpointError, match="Saving step 2 .* failed: .*no space left") as err:
        mgr.wait_until_finished()
    assert isinstance(err.value.__cause__, jaxckpt.CheckpointError)
    assert "injected" in str(err.value.__cause__.__cause__)
    assert mgr.all_steps() == [1]
    assert visible(tmp_path) == ["1"]  # nothing half-written is visible
    # the same surfaces from save() and close()
    mgr.save(3, {"x": np.ones(3)})
    with pytest.raises(jaxckpt.CheckpointError, match="Saving step 3"):
        mgr.save(4, {"x": np.ones(3)})
    mgr.save(5, {"x": np.ones(3)})
    with pytest.raises(jaxckpt.CheckpointError, match="Saving step 5"):
        mgr.close()
    fail["on"] = False
    assert jaxckpt.CheckpointManager(tmp_path).all_steps() == [1]


def test_a_failed_save_leaves_the_with_its_failed_lease_release_a_note(tmp_path, monkeypatch):
    from jaxckpt._manager import lease as _lease

    def fail_writes(op, key):
        if op == "write":
            raise OSError("injected: no space left on device")

    removals = []

    def no_removal(root, key):
        removals.append(key)
        raise PermissionError(f"injected: cannot remove '{key}'")

    run = tmp_path / "run"
    with pytest.raises(jaxckpt.CheckpointError) as err:
        with jaxckpt.CheckpointManager(run) as mgr:
            mgr.save(8, {"x": np.ones(3)})
            mgr.wait_until_finished()
            monkeypatch.setattr(_storage, "fault_hook", fail_writes)
            monkeypatch.setattr(_lease._kvstore, "delete_blob", no_removal)
            mgr.save(9, {"x": np.ones(3) * 9})
    # the save's own error, never the lease's; the lease's is a note on it
    assert str(err.value).startswith(f"Saving step 9 to '{run}' failed: ") and "no space left" in str(err.value)
    assert err.value.__notes__ == [f"Then, closing the manager: injected: cannot remove '{_lease.LEASE_FILE}'"]
    del mgr
    import gc
    gc.collect()  # the manager's finaliser: its lease was released (tried) once, by close
    assert removals == [_lease.LEASE_FILE]
    monkeypatch.undo()
    assert (run / _lease.LEASE_FILE).exists()  # left behind, judged by its holder's liveness
    with jaxckpt.CheckpointManager(run, read_only=True) as mgr:
        assert mgr.all_steps() == [8]


def test_a_failed_save_alone_leaves_the_with(tmp_path, monkeypatch):
    with pytest.raises(jaxckpt.CheckpointError, match=r"^Saving step 9 to '.*' failed: .*injected") as err:
        with jaxckpt.CheckpointManager(tmp_path) as mgr:
            monkeypatch.setattr(_storage, "fault_hook", lambda op, key: (_ for _ in ()).throw(OSError("injected")))
            mgr.save(9, {"x": np.ones(1)})
    assert not hasattr(err.value, "__notes__")
    monkeypatch.undo()
    assert jaxckpt.CheckpointManager(tmp_path).all_steps() == []  # the lease was released


@pytest.mark.parametrize("traced", ["state", "step", "metric"])
def test_save_inside_jit_is_refused_before_anything_starts(tmp_path, traced):
    mgr = jaxckpt.CheckpointManager(tmp_path, async_save=True)

    @jax.jit
    def train_step(w, n):
        state = {"opt": {"mu": w + 1 if traced == "state" else np.zeros(3)}, "n": 5}
        mgr.save(n if traced == "step" else 7, state, metrics={"loss": w.sum() if traced == "metric" else 0.5})
        return w

    with pytest.raises(jaxckpt.CheckpointError) as err:
        train_step(jnp.ones(3), 7)
    what = {"state": "leaf 'opt/mu' is a JAX tracer (float32[3])", "step": "the step is a JAX tracer (int32[])",
            "metric": "metrics['loss'] is a JAX tracer (float32[])"}[traced]
    step = "(traced)" if traced == "step" else "7"
    assert str(err.value) == (f"Saving step {step} to '{tmp_path}' failed: {what}, not an array with values: save "
                              "was called inside a traced function (jax.jit, vmap, grad, ...). Save outside it, on "
                              "the arrays it returns.")
    assert mgr.attempts() == [] and mgr.all_steps() == []  # nothing started, nothing pending
    mgr.wait_until_finished()
    mgr.save(7, {"opt": {"mu": jnp.ones(3)}, "n": 5})  # outside jit: step 7 was never taken
    mgr.close()
    assert mgr.all_steps() == [7]


def test_sync_failure_raises_directly(tmp_path, monkeypatch):
    monkeypatch.setattr(_storage, "fault_hook", lambda op, key: (_ for _ in ()).throw(OSError("boom")))
    with jaxckpt.CheckpointManager(tmp_path, async_save=False) as mgr:
        with pytest.raises(jaxckpt.CheckpointError, match="Saving step 0 .* failed.*boom"):
            mgr.save(0, {"x": np.ones(1)})
        assert mgr.all_steps() == []


def test_max_pending_bounds_saves_in_flight(tmp_path, monkeypatch):
    release = threading.Event()
    started = threading.Event()

    def hold(op, key):
        if threading.current_thread().name.startswith("jaxckpt-save"):
            started.set()
            release.wait(10)

    monkeypatch.setattr(_storage, "fault_hook", hold)
    mgr = jaxckpt.CheckpointManager(tmp_path, max_pending=1)
    mgr.save(1, {"x": np.ones(1024, np.float32)})
    assert started.wait(10)
    assert mgr.staging_bytes == 4096
    second_returned = threading.Event()
    t = threading.Thread(target=lambda: (mgr.save(2, {"x": np.ones(4)}), second_returned.set()))
    t.start()
    assert not second_returned.wait(0.5)  # blocked behind the first save
    release.set()
    assert second_returned.wait(10)
    t.join()
    mgr.close()
    assert mgr.all_steps() == [1, 2]
    assert mgr.staging_bytes == 0


def test_latest_step_lists_a_step_once_it_commits(tmp_path, monkeypatch):
    # what the latest_step docstring and docs/training.md say (issue 31): an async save in
    # flight is not listed yet
    release = threading.Event()
    monkeypatch.setattr(_storage, "fault_hook", lambda op, key: release.wait(10))
    with jaxckpt.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"x": np.ones(4)})
        assert mgr.latest_step() is None and mgr.all_steps() == []
        release.set()
        mgr.wait_until_finished()
        assert mgr.latest_step() == 1
        release.clear()
        mgr.save(2, {"x": np.ones(4)})
        assert mgr.latest_step() == 1
        release.set()
    assert mgr.latest_step() == 2


def test_snapshot_owns_host_arrays(tmp_path, monkeypatch):
    release = threading.Event()
    monkeypatch.setattr(_storage, "fault_hook", lambda op, key: release.wait(10))
    x = np.arange(8.0)
    with jaxckpt.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"x": x})
        x[:] = -1  # the caller reuses its buffer while the write is pending
        release.set()
    assert_bit_equal(jaxckpt.CheckpointManager(tmp_path).restore(1)["x"], np.arange(8.0))


def test_time_and_best_retention_with_injected_clock(tmp_path):
    clock = FakeClock()
    losses = {0: 4.0, 1: 1.0, 2: 3.0, 3: 2.0, 4: 5.0, 5: 6.0, 6: 0.5, 7: 7.0}
    with jaxckpt.CheckpointManager(tmp_path, max_to_keep=2, keep_time_interval=30, best_metric="loss",
                                   keep_best=1, clock=clock, async_save=False) as mgr:
        for s in range(8):
            clock.t = 1000.0 + 10 * s
            mgr.save(s, {"s": s}, metrics={"loss": losses[s]})
        # latest 2: 6, 7; best: 6 (0.5); one per 30 s: 0 (1000), 3 (1030), 6 (1060)
        assert mgr.all_steps() == [0, 3, 6, 7]
        assert mgr.best_step() == 6
    assert sorted(os.listdir(tmp_path)) == ["0", "3", "6", "7", "history.jsonl"]


def test_latest_is_kept_even_if_worst(tmp_path):
    with jaxckpt.CheckpointManager(tmp_path, best_metric="acc", best_mode="max", keep_best=1,
                                   async_save=False) as mgr:
        mgr.save(1, {"a": 1}, metrics={"acc": 0.9})
        mgr.save(2, {"a": 2}, metrics={"acc": 0.1})
        assert mgr.all_steps() == [1, 2]
        mgr.save(3, {"a": 3}, metrics={"acc": 0.2})
        assert mgr.all_steps() == [1, 3]
        assert mgr.best_step() == 1


def test_retention_spares_a_step_being_restored(tmp_path, monkeypatch):
    mgr = jaxckpt.CheckpointManager(tmp_path, max_to_keep=1, async_save=False)
    mgr.save(1, {"x": np.ones(2)})
    real_restore = jaxckpt._restore.restore

    def restore_while_saving(path, *a, **kw):
        mgr.save(2, {"x": np.zeros(2)})  # retention runs while step 1 is being read
        assert (tmp_path / "1").exists()
        return real_restore(path, *a, **kw)

    monkeypatch.setattr(jaxckpt._restore, "restore", restore_while_saving)
    assert_bit_equal(mgr.restore(1)["x"], np.ones(2))
    monkeypatch.setattr(jaxckpt._restore, "restore", real_restore)
    assert mgr.all_steps() == [1, 2]
    mgr.save(3, {"x": np.zeros(2)})  # now step 1 (deferred) and 2 go
    assert mgr.all_steps() == [3]
    mgr.wait_until_finished()  # deletes run on their own thread
    assert visible(tmp_path) == ["3"]
    mgr.close()
    assert sorted(os.listdir(tmp_path)) == ["3", "history.jsonl"]  # the lease is released on close


def test_restore_errors(tmp_path):
    mgr = jaxckpt.CheckpointManager(tmp_path)
    with pytest.raises(jaxckpt.CheckpointNotFoundError, match="No committed step in"):
        mgr.restore()
    mgr.save(1, {"a": 1})
    mgr.wait_until_finished()
    with pytest.raises(jaxckpt.CheckpointNotFoundError, match=r"No committed step 2 .*committed: \[1\]"):
        mgr.restore(2)
    with pytest.raises(jaxckpt.CheckpointError, match="best_step\\(\\) needs best_metric"):
        mgr.best_step()
    mgr.close()
    with pytest.raises(jaxckpt.CheckpointError, match="is closed"):
        mgr.save(5, {"a": 1})


def _run_child(code, **kw):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def test_sigkill_during_async_save_keeps_previous_step(tmp_path):
    code = f"""
        import os, sys, time
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
        import jax, numpy as np
        from jax.sharding import NamedSharding, PartitionSpec as P
        import jaxckpt
        from jaxckpt import _storage
        mesh = jax.make_mesh((4,), ("x",))
        mgr = jaxckpt.CheckpointManager({str(tmp_path)!r})
        mgr.save(1, {{"w": np.full(1024, 1.0, np.float32)}})
        mgr.wait_until_finished()
        writes = []
        def hook(op, key):
            writes.append(key)
            if len(writes) == 6:          # part of the big save is on disk
                print("MIDWAY", flush=True)
                time.sleep(60)
        _storage.fault_hook = hook
        big = {{f"w{{i}}": jax.device_put(np.full((2048, 1024), i, np.float32), NamedSharding(mesh, P("x")))
               for i in range(8)}}   # 64 MiB
        mgr.save(2, big)
        print("RETURNED", flush=True)
        time.sleep(60)
    """
    child = _run_child(code)
    lines = []
    for line in child.stdout:  # save(2) returned (async) and its writes are half done
        lines.append(line.strip())
        if {"MIDWAY", "RETURNED"} <= set(lines):
            break
    assert {"MIDWAY", "RETURNED"} <= set(lines), child.stderr.read()
    child.send_signal(signal.SIGKILL)
    child.wait(10)
    child.stdout.close()
    child.stderr.close()
    assert child.returncode == -signal.SIGKILL
    leftovers = os.listdir(tmp_path)
    assert "2" not in leftovers and any(n.startswith(".2.jaxckpt-tmp-") for n in leftovers)
    # the killed writer's lease names a pid that no longer exists: provably gone
    mgr = jaxckpt.CheckpointManager(tmp_path)
    assert mgr.latest_step() == 1
    assert_bit_equal(mgr.restore()["w"], np.full(1024, 1.0, np.float32))
    assert visible(tmp_path) == ["1"]  # the dead attempt was cleaned up
    mgr.save(2, {"w": np.zeros(4, np.float32)})
    mgr.close()
    assert sorted(os.listdir(tmp_path)) == ["1", "2", "history.jsonl"]


def test_pending_save_completes_at_interpreter_exit(tmp_path):
    code = f"""
        import numpy as np, jaxckpt
        mgr = jaxckpt.CheckpointManager({str(tmp_path)!r})
        mgr.save(4, {{"x": np.arange(1 << 20, dtype=np.float32)}})
        # no close(): atexit must wait for the commit
    """
    child = _run_child(code)
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err
    mgr = jaxckpt.CheckpointManager(tmp_path)
    assert mgr.all_steps() == [4]
    assert_bit_equal(mgr.restore()["x"], np.arange(1 << 20, dtype=np.float32))


# --- one writer, many readers (issue 8, item 5) --------------------------------------


def test_second_writer_is_refused_and_a_live_save_survives_readers(tmp_path, monkeypatch):
    release = threading.Event()
    holding = threading.Event()

    def hold(op, key):  # the first writer's async save stays in flight (its writes: a reader's reads
        if op == "write" and threading.current_thread() is not threading.main_thread():  # run on threads too)
            holding.set()
            release.wait(20)

    writer = jaxckpt.CheckpointManager(tmp_path)
    writer.save(1, {"x": np.ones(3)})
    writer.wait_until_finished()
    monkeypatch.setattr(_storage, "fault_hook", hold)
    writer.save(2, {"x": np.full(1 << 18, 2.0, np.float32)})
    assert holding.wait(10)
    staging = [n for n in os.listdir(tmp_path) if n.startswith(".2.jaxckpt-tmp-")]
    assert len(staging) == 1
    with pytest.raises(jaxckpt.CheckpointError,
                       match=rf"'{tmp_path}' is being written by another CheckpointManager: pid {os.getpid()} "
                             r"on host '.+' \(since .+\)\. Stop it first, or open this directory with "
                             r"CheckpointManager\(\.\.\., read_only=True\)"):
        jaxckpt.CheckpointManager(tmp_path)
    # readers are always allowed, and never touch the attempt in flight
    for _ in range(5):
        reader = jaxckpt.CheckpointManager(tmp_path, read_only=True)
        assert reader.all_steps() == [1]
        assert_bit_equal(reader.restore()["x"], np.ones(3))
        with pytest.raises(jaxckpt.CheckpointError, match="is read-only: save\\(\\) is not allowed"):
            reader.save(3, {"x": np.ones(3)})
        reader.close()
    assert staging[0] in os.listdir(tmp_path)
    release.set()
    writer.wait_until_finished()
    assert writer.all_steps() == [1, 2]
    writer.close()
    reader = jaxckpt.CheckpointManager(tmp_path, read_only=True)
    assert reader.all_steps() == [1, 2]
    assert_bit_equal(reader.restore(2)["x"], np.full(1 << 18, 2.0, np.float32))
    reader.close()
    # once the writer closed, a new writer may start
    jaxckpt.CheckpointManager(tmp_path).close()


def test_notebook_polling_a_training_run_never_breaks_it(tmp_path):
    stop = threading.Event()
    seen, errors = [], []

    def notebook():  # a cell re-run every few ms: opens a read-only manager each time
        while not stop.is_set():
            try:
                with jaxckpt.CheckpointManager(tmp_path, read_only=True) as m:
                    seen.append(m.latest_step())
            except Exception as e:  # noqa: BLE001
                errors.append(e)

    t = threading.Thread(target=notebook)
    with jaxckpt.CheckpointManager(tmp_path, max_to_keep=2) as mgr:
        t.start()
        for i in range(1, 16):
            mgr.save(i, {"w": np.full(1 << 16, i, np.float32)})
        mgr.wait_until_finished()
        stop.set()
        t.join()
        assert mgr.all_steps() == [14, 15]
    assert errors == [] and len(seen) > 5
    assert all(s is None or 1 <= s <= 15 for s in seen)


def test_lease_of_another_host_is_waited_out_only_if_it_stops_renewing(tmp_path, monkeypatch):
    import json
    import time

    from jaxckpt._manager import lease as _lease

    monkeypatch.setattr(_lease, "LEASE_S", 1.0)
    lease = tmp_path / ".jaxckpt-writer.json"
    owner = {"host": "other-host", "pid": 1, "token": "t", "started": time.time(), "renewed": time.time(),
             "count": 0}
    lease.write_text(json.dumps(owner))
    (tmp_path / ".5.jaxckpt-tmp-deadbeef").mkdir()  # its attempt

    stop = threading.Event()

    def renew():  # the other host is alive: it keeps renewing
        while not stop.wait(0.2):
            owner["count"] += 1
            lease.write_text(json.dumps(owner))

    t = threading.Thread(target=renew)
    t.start()
    try:
        with pytest.raises(jaxckpt.CheckpointError, match="pid 1 on host 'other-host'"):
            jaxckpt.CheckpointManager(tmp_path)
    finally:
        stop.set()
        t.join()
    assert (tmp_path / ".5.jaxckpt-tmp-deadbeef").exists()
    # now it stopped renewing: after a lease period the newcomer takes over and cleans up
    start = time.monotonic()
    mgr = jaxckpt.CheckpointManager(tmp_path)
    assert time.monotonic() - start >= 1.0
    assert not (tmp_path / ".5.jaxckpt-tmp-deadbeef").exists()
    assert json.loads(lease.read_text())["pid"] == os.getpid()
    mgr.close()
    assert not lease.exists()


# --- errors a user can cause (issue 8, items 10 and 11) -----------------------------


def test_metrics_may_be_jax_and_numpy_scalars(tmp_path):
    with jaxckpt.CheckpointManager(tmp_path, best_metric="loss") as mgr:
        loss = jnp.float32(0.25) * 2
        mgr.save(1, {"x": 1}, metrics={"loss": loss, "acc": np.float64(0.75), "n": np.int32(3),
                                       "lr": jnp.bfloat16(0.5), "tag": "warmup", "none": None})
        mgr.wait_until_finished()
        m = mgr.metrics(1)
        assert m == {"loss": 0.5, "acc": 0.75, "n": 3, "lr": 0.5, "tag": "warmup", "none": None}
        assert type(m["loss"]) is float and type(m["n"]) is int
        assert mgr.best_step() == 1
        with pytest.raises(jaxckpt.CheckpointError, match=r"metrics\['hist'\] has shape \(3,\); a metric must be a scalar"):
            mgr.save(2, {"x": 1}, metrics={"hist": np.ones(3)})
        with pytest.raises(jaxckpt.CheckpointError, match=r"metrics\['cfg'\] is a dict; a metric must be a number"):
            mgr.save(2, {"x": 1}, metrics={"cfg": {}})
        with pytest.raises(jaxckpt.CheckpointError, match=r"metrics key 3 is a int; metric names must be str"):
            mgr.save(2, {"x": 1}, metrics={3: 1.0})


def test_manager_directory_that_is_a_file(tmp_path):
    f = tmp_path / "runs"
    f.write_text("not a directory")
    for read_only in (False, True):
        with pytest.raises(jaxckpt.CheckpointError, match=f"CheckpointManager directory '{f}' is a file, not a directory"):
            jaxckpt.CheckpointManager(f, read_only=read_only)


def test_close_racing_save_is_a_checkpoint_error(tmp_path, monkeypatch):
    mgr = jaxckpt.CheckpointManager(tmp_path)
    # close() wins the race right after save() checked that the manager is open
    real_wait = mgr._saves.wait_for_slot

    def close_then_wait():
        real_wait()
        mgr.close()

    monkeypatch.setattr(mgr._saves, "wait_for_slot", close_then_wait)
    with pytest.raises(jaxckpt.CheckpointError, match=f"CheckpointManager for '{tmp_path}' was closed during save\\(1\\)"):
        mgr.save(1, {"x": np.ones(2)})


def test_reload_keeps_a_step_committed_during_the_scan(tmp_path, monkeypatch):
    from jaxckpt import _commit

    mgr = jaxckpt.CheckpointManager(tmp_path, async_save=False)
    mgr.save(1, {"x": 1})
    real = _commit.listed_steps  # the listing a scan starts from

    def slow_scan(directory):
        found = real(directory)  # sees step 1 only
        mgr.save(2, {"x": 2})  # commits while the scan's result is in flight
        return found

    monkeypatch.setattr(_commit, "listed_steps", slow_scan)
    mgr.reload()
    assert mgr.all_steps() == [1, 2]
    monkeypatch.setattr(_commit, "listed_steps", real)
    mgr.close()


# --- issue 9: the notebook view, delete and attempts -----------------------------------


def test_html_lists_steps_metrics_totals_and_escapes(tmp_path):
    clock = FakeClock(1000.0)
    with jaxckpt.CheckpointManager(tmp_path, clock=clock, max_to_keep=2, async_save=False) as mgr:
        for s in (10, 20, 30):
            clock.t = 1000.0 + s
            mgr.save(s, {"x": np.ones(4, np.float32)},
                     metrics={"loss": s / 100, "<script>alert(1)</script>": f"<i>{s}</i>"})
        clock.t = 1090.0
        page = mgr._repr_html_()
    assert "<script" not in page and "<i>" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page and "&lt;i&gt;30&lt;/i&gt;" in page
    assert f"<code>{tmp_path}</code> (writer)" in page
    assert "2 committed steps, 32 B" in page  # step 10 went to retention
    assert ">20<" in page and ">30<" in page and ">10<" not in page
    assert ">0.3<" in page and ">60 s<" in page  # the loss of step 30 and its age on the manager's clock
    assert page.index(">30<") < page.index(">20<")  # newest first
    assert "mgr.advise_interval(mtbf_s=...)" in page
    assert "var(--jp-ui-font-color1, inherit)" in page and "var(--jp-border-color2, #ccc)" in page
    assert "background" not in page and "white" not in page and "#fff" not in page
    reader = jaxckpt.CheckpointManager(tmp_path, read_only=True)
    assert "(read-only)" in reader._repr_html_()


def test_views_show_stored_sizes_and_mark_the_best_step(tmp_path):
    from jaxckpt import _html

    # issue 31: the manager's views showed neither what compressed steps take nor the best step
    with jaxckpt.CheckpointManager(tmp_path, best_metric="loss", async_save=False, compression="zstd") as mgr:
        for s, loss in ((1, 0.5), (2, 0.25), (3, 0.4)):
            mgr.save(s, {"w": np.tile(np.arange(64, dtype=np.float32), (64, 1)) * s, "step": s},
                     metrics={"loss": loss})
        page, text, infos = mgr._repr_html_(), repr(mgr), {s: mgr.info(s) for s in mgr.all_steps()}
    stored = {s: jaxckpt.open(tmp_path / str(s))["w"].stored_nbytes for s in (1, 2, 3)}
    assert [(i["stored_bytes"], i["codecs"], i["bytes"]) for i in infos.values()] == [
        (stored[s], ["zstd"], 64 * 64 * 4) for s in (1, 2, 3)]
    assert text == f"CheckpointManager({str(tmp_path)!r}, steps=[1, 2, 3], best=2)"
    td = f"<td style='{_html._TD}'>"
    assert f"<th style='{_html._TH}'>size</th><th style='{_html._TH}'>stored</th>" in page
    assert f"{td}16.0 KiB</td>{td}{_html.human_bytes(stored[3])} zstd</td>" in page
    assert f"<tr style='{_html._TR};font-weight:bold'>{td}★ 2</td>" in page and page.count("★") == 1
    total = _html.human_bytes(sum(stored.values()))
    assert f"3 committed steps, 48.0 KiB ({total} stored, zstd); best loss (min): step 2; saves blocked" in page
    # a manager without best_metric marks none; steps saved raw have no stored column
    reader = jaxckpt.CheckpointManager(tmp_path, read_only=True)
    assert repr(reader) == f"CheckpointManager({str(tmp_path)!r}, read_only=True, steps=[1, 2, 3])"
    assert "★" not in reader._repr_html_() and "best" not in reader._repr_html_()
    with jaxckpt.CheckpointManager(tmp_path / "raw", async_save=False) as mgr:
        mgr.save(1, {"w": np.ones(4, np.float32)})
        assert ">stored<" not in mgr._repr_html_() and "stored_bytes" not in mgr.info(1)


def test_html_caps_rows(tmp_path, monkeypatch):
    from jaxckpt import _html

    monkeypatch.setattr(_html, "_MANAGER_ROWS", 3)
    with jaxckpt.CheckpointManager(tmp_path, async_save=False) as mgr:
        for s in range(5):
            mgr.save(s, {"x": s})
        page = mgr._repr_html_()
    assert "… 2 more (older steps not shown)" in page and "5 committed steps" in page
    assert ">4<" in page and ">2<" in page and ">1<" not in page
    assert "no committed step yet" in jaxckpt.CheckpointManager(tmp_path / "new", read_only=True)._repr_html_()


def test_delete_renames_first_so_a_half_deleted_step_is_never_listed(tmp_path, monkeypatch):
    mgr = jaxckpt.CheckpointManager(tmp_path, async_save=False)
    for s in (1, 2, 3):
        mgr.save(s, {"x": np.full(8, s)}, metrics={"loss": s})
    seen = {}
    real_delete_tree = _kvstore.delete_tree

    def look_then_delete(loc):
        if not seen:  # mid-delete: the data is still there, under a hidden name
            seen["listing"] = sorted(os.listdir(tmp_path))
            seen["mgr"] = mgr.all_steps()
            seen["reader"] = jaxckpt.CheckpointManager(tmp_path, read_only=True).all_steps()
            seen["attempts"] = mgr.attempts()
        real_delete_tree(loc)

    monkeypatch.setattr(_kvstore, "delete_tree", look_then_delete)
    mgr.delete(2)
    hidden, lease, *shown = seen["listing"]
    assert hidden.startswith(".2.jaxckpt-old-") and lease == ".jaxckpt-writer.json"
    assert shown == ["1", "3", "history.jsonl"]
    assert seen["mgr"] == seen["reader"] == [1, 3]
    (attempt,) = seen["attempts"]
    assert attempt["step"] == 2 and attempt["kind"] == "old" and attempt["name"].startswith(".2.jaxckpt-old-")
    assert attempt["bytes"] > 64 and attempt["writer_alive"] is True and attempt["writer"]["pid"] == os.getpid()
    assert sorted(os.listdir(tmp_path)) == [".jaxckpt-writer.json", "1", "3", "history.jsonl"]
    assert mgr.attempts() == []
    assert [(r.step, r.exists) for r in mgr.history()] == [(1, True), (2, False), (3, True)]
    mgr.delete(3)  # the latest too, on request
    assert mgr.all_steps() == [1] and mgr.latest_step() == 1
    with pytest.raises(jaxckpt.CheckpointNotFoundError, match=r"No committed step 3 in '.*' \(committed: \[1\]\)"):
        mgr.delete(3)
    mgr.close()
    with pytest.raises(jaxckpt.CheckpointError, match="is closed"):
        mgr.delete(1)


def test_delete_is_refused_read_only_and_while_restoring(tmp_path, monkeypatch):
    mgr = jaxckpt.CheckpointManager(tmp_path, async_save=False)
    mgr.save(1, {"x": np.ones(2)})
    mgr.save(2, {"x": np.zeros(2)})
    reader = jaxckpt.CheckpointManager(tmp_path, read_only=True)
    assert reader.all_steps() == [1, 2]  # listed (each manifest's presence checked once)
    with pytest.raises(jaxckpt.CheckpointError, match=r"read-only: delete\(\) is not allowed"):
        reader.delete(1)
    real_restore = jaxckpt._restore.restore
    refused = []

    def delete_while_restoring(path, *a, **kw):
        with pytest.raises(jaxckpt.CheckpointError, match=r"Step 1 in '.*' is being restored; delete it afterwards"):
            mgr.delete(1)
        refused.append(True)
        return real_restore(path, *a, **kw)

    monkeypatch.setattr(jaxckpt._restore, "restore", delete_while_restoring)
    assert_bit_equal(mgr.restore(1)["x"], np.ones(2))
    assert refused == [True]
    monkeypatch.setattr(jaxckpt._restore, "restore", real_restore)
    mgr.delete(1)
    assert mgr.all_steps() == [2] and reader.all_steps() == [1, 2]
    reader.reload()
    assert reader.all_steps() == [2]
    mgr.close()


def test_attempts_say_whether_their_writer_is_gone(tmp_path):
    import json
    import socket
    import time

    with jaxckpt.CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, {"x": 1})
    stale = tmp_path / ".7.jaxckpt-tmp-abc"
    (stale / "arrays").mkdir(parents=True)
    (stale / "arrays" / "c0").write_bytes(b"0123456789")
    (tmp_path / ".8.jaxckpt-old-def").mkdir()
    reader = jaxckpt.CheckpointManager(tmp_path, read_only=True)
    got = reader.attempts()
    assert [(a["step"], a["name"], a["kind"], a["bytes"]) for a in got] == [
        (7, ".7.jaxckpt-tmp-abc", "tmp", 10), (8, ".8.jaxckpt-old-def", "old", 0)]
    assert all(a["writer"] is None and a["writer_alive"] is False for a in got)  # no lease: no writer
    assert got[0]["mtime"] == os.stat(stale).st_mtime
    # a lease left by a process that is gone (this host, a pid that no longer exists)
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = {"host": socket.gethostname(), "pid": int(child.stdout), "token": "t", "started": time.time(),
            "renewed": time.time(), "count": 0, "lease_s": 15.0}
    (tmp_path / ".jaxckpt-writer.json").write_text(json.dumps(dead))
    assert [(a["writer"]["pid"], a["writer_alive"]) for a in reader.attempts()] == [(dead["pid"], False)] * 2
    # on another host and renewed just now: not provably gone
    (tmp_path / ".jaxckpt-writer.json").write_text(json.dumps({**dead, "host": "elsewhere"}))
    assert [a["writer_alive"] for a in reader.attempts()] == [True, True]
    assert (tmp_path / ".jaxckpt-writer.json").exists() and stale.exists()  # reading changed nothing


def test_a_slow_delete_never_delays_the_next_save(tmp_path, monkeypatch):
    from jaxckpt._manager import marks as _marks

    release, started = threading.Event(), threading.Event()
    real = _marks.delete_unless_read

    def slow_delete(directory, step, token):  # an object store deleting object by object
        started.set()
        release.wait(30)
        return real(directory, step, token)

    monkeypatch.setattr(_marks, "delete_unless_read", slow_delete)
    with jaxckpt.CheckpointManager(tmp_path, max_to_keep=1) as mgr:
        mgr.save(1, {"x": np.ones(4)})
        mgr.save(2, {"x": np.ones(4) * 2})
        mgr.save(3, {"x": np.ones(4) * 3})  # settles step 2, whose retention started deleting step 1
        assert started.wait(10)
        try:
            mgr.save(4, {"x": np.ones(4) * 4})  # settles step 3 while the delete of step 1 still hangs
            assert not release.is_set() and mgr.all_steps() == [3]
            # step 1's delete hangs; step 2's waits behind it (step 4's own attempt, its staging
            # directory and claim, may already be in flight beside them)
            assert [n for n in visible(tmp_path) if not n.startswith(".4.")] == ["1", "2", "3"]
        finally:
            release.set()
        mgr.wait_until_finished()
        assert mgr.all_steps() == [4] and visible(tmp_path) == ["4"]


def test_a_jitted_loop_on_a_one_device_mesh_saves_every_step(tmp_path):
    """Taking a snapshot must not change the array's sharding (a device set that a
    snapshot once emptied made the second save of a one-device mesh fail)."""
    one = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    w = jax.device_put(np.arange(8, dtype=np.float32), NamedSharding(one, P("x")))
    step_fn = jax.jit(lambda w: w + 1)
    with jaxckpt.CheckpointManager(tmp_path) as mgr:
        for step in range(1, 4):
            w = step_fn(w)
            mgr.save(step, w)
        mgr.wait_until_finished()
        assert mgr.all_steps() == [1, 2, 3]
        assert len(w.sharding.device_set) == 1
        assert_bit_equal(mgr.restore(2), np.arange(8, dtype=np.float32) + 2)


def test_restore_right_after_an_async_save_returns_that_step(tmp_path):
    with jaxckpt.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"w": np.zeros(4)})
        mgr.wait_until_finished()
        mgr.save(2, {"w": np.ones(4)})
        assert_bit_equal(mgr.restore()["w"], np.ones(4))  # the save in flight is finished first
        mgr.save(3, {"w": np.full(4, 3.0)})
        assert_bit_equal(mgr.restore(3)["w"], np.full(4, 3.0))


def test_a_step_asked_for_survives_the_retention_of_the_saves_restore_settles(tmp_path):
    """restore(step) finishes the saves in flight first; their retention must not delete
    the step it was asked for (it was committed when asked)."""
    with jaxckpt.CheckpointManager(tmp_path, max_to_keep=1, max_pending=2) as mgr:
        mgr.save(1, {"w": np.zeros(4)})
        mgr.wait_until_finished()
        mgr.save(2, {"w": np.ones(4)})
        mgr.save(3, {"w": np.full(4, 3.0)})
        assert_bit_equal(mgr.restore(1)["w"], np.zeros(4))
        mgr.wait_until_finished()
        assert mgr.all_steps() == [1, 3] and visible(tmp_path) == ["1", "3"]  # its delete was deferred
        mgr.save(4, {"w": np.full(4, 4.0)})
        mgr.wait_until_finished()
        assert mgr.all_steps() == [4] and visible(tmp_path) == ["4"]


def test_an_unclosed_manager_is_freed_with_its_last_reference(tmp_path):
    # No reference cycle through the manager: dropped unclosed, it is freed (and its
    # lease released) at once, not by the cyclic collector at some later moment of the
    # program (where its clean-up's I/O surprised another part: test_s3's handle counts).
    import gc
    import weakref

    was = gc.isenabled()
    gc.disable()
    try:
        mgr = jaxckpt.CheckpointManager(tmp_path / "m")
        mgr.save(0, {"x": np.arange(3)})
        mgr.wait_until_finished()
        ref = weakref.ref(mgr)
        del mgr
        assert ref() is None
    finally:
        if was:
            gc.enable()
    assert not os.path.exists(tmp_path / "m" / ".jaxckpt-writer.json")  # its lease released
