"""Old checkpoints stay readable: fixtures written by each format version, committed under
tests/fixtures/ and never regenerated, restore bit for bit (DESIGN.md rule 8).

v1: a local checkpoint (data at its root). v2: data under a prefix the manifest names,
as object stores are written (the same tree, copied into a local directory). v3: every
chunk an entry of its writer's stream of data objects, locally (v3) and under an
attempt's prefix (v3-store); 384 KiB objects, so the 1 MiB leaf spans three.
"""

import os
import sys

import jax
import numpy as np
import pytest
from conftest import assert_bit_equal, mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
sys.path.insert(0, FIXTURES)
from make_v1 import expected  # noqa: E402

# (fixture, format version, made by, chunks verify reads: v1/v2 pack the small leaves)
VERSIONS = [("v1", 1, "tests/fixtures/make_v1.py", 5), ("v2", 2, "tests/fixtures/make_v2.py", 5),
            ("v3", 3, "tests/fixtures/make_v3.py", 10), ("v3-store", 3, "tests/fixtures/make_v3.py", 10)]


def assert_fixture(got):
    """``got`` holds the fixtures' tree, every leaf bit for bit and of its own type."""
    want = expected()
    for key in ("big", "small", "half", "nibbles"):
        assert_bit_equal(got["params"][key], want["params"][key])
    assert type(got["opt"][0]["count"]) is np.int32 and got["opt"][0]["count"] == 7
    assert type(got["opt"][0]["lr"]) is np.float64 and got["opt"][0]["lr"] == 0.125
    assert got["opt"][1] == () and got["opt"][2] is None
    assert_bit_equal(jax.random.key_data(got["rng"]), want["rng"])
    assert (got["step"], got["name"], got["flag"]) == (1000, "fixture", True)


@pytest.mark.parametrize("name,version,made_by,chunks", VERSIONS)
def test_fixture_restores_without_a_target(name, version, made_by, chunks):
    path = os.path.join(FIXTURES, name)
    assert_fixture(jaxckpt.restore(path))
    info = jaxckpt.metadata(path)
    assert info.format_version == version and info.metadata == {"made_by": made_by}
    assert info.tree["params"]["big"].sharding.mesh_shape == {"x": 4}


@pytest.mark.parametrize("name,version,made_by,chunks", VERSIONS)
def test_fixture_restores_onto_another_mesh_and_verifies(name, version, made_by, chunks):
    path = os.path.join(FIXTURES, name)
    s = NamedSharding(mesh((2,), ("y",)), P(None, "y"))
    target = jax.tree.map(lambda x: x, expected(), is_leaf=lambda x: x is None)
    target["params"]["big"] = jax.ShapeDtypeStruct((512, 512), np.float32, sharding=s)
    target["rng"] = jax.random.key(0)
    got = jaxckpt.restore(path, target)
    assert got["params"]["big"].sharding == s
    assert_bit_equal(got["params"]["big"], expected()["params"]["big"])
    report = jaxckpt.verify(path)
    assert report.ok and report.leaves == 11 and report.chunks == chunks, report.problems
    assert_bit_equal(jaxckpt.open(path)["params/small"][1], expected()["params"]["small"][1])


def test_the_v4_fixture_restores_from_the_pool_entry_of_a_deleted_step():
    # made by tests/fixtures/make_v4.py: step 2 of a dedup manager, every array referring
    # to step 1's bytes, step 1 deleted; its own pool entry is empty (git keeps no empty
    # directory: a clone has none, and nothing needs it)
    path = os.path.join(FIXTURES, "v4", "2")
    got = jaxckpt.restore(path)
    assert got["name"] == "fixture v4"
    got["name"] = "fixture"
    assert_fixture(got)
    info = jaxckpt.metadata(path)
    assert info.format_version == 4 and info.info["dedup"]["referred_steps"] == [1]
    report = jaxckpt.verify(path)
    assert report.ok and report.leaves == 11 and report.chunks == 10, report.problems
    with jaxckpt.CheckpointManager(os.path.join(FIXTURES, "v4"), read_only=True) as mgr:
        assert mgr.all_steps() == [2]
        assert_bit_equal(mgr.restore(2)["params"]["big"], expected()["params"]["big"])
