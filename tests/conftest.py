"""Shared fixtures: 8 CPU devices (set before jax is used), meshes, temp dirs."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402


@pytest.fixture
def ckpt(tmp_path):
    """A path for one checkpoint (not yet existing)."""
    return tmp_path / "ckpt"


def mesh(shape, names):
    n = int(np.prod(shape))
    return jax.sharding.Mesh(np.array(jax.devices()[:n]).reshape(shape), names)


def sharded(x, shape, names, spec):
    return jax.device_put(x, NamedSharding(mesh(shape, names), P(*spec)))


def assert_bit_equal(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    assert a.shape == b.shape, (a.shape, b.shape)
    assert a.tobytes() == b.tobytes()
