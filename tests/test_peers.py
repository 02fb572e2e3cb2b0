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
        # both steps host 1 listed come back (the newest first), not the newest only
        assert res[p]["steps_at_start"] == [2, 3] and res[p]["latest_at_start"] == 3
        assert res[p]["restored"] == 3
        assert res[p]["on_disk_after_restore"] == ["2", "3"]
        assert res[p]["steps"] == [3, 4]
        assert res[p]["on_disk"] == ["3", "4"]
    # host 0 keeps host 1's part of steps 3 and 4; host 1's copies of host 0's parts were lost with
    # its disk (a repair sends back a host's own part only): listed as lacking them until the copies
    # sent in the background after the start are applied (at the save of step 4)
    missing = ["local", "peer-copies-missing"]
    assert res[0]["tiers_after_restore"] == res[1]["tiers_after_restore"] == {"2": missing, "3": missing}
    assert res[0]["peers"] == {"p1": ["3", "4"]} and res[1]["peers"] == {"p0": ["3", "4"]}


def test_a_failed_peer_copy_keeps_the_step_in_every_process(tmp_path):
    """Host 1 cannot write host 0's part of step 2 (an I/O error in the middle of the
    copy). The save of step 2 does not fail: in both processes step 2 stays committed and
    listed, marked as lacking its peer copies, with the cause in a warning; the save of
    step 3 copies step 3 and sends step 2's copies again, and no attempt is left."""
    res = run_job({"path": str(tmp_path), "save": [1, 2], "fail_peer": [1, 2], "keep": 3,
                   "ops": [["tiers"], ["save", 3]]})
    for p in (0, 1):
        assert "save_errors" not in res[p]
        assert res[p]["ops"][0] == {"steps": [1, 2], "tiers": {"1": ["local"], "2": ["local", "peer-copies-missing"]}}
        assert res[p]["ops"][1] == {"steps": [1, 2, 3], "tiers": {"1": ["local"], "2": ["local"], "3": ["local"]}}
        assert res[p]["on_disk"] == ["1", "2", "3"] and res[p]["peers"] == {f"p{1 - p}": ["1", "2", "3"]}
        assert res[p]["peer_attempts"] == []  # the failed copy's staging went with the next copy
        assert [w for w in res[p]["warnings"] if "peer cop" in w] == [
            f"jaxckpt: the peer copy of step 2 in '{tmp_path / f'host{p}'}' failed: "
            + ("process 1: OSError: [Errno 28] No space left on device (injected)" if p == 1 else
               f"peer5/d1s0/ack0 '{tmp_path / 'host0' / '2'}': failed in process 1 (process 1: OSError: [Errno 28] No "
               "space left on device (injected))")
            + "; the step is kept without its peer copies (sent again at the next save)"]


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


def test_a_full_ram_disk_keeps_the_step_without_its_peer_copies(tmp_path):
    """Each host's directory is a RAM disk of its own (a tmpfs of 1.5 MiB in the process's
    mount namespace). A host's part of a step is 256 KiB, so two steps of its own and two
    peer copies fit; with max_to_keep=3 the third step's peer copy finds no room before
    a byte moves: step 3 is kept and listed in both processes, marked as lacking its peer
    copies, with a warning naming the bytes needed and free; steps 1 and 2 and their
    copies stay."""
    if not _can_mount_a_ram_disk(tmp_path):
        pytest.skip("unshare -rm cannot mount a tmpfs here")
    res = run_job({"path": str(tmp_path), "save": [1, 2, 3], "keep": 3, "rows": 256, "tmpfs": "1536k",
                   "ops": [["tiers"]]})
    for p in (0, 1):
        assert "save_errors" not in res[p]
        assert res[p]["ops"] == [{"steps": [1, 2, 3], "tiers": {"1": ["local"], "2": ["local"],
                                                                "3": ["local", "peer-copies-missing"]}}]
        assert res[p]["on_disk"] == ["1", "2", "3"] and res[p]["peers"] == {f"p{1 - p}": ["1", "2"]}
        assert res[p]["peer_attempts"] == []
        [warning] = [w for w in res[p]["warnings"] if "peer cop" in w]
        # its own cause (both hosts are full): the bytes its partner's part takes, and what is free
        assert warning.startswith(f"jaxckpt: the peer copy of step 3 in '{tmp_path / f'host{p}'}' failed: no room "
                                  f"for the peer copies of step 3 in '{tmp_path / f'host{p}'}' (process {p}): they "
                                  "take "), warning
        assert warning.endswith(" are free; on a RAM disk (/dev/shm) each host holds max_to_keep steps of its own and "
                                "of its 1 partner(s), plus the step being saved; the step is kept without its peer "
                                "copies (sent again at the next save)"), warning


def test_the_ring_and_the_repair_plan():
    from jaxckpt._manager import peerrepair, peers, peerwaves

    assert peers.ring([0, 2, 4], 1) == [(0, 2), (2, 4), (4, 0)]
    assert peers.partners([0, 2, 4], 2) == {0: [2, 4], 2: [4, 0], 4: [0, 2]}
    assert peerwaves.waves({0: 10, 2: 0}, 8192) == (1, 4096)
    assert peerwaves.waves({0: 10_000, 2: 3}, 8192) == (2, 8192)
    # 64 MiB + 100 bytes in rows of at most 32 MiB: three even rows (4 KiB multiples), not 32 + 32 + 100 bytes
    assert peerwaves.waves({0: (64 << 20) + 100}, 32 << 20) == (3, 5462 * 4096)
    assert peerwaves.waves({}, 8192) == (0, 0)
    # every process of a host sends to the process at its place in the partner host (modulo its size)
    assert peers.copy_routes([(0, 1), (2,)], 1) == [peers.Route(0, 0, 2, 1), peers.Route(0, 1, 2, 1),
                                                    peers.Route(2, 2, 0, 1)]
    assert peers.owned([("data/p1.0", 5), ("data/p0.3", 6), ("data/p7.0", 7), ("x.json", 8)], (0, 1)) == {
        0: [("data/p0.3", 6), ("data/p7.0", 7), ("x.json", 8)], 1: [("data/p1.0", 5)]}
    assert peerrepair.rounds_of({0: 2, 1: 2, 3: 0}) == [[(2, 0), (0, 3)], [(2, 1)]]

    def part(name, save="t1", digest=None):  # a group's own part of a step
        return {"id": name, "save": save, "digest": digest or f"d-{name}"}

    def copy(name, parts, now=None):  # a peer copy of a part, recorded with the step's parts
        return {"now": now or f"d-{name}", "recorded": f"d-{name}", "id": name, "parts": parts}

    v5 = {0: "a5", 1: "b5"}  # step 5's identity: each host's manifest checksum

    def plan(*args):  # the plan less its older steps (asserted on their own below)
        return tuple(peerrepair.plan_repair(*args))[:4]

    # host 1 lost step 5 (empty directory); host 0 holds a usable copy of it. Step 5 then lacks
    # host 1's copy of host 0's part (lost with host 1's disk)
    held = {0: {4: part("a4"), 5: part("a5")}, 1: {}}
    copies = {0: {1: {5: copy("b5", v5)}}, 1: {}}
    assert plan(held, copies, set(), None) == (5, {1: 0}, {}, {5})
    assert peerrepair.plan_repair(held, copies, set(), None).older == ()  # step 4: no copy of host 1's part
    # with a copy of host 1's part of step 4 too, step 4 is an older step to send back (after 5)
    more = {0: {1: {4: copy("b4", {0: "a4", 1: "b4"}), 5: copy("b5", v5)}}, 1: {}}
    assert peerrepair.plan_repair(held, more, set(), None) == ((5, {1: 0}, {}, {5}, (4,)))
    assert peerrepair.plan_repair(held, more, set(), 4).older == ()  # a step asked for: that one only
    assert plan(held, copies, set(), 4) == (None, {}, {}, set())  # host 1's step 4: nowhere
    assert plan(held, copies, {4}, 4) == (4, {}, {}, set())  # the bucket's
    assert plan(held, copies, {6}, None) == (6, {}, {}, set())  # a newer bucket step wins
    # a damaged copy (its files changed since it was recorded) is not used, and removed
    assert plan(held, {0: {1: {5: copy("b5", v5, now="zz")}}, 1: {}}, {4}, None) == (4, {}, {0: [(1, 5)]}, set())
    # every part in its own directory, intact: nothing to send; host 0's copy at host 1 is missing
    held = {0: {5: part("a5")}, 1: {5: part("b5")}}
    assert plan(held, copies, set(), None) == (5, {}, {}, {5})
    both = {0: {1: {5: copy("b5", v5)}}, 1: {0: {5: copy("a5", v5)}}}
    assert plan(held, both, set(), None) == (5, {}, {}, set())
    # host 1 lost a file of step 5 since its commit: its digest differs from the recorded one
    assert plan({0: {5: part("a5")}, 1: {5: part("b5", digest="d-short")}}, both, set(), None) == (5, {1: 0}, {}, set())
    # step 5 saved again (a5', b5'): the copies of the first save are never used, and removed
    again = {0: {5: part("a5'", "t2")}, 1: {5: part("b5'", "t2")}}
    assert plan(again, both, set(), None) == (5, {}, {0: [(1, 5)], 1: [(0, 5)]}, {5})
    # ... with host 1's directory wiped: host 0's new part beside the old copy of host 1's would be
    # a mix: step 5 is not to be had here (the bucket's step 4 is)
    assert plan({0: {5: part("a5'", "t2")}, 1: {}}, {0: both[0], 1: {}}, {4}, None) == (4, {}, {0: [(1, 5)]}, set())
    # step 5 deleted on every host: its copies never bring it back
    held = {0: {4: part("a4")}, 1: {4: part("b4")}}
    v4 = {0: "a4", 1: "b4"}
    left = {0: {1: {4: copy("b4", v4), 5: copy("b5", v5)}}, 1: {0: {4: copy("a4", v4), 5: copy("a5", v5)}}}
    assert plan(held, left, set(), None) == (4, {}, {0: [(1, 5)], 1: [(0, 5)]}, set())
    assert plan(held, left, set(), 5) == (None, {}, {0: [(1, 5)], 1: [(0, 5)]}, set())
    # the hosts hold parts of two saves of step 5: never a mix, not even from the copies; which
    # copies are stale is unknown, so none is removed
    mixed = {0: {5: part("a5")}, 1: {5: part("b5'", "t2")}}
    assert plan(mixed, both, set(), None) == (None, {}, {}, set())
    assert plan(mixed, both, {5}, None) == (5, {}, {}, set())  # the bucket's
    # a copy without its record (made before copies carried the step's identity): not used, removed
    old = {0: {1: {5: {"now": "d-b5", "recorded": "", "id": "b5", "parts": None}}}, 1: {}}
    assert plan({0: {5: part("a5")}, 1: {}}, old, set(), None) == (None, {}, {0: [(1, 5)]}, set())
    # two copies per part (three hosts): host 2 lost everything; host 0's copy of host 2's part is used
    v = {0: "a", 2: "b", 4: "c"}
    held = {0: {7: part("a")}, 2: {7: part("b")}, 4: {}}
    copies = {0: {2: {7: copy("b", v)}, 4: {7: copy("c", v)}}, 2: {0: {7: copy("a", v)}, 4: {7: copy("c", v)}}, 4: {}}
    assert plan(held, copies, set(), None, 2) == (7, {4: 0}, {}, {7})


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


def test_a_deleted_step_never_comes_back_from_its_peer_copies(tmp_path):
    """``delete(3)`` drops step 3's peer copies on every host: neither the restore that
    follows in the same job nor the next job's start lists or restores step 3 again."""
    res = run_job({"path": str(tmp_path), "save": [1, 2, 3], "keep": 3,
                   "ops": [["delete", 3], ["restore", None]]})
    for p in (0, 1):
        assert res[p]["ops"][0] == {"steps": [1, 2]}
        assert res[p]["ops"][1] == {"step": 2, "version": 1, "w": 1, "b": 1, "steps": [1, 2]}
        assert res[p]["on_disk"] == ["1", "2"] and res[p]["peers"] == {f"p{1 - p}": ["1", "2"]}
    res = run_job({"path": str(tmp_path), "restore": None, "keep": 3})
    for p in (0, 1):
        assert res[p]["steps_at_start"] == [1, 2] and res[p]["restored"] == 2
        assert res[p]["on_disk"] == ["1", "2"] and res[p]["peers"] == {f"p{1 - p}": ["1", "2"]}


def test_a_step_saved_again_is_never_replaced_or_mixed_with_its_old_peer_copy(tmp_path):
    """Step 3 (version 1) is saved with its peer copies and deleted; its old copies are put
    back (as a job killed between deleting the step and its copies leaves them), and a job
    without peer copies saves step 3 again with other values (version 2).

    With host 1's directory wiped, host 1's part of version 2 exists nowhere: restoring
    step 3 is refused in both processes (never host 0's version 2 beside version 1's
    copy), the latest restorable step is 2, and host 0 drops the stale copy. With every
    directory intact, the next job restores version 2 (never the old copy over it),
    drops the stale copies, marks step 3 as lacking its copies and sends them at its next
    save; once host 1's directory is wiped, every process restores version 2 bit for bit."""
    run = tmp_path / "run"
    run_job({"path": str(run), "save": [1, 2, 3], "keep": 3})
    for h in (0, 1):
        shutil.copytree(run / f"host{h}" / ".jaxckpt-peers", tmp_path / f"old{h}")
    res = run_job({"path": str(run), "keep": 3, "ops": [["delete", 3]]})
    assert res[0]["ops"] == res[1]["ops"] == [{"steps": [1, 2]}]
    for h in (0, 1):
        shutil.copytree(tmp_path / f"old{h}", run / f"host{h}" / ".jaxckpt-peers", dirs_exist_ok=True)
    res = run_job({"path": str(run), "keep": 3, "copies": 0, "ops": [["save", 3, 2]]})
    assert res[0]["ops"] == res[1]["ops"] == [{"steps": [1, 2, 3], "tiers": {"1": ["local"], "2": ["local"],
                                                                           "3": ["local"]}}]

    wiped = tmp_path / "wiped"
    shutil.copytree(run, wiped)
    shutil.rmtree(wiped / "host1")
    res = run_job({"path": str(wiped), "keep": 3, "ops": [["restore", 3], ["restore", None]]})
    for p in (0, 1):
        assert res[p]["steps_at_start"] == [1, 2]  # both sent back to host 1 at the start
        assert res[p]["ops"][0]["error"].startswith(
            f"CheckpointError: Cannot restore step 3 from '{wiped / f'host{p}'}': step 3 is missing on process 1 on "
            "host "), res[p]["ops"]
        assert res[p]["ops"][1] == {"step": 2, "version": 1, "w": 1, "b": 1, "steps": [1, 2]}
    assert res[0]["peers"] == {"p1": ["1", "2"]}  # version 1's copy of step 3: removed

    res = run_job({"path": str(run), "keep": 3, "ops": [["restore", 3], ["tiers"], ["save", 4]]})
    for p in (0, 1):
        assert res[p]["steps_at_start"] == [1, 2, 3]
        assert res[p]["ops"][0] == {"step": 3, "version": 2, "w": 2, "b": 2, "steps": [1, 2, 3]}
        assert res[p]["ops"][1]["tiers"] == {"1": ["local"], "2": ["local"], "3": ["local", "peer-copies-missing"]}
        assert res[p]["ops"][2] == {"steps": [2, 3, 4], "tiers": {"2": ["local"], "3": ["local"], "4": ["local"]}}
        assert res[p]["peers"] == {f"p{1 - p}": ["2", "3", "4"]}
    shutil.rmtree(run / "host1")
    res = run_job({"path": str(run), "keep": 3, "ops": [["restore", 3]]})
    for p in (0, 1):
        assert res[p]["ops"] == [{"step": 3, "version": 2, "w": 2, "b": 2, "steps": [2, 3, 4]}]


def test_a_failed_peer_copy_keeps_the_step_and_copies_it_at_the_next_save(tmp_path):
    """Host 1 finds no room for host 0's part of step 3 (its free-space check says 0
    bytes): step 3 stays committed and listed, marked as lacking its peer copies in
    ``step_tiers()`` with a warning in every process, and still reaches the persistent
    tier. The save of step 4 makes step 4's copies and sends step 3's again: then every
    step has its copies and nothing is marked."""
    durable = tmp_path / "durable"
    res = run_job({"path": str(tmp_path), "save": [1, 2], "keep": 3, "durable": str(durable), "every": 1,
                   "no_room": [1, 3], "ops": [["save", 3], ["save", 4]]})
    for p in (0, 1):
        assert res[p]["ops"][0] == {"steps": [1, 2, 3], "tiers": {
            "1": ["local", "persistent"], "2": ["local", "persistent"],
            "3": ["local", "persistent", "peer-copies-missing"]}}, res[p]
        assert res[p]["ops"][1] == {"steps": [1, 2, 3, 4], "tiers": {  # step 1: retention took its local copy
            "1": ["persistent"], "2": ["local", "persistent"], "3": ["local", "persistent"],
            "4": ["local", "persistent"]}}
        assert "save_errors" not in res[p]
        assert res[p]["on_disk"] == ["2", "3", "4"] and res[p]["peers"] == {f"p{1 - p}": ["2", "3", "4"]}
        assert res[p]["durable_on_disk"] == ["1", "2", "3", "4"]
        missing = [w for w in res[p]["warnings"] if "peer cop" in w]
        assert len(missing) == 1 and missing[0].startswith(
            f"jaxckpt: the peer copy of step 3 in '{tmp_path / f'host{p}'}' failed: "), missing
        assert missing[0].endswith("; the step is kept without its peer copies (sent again at the next save)")
    assert f"no room for the peer copies of step 3 in '{tmp_path / 'host1'}' (process 1): they take " \
        in res[1]["warnings"][0]


def test_deleting_a_step_only_the_persistent_tier_lists_leaves_nothing_to_rebuild_it_from(tmp_path):
    """Host 1 lost its directory: step 1 is in the persistent tier, host 0 still holds its
    own part of it and its peer copy of host 1's (which the start sends back). ``delete(1)``
    takes all of them (the breaker's case against c1abc6a's successor: the restore after
    the delete rebuilt step 1 from those parts, bit for bit version 1, and listed it
    again)."""
    durable = str(tmp_path / "durable")
    run_job({"path": str(tmp_path), "save": [1, 2], "keep": 3, "durable": durable, "every": 1})
    shutil.rmtree(tmp_path / "host1")
    res = run_job({"path": str(tmp_path), "keep": 3, "durable": durable, "every": 1,
                   "ops": [["tiers"], ["delete", 1], ["restore", 1], ["tiers"]]})
    for p in (0, 1):
        ops = res[p]["ops"]
        # since the start sends back every step it can (not the newest only), step 1 is local again
        assert ops[0]["tiers"]["1"] == ["local", "persistent", "peer-copies-missing"], ops[0]
        assert ops[1] == {"steps": [2]}, ops[1]
        assert ops[2]["error"].startswith("CheckpointNotFoundError: No committed step 1 "), ops[2]
        assert ops[3]["steps"] == [2], ops[3]
        assert "1" not in res[p]["on_disk"] and "1" not in res[p]["durable_on_disk"], res[p]
        assert all("1" not in steps for steps in res[p]["peers"].values()), res[p]["peers"]
    res = run_job({"path": str(tmp_path), "keep": 3, "durable": durable, "every": 1, "ops": [["restore", 1]]})
    for p in (0, 1):
        assert res[p]["steps_at_start"] == [2]
        assert res[p]["ops"][0]["error"].startswith("CheckpointNotFoundError: No committed step 1 "), res[p]["ops"]


def test_a_delete_one_host_refuses_is_done_on_none_and_the_listings_stay_one(tmp_path):
    """A live reader mark on host 1's step 3 (an evaluator restoring it) refuses
    ``delete(3)`` there: no host deletes its part, every process raises and still lists
    step 3, and the run goes on with one listing everywhere. (Before, host 0 deleted its
    part and process 0 stopped listing the step while process 1 kept it: retention then
    deleted different steps per host, and a step saved again by one process paired with
    another step's save in the other, restoring one step's bytes as another's.)"""
    from jaxckpt._manager.marks import ReaderMark
    from jaxckpt._storage.location import resolve

    os.makedirs(tmp_path / "host1")
    with ReaderMark(resolve(str(tmp_path / "host1")), 3):
        res = run_job({"path": str(tmp_path), "keep": 3,
                       "ops": [["save", 1], ["save", 2], ["save", 3], ["delete", 3], ["tiers"], ["save", 4],
                               ["tiers"]]})
    for p in (0, 1):
        ops = res[p]["ops"]
        assert "is being restored by pid" in ops[3]["error"] and "host1' is being restored" in ops[3]["error"], ops[3]
        assert ops[4]["steps"] == [1, 2, 3], ops[4]
        assert ops[6]["steps"] == [2, 3, 4], ops[6]
    res = run_job({"path": str(tmp_path), "keep": 3, "ops": [["delete", 3], ["restore", None]]})
    for p in (0, 1):
        assert res[p]["steps_at_start"] == [2, 3, 4]
        assert res[p]["ops"] == [{"steps": [2, 4]}, {"step": 4, "version": 1, "w": 1, "b": 1, "steps": [2, 4]}]


def test_a_replaced_host_gets_back_the_copies_it_held_so_a_second_loss_is_survived(tmp_path):
    """Three hosts in a ring (0 -> 1 -> 2 -> 0). Host 1's directory is wiped: it lost its
    part and the copy of host 0's part it held. The next start sends its part back and,
    in the background, host 0's copy to it again (settled by ``wait_until_finished``):
    before issue 32 only the next save did. Then host 0's directory is wiped right away,
    with no save in between: its part comes back from host 1's new copy, bit for bit."""
    res = run_job({"path": str(tmp_path), "save": [1, 2]}, nproc=3)
    assert [res[p]["peers"] for p in range(3)] == [{"p2": ["1", "2"]}, {"p0": ["1", "2"]}, {"p1": ["1", "2"]}]
    shutil.rmtree(os.path.join(tmp_path, "host1"))
    res = run_job({"path": str(tmp_path), "ops": [["wait"]]}, nproc=3)
    for p in range(3):
        assert res[p]["steps_at_start"] == [1, 2]
        assert res[p]["ops"] == [{"steps": [1, 2], "tiers": {"1": ["local"], "2": ["local"]}}]
    assert res[1]["peers"] == {"p0": ["1", "2"]} and res[1]["peer_attempts"] == []
    shutil.rmtree(os.path.join(tmp_path, "host0"))
    res = run_job({"path": str(tmp_path), "restore": None}, nproc=3)
    for p in range(3):
        assert res[p]["restored"] == 2 and "error" not in res[p]
        assert res[p]["steps"] == [1, 2]


def test_copies_a_restart_finds_missing_are_sent_once_and_never_for_a_deleted_step(tmp_path):
    """Host 1 lost only the copies it held (its ``.jaxckpt-peers``). The next start sends
    steps 1-3 again in the background; the saves after it (``max_pending=2``: each save's
    job is submitted before the earlier outcomes are applied) do not send them again, and
    step 1, which retention deletes meanwhile, is never copied after its deletion (a
    breaker's case: every step was copied three times, and a deleted one warned)."""
    run_job({"path": str(tmp_path), "save": [1, 2, 3], "keep": 3})
    shutil.rmtree(os.path.join(tmp_path, "host1", ".jaxckpt-peers"))
    res = run_job({"path": str(tmp_path), "keep": 3, "max_pending": 2, "count_copies": True,
                   "ops": [["save", 4], ["save", 5], ["save", 6]]})
    for p in (0, 1):
        assert res[p]["warnings"] == []
        assert sorted(step for step, _ in res[p]["copied"]) == [1, 2, 3, 4, 5, 6]
        assert res[p]["ops"][-1] == {"steps": [4, 5, 6], "tiers": {"4": ["local"], "5": ["local"], "6": ["local"]}}
        assert res[p]["peers"] == {f"p{1 - p}": ["4", "5", "6"]}


def test_copies_a_restart_finds_missing_are_sent_once_though_a_restore_repairs_again(tmp_path):
    """A breaker's case: host 1 lost the copies it held; the start queues steps 1-3 to be
    sent and the restore right after it (its own repair, before that job ran, finds them
    still missing) queued them again: each sent twice. Now once."""
    run_job({"path": str(tmp_path), "save": [1, 2, 3], "keep": 3})
    shutil.rmtree(os.path.join(tmp_path, "host1", ".jaxckpt-peers"))
    res = run_job({"path": str(tmp_path), "keep": 3, "count_copies": True,
                   "ops": [["restore", None], ["save", 4], ["wait"]]})
    for p in (0, 1):
        assert res[p]["warnings"] == [] and res[p]["ops"][0]["step"] == 3
        assert sorted(step for step, _ in res[p]["copied"]) == [1, 2, 3, 4], res[p]["copied"]
        assert res[p]["peers"] == {f"p{1 - p}": ["2", "3", "4"]}


def test_a_wiped_host_gets_back_every_step_it_listed_not_only_the_newest(tmp_path):
    """A breaker's case: host 1 wiped after steps 1-3 (max_to_keep=3). The start sent back
    the newest step only; steps 1 and 2, which host 0 held and host 0's copies could
    rebuild, were never listed and the next save deleted them. Now every such step is
    sent back at the start, newest first, and listed; retention then keeps 2-4."""
    run_job({"path": str(tmp_path), "save": [1, 2, 3], "keep": 3})
    shutil.rmtree(os.path.join(tmp_path, "host1"))
    res = run_job({"path": str(tmp_path), "keep": 3, "ops": [["tiers"], ["save", 4], ["restore", 2]]})
    for p in (0, 1):
        assert res[p]["steps_at_start"] == [1, 2, 3], res[p]
        assert res[p]["ops"][1]["steps"] == [2, 3, 4]
        assert res[p]["ops"][2] == {"step": 2, "version": 1, "w": 1, "b": 1, "steps": [2, 3, 4]}
        assert res[p]["on_disk"] == ["2", "3", "4"]


def test_a_copy_one_process_gave_up_on_fails_at_once_in_every_process(tmp_path):
    """A breaker's cases, each a wait that ran out the stall bound (40 s here, 10 min by
    default) before the failure was heard: (1) host 0's read of its part fails after
    block 0 was offered (and taken back): host 1 waited for block 0 to arrive; (2) host 1
    starts step 3's copy 25 s late, past the manager's timeout_s (20 s), at which host 0
    gave up on it: each waited for the other. Now a process that gave up posts it at
    the copy's verdict and every wait of the copy ends there: the step is kept, marked
    lacking its copies, and step 4's save sends it again."""
    for fault in ({"fail_read": [0, 3, 1]}, {"late": [1, 3, 25]}):
        path = tmp_path / next(iter(fault))
        res = run_workers(WORKER, 2, lambda i, port: [port, 2, i, "job", json.dumps(
            {"path": str(path), "keep": 3, "block_bytes": 16384, "time_ops": True, **fault,
             "ops": [["save", 1], ["save", 2], ["save", 3], ["save", 4]]})], 150, env={"JAXCKPT_STALL_S": "40"})
        for p in (0, 1):
            ops = res[p]["ops"]
            assert "crash" not in res[p], res[p]
            late = fault.get("late", [0, 0, 0])[2]
            assert ops[2]["seconds"] < late + 12, (fault, p, ops[2])  # not the stall bound's 40 s
            assert ops[2]["tiers"]["3"] == ["local", "peer-copies-missing"], (fault, ops[2])
            assert ops[3]["tiers"] == {"2": ["local"], "3": ["local"], "4": ["local"]}, (fault, ops[3])
            assert any("the peer copy of step 3" in w for w in res[p]["warnings"]), res[p]["warnings"]


def test_codecs_with_a_directory_per_host_survive_a_lost_host_and_two(tmp_path):
    """Issue 32, item 5: compression and quantize with a directory per host (refused
    before). Three hosts in a ring, a persistent tier every 2nd step; ``w`` (sharded) and
    ``r`` (replicated: each host encodes its own copy) in zstd,
    the moment ``mu`` in int8. Each host's manifest locates its compressed chunks in its
    own data objects and the others at the designated copy. Host 1 lost: restored from
    its peer, bit for bit (``mu`` within its int8 bound); hosts 1 and 2 lost: from the
    persistent tier, the same."""
    durable = str(tmp_path / "durable")
    base = {"path": str(tmp_path), "durable": durable, "keep": 3, "codecs": True}
    res = run_job({**base, "save": [1, 2, 3]}, nproc=3)
    for p in range(3):
        assert "crash" not in res[p] and not res[p].get("save_errors"), res[p]
        assert res[p]["steps"] == [1, 2, 3] and res[p]["peers"] == {f"p{(p - 1) % 3}": ["1", "2", "3"]}
    assert res[0]["durable_on_disk"] == ["2"]
    for host in range(3):
        man = json.loads((tmp_path / f"host{host}" / "3" / "manifest.json").read_text())
        leaves = {leaf["path"]: leaf for leaf in man["leaves"]}
        assert [leaves[k]["codec"] for k in ("w", "r", "mu", "b")] == ["zstd", "zstd", "int8", "raw"], host
        # r: every host's own copy; w: its own third here, the others' at their (only) copy
        assert {run[0] for run in leaves["r"]["runs"]} == {host}
        assert sorted({run[0] for run in leaves["w"]["runs"]}) == [0, 1, 2]
        assert sum(leaves["r"]["sizes"]) < 192 * 64 * 4 / 2  # half zero, one decimal: compressed
    shutil.rmtree(tmp_path / "host1")

    res = run_job({**base, "restore": None}, nproc=3)
    for p in range(3):
        assert "crash" not in res[p] and "error" not in res[p], res[p]
        assert res[p]["steps_at_start"] == [1, 2, 3] and res[p]["restored"] == 3  # check(): the values
        assert res[p]["tiers_after_restore"]["3"][0] == "local"
    shutil.rmtree(tmp_path / "host1")
    shutil.rmtree(tmp_path / "host2")

    res = run_job({**base, "restore": None}, nproc=3)
    for p in range(3):
        assert "crash" not in res[p] and "error" not in res[p], res[p]
        assert res[p]["steps_at_start"] == [2] and res[p]["restored"] == 2
        assert res[p]["tiers_after_restore"] == {"2": ["persistent"]}
