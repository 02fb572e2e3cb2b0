"""Pure layout arithmetic."""

import jax
import numpy as np
import pytest
from conftest import mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxckpt import _layout


def test_shards_of_lists_each_distinct_slice_with_its_holders():
    m = mesh((4, 2), ("a", "b"))
    for spec in [P("a"), P(None, "b"), P(), P(("a", "b"))]:
        x = jax.device_put(np.zeros((8, 8)), NamedSharding(m, spec))
        shards = _layout.shards_of(x.sharding, x.shape)
        # the distinct slices are exactly jax's replica-0 shards
        replica0 = sorted(_layout.normalize_index(s.index, x.shape) for s in x.addressable_shards if s.replica_id == 0)
        assert sorted(s.index for s in shards) == replica0
        for s in shards:
            holders = {d for d in x.sharding.device_set
                       if _layout.normalize_index(x.sharding.devices_indices_map(x.shape)[d], x.shape) == s.index}
            assert set(s.devices) == holders and s.processes == (0,)


def test_assign_writers_balances_bytes_largest_first():
    # (nbytes, holders): hand-computed greedy, largest first to the least-loaded holder
    chunks = [(10, (0, 1)), (40, (0, 1)), (30, (0, 1)), (20, (1,)), (25, (0, 1, 2))]
    # 40 -> 0 (tie, lowest); 30 -> 1; 25 -> 2; 20 -> 1 (only holder); 10 -> 0 (0 has 40, 1 has 50)
    assert _layout.assign_writers(chunks) == [0, 0, 1, 1, 2]
    # fully replicated: 8 equal chunks over 4 processes, 2 each
    got = _layout.assign_writers([(128, (0, 1, 2, 3))] * 8)
    assert sorted(got) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert _layout.assign_writers([]) == []


def test_split_chunk_shape_for_replicas():
    mib = 1 << 20
    # not replicated: chunk = shard (zero-length dims get extent 1)
    assert _layout.split_chunk_shape((256, 1024), 1, 4) == (256, 1024)
    assert _layout.split_chunk_shape((0, 6), 1, 4) == (1, 6)
    # 1 MiB rows x 256 held by 4 processes: 4 pieces of 64 MiB (a multiple of 4)
    assert _layout.split_chunk_shape((256, mib // 4), 4, 4) == (64, mib // 4)
    # 3 holders, 12 rows of 4 MiB: 3 pieces; 10 rows of 4 MiB: no multiple of 3 divides 10 -> 5
    assert _layout.split_chunk_shape((12, mib), 3, 4) == (4, mib)
    assert _layout.split_chunk_shape((10, mib), 3, 4) == (2, mib)
    # pieces would be under MIN_PIECE_BYTES: no split
    assert _layout.split_chunk_shape((8, 1024), 4, 4) == (8, 1024)
    # first dimension of length 1 is skipped
    assert _layout.split_chunk_shape((1, 64, mib // 4), 2, 4) == (1, 32, mib // 4)


def test_chunk_shape_is_shard_shape():
    m = mesh((4, 2), ("a", "b"))
    assert _layout.chunk_shape_for(NamedSharding(m, P("a", "b")), (8, 6)) == (2, 3)
    assert _layout.chunk_shape_for(NamedSharding(m, P()), (8, 6)) == (8, 6)
    assert _layout.chunk_shape_for(NamedSharding(m, P("a")), (0, 6)) == (1, 6)


def test_chunks_overlapping():
    got = list(_layout.chunks_overlapping(((1, 5), (0, 3)), (2, 3)))
    assert got == [((0, 0), ((1, 2), (0, 3))), ((1, 0), ((2, 4), (0, 3))), ((2, 0), ((4, 5), (0, 3)))]
    assert list(_layout.chunks_overlapping((), ())) == [((), ())]
    assert _layout.chunk_flat_index((2, 1), (3, 4)) == 9


def test_sharding_json_round_trip():
    m = mesh((2, 2, 2), ("a", "b", "c"))
    s = NamedSharding(m, P("a", ("b", "c"), None))
    saved = _layout.sharding_from_json(_layout.sharding_to_json(s))
    assert saved.spec == P("a", ("b", "c"), None)
    assert saved.mesh_shape == {"a": 2, "b": 2, "c": 2}
    assert saved.to_sharding() == s


def test_needed_indices_normalized():
    m = mesh((2,), ("x",))
    got = _layout.needed_indices(NamedSharding(m, P("x")), (4, 3))
    assert sorted(got.values()) == [((0, 2), (0, 3)), ((2, 4), (0, 3))]


@pytest.mark.parametrize("shape, chunk_shape", [((10, 7), (3, 2)), ((), ()), ((0, 4), (1, 4)), ((64, 128), (16, 128)),
                                                ((5,), (5,)), ((9, 9, 3), (4, 2, 3)), ((1,), (1,))])
def test_chunk_sizes_are_the_clipped_regions_sizes(shape, chunk_shape):
    want = [_layout.index_size(_layout.chunk_region(c, chunk_shape, shape))
            for c in _layout.chunk_cells(shape, chunk_shape)]
    assert _layout.chunk_sizes(shape, chunk_shape) == want


def test_assign_with_loads_picks_the_least_loaded_holder_lowest_first():
    # the heap version against the plain rule: largest first, each to the holder with
    # the fewest bytes so far, ties to the lowest process
    rng = np.random.default_rng(7)
    for _ in range(200):
        n = int(rng.integers(1, 8))
        chunks = []
        for _ in range(int(rng.integers(1, 40))):
            holders = sorted(rng.choice(n, size=int(rng.integers(1, n + 1)), replace=False).tolist())
            chunks.append((int(rng.integers(1, 5)) * 64, holders))
        start = {p: int(rng.integers(0, 3)) * 64 for p in range(n) if rng.random() < 0.5}
        want, load = [0] * len(chunks), dict(start)
        for i, (nbytes, holders) in enumerate(chunks):
            if len(holders) == 1:
                want[i] = holders[0]
                load[holders[0]] = load.get(holders[0], 0) + nbytes
        for i in sorted((i for i, c in enumerate(chunks) if len(c[1]) > 1), key=lambda i: -chunks[i][0]):
            best = min(chunks[i][1], key=lambda p: (load.get(p, 0), p))
            load[best] = load.get(best, 0) + chunks[i][0]
            want[i] = best
        got_load = dict(start)
        assert _layout.assign_with_loads(chunks, got_load) == want
        assert got_load == load
