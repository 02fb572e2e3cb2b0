"""Peer copies (``CheckpointManager(..., peer_copies=1)``): each host's part of a step also
on its partner host, sent over JAX's collectives; a lost host restored from it bit for
bit; two lost partners fall back to the bucket; a failed copy fails the save in every
process; a full RAM disk is a clear error. Real multi-process jobs, one CPU device per
process (tests/mp_peers_worker.py)."""

import json
import os
import shutil
import subprocess
import tempfile

import pytest
from conftest import run_workers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "mp_peers_worker.py")


def run_job(args, nproc=2, timeout=120):
    return run_workers(WORKER, nproc, lambda i, port: [port, nproc, i, "job", json.dumps(args)], timeout)


@pytest.fixture
def ram_dir(tmp_path):
    """A directory on the RAM disk (/dev/shm) when there is one, else ``tmp_path``."""
    if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
        yield tmp_path
        return
    path = tempfile.mkdtemp(prefix="jaxckpt-test-", dir="/dev/shm")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_a_lost_host_is_restored_from_its_peer_bit_for_bit(ram_dir):
    """Two hosts, sharded state (each host's half exists only on it), local directories on
    the RAM disk. Each host keeps its partner's part of the steps it lists (retention
    prunes them with its own). Host 1's directory is wiped; the next start sends its part
    of step 3 back from host 0's copy: listed at once, restored bit for bit, and the saves
    go on with peer copies again."""
    res = run_job({"path": str(ram_dir), "save": [1, 2, 3]})
    for p in (0, 1):
        assert res[p]["steps"] == [2, 3] and res[p]["on_disk"] == ["2", "3"]
        assert res[p]["peers"] == {f"p{1 - p}": ["2", "3"]}  # the partner's part, pruned with its own
    shutil.rmtree(os.path.join(ram_dir, "host1"))

    res = run_job({"path": str(ram_dir), "restore": None, "save": [4]})
    for p in (0, 1):
        assert res[p]["steps_at_start"] == [3] and res[p]["latest_at_start"] == 3
        assert res[p]["restored"] == 3
        assert res[p]["on_disk_after_restore"] == (["2", "3"] if p == 0 else ["3"])
        assert res[p]["steps"] == [3, 4]
        assert res[p]["on_disk"] == ["3", "4"]  # host 0's step 2, which host 1 lacked: gone with step 4
    # host 0 keeps host 1's part of steps 3 and 4; host 1's copy of host 0's step 3 was lost with its
    # disk (a repair sends back a host's own part only): step 4 is the first it holds again
    assert res[0]["peers"] == {"p1": ["3", "4"]} and res[1]["peers"] == {"p0": ["4"]}


def test_a_failed_peer_copy_fails_the_save_in_every_process(tmp_path):
    """Host 1 cannot write host 0's part of step 2 (an I/O error). The save of step 2
    fails in both processes with the same cause, step 2 is deleted from both hosts (and
    from the peer directories), step 1 and its copies are untouched, and step 3 saves."""
    res = run_job({"path": str(tmp_path), "save": [1, 2, 3], "fail_peer": [1, 2], "keep": 3})
    for p in (0, 1):
        error = res[p]["save_errors"]["2"]
        assert error.startswith("Saving step 2 to "), error
        assert "the peer copy failed (the step is deleted on every host): " in error
        assert list(res[p]["save_errors"]) == ["2"]
        assert res[p]["steps"] == [1, 3] and res[p]["on_disk"] == ["1", "3"]
        assert res[p]["peers"] == {f"p{1 - p}": ["1", "3"]}
        assert res[p]["peer_attempts"] == []  # the failed copy's staging went with the next copy
    assert res[1]["save_errors"]["2"].endswith(
        "the peer copy failed (the step is deleted on every host): process 1: OSError: [Errno 28] No space left "
        "on device (injected)")
    assert res[0]["save_errors"]["2"].endswith(
        "/2': failed in process 1 (process 1: OSError: [Errno 28] No space left on device (injected))"), res[0]


@pytest.mark.slow
def test_two_lost_partners_fall_back_to_the_bucket(tmp_path, s3_server):
    """Three hosts in a ring (0 -> 1 -> 2 -> 0), the local S3 server as the persistent
    tier (every 2nd step). Hosts 1 and 2 are lost together: host 1's part of step 3 was
    on host 2 only, so it exists nowhere local and every process restores the bucket's
    step 2, bit for bit."""
    durable = s3_server("peers/a")
    res = run_job({"path": str(tmp_path), "save": [1, 2, 3], "durable": durable, "keep": 3}, nproc=3)
    assert [res[p]["peers"] for p in range(3)] == [{"p2": ["1", "2", "3"]}, {"p0": ["1", "2", "3"]},
                                                   {"p1": ["1", "2", "3"]}]
    shutil.rmtree(tmp_path / "host1")
    shutil.rmtree(tmp_path / "host2")
    res = run_job({"path": str(tmp_path), "restore": None, "durable": durable, "keep": 3}, nproc=3)
    for p in range(3):
        assert res[p]["steps_at_start"] == [2]  # the bucket's steps only
        assert res[p]["restored"] == 2
        assert res[p]["tiers_after_restore"] == {"2": ["persistent"]}
    assert res[1]["on_disk"] == res[2]["on_disk"] == []


def _can_mount_a_ram_disk(tmp_path):
    try:
        out = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=1m none {tmp_path}"],
                             capture_output=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0


def test_a_full_ram_disk_fails_the_save_before_a_byte_moves(tmp_path):
    """Each host's directory is a RAM disk of its own (a tmpfs of 1.5 MiB in the process's
    mount namespace). A host's part of a step is 256 KiB, so two steps of its own and two
    peer copies fit; with max_to_keep=3 the third step's peer copy finds no room: the
    save fails in both processes naming the bytes needed and free, and steps 1 and 2 (and
    their copies) stay."""
    if not _can_mount_a_ram_disk(tmp_path):
        pytest.skip("unshare -rm cannot mount a tmpfs here")
    res = run_job({"path": str(tmp_path), "save": [1, 2, 3], "keep": 3, "rows": 256, "tmpfs": "1536k"})
    for p in (0, 1):
        assert res[p]["steps"] == [1, 2], res[p]
        assert res[p]["on_disk"] == ["1", "2"] and res[p]["peers"] == {f"p{1 - p}": ["1", "2"]}
        error = res[p]["save_errors"]["3"]
        # its own cause (both hosts are full): the bytes its partner's part takes, and what is free
        assert f"no room for the peer copies of step 3 in '{tmp_path / f'host{p}'}' (process {p}): they take " \
            in error, error
        assert "on a RAM disk (/dev/shm) each host holds max_to_keep steps of its own and of its 1 partner(s)" \
            in error


def test_the_ring_and_the_repair_plan():
    from jaxckpt._manager import peers

    assert peers.ring([0, 2, 4], 1) == [(0, 2), (2, 4), (4, 0)]
    assert peers.partners([0, 2, 4], 2) == {0: [2, 4], 2: [4, 0], 4: [0, 2]}
    assert peers.waves({0: 10, 2: 0}, 8192) == (1, 4096)
    assert peers.waves({0: 10_000, 2: 3}, 8192) == (2, 8192)
    # 64 MiB + 100 bytes in rows of at most 32 MiB: three even rows (4 KiB multiples), not 32 + 32 + 100 bytes
    assert peers.waves({0: (64 << 20) + 100}, 32 << 20) == (3, 5462 * 4096)
    assert peers.waves({}, 8192) == (0, 0)
    assert peers.rounds_of({0: 2, 1: 2, 3: 0}) == [[(2, 0), (0, 3)], [(2, 1)]]
    # host 1 lost step 5 (empty directory); host 0 holds a valid copy of it
    held = {0: {4: "a4", 5: "a5"}, 1: {}}
    copies = {0: {1: {5: ["b5", "b5"]}}, 1: {}}
    assert peers.plan_repair(held, copies, set(), None) == (5, {1: 0})
    assert peers.plan_repair(held, copies, set(), 4) == (None, {})  # host 1's step 4: nowhere
    assert peers.plan_repair(held, copies, {4}, 4) == (4, {})  # the bucket's
    assert peers.plan_repair(held, copies, {6}, None) == (6, {})  # a newer bucket step wins
    # a damaged copy (its files changed since it was recorded) is not used
    assert peers.plan_repair(held, {0: {1: {5: ["zz", "b5"]}}, 1: {}}, {4}, None) == (4, {})
    # every part in its own directory, intact: nothing to send
    held = {0: {5: "a5"}, 1: {5: "b5"}}
    assert peers.plan_repair(held, copies, set(), None) == (5, {})
    # host 1 lost a file of step 5 since its commit: its digest differs from the recorded one
    assert peers.plan_repair({0: {5: "a5"}, 1: {5: "b5-short"}}, copies, set(), None) == (5, {1: 0})


def test_peer_copies_need_a_directory_per_host(tmp_path):
    """One process (one group): refused by name, and the refused manager's lease is given
    back (the next manager starts)."""
    import jaxckpt

    with pytest.raises(jaxckpt.CheckpointError) as e:
        jaxckpt.CheckpointManager(tmp_path, peer_copies=1)
    assert str(e.value) == (f"peer_copies=1 needs a local directory per host, but '{tmp_path}' is shared by every "
                            "process of this job (1 process(es), one group)")
    with pytest.raises(jaxckpt.CheckpointError, match=r"^peer_copies must be a non-negative int, got -1$"):
        jaxckpt.CheckpointManager(tmp_path, peer_copies=-1)
    with jaxckpt.CheckpointManager(tmp_path, peer_copies=0) as mgr:
        assert mgr.all_steps() == []
