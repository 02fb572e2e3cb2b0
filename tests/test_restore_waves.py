"""A restore within a host-memory budget (issue 34): ``max_staging_bytes`` reads the
leaves in waves, the next while the one before is placed, two at most in host memory."""

from __future__ import annotations

import threading

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt import _reader, _restore, _waves


def test_waves_are_consecutive_within_half_the_budget_and_a_big_item_goes_alone():
    assert _waves.restore_waves([10, 10, 10, 30, 5, 0], 40) == [[0, 1], [2], [3], [4, 5]]
    assert _waves.restore_waves([10, 10], None) == [[0, 1]]
    assert _waves.restore_waves([], 8) == [[]]
    assert _waves.restore_waves([1] * 5, 1) == [[0], [1], [2], [3], [4]]


def _state():
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))
    rng = np.random.default_rng(0)
    state = {f"w{k}": jax.device_put(rng.standard_normal((64, 32)).astype(np.float32),
                                     NamedSharding(mesh, P("a", "b"))) for k in range(6)}
    state.update(h=np.arange(1000, dtype=np.int32), n=7, name="run", key=jax.random.key(3))
    return state, mesh


def _events(monkeypatch):
    events, lock = [], threading.Lock()
    real_run, real_place = _reader.Reader.run, _restore._place

    def run(self):
        with lock:
            events.append(("read", sorted(p for p, _ in self._wanted)))
        return real_run(self)

    def place(reader, requests, plans, where):
        out = real_place(reader, requests, plans, where)
        with lock:
            events.append(("placed", sorted(r.rec.path for r in requests)))
        return out

    monkeypatch.setattr(_reader.Reader, "run", run)
    monkeypatch.setattr(_restore, "_place", place)
    return events


def test_a_restore_in_waves_is_exact_and_reads_at_most_one_wave_ahead(tmp_path, monkeypatch):
    state, mesh = _state()
    jaxckpt.save(tmp_path / "c", state)
    target = jax.tree.map(lambda x: x, state)
    whole = jaxckpt.restore(tmp_path / "c", target)
    events = _events(monkeypatch)
    back = jaxckpt.restore(tmp_path / "c", target, max_staging_bytes=4 * 64 * 32 * 4)  # 2 leaves a wave
    for k in range(6):
        assert back[f"w{k}"].sharding == state[f"w{k}"].sharding
        assert np.array_equal(np.asarray(back[f"w{k}"]), np.asarray(state[f"w{k}"]))
        assert np.array_equal(np.asarray(back[f"w{k}"]), np.asarray(whole[f"w{k}"]))
    assert np.array_equal(back["h"], state["h"]) and back["n"] == 7 and back["name"] == "run"
    assert np.array_equal(jax.random.key_data(back["key"]), jax.random.key_data(state["key"]))
    reads = [e for e in events if e[0] == "read"]
    # in the tree's order, up to 16 KiB a wave (h: 4,000 bytes, key: 8, each w: 8 KiB)
    assert [r[1] for r in reads] == [["h", "key", "w0"], ["w1", "w2"], ["w3", "w4"], ["w5"]]
    for k, e in enumerate(events):  # never two waves read ahead of the last placed
        if e[0] == "read":
            assert sum(x[0] == "read" for x in events[:k + 1]) - sum(x[0] == "placed" for x in events[:k]) <= 2


def test_a_cast_in_waves_is_exact_and_the_manager_passes_its_budget(tmp_path, monkeypatch):
    state = {f"w{k}": np.arange(4096, dtype=np.float32) * (k + 1) / 3 for k in range(8)}
    with jaxckpt.CheckpointManager(tmp_path, async_save=False, max_staging_bytes=2 * 4096 * 4) as mgr:
        mgr.save(1, state)
        events = _events(monkeypatch)
        target = {k: jax.ShapeDtypeStruct(v.shape, ml_dtypes.bfloat16, sharding=jax.sharding.SingleDeviceSharding(
            jax.devices()[0])) for k, v in state.items()}
        back = mgr.restore(1, target)
    for k, v in state.items():
        assert back[k].dtype == ml_dtypes.bfloat16
        assert np.array_equal(np.asarray(back[k]), v.astype(ml_dtypes.bfloat16))
    assert [e[1] for e in events if e[0] == "read"] == [[f"w{k}"] for k in range(8)]


def test_a_damaged_leaf_in_a_later_wave_raises_and_leaves_no_thread(tmp_path):
    state = {f"w{k}": np.full(4096, k, np.float32) for k in range(6)}
    jaxckpt.save(tmp_path / "c", state)
    obj = next((tmp_path / "c" / "data").rglob("p0.*"))
    raw = bytearray(obj.read_bytes())
    at = raw.rfind(np.full(16, 4, np.float32).tobytes())  # inside w4's entry
    raw[at] ^= 0xFF
    obj.write_bytes(bytes(raw))
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(jaxckpt.CorruptCheckpointError, match="w4"):
        jaxckpt.restore(tmp_path / "c", {k: np.zeros(4096, np.float32) for k in state},
                        max_staging_bytes=4096 * 4 * 2)
    assert "jaxckpt-restore-ahead" not in {t.name for t in threading.enumerate()} - before


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "1"])
def test_a_bad_budget_is_refused(tmp_path, bad):
    jaxckpt.save(tmp_path / "c", {"x": np.ones(3)})
    with pytest.raises(ValueError, match=f"max_staging_bytes must be a positive int, got {bad!r}"):
        jaxckpt.restore(tmp_path / "c", max_staging_bytes=bad)
