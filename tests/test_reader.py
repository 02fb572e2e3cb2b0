"""The restore data path: aligned buffers, merged packed ranges, shared chunks read once."""

import dataclasses

import numpy as np
import pytest
from conftest import assert_bit_equal, sharded

import jaxckpt
from jaxckpt import _commit, _layout, _reader, _storage
from jaxckpt._storage import chunkfiles as _chunkfiles
from jaxckpt._storage import location as _location
from jaxckpt._storage import zarr as _zarr


def _reader_for(ckpt):
    loc = _location.resolve(ckpt)
    return loc, _commit.read_manifest(loc)


@pytest.mark.format1
def test_packed_ranges_merge_within_a_stored_chunk(ckpt):
    leaves = {f"l{i}": np.full(1000, i, np.float32) for i in range(10)}  # 4000 B each
    jaxckpt.save(ckpt, leaves)
    loc, man = _reader_for(ckpt)
    reader = _reader.Reader(loc, man)
    recs = {r.path: r for r in man.leaves}
    for name in ("l1", "l7"):
        reader.add(recs[name], ((0, 1000),))
    _storage.reset_io_stats()
    reader.run()
    # both live in the one stored chunk: one read from the first byte of l1 to the last
    # of l7, which fetches that chunk whole
    stats = _storage.io_stats()
    assert stats["reads"] == 1
    (packed,) = man.packed
    assert packed.nbytes == packed.chunk_bytes  # one chunk
    assert stats["bytes_read"] == packed.nbytes
    for name in ("l1", "l7"):
        out = reader.get(recs[name], ((0, 1000),))
        assert_bit_equal(out, leaves[name])
        assert out.ctypes.data % 64 == 0  # a view into the aligned read buffer


def test_file_slices_land_in_aligned_buffers(ckpt):
    host = np.arange(1 << 20, dtype=np.float32).reshape(1024, 1024)
    jaxckpt.save(ckpt, {"w": sharded(host, (4,), ("x",), ("x", None))})
    loc, man = _reader_for(ckpt)
    (rec,) = man.leaves
    reader = _reader.Reader(loc, man)
    halves = [((0, 1024), (0, 512)), ((0, 1024), (512, 1024))]
    for index in halves:
        reader.add(rec, index)
    _storage.reset_io_stats()
    reader.run()
    # every saved row chunk is needed by both halves: read once each, not twice
    assert _storage.io_stats()["reads"] == 4
    for index in halves:
        out = reader.get(rec, index)
        assert out.ctypes.data % 64 == 0
        assert_bit_equal(out, host[_layout.index_to_slices(index)])


def test_aligned_empty():
    for shape, dtype in [((3, 5), np.float32), ((0,), np.int8), ((), np.complex128)]:
        a = _chunkfiles.aligned_empty(shape, dtype)
        assert a.shape == shape and a.dtype == dtype and a.flags.c_contiguous
        assert a.size == 0 or a.ctypes.data % 64 == 0


@pytest.mark.format1
def test_edge_chunks_written_by_other_zarr_writers_are_read(ckpt):
    """zarr stores an edge chunk at full size; such chunks must not take the direct path."""
    import json
    import shutil

    import tensorstore as ts

    host = np.arange(10 * 32768, dtype=np.float32).reshape(10, 32768)  # 1.25 MiB: file store
    jaxckpt.save(ckpt, {"w": host})
    shutil.rmtree(ckpt / "arrays" / "0")
    spec = _zarr.array_spec(_location.resolve(ckpt), "0", (10, 32768), (4, 32768), "float32")
    ts.open(spec, create=True).result().write(host).result()  # chunks of 4, 4 and (stored as 4) 2 rows
    doc = json.loads((ckpt / "manifest.json").read_text())
    del doc["checksum"]  # edited below: read as a manifest written before checksums
    doc["leaves"][0]["chunk_shape"] = [4, 32768]
    (ckpt / "manifest.json").write_text(json.dumps(doc))
    _storage.reset_io_stats()
    assert_bit_equal(jaxckpt.restore(ckpt)["w"], host)
    assert _storage.io_stats()["reads"] == 3


def test_a_store_that_fails_is_not_reported_as_corruption():
    from jaxckpt import _errors, _reader
    from jaxckpt._storage import location as _location

    op = _reader._Op(8, ["params/w"], None, None, None, ((0, 2),))
    loc = _location.resolve("s3://b/ckpt")
    bad = _reader._corrupt(loc, op, ValueError("DATA_LOSS: Digest mismatch, stored digest is 0x1"))
    assert type(bad) is _errors.CorruptCheckpointError and "leaf 'params/w' could not be read" in str(bad)
    gone = _reader._corrupt(loc, op, ValueError("UNAVAILABLE: Failed to connect to 127.0.0.1 port 9"))
    assert type(gone) is _errors.CheckpointError
    assert str(gone) == "Checkpoint 's3://b/ckpt': reading leaf 'params/w' failed: UNAVAILABLE: Failed to connect to 127.0.0.1 port 9"


@pytest.mark.format1
def test_a_0d_leaf_in_the_file_store_is_read(ckpt):
    """No save puts a 0-d leaf in a file of its own (it is packed), but the format allows
    it; the fuzzer (tests/test_fuzz.py) found its read failing with a TypeError."""
    import json

    import tensorstore as ts

    jaxckpt.save(ckpt, {"s": np.float64(1.5)})
    doc = json.loads((ckpt / "manifest.json").read_text())
    del doc["checksum"]  # edited below: read as a manifest written before checksums
    rec = doc["leaves"][0]
    rec.update(store="file", key="0")
    del rec["chunks"]
    doc["packed"] = []
    (ckpt / "manifest.json").write_text(json.dumps(doc))
    spec = _zarr.array_spec(_location.resolve(ckpt), "0", (), (), "float64")
    ts.open(spec, create=True).result().write(np.float64(2.5)).result()
    out = jaxckpt.restore(ckpt)["s"]
    assert type(out) is np.float64 and out == 2.5
    assert jaxckpt.open(ckpt)["s"][()] == 2.5


@pytest.mark.format1
def test_a_leaf_of_back_to_back_row_chunks_is_one_range_without_assembly(ckpt):
    # a small kernel sharded by rows over 4 devices: 4 packed chunks one after the other
    # in process 0's array, so the whole leaf is one byte range (a view, no copy); by
    # columns the chunks are not C-order blocks of the leaf and are assembled
    rows = np.arange(64 * 48, dtype=np.float32).reshape(64, 48)
    jaxckpt.save(ckpt, {"rows": sharded(rows, (4,), ("x",), ("x", None)),
                        "cols": sharded(rows, (4,), ("x",), (None, "x"))})
    loc, man = _reader_for(ckpt)
    recs = {r.path: r for r in man.leaves}
    full = ((0, 64), (0, 48))
    assert len(recs["rows"].chunks) == len(recs["cols"].chunks) == 4
    assert _reader._packed_chunks(recs["rows"], full) == [(0, recs["rows"].chunks[0][1], rows.nbytes, full)]
    assert len(_reader._packed_chunks(recs["cols"], full)) == 4
    reader = _reader.Reader(loc, man)
    for name in ("rows", "cols"):
        reader.add(recs[name], full)
    reader.run()
    assert_bit_equal(reader.get(recs["rows"], full), rows)
    assert_bit_equal(reader.get(recs["cols"], full), rows)
    assert reader.get(recs["rows"], full).base is not None  # a view of the packed bytes read
    # part of the leaf is still read by chunk
    assert len(_reader._packed_chunks(recs["rows"], ((16, 48), (0, 48)))) == 2


@pytest.mark.format1
def test_rows_out_of_order_in_the_packed_array_are_assembled(ckpt):
    rows = np.arange(64 * 48, dtype=np.float32).reshape(64, 48)
    jaxckpt.save(ckpt, {"rows": sharded(rows, (4,), ("x",), ("x", None))})
    loc, man = _reader_for(ckpt)
    rec = man.leaves[0]
    swapped = dataclasses.replace(rec, chunks=(rec.chunks[1], rec.chunks[0], *rec.chunks[2:]))
    assert not _reader._back_to_back(swapped, 4)
    assert len(_reader._packed_chunks(swapped, ((0, 64), (0, 48)))) == 4


def test_run_tasks_raises_the_first_failed_task_in_order_not_in_time():
    # task 1 fails at once, task 0 a moment later: the error raised is task 0's, every time
    # (a restore of two damaged leaves names the same one whichever thread is faster)
    import threading

    from jaxckpt import _tasks

    started = threading.Event()

    def slow():
        started.wait(5)
        raise ValueError("task 0")

    def fast():
        started.set()
        raise ValueError("task 1")

    with pytest.raises(ValueError, match="^task 0$"):
        _tasks.run_tasks([slow, fast], 2)
