"""Old checkpoints stay readable: fixtures written by each format version, committed under
tests/fixtures/ and never regenerated, restore bit for bit (DESIGN.md rule 8)."""

import os
import sys

import jax
import numpy as np
from conftest import assert_bit_equal, mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
sys.path.insert(0, FIXTURES)
from make_v1 import expected  # noqa: E402


def test_v1_restores_without_a_target():
    path = os.path.join(FIXTURES, "v1")
    want = expected()
    got = jaxckpt.restore(path)
    for key in ("big", "small", "half", "nibbles"):
        assert_bit_equal(got["params"][key], want["params"][key])
    assert type(got["opt"][0]["count"]) is np.int32 and got["opt"][0]["count"] == 7
    assert type(got["opt"][0]["lr"]) is np.float64 and got["opt"][0]["lr"] == 0.125
    assert got["opt"][1] == () and got["opt"][2] is None
    assert_bit_equal(jax.random.key_data(got["rng"]), want["rng"])
    assert (got["step"], got["name"], got["flag"]) == (1000, "fixture", True)
    info = jaxckpt.metadata(path)
    assert info.format_version == 1 and info.metadata == {"made_by": "tests/fixtures/make_v1.py"}
    assert info.tree["params"]["big"].sharding.mesh_shape == {"x": 4}


def test_v1_restores_onto_another_mesh_and_verifies():
    path = os.path.join(FIXTURES, "v1")
    s = NamedSharding(mesh((2,), ("y",)), P(None, "y"))
    target = jax.tree.map(lambda x: x, expected(), is_leaf=lambda x: x is None)
    target["params"]["big"] = jax.ShapeDtypeStruct((512, 512), np.float32, sharding=s)
    target["rng"] = jax.random.key(0)
    got = jaxckpt.restore(path, target)
    assert got["params"]["big"].sharding == s
    assert_bit_equal(got["params"]["big"], expected()["params"]["big"])
    report = jaxckpt.verify(path)
    assert report.ok and report.leaves == 11, report.problems
