"""The save data path: what a snapshot holds and how small leaves are packed."""

import jax
import numpy as np
import pytest
from conftest import sharded

from jaxckpt import _chunking, _layout, _snapshot, _writer


@pytest.mark.format1
def test_small_leaves_are_packed_aligned_with_zero_padding():
    tree = {"a": np.arange(3, dtype=np.int8), "b": sharded(np.arange(16, dtype=np.float32), (4,), ("x",), ("x",)),
            "c": np.ones((2, 2), np.float64), "step": 5}
    snap = _snapshot.snapshot(tree, copy_host_arrays=True)
    recs = {r.path: r for r in snap.records}
    assert recs["step"].kind == "value" and recs["step"].value == 5
    assert recs["a"].chunks == ((0, 0),)
    assert recs["b"].chunks == ((0, 64), (0, 128), (0, 192), (0, 256))  # one 16-byte shard per device
    assert recs["c"].chunks == ((0, 320),)
    assert snap.packed == (_snapshot.PackedArray(0, 384, 384),)
    buf = snap.packed_buf
    assert buf[:3].tolist() == [0, 1, 2] and not buf[3:64].any()  # padding is zeros
    assert buf[64:80].view(np.float32).tolist() == [0, 1, 2, 3]
    assert buf[320:352].view(np.float64).tolist() == [1.0] * 4
    assert snap.file_shards == {}


@pytest.mark.format1
def test_big_leaves_keep_one_host_buffer_per_replica0_shard():
    x = sharded(np.arange(1 << 20, dtype=np.float32).reshape(1024, 1024), (4, 2), ("a", "b"), ("a", None))
    snap = _snapshot.snapshot({"x": x}, copy_host_arrays=False)
    (rec,) = snap.records
    assert rec.store == "file" and rec.chunk_shape == (256, 1024)
    shards = snap.file_shards[0]
    # 8 devices hold 4 distinct row blocks: only the 4 replica-0 shards are written
    assert sorted(index for index, _ in shards) == [((i * 256, (i + 1) * 256), (0, 1024)) for i in range(4)]
    assert sorted(s.index for s in _layout.shards_of(x.sharding, x.shape)) == sorted(index for index, _ in shards)
    assert snap.nbytes_local == x.nbytes


def test_prng_keys_and_scalars():
    snap = _snapshot.snapshot({"k": jax.random.key(0, impl="rbg"), "s": np.float16(2)}, copy_host_arrays=True)
    k, s = snap.records
    assert (k.kind, k.impl, k.key_ndim, k.dtype, k.shape) == ("prng_key", "rbg", 0, "uint32", (4,))
    assert s.scalar and s.shape == () and s.dtype == "float16"


@pytest.mark.format1
def test_direct_chunk_writes_match_tensorstore_byte_for_byte(tmp_path, monkeypatch):
    import os

    import jaxckpt

    tree = {"w": sharded(np.arange(1 << 19, dtype=np.float32).reshape(512, 1024), (4,), ("x",), ("x", None)),
            "b": np.arange(1 << 20, dtype=np.int8).reshape(1024, 1024) % 7,
            "z": sharded(np.zeros((1 << 20,), np.float16), (2,), ("y",), ("y",))}
    jaxckpt.save(tmp_path / "direct", tree)
    monkeypatch.setattr(_writer, "DIRECT_WRITES", False)
    jaxckpt.save(tmp_path / "ts", tree)

    def chunks(root):
        out = {}
        for dirpath, _, files in os.walk(root / "arrays"):
            for f in files:
                if f != "zarr.json":
                    path = os.path.join(dirpath, f)
                    with open(path, "rb") as f:
                        out[os.path.relpath(path, root)] = f.read()
        return out

    direct, ts = chunks(tmp_path / "direct"), chunks(tmp_path / "ts")
    assert sorted(direct) == sorted(ts) and len(direct) == 4 + 1 + 2
    assert all(direct[k] == ts[k] for k in direct)


def test_row_block_chunks_are_views_of_their_shard_in_order():
    # Format 3 cuts a shard into row blocks; the snapshot cuts each shard with one reshape
    # (``_ArrayLeaf.hosts``). Each chunk's buffer must be exactly its region, still a view.
    x = sharded(np.arange(64 * 8, dtype=np.float32).reshape(64, 8), (4,), ("x",), ("x", None))
    shards = {_layout.normalize_index(s.index, x.shape): s for s in x.addressable_shards}
    leaf = _snapshot._ArrayLeaf(0, {}, [], {k: s.data for k, s in shards.items()})
    chunks = [_snapshot._Chunk(((r, r + 4), (0, 8)), 4 * 8 * 4, (0,), ((r // 16 * 16, r // 16 * 16 + 16), (0, 8)))
              for r in range(0, 64, 4) if r != 20]  # C order; the second shard's second block is another's
    got = leaf.hosts(chunks)
    for chunk, data in zip(chunks, got):
        (a, b), _ = chunk.region
        assert data.shape == (4, 8) and np.array_equal(data, np.asarray(x)[a:b])
        assert np.shares_memory(data, np.asarray(shards[chunk.shard].data))
    odd = _snapshot._Chunk(((0, 4), (0, 4)), 64, (0,), ((0, 16), (0, 8)))  # not a row block: sliced
    assert np.array_equal(leaf.hosts([odd])[0], np.asarray(x)[0:4, 0:4])


def test_format3_pieces_are_whole_shards_cut_into_chunks_by_the_writer():
    # a shard whose every row-block chunk this process writes is one piece (one view taken
    # in the blocking part); the writer cuts it into its chunks in the background
    x = sharded(np.arange(64 * 8, dtype=np.float32).reshape(64, 8), (4,), ("x",), ("x", None))
    shards = {_layout.normalize_index(s.index, x.shape): s for s in x.addressable_shards}
    leaf = _snapshot._ArrayLeaf(0, {}, [], {k: s.data for k, s in shards.items()})
    chunks = [_snapshot._Chunk(((r, r + 4), (0, 8)), 4 * 8 * 4, (0,), ((r // 16 * 16, r // 16 * 16 + 16), (0, 8)))
              for r in range(0, 64, 4) if r != 20]  # the second shard lacks one chunk: 3 pieces
    pieces = leaf.pieces(chunks)
    assert [region for region, _ in pieces] == [
        ((0, 16), (0, 8)), ((16, 20), (0, 8)), ((24, 28), (0, 8)), ((28, 32), (0, 8)),
        ((32, 48), (0, 8)), ((48, 64), (0, 8))]
    rec = _snapshot.LeafRecord(path="x", kind="array", shape=(64, 8), chunk_shape=(4, 8))
    cut = list(_writer.split_rows(rec, pieces))
    assert [region for region, _ in cut] == [c.region for c in chunks]
    for region, data in cut:
        (a, b), _ = region
        assert np.array_equal(data, np.asarray(x)[a:b]) and data.flags.c_contiguous


def _chunks_by_cells(shape, chunk_shape, shards, itemsize):
    """The chunk list read literally: every grid cell in C order, its region clipped, its
    owner the last shard overlapping it."""
    owner = {}
    for shard in shards:
        for cell, _ in _layout.chunks_overlapping(shard.index, chunk_shape):
            owner[cell] = shard
    out = []
    for cell in _layout.chunk_cells(shape, chunk_shape):
        region = _layout.chunk_region(cell, chunk_shape, shape)
        out.append(_chunking.Chunk(region, _layout.index_size(region) * itemsize, owner[cell].processes,
                                   owner[cell].index))
    return out


@pytest.mark.parametrize("seed", range(40))
def test_row_block_chunk_lists_match_the_cell_by_cell_list(seed):
    # Format 3's fine chunks are blocks of whole rows; their list is built by arithmetic
    # (``_chunking.row_chunks``), which must give exactly the cell-by-cell list
    rng = np.random.default_rng(seed)
    devices = np.array(jax.devices())
    meshes = [jax.sharding.Mesh(devices.reshape(8), ("a",)), jax.sharding.Mesh(devices.reshape(4, 2), ("a", "b"))]
    checked = 0
    for _ in range(30):
        mesh = meshes[int(rng.integers(2))]
        ndim = int(rng.integers(1, 4))
        shape = tuple(int(rng.choice([0, 8, 16, 24, 40, 48])) for _ in range(ndim))  # every split divides
        spec = [None] * ndim
        for axis in mesh.axis_names:
            if rng.integers(2):
                spec[int(rng.integers(ndim))] = axis if spec[0] != axis else None
        if len([a for a in spec if a]) != len({a for a in spec if a}):
            continue
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
        shards = _layout.shards_of(sharding, shape)
        rows = shards[0].index[0][1] - shards[0].index[0][0] if shards else 1
        # a divisor of the shard's rows (what a save picks), or any height (straddling shards)
        height = max(1, rows // int(rng.choice([1, 2, 4]))) if rng.integers(2) else int(rng.integers(1, 50))
        chunk_shape = (height, *(max(1, d) for d in shape[1:]))
        if any(d == 0 for d in shape[1:]):
            continue  # a zero-width row: the chunk extent 1 is not the shape's; not a row block
        got = _chunking.chunks(shape, chunk_shape, shards, 4)
        assert got == _chunks_by_cells(shape, chunk_shape, shards, 4), (shape, spec, chunk_shape)
        checked += 1
    assert checked


def test_a_repeated_save_of_the_same_leaves_gets_the_same_writer_lists():
    # Replicated chunks (several holders) are balanced per save; a training loop's repeated
    # save of the same leaves gets the very same writer lists back, so that the stream
    # layout and each process's share (cached per writer list) are not planned again.
    def chunk(row, holders, nbytes=64):
        return _chunking.Chunk(((row, row + 1), (0, 16)), nbytes, holders, ((0, 8), (0, 16)))

    replicated = [chunk(r, (0, 1, 2)) for r in range(8)]
    sharded_ = [chunk(r, (r % 3,), 128) for r in range(6)]
    lists = [sharded_, replicated]
    first = _chunking.writers_of(lists)
    load = {}
    for c in sharded_:
        load[c.holders[0]] = load.get(c.holders[0], 0) + c.nbytes
    assert first[0] == [0, 1, 2, 0, 1, 2]
    assert first[1] == _layout.assign_with_loads([(c.nbytes, c.holders) for c in replicated], load)
    again = _chunking.writers_of([sharded_, replicated])
    assert again is first and again[1] is first[1]
    copy = list(replicated)  # equal chunks, another list (a numpy leaf's, made per save): planned anew
    other = _chunking.writers_of([sharded_, copy])
    assert other == first and other is not first and other[1] is not first[1]
    # the stream layout is then reused: the same writer lists give the last layout's runs
    payloads = [64, 128]
    layout = _snapshot._plan_streams(payloads, first)
    assert _snapshot._plan_streams(payloads, first).runs is layout.runs


def test_accelerator_shards_are_staged_through_pinned_host_memory(tmp_path, monkeypatch):
    """On a device with pinned host memory (a GPU) the snapshot's host copy of each shard is
    one batched ``device_put`` to ``pinned_host`` that numpy views without a copy (4 GiB on an
    H200: 0.08 s against 2.66 s through pageable memory, benchmarks/RESULTS.md). CPU devices
    are made to look like accelerators here: their memories include ``pinned_host`` too."""
    import jaxckpt

    monkeypatch.setattr(_snapshot, "_on_cpu", lambda data: False)
    real_indices = _layout.device_indices
    monkeypatch.setattr(_layout, "device_indices", lambda s, shape: (real_indices(s, shape)[0], False))
    puts = []
    real_put = jax.device_put

    def put(x, device=None, **kw):
        if isinstance(x, list) and isinstance(device, list):
            puts.append([d.memory_kind for d in device])
        return real_put(x, device, **kw)

    monkeypatch.setattr(_snapshot.jax, "device_put", put)
    x = sharded(np.arange(1 << 16, dtype=np.float32).reshape(256, 256), (4, 2), ("a", "b"), ("a", None))
    y = sharded(np.arange(64, dtype=np.int8).reshape(8, 8), (4, 2), ("a", "b"), ("a", "b"))
    jaxckpt.save(tmp_path / "c", {"x": x, "y": y})
    assert puts and all(kind == "pinned_host" for kinds in puts for kind in kinds)
    assert sum(len(kinds) for kinds in puts) == 4 + 8  # x: 4 distinct row blocks; y: 8 shards
    out = jaxckpt.restore(tmp_path / "c")
    np.testing.assert_array_equal(out["x"], np.asarray(x))
    np.testing.assert_array_equal(out["y"], np.asarray(y))


def test_a_backend_refusing_the_pinned_put_falls_back_to_host_copies(tmp_path, monkeypatch):
    import jaxckpt

    monkeypatch.setattr(_snapshot, "_on_cpu", lambda data: False)
    real_indices = _layout.device_indices
    monkeypatch.setattr(_layout, "device_indices", lambda s, shape: (real_indices(s, shape)[0], False))
    real_put = jax.device_put

    def put(x, device=None, **kw):
        if isinstance(device, list):
            raise RuntimeError("pinned_host is not supported here")
        return real_put(x, device, **kw)

    monkeypatch.setattr(_snapshot.jax, "device_put", put)
    x = sharded(np.arange(1 << 14, dtype=np.float32).reshape(128, 128), (4, 2), ("a", "b"), ("a", None))
    jaxckpt.save(tmp_path / "c", {"x": x})
    np.testing.assert_array_equal(jaxckpt.restore(tmp_path / "c")["x"], np.asarray(x))
