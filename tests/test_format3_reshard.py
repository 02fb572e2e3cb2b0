"""Format 3 reads by byte range, finer than a shard (issue 22, item 2): a format-3 save
cuts its chunks finer than the saved shards (``_layout.fine_chunk_shape``), so a
restore onto a layout that cuts across the saved shards reads at most 1.25x the bytes
each process holds, without the read-once exchange; and the exchange works on format 3
(each entry read once in the job), in real two-process jobs."""

import json
import math
import os

import jax
import numpy as np
import pytest
from conftest import assert_bit_equal, run_workers
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt import _layout
from jaxckpt._storage import io_stats, reset_io_stats

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE = (2048, 4096)  # float32, 32 MiB: row blocks of 8 MiB on 4 devices, cut to 4 MiB chunks


def test_fine_chunk_shape_spreads_cuts_over_the_dimensions():
    # saved by one process: a 32 MiB row block cut into rows down to 4 MiB (contiguous in
    # the slice holding it: read straight into place)
    assert _layout.fine_chunk_shape((8192, 1024), (32768, 1024), 4) == (1024, 1024)
    # by 4 processes: first until every dimension has 4 pieces (columns), then rows to 4 MiB
    assert _layout.fine_chunk_shape((8192, 1024), (32768, 1024), 4, 4) == (4096, 256)
    assert _layout.fine_chunk_shape((2048, 1024), (8192, 1024), 4, 4) == (2048, 256)
    assert _layout.fine_chunk_shape((256, 1024), (1024, 1024), 4, 4) == (256, 1024)  # 1 MiB: no further
    assert _layout.fine_chunk_shape((512, 1024), (1024, 1024), 4) == (512, 1024)  # 2 MiB: whole
    # no factor 2, 3, 5 or 7 along rows (50257 = 29 x 1733); columns stop at 512-byte runs
    assert _layout.fine_chunk_shape((50257, 768), (50257, 768), 2) == (50257, 384)
    # 12 MiB: the smallest factor first (2), twice, to 3 MiB
    assert _layout.fine_chunk_shape((3 << 20,), (3 << 20,), 4) == (3 << 18,)
    assert _layout.fine_chunk_shape((0, 5), (0, 5), 4) == (1, 5)


def _save(path, fmt, monkeypatch, tree):
    monkeypatch.setenv("JAXCKPT_FORMAT", fmt)
    jaxckpt.save(path, tree)
    monkeypatch.delenv("JAXCKPT_FORMAT")
    with open(os.path.join(path, "manifest.json")) as f:
        return {leaf["path"]: leaf for leaf in json.load(f)["leaves"]}


def _row_blocks():
    host = np.random.default_rng(3).standard_normal(SHAPE, dtype=np.float32)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))
    return host, jax.device_put(host, NamedSharding(mesh, P("data", None)))


def test_format_3_cuts_finer_than_format_1_and_leaves_small_leaves_whole(tmp_path, monkeypatch):
    host, w = _row_blocks()
    small = {f"s{i}": np.arange(i + 8, dtype=np.float32) for i in range(40)}
    leaves = {fmt: _save(str(tmp_path / fmt), fmt, monkeypatch, {"w": w, **small}) for fmt in ("1", "3")}
    assert leaves["1"]["w"]["chunk_shape"] == [512, 4096]  # format 1: the saved shard, as before
    assert leaves["3"]["w"]["chunk_shape"] == [256, 4096]
    # one writer: one run, whatever the cuts (after the 40 small leaves' entries)
    assert leaves["3"]["w"]["runs"] == [[0, 0, 8, sum(-(-(4 * (i + 8) + 4) // 64) * 64 for i in range(40))]]
    # small leaves stay one chunk each: no entries where no reading needs them
    assert all(leaves["3"][k]["chunk_shape"] == [i + 8] for i, k in enumerate(small))


def _layouts():
    devs = np.array(jax.devices())
    return {
        "2x2 P(a,b)": NamedSharding(jax.sharding.Mesh(devs[:4].reshape(2, 2), ("a", "b")), P("a", "b")),
        "2x2 P(-,b)": NamedSharding(jax.sharding.Mesh(devs[:4].reshape(2, 2), ("a", "b")), P(None, "b")),
        "1 device": jax.sharding.SingleDeviceSharding(devs[0]),
        "4x2": NamedSharding(jax.sharding.Mesh(devs.reshape(4, 2), ("d", "m")), P("d", "m")),
    }


def test_single_process_restores_onto_the_matrix_layouts_read_what_they_hold(tmp_path, monkeypatch):
    host, w = _row_blocks()
    path = str(tmp_path / "c")
    _save(path, "3", monkeypatch, {"w": w})
    for name, sharding in _layouts().items():
        reset_io_stats()
        back = jaxckpt.restore(path, {"w": jax.ShapeDtypeStruct(SHAPE, np.float32, sharding=sharding)})
        assert_bit_equal(back["w"], host)
        assert io_stats()["bytes_read"] == host.nbytes, name  # each chunk once: exactly what it holds


WORKER = '''
import json, os, sys
port, pid, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid, initialization_timeout=60)
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import jaxckpt
from jaxckpt import _exchange, _storage
SHAPE = (2048, 4096)
host = {"w": np.random.default_rng(3).standard_normal(SHAPE, dtype=np.float32),
        "b": np.arange(1000, dtype=np.float32), "step": np.array(7, np.int32)}
devs = np.array(jax.devices())  # process 0: devices 0 and 1
rows = NamedSharding(jax.sharding.Mesh(devs, ("d",)), P("d", None))
os.environ["JAXCKPT_FORMAT"] = "3"
jaxckpt.save(path, {"w": jax.make_array_from_callback(SHAPE, rows, lambda i: host["w"][i]),
                    "b": host["b"], "step": host["step"]}, timeout_s=60)
del os.environ["JAXCKPT_FORMAT"]
# the column axis crosses the processes: process 0 holds the left half, both row halves
across = NamedSharding(jax.sharding.Mesh(devs.reshape(2, 2).T, ("a", "b")), P("a", "b"))
everywhere = NamedSharding(jax.sharding.Mesh(devs, ("d",)), P())
entries = []
_storage.fault_hook = lambda op, key: entries.append(key) if op == "read" else None

def restore(sharding, mode):
    _exchange.READ_ONCE = mode
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding if k == "w" else everywhere)
              for k, v in host.items()}
    entries.clear()
    _storage.reset_io_stats()
    back = jaxckpt.restore(path, target)
    same, held = True, {}
    for k, v in host.items():
        for shard in back[k].addressable_shards:
            same &= np.asarray(shard.data).tobytes() == v[shard.index].tobytes()
            held[(k, str(shard.index))] = v[shard.index].nbytes
    return {"same": bool(same), "read": _storage.io_stats()["bytes_read"], "held": sum(held.values()),
            "entries": sorted(entries)}

out = {"across": restore(across, "0"), "once": restore(everywhere, "1")}
print("RESULT " + json.dumps(out), flush=True)
'''


def test_two_processes_read_what_they_hold_and_read_once_on_format_3(tmp_path):
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    path = tmp_path / "ckpt"
    res = run_workers(str(worker), 2, lambda i, port: [port, i, path], 120, "a format-3 reshard")
    with open(path / "manifest.json") as f:
        leaves = {leaf["path"]: leaf for leaf in json.load(f)["leaves"]}
    assert leaves["w"]["chunk_shape"] == [512, 2048]
    for p in (0, 1):
        across = res[p]["across"]
        assert across["same"], across
        # without the exchange each process reads its half of every row block: what it holds
        # (format 1 reads every row block whole: 2x)
        assert across["read"] <= 1.25 * across["held"], across
        assert across["read"] == across["held"], across
        assert res[p]["once"]["same"], res[p]["once"]
    # read once: every entry of the checkpoint read by exactly one of the two processes
    once = res[0]["once"]["entries"] + res[1]["once"]["entries"]
    n_entries = sum(r[2] for leaf in leaves.values() for r in leaf.get("runs", ()))
    assert len(once) == len(set(once)) == n_entries == 8 + 2, once
    assert res[0]["once"]["entries"] and res[1]["once"]["entries"]
    assert res[0]["once"]["read"] + res[1]["once"]["read"] == math.prod(SHAPE) * 4 + 4000 + 4


def test_small_entries_are_read_in_one_preadv_and_a_bad_one_names_its_leaf(tmp_path, monkeypatch):
    from jaxckpt import _reader
    from jaxckpt._errors import CorruptCheckpointError

    small = {f"s{i:02d}": np.arange(100 * i + 8, dtype=np.float32) for i in range(40)}
    path = str(tmp_path / "c")
    leaves = _save(path, "3", monkeypatch, small)
    calls = []
    monkeypatch.setattr(_reader, "_preadv", lambda fd, parts, at: calls.append(len(parts)) or os.preadv(fd, parts, at))
    reset_io_stats()
    back = jaxckpt.restore(path, {k: np.zeros_like(v) for k, v in small.items()})
    for k, v in small.items():
        assert_bit_equal(back[k], v)
    assert len(calls) == 1 and calls[0] == 40 * 3 - 1  # gaps, payloads and checksums of 40 entries
    assert io_stats()["reads"] == 40 and io_stats()["bytes_read"] == sum(v.nbytes for v in small.values())
    offset = leaves["s07"]["runs"][0][3]
    with open(os.path.join(path, "data", "p0.0"), "r+b") as f:
        f.seek(offset + 5)
        byte = f.read(1)
        f.seek(offset + 5)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(CorruptCheckpointError, match=r"leaf 's07' chunk cell \[0\] could not be read: DATA_LOSS: entry at offset "
                                                     rf"{offset} of stream p0 .*digest mismatch"):
        jaxckpt.restore(path, {k: np.zeros_like(v) for k, v in small.items()})
