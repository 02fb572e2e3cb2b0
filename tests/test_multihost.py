"""Real multi-process JAX (gloo CPU collectives on 127.0.0.1): save in N processes,
restore in M, agreement on commit, failing as one, the manager in a jitted loop."""

import json
import os
import shutil

import numpy as np
import pytest
from conftest import run_workers

import jaxckpt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "mp_worker.py")


def run_job(nproc, ndev, scenario, args, timeout=90):
    """``nproc`` processes of ``ndev`` devices each; each one's ``RESULT`` dict by process
    id, or for one that printed none (killed on purpose) its exit code and stderr."""
    return run_workers(WORKER, nproc, lambda i, port: [port, nproc, i, ndev, scenario, json.dumps(args)], timeout,
                       scenario, exits_ok=True)


# (saving processes, mesh, spec) -> (restoring processes, mesh, spec); 2 devices per process
MATRIX = {
    "2->1": ((2, (4,), ("x",), ["x", None]), (1, (2,), ("y",), [None, "y"])),
    "1->2": ((1, (2,), ("x",), [None, "x"]), (2, (2, 2), ("a", "b"), ["b", "a"])),
    "2->4": ((2, (2, 2), ("a", "b"), ["a", "b"]), (4, (4, 2), ("d", "m"), ["d", None])),
    "4->2": ((4, (8,), ("x",), ["x", None]), (2, (2, 2), ("p", "q"), [None, ["p", "q"]])),
}


@pytest.mark.parametrize("case", [c if c == "2->1" else pytest.param(c, marks=pytest.mark.slow) for c in sorted(MATRIX)])
def test_save_in_n_processes_restore_in_m(tmp_path, case):
    (n, mesh_s, names_s, spec_s), (m, mesh_r, names_r, spec_r) = MATRIX[case]
    path = str(tmp_path / "ckpt")
    saved = run_job(n, 2, "save", {"mesh": mesh_s, "names": names_s, "spec": spec_s, "path": path})
    written = [saved[i]["written"] for i in range(n)]
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    small = 8 * 16 * 4 + 16 * 4 + 3  # the sharded small leaf, the replicated one, the host one
    if manifest["format_version"] == 3:
        # every chunk one entry of one writer's stream (these chunks tile their leaves)
        leaves = [leaf for leaf in manifest["leaves"] if leaf["kind"] == "array"]
        assert all(leaf["store"] == "stream" for leaf in leaves)
        payload = sum(sum(r[2] for r in leaf["runs"]) * (leaf["entry_bytes"] - 4) for leaf in leaves)
        assert payload == 64 * 4096 * 4 + small
        assert sorted(manifest["streams"]) == [str(i) for i in range(n)]  # every process wrote its part
        packed = small
    else:  # JAXCKPT_FORMAT=1: small leaves are packed with each shard padded to 64 bytes
        packed = sum(p["nbytes"] for p in manifest["packed"])
        n_chunks = sum(len(leaf.get("chunks", [])) for leaf in manifest["leaves"])
        assert small <= packed < small + 64 * n_chunks
    # every byte written exactly once in total: replicated leaves once, not once per process
    assert sum(written) == 64 * 4096 * 4 + packed, written
    restored = run_job(m, 2, "restore", {"mesh": mesh_r, "names": names_r, "spec": spec_r, "path": path})
    for i in range(m):
        assert restored[i].get("ok"), restored[i]
        # Each process read the saved chunks its own devices' slices touch, each once
        # and whole (a chunk's checksum covers all of it; small leaves: plus their
        # 64-byte alignment padding). Where the target's slices are whole saved chunks
        # that is exactly the bytes its devices hold; where they cut across chunks
        # (2 -> 4, 4 -> 2), more (the exchange, off for local paths, would read each
        # chunk once per job instead: test_read_once_*).
        r = restored[i]
        assert r["chunk_bytes"] <= r["read"] <= r["chunk_bytes"] + 64 * 8, r
        if case in ("1->2", "2->1"):
            assert r["read"] - r["needed"] < 64 * 8, r
    if case == "2->4":
        print(f"\n(2,4): bytes written per process {written}; read per process "
              f"{[restored[i]['read'] for i in range(m)]}")


def test_injected_write_failure_fails_every_process(tmp_path):
    path = str(tmp_path / "ckpt")
    args = {"mesh": (4,), "names": ("x",), "spec": ["x", None], "path": path, "bad": 1, "timeout": 20}
    res = run_job(2, 2, "fail_write", args)
    assert "injected failure in process 1" in res[1]["error"]
    assert "failed in process 1" in res[0]["error"] and "injected failure" in res[0]["error"]
    assert not res[0]["committed"] and not os.path.exists(path)
    assert os.listdir(tmp_path) == []  # the staging directory was removed


@pytest.mark.slow
def test_dead_process_fails_the_save_within_the_staleness_bound(tmp_path):
    # process 1 dies in the middle of its writes; the timeout for peers that have not
    # started (30 s) is far longer than the heartbeat staleness bound (STALE_S = 10 s)
    path = str(tmp_path / "ckpt")
    args = {"mesh": (4,), "names": ("x",), "spec": ["x", None], "path": path, "bad": 1, "timeout": 30}
    res = run_job(2, 2, "die", args)
    assert res[1].get("exit") == 3
    assert "process 1 stopped responding (no heartbeat for 1" in res[0]["error"], res[0]["error"]
    # STALE_S, plus at most a heartbeat, a poll and process 0's own (small) write
    assert 10 <= res[0]["seconds"] < 16, res[0]["seconds"]
    assert not res[0]["committed"] and not os.path.exists(path)


@pytest.mark.slow
def test_slow_writer_is_waited_for_and_both_commit(tmp_path):
    # process 1 writes for 8 s, longer than the 3 s timeout: it is alive, so it is waited for
    path = str(tmp_path / "ckpt")
    args = {"mesh": (4,), "names": ("x",), "spec": ["x", None], "path": path, "slow": 1, "sleep": 8,
            "timeout": 3}
    res = run_job(2, 2, "slow_write", args)
    for i in range(2):
        assert res[i]["error"] is None, res[i]
        assert res[i]["committed"]
        assert res[i]["seconds"] >= 8
    restored = run_job(1, 2, "restore", {"mesh": (2,), "names": ("y",), "spec": [None, "y"], "path": path})
    assert restored[0]["ok"]


def test_one_sided_failure_is_raised_in_both_and_the_next_save_succeeds(tmp_path):
    path = str(tmp_path / "steps")
    res = run_job(2, 2, "one_sided", {"mesh": (4,), "names": ("x",), "spec": ["x", None], "path": path})
    for i in range(2):
        (err,) = res[i]["errors"]
        assert "Saving step 1 to" in err and "injected one-sided failure in process 1" in err, err
        assert res[i]["steps"] == [2, 3], res[i]
        # agreement keys do not pile up: only the last save's (still readable) keys remain
        assert res[i]["keys"] and all("/op/save" in k for k in res[i]["keys"]), res[i]["keys"]
        assert len({k.split("/op/")[1].split("/")[0] for k in res[i]["keys"]}) == 1, res[i]["keys"]
    # the failed attempt was removed; the lease released
    assert sorted(os.listdir(path)) == ["2", "3", "history.jsonl"]


@pytest.mark.slow
def test_replicated_state_is_written_by_all_processes_balanced(tmp_path):
    path = str(tmp_path / "ckpt")
    # 4 processes x 1 device, everything replicated: one 16 MiB leaf (split in 4 pieces),
    # three 1.5 MiB leaves, 50 small ones and a 2 MiB host array
    args = {"mesh": (4,), "names": ("x",), "spec": [None], "path": path,
            "big": [4 << 20, 3 << 18, 3 << 18, 3 << 18], "small": 50, "host": 1 << 19}
    res = run_job(4, 1, "replicated", args, timeout=120)
    written = [res[i]["written"] for i in range(4)]
    assert all(res[i]["same"] for i in range(4))
    total = 4 * ((4 << 20) + 3 * (3 << 18) + (1 << 19)) + 50 * 4096
    assert total <= sum(written) < total + 64 * 60  # each byte once (+ packing padding)
    mean = sum(written) / 4
    assert max(written) / mean <= 1.1, written
    print(f"\nreplicated, 4 processes: bytes written per process {written}, max/mean {max(written) / mean:.3f}")


def test_followers_take_the_manifest_from_process_0_not_the_file(tmp_path):
    path = str(tmp_path / "steps")
    res = run_job(2, 2, "no_manifest_reread", {"mesh": (4,), "names": ("x",), "spec": ["x", None], "path": path})
    for i in range(2):
        assert res[i]["steps"] == [1, 2, 3], res[i]
        assert res[i]["bytes"] == 64 * 4096 * 4 + 8 * 16 * 4 + 16 * 4 + 3


def test_async_manager_in_two_processes(tmp_path):
    path = str(tmp_path / "steps")
    res = run_job(2, 2, "manager", {"mesh": (2, 2), "names": ("a", "b"), "spec": ["a", "b"], "path": path})
    for i in range(2):
        assert res[i]["steps"] == [4, 5], res[i]
        # (process 0 may still be releasing its writer lease when process 1 looks)
        assert [f for f in res[i]["files"] if f != ".jaxckpt-writer.json"] == ["4", "5", "history.jsonl"]
        assert res[i]["restored_total"] == res[i]["expected"]
        assert res[i]["n"] == 5


def two_tier_job(tmp_path, durable, **args):
    res = run_job(2, 2, "two_tiers", {"mesh": (4,), "names": ("a",), "spec": ["a", None],
                                      "path": str(tmp_path / "local"), "durable": durable, **args}, timeout=120)
    assert all("crash" not in r and "exit" not in r for r in res.values()), res
    return res


@pytest.mark.slow
def test_two_tiers_with_a_local_directory_per_host_and_a_lost_host(tmp_path, s3_server):
    """Each process has a local directory of its own (as each host has its own disk) and
    the local S3 server is the persistent tier. Each directory holds what its process's
    devices hold (its half of the sharded leaf, all of the replicated ones); a step
    restores locally only when both hold theirs. With one directory wiped (a lost host)
    the newest persistent step restores, bit for bit, and saving goes on."""
    durable = s3_server("mp-tiers/a")
    res = two_tier_job(tmp_path, durable, save=[1, 2, 3, 4, 5])
    want = {"2": ["persistent"], "3": ["local"], "4": ["local", "persistent"], "5": ["local"]}
    for p in (0, 1):
        assert res[p]["groups"] == [[0], [1]]
        assert res[p]["tiers"] == want and res[p]["local_steps"] == ["3", "4", "5"]
    # each host's copy: the replicated leaves whole, the sharded one only in its own half
    for p in (0, 1):
        step = tmp_path / "local" / f"host{p}" / "5"
        man = json.loads((step / "manifest.json").read_text())
        w = next(leaf for leaf in man["leaves"] if leaf["path"] == "w")
        if man["format_version"] == 3:  # its own stream: the chunks of its half of w's rows
            assert sorted(os.listdir(step / "data")) == [f"p{p}.0"]
            grid = [n // c for n, c in zip(w["shape"], w["chunk_shape"])]
            rows = [int(np.unravel_index(f, grid)[0]) * w["chunk_shape"][0]
                    for proc, first, count, _ in w["runs"] if proc == p for f in range(first, first + count)]
            half = w["shape"][0] // 2
            assert rows and all(p * half <= r < (p + 1) * half for r in rows)
            assert len(rows) == np.prod(grid) // 2
            continue
        chunks = sorted(os.listdir(step / "arrays" / w["key"] / "c"))
        assert chunks == ([str(p * 2), str(p * 2 + 1)] if w["chunk_shape"][0] == 16 else [str(p)])
    assert jaxckpt.verify(dict(durable, path="mp-tiers/a/4")).ok

    res = two_tier_job(tmp_path, durable, restore=True)  # both hosts hold step 5: local
    assert [res[p]["restored"] for p in (0, 1)] == [5, 5]

    shutil.rmtree(tmp_path / "local" / "host1")  # host 1 is replaced by a new machine
    res = two_tier_job(tmp_path, durable, restore=True, then_save=[5, 6])
    for p in (0, 1):
        assert res[p]["tiers_at_start"] == {"2": ["persistent"], "4": ["persistent"]}
        assert res[p]["restored"] == 4  # step 5 is on host 0 only: the persistent step 4 restores
        assert res[p]["tiers_after"] == {"4": ["persistent"], "5": ["local"], "6": ["local", "persistent"]}
    # host 0's steps that host 1 lost (sharded: no host holds them whole) are deleted once step 5
    # is committed everywhere, never at the start
    assert res[0]["local_steps"] == res[1]["local_steps"] == ["5", "6"]


def test_two_tiers_with_a_shared_local_directory(tmp_path, s3_server):
    durable = s3_server("mp-tiers/b")
    res = two_tier_job(tmp_path, durable, shared=True, save=[1, 2, 3, 4], restore=True)
    for p in (0, 1):
        assert res[p]["groups"] == [[0, 1]]
        assert res[p]["tiers"] == {"2": ["local", "persistent"], "3": ["local"], "4": ["local", "persistent"]}
        assert res[p]["restored"] == 4
    back = jaxckpt.restore(dict(durable, path="mp-tiers/b/2"))
    assert back["r"].tobytes() == (np.arange(300_000, dtype=np.int32) * 2).tobytes()
    assert back["w"].tobytes() == (np.arange(64 * 1024, dtype=np.float32).reshape(64, 1024) + 2).tobytes()


# --- read once per job (_exchange) ---------------------------------------------------


def read_once_job(tmp_path, nproc=2, **args):
    args.setdefault("path", str(tmp_path / "ckpt"))
    res = run_job(nproc, 2, "read_once", {"mesh": (2 * nproc,), "names": ("x",), "spec": [None], **args}, timeout=120)
    assert all("exit" not in r for r in res.values() if r["pid"] != args.get("bad")), res
    return res


def state_bytes():
    sizes = {"w": 256 * 1024 * 4, "cols": 64 * 512 * 4, "across": 96 * 384 * 4, "h": 64 * 96 * 2, "odd": 100, "mask": 48, "s": 4, "key": 8}
    return sum(sizes.values())


def test_read_once_in_waves_within_a_host_budget_is_exact_and_reads_each_byte_once(tmp_path):
    """``max_staging_bytes``: every process forms the same waves (global facts), the
    exchange of each wave in turn; every byte still read once in the job."""
    whole = read_once_job(tmp_path / "whole", read_once="1")
    waves = read_once_job(tmp_path / "waves", read_once="1", budget=256 << 10)
    assert all(waves[p]["same"] for p in range(2)), waves
    assert sum(waves[p]["read"] for p in range(2)) == sum(whole[p]["read"] for p in range(2))


@pytest.mark.parametrize("nproc", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_read_once_reads_each_replicated_byte_once_per_job(tmp_path, nproc):
    """Fully replicated leaves, column blocks replicated over the processes, and column
    blocks of row-chunked data each held by one process: each saved byte is read from
    storage by one process of the job, spread over them, and every process gets every
    byte of what its devices hold. With the exchange off every process reads all of it."""
    once = read_once_job(tmp_path / "once", nproc, read_once="1")
    each = read_once_job(tmp_path / "each", nproc, read_once="0")
    total = state_bytes()
    assert all(once[p]["same"] and each[p]["same"] for p in range(nproc)), (once, each)
    assert [once[p]["state_bytes"] for p in range(nproc)] == [total] * nproc
    reads = [once[p]["read"] for p in range(nproc)]
    # each saved chunk once in the job (a chunk read twice would add >= 4 KiB): small
    # leaves add their 64-byte chunk padding
    assert total <= sum(reads) <= total + 64 * 16, reads
    # balanced, a saved chunk being the unit: saved from 2 processes the 1 MiB leaf is 2
    # chunks; from 3 it is saved replicated, one chunk (replicas split only above 4 MiB)
    assert max(reads) <= (total / 2 * 1.1 if nproc == 2 else 1 << 20), reads
    assert all(total <= each[p]["read"] <= total + 64 * 16 for p in range(nproc)), each


@pytest.mark.slow
def test_read_once_in_many_waves(tmp_path):
    # ~20 collectives; every slice copied out of its wave's buffer (none kept as a view)
    res = read_once_job(tmp_path, read_once="1", wave=64 << 10, view_share=2.0)
    assert res[0]["same"] and res[1]["same"], res
    assert sum(res[p]["read"] for p in (0, 1)) <= state_bytes() + 64 * 16


def test_read_once_is_the_default_for_object_stores(tmp_path, s3_server):
    endpoint = s3_server("unused")["endpoint"]
    res = read_once_job(tmp_path, path="s3://jaxckpt-test/read-once", endpoint=endpoint)  # read_once: auto
    assert res[0]["same"] and res[1]["same"], res
    assert state_bytes() <= res[0]["read"] + res[1]["read"] <= state_bytes() + 64 * 16, res


def test_read_once_is_off_by_default_for_local_paths(tmp_path):
    res = read_once_job(tmp_path, read_once="auto")
    assert all(res[p]["same"] and res[p]["read"] >= state_bytes() for p in (0, 1)), res


def test_read_once_falls_back_to_storage_when_the_collective_fails(tmp_path):
    res = read_once_job(tmp_path, read_once="1", gather_fails=True)
    for p in (0, 1):
        assert res[p]["same"], res
        assert res[p]["read"] >= state_bytes()  # its own pieces, then everything it lacked
        assert any("exchanging replicated slices between processes failed (injected: no collectives)" in w
                   for w in res[p]["warnings"]), res[p]["warnings"]


def test_a_failed_read_fails_the_restore_in_every_process(tmp_path):
    res = read_once_job(tmp_path, read_once="1", bad=1, fault="fail")
    assert res[1]["error"].startswith("CheckpointError: Checkpoint "), res[1]
    assert "injected read failure in process 1" in res[1]["error"]
    assert res[0]["error"].startswith("CheckpointError: restore"), res[0]
    assert "/read " in res[0]["error"] and "failed in process 1" in res[0]["error"]
    assert "injected read failure in process 1" in res[0]["error"]


@pytest.mark.slow
def test_a_reader_that_dies_fails_the_others_within_the_staleness_bound(tmp_path):
    res = read_once_job(tmp_path, read_once="1", bad=1, fault="die", stale=3)
    assert res[1].get("exit") == 3
    assert "process 1 stopped responding (no heartbeat for 3s; dead or hung)" in res[0]["error"], res[0]
    assert res[0]["seconds"] < 10


@pytest.mark.slow
def test_a_late_process_is_waited_for(tmp_path):
    res = read_once_job(tmp_path, read_once="1", late=1, late_s=4)
    assert res[0]["same"] and res[1]["same"], res


@pytest.mark.slow
def test_a_process_too_late_fails_the_restore_in_both_without_a_hang(tmp_path):
    # process 0 gives up on process 1 after START_TIMEOUT_S (1 s here) having posted its
    # own read; process 1, arriving later, must not enter the all-gather alone
    res = read_once_job(tmp_path, read_once="1", late=1, late_s=3, start_timeout=1)
    assert "process 1 did not report within 1s" in res[0]["error"], res[0]
    assert "process 0 did not report within 1s" in res[1]["error"], res[1]
    assert res[1]["seconds"] < 5
