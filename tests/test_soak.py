"""Soak: async saves every step, with retention and random restores, for a while.

The run lasts ``JAXCKPT_SOAK_S`` seconds (default 10; ``make test-all``, which CI runs, sets 30,
and ``JAXCKPT_SOAK_S=3600 pytest -m slow tests/test_soak.py`` is the long soak). Checked: every step
retention must keep is there and restores bit for bit, every random restore is exact,
and nothing leaks: threads, file descriptors, and memory (the RSS trend over the second
half of the run, measured and printed).
"""

import gc
import os
import random
import threading
import time

import numpy as np
import pytest

import jaxckpt

KEEP_LAST, KEEP_PERIOD = 3, 50


def state(i):
    big = np.arange(256 * 1024, dtype=np.float32) + i  # 1 MiB: a file-store leaf
    return {"big": big, "small": np.full(33, i, np.int64), "nested": {"k": np.float32(i), "tag": f"s{i}"}, "step": i}


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def open_fds():
    return len(os.listdir("/proc/self/fd"))


def check(back, i):
    want = state(i)
    assert back["big"].tobytes() == want["big"].tobytes(), i
    assert back["small"].tobytes() == want["small"].tobytes(), i
    assert back["nested"]["tag"] == f"s{i}" and back["step"] == i


def slope_per_1000(samples):
    """Least-squares RSS growth in bytes per 1000 steps over (step, rss) samples."""
    x = np.array([s for s, _ in samples], float)
    y = np.array([r for _, r in samples], float)
    return float(np.polyfit(x, y, 1)[0] * 1000) if len(samples) > 2 else 0.0


@pytest.mark.slow
def test_soak_async_saves_retention_and_restores(tmp_path):
    seconds = float(os.environ.get("JAXCKPT_SOAK_S", "10"))
    rng = random.Random(0)
    threads0, fds0 = threading.active_count(), open_fds()
    samples = []
    step, restores = 0, 0
    deadline = time.monotonic() + seconds
    with jaxckpt.CheckpointManager(tmp_path, max_to_keep=KEEP_LAST, keep_period=KEEP_PERIOD, max_pending=2) as mgr:
        while time.monotonic() < deadline:
            step += 1
            mgr.save(step, state(step))
            if step % 7 == 0:
                committed = mgr.all_steps()
                if committed:
                    pick = committed[-1] if rng.random() < 0.5 else rng.choice(committed)
                    check(mgr.restore(pick), pick)
                    restores += 1
            if step % 50 == 0:
                gc.collect()
                samples.append((step, rss_bytes()))
        step += 1  # a last save: deletes that retention deferred for a restore run now
        mgr.save(step, state(step))
        mgr.wait_until_finished()
    expected = sorted({s for s in range(1, step + 1) if s % KEEP_PERIOD == 0} | set(range(step - KEEP_LAST + 1, step + 1)))
    with jaxckpt.CheckpointManager(tmp_path, read_only=True) as reader:
        assert reader.all_steps() == expected  # no committed step lost, none kept too many
        for s in expected:
            check(reader.restore(s), s)
    assert not [n for n in os.listdir(tmp_path) if ".jaxckpt-tmp-" in n or ".jaxckpt-old-" in n]  # no attempt left
    assert threading.active_count() <= threads0, [t.name for t in threading.enumerate()]
    assert open_fds() <= fds0 + 2  # +2: tolerance for lazily opened runtime files
    half = samples[len(samples) // 2:]
    growth = slope_per_1000(half)
    print(f"soak: {step} steps in {seconds:.0f} s, {restores} restores, RSS {samples[-1][1] / 2**20:.0f} MiB, "
          f"trend over the second half {growth / 2**20:+.2f} MiB per 1000 steps")
    assert step >= 100
    assert growth < 8 * 2**20  # a leak of one 1 MiB leaf per 125 steps would show as 8 MiB / 1000 steps
