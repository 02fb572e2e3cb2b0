"""Pure layout arithmetic."""

import jax
import numpy as np
from conftest import mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxckpt import _layout


def test_replica0_devices_match_jax_replica_ids():
    m = mesh((4, 2), ("a", "b"))
    for spec in [P("a"), P(None, "b"), P(), P(("a", "b"))]:
        x = jax.device_put(np.zeros((8, 8)), NamedSharding(m, spec))
        replica0 = {s.device: _layout.normalize_index(s.index, x.shape)
                    for s in x.addressable_shards if s.replica_id == 0}
        assert _layout.replica0_devices(x.sharding, x.shape) == replica0


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
