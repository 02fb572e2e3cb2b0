"""Peer copies beside training (issue 32): the copy moves over ``jax.experimental.transfer``
on the manager's own thread while the loop runs its collectives (a ``psum`` in every
jitted step, a ``multihost_utils`` barrier every 5 steps), for 200 steps; every process
of a host sends the files it wrote; a host killed in the middle of a copy is reported at
the next call in every other process, within the documented bounds, and nothing hangs.
Real multi-process jobs (tests/mp_peerloop_worker.py), one CPU device per process."""

import filecmp
import json
import os

from conftest import run_workers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "mp_peerloop_worker.py")


def run_loop(args, nproc, timeout=180, exits_ok=False):
    return run_workers(WORKER, nproc, lambda i, port: [port, nproc, i, json.dumps(args)], timeout,
                       exits_ok=exits_ok)


def same_tree(a, b):
    """Every file of ``a`` in ``b`` with the same bytes (``b`` may hold more)."""
    for root, _, files in os.walk(a):
        for name in files:
            path = os.path.join(root, name)
            twin = os.path.join(b, os.path.relpath(path, a))
            assert os.path.isfile(twin) and filecmp.cmp(path, twin, shallow=False), twin
    return True


def test_copies_move_beside_a_loop_of_collectives_every_process_sending_its_own(tmp_path):
    """Two hosts of two processes each (a directory per host), 200 steps, a save every 20
    with ``peer_copies=1``: the loop's values are right, every save's copy was made
    (nothing lacks its copies), each host holds its partner's retained steps byte for
    byte, and each of the four processes sent its own share (the data object it wrote)."""
    res = run_loop({"path": str(tmp_path), "per_host": 2, "steps": 200, "every": 20}, nproc=4)
    for p in range(4):
        assert res[p]["values_ok"] is True
        assert res[p]["saved"] == list(range(20, 201, 20))
        assert res[p]["wait"] == "ok" and res[p]["warnings"] == []
        assert res[p]["steps"] == [180, 200]
        assert res[p]["tiers"] == {"180": ["local"], "200": ["local"]}
        # its own share of each of the 10 saves: its data object, nobody else's
        (tag, nbytes), = res[p]["sent"].items()
        assert tag == f"d1s{p}" and nbytes > 10 * 256 * 256 * 4
    for host, partner in ((0, 1), (1, 0)):
        copies = tmp_path / f"host{host}" / ".jaxckpt-peers" / f"p{2 * partner}"
        assert sorted(os.listdir(copies)) == ["180", "200"]
        for step in ("180", "200"):
            assert same_tree(tmp_path / f"host{partner}" / step, copies / step)
            assert sorted(os.listdir(copies / step / "data")) == ["p%d.0" % (2 * partner), "p%d.0" % (2 * partner + 1)]


def test_a_host_killed_mid_copy_is_reported_at_the_next_call_in_every_process(tmp_path):
    """Three hosts; process 2 dies receiving its second block of the last save's copy.
    The others' loops are done; their next call (``wait_until_finished``) returns within
    the dead-peer bound (``STALE_S``, 10 s, plus a little) with the copy's failure in a
    warning and the step kept, lacking its copies; the save after it fails in both,
    naming process 2, within ``timeout_s``. Nobody hangs."""
    res = run_loop({"path": str(tmp_path), "steps": 200, "every": 20, "kill": 2}, nproc=3, exits_ok=True)
    assert res[2]["exit"] == 9
    for p in (0, 1):
        assert res[p]["values_ok"] is True and res[p]["saved"] == list(range(20, 201, 20))
        assert res[p]["wait"] == "ok" and res[p]["wait_s"] < 25
        assert res[p]["steps"] == [180, 200]
        assert res[p]["tiers"] == {"180": ["local"], "200": ["local", "peer-copies-missing"]}
        (warning,) = res[p]["warnings"]
        assert warning.startswith(f"jaxckpt: the peer copy of step 200 in '{tmp_path / f'host{p}'}' failed: ")
        assert warning.endswith("; the step is kept without its peer copies (sent again at the next save)")
        assert res[p]["save"].startswith(f"CheckpointError: Saving step 220 to '{tmp_path / f'host{p}'}' failed: ")
        assert "process 2 did not report within 10s" in res[p]["save"] and res[p]["save_s"] < 25
    # process 1 sends to process 2: it waited for the dead receiver's acknowledgement
    assert "process 2 stopped responding" in res[1]["warnings"][0]


def test_offers_a_failed_copy_left_are_taken_back():
    """A receiver that fails leaves the blocks it never pulled offered on the sender's
    transfer server, held for the process's life (a breaker saw the sender grow by
    192 MiB a failed copy). The sender pulls its own offers back: they arrive at once,
    and are gone from the server after (pulling one again never arrives)."""
    import time

    import jax
    import numpy as np

    from jaxckpt._manager import peerlink

    dev = peerlink.host_device()
    blocks = [jax.device_put(np.full(1 << 20, i, np.uint8), dev) for i in range(2)]
    held = {}
    for i, arr in enumerate(blocks):
        uid = 7_000_000 + i
        peerlink.server().await_pull(uid, [arr])
        held[i] = (uid, arr)
    uids = [uid for uid, _ in held.values()]
    started = time.monotonic()
    peerlink._take_back(held)
    assert held == {} and time.monotonic() - started < peerlink.TAKE_BACK_S
    sharding = jax.sharding.SingleDeviceSharding(dev)
    again = peerlink.server().connect(peerlink.address()).pull(
        uids[0], [jax.ShapeDtypeStruct((1 << 20,), np.uint8, sharding=sharding)])[0]
    time.sleep(0.5)
    assert not again.is_ready()
