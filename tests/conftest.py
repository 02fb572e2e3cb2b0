"""Shared fixtures: 8 CPU devices (set before jax is used), meshes, temp dirs."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


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


@pytest.fixture(scope="session")
def s3_server():
    """A local S3 API (moto) on 127.0.0.1 with one bucket; yields a kvstore spec maker."""
    import socket
    import subprocess
    import sys
    import time

    import boto3

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = os.path.join(os.path.dirname(sys.executable), "moto_server")
    server = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    for _ in range(200):
        try:
            client.create_bucket(Bucket="jaxckpt-test")
            break
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(0.05)
    else:
        server.terminate()
        raise RuntimeError("moto_server did not start")

    def spec(prefix):
        return {"driver": "s3", "bucket": "jaxckpt-test", "path": prefix, "endpoint": endpoint,
                "aws_region": "us-east-1"}

    spec.client = client
    yield spec
    server.terminate()
    server.wait(10)
