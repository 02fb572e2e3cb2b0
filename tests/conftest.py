"""Shared fixtures: 8 CPU devices (set before jax is used), meshes, temp dirs."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


@pytest.fixture(autouse=True)
def _layout_pin(request, monkeypatch):
    """A test marked ``format1`` is about the layout of formats 1 and 2 (a chunk file per
    chunk, small leaves packed): its saves write that layout (``JAXCKPT_FORMAT=1``, in its
    subprocesses too). Every other test saves format 3, the default, unless it sets the
    variable itself."""
    if request.node.get_closest_marker("format1") is not None:
        monkeypatch.setenv("JAXCKPT_FORMAT", "1")


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


# gcp-storage-emulator (2026.7.19) ignores the JSON API's ``startOffset``/``endOffset``
# list parameters and answers with every object of the bucket. tensorstore's ``gcs``
# driver lists a prefix with exactly those (``?startOffset=run%2F2%2F&endOffset=run%2F20``,
# no ``prefix``) and cuts its path prefix off each returned name: a foreign name shorter
# than that prefix aborts the whole process (``std::out_of_range: basic_string_view::substr``),
# a longer one is listed as a key of the wrong prefix. So the emulator is started with its
# list handler filtering by those two parameters, as Cloud Storage does.
_GCS_EMULATOR = """
import sys
from gcp_storage_emulator.handlers import objects

_ls = objects.ls


def ls(request, response, storage, *args, **kwargs):
    start = (request.query.get("startOffset") or [None])[0]
    end = (request.query.get("endOffset") or [None])[0]

    def keep(name):
        return (start is None or name >= start) and (end is None or name < end)

    class Offsets:
        def __getattr__(self, name):
            return getattr(storage, name)

        def get_file_list(self, *a, **kw):
            files, prefixes = storage.get_file_list(*a, **kw)
            return [f for f in files if keep(f["name"])], [p for p in prefixes if keep(p)]

    return _ls(request, response, Offsets(), *args, **kwargs)


objects.ls = ls  # before the server module builds its routing table

from gcp_storage_emulator.__main__ import main

main(sys.argv[1:])
"""


@pytest.fixture(scope="session")
def gcs_server():
    """A local GCS JSON API (gcp-storage-emulator, in memory) on 127.0.0.1 with one bucket.

    tensorstore's ``gcs`` driver is pointed at it through ``TENSORSTORE_GCS_HTTP_URL``, and
    ``GOOGLE_AUTH_TOKEN_FOR_TESTING`` makes its auth use a fixed token instead of looking
    for Google credentials or the metadata server. Both are set before any ``gs://`` access,
    so a plain ``gs://jaxckpt-test/...`` URL never leaves this machine. Yields a maker of
    such URLs; ``.keys(prefix)`` lists the bucket's object names through the emulator."""
    import json
    import socket
    import subprocess
    import sys
    import time
    import urllib.parse
    import urllib.request

    bucket = "jaxckpt-test"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-c", _GCS_EMULATOR, "start", "-H", "127.0.0.1", "--port", str(port), "--in-memory",
                               "--default-bucket", bucket, "-q"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def get(path):
        with urllib.request.urlopen(endpoint + path, timeout=10) as r:
            return json.loads(r.read())

    for _ in range(200):
        try:
            get(f"/storage/v1/b/{bucket}")
            break
        except OSError:  # not up yet (refused, or the bucket not made yet)
            time.sleep(0.05)
    else:
        server.terminate()
        raise RuntimeError("gcp-storage-emulator did not start")
    saved = {k: os.environ.get(k) for k in ("TENSORSTORE_GCS_HTTP_URL", "GOOGLE_AUTH_TOKEN_FOR_TESTING")}
    os.environ["TENSORSTORE_GCS_HTTP_URL"] = endpoint
    os.environ["GOOGLE_AUTH_TOKEN_FOR_TESTING"] = "testing"

    def url(prefix):
        return f"gs://{bucket}/{prefix}"

    def keys(prefix):
        names, token = [], None
        while True:
            query = {"prefix": prefix, **({"pageToken": token} if token else {})}
            page = get(f"/storage/v1/b/{bucket}/o?" + urllib.parse.urlencode(query))
            names += [o["name"] for o in page.get("items", [])]
            token = page.get("nextPageToken")
            if not token:
                return sorted(names)

    url.bucket, url.endpoint, url.keys = bucket, endpoint, keys
    yield url
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    server.terminate()
    server.wait(10)


def free_port():
    """A port on 127.0.0.1 that nothing listens on (closed right after it was picked)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MotoServer:
    """A local S3 API (moto) of its own on 127.0.0.1, with the bucket ``jaxckpt-test``.

    ``env`` is added to the server's environment (``INITIAL_NO_AUTH_ACTION_COUNT`` turns
    authentication on); ``stop()`` / ``resume()`` pause and continue the process
    (SIGSTOP / SIGCONT): a store that stops answering, with its connections open.
    """

    def __init__(self, env=None, bucket=True):
        import subprocess
        import sys

        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        exe = os.path.join(os.path.dirname(sys.executable), "moto_server")
        self.proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     env=dict(os.environ, **(env or {})))
        self._wait_until_up()
        if bucket:
            self.client().create_bucket(Bucket="jaxckpt-test")

    def _wait_until_up(self):
        import socket
        import time

        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.05)
        self.close()
        raise RuntimeError("moto_server did not start")

    def client(self, service="s3", key="testing", secret="testing"):
        import boto3
        import botocore.config

        config = botocore.config.Config(connect_timeout=5, read_timeout=10, retries={"max_attempts": 2})
        return boto3.client(service, endpoint_url=self.endpoint, region_name="us-east-1", config=config,
                            aws_access_key_id=key, aws_secret_access_key=secret)

    def stop(self):
        import signal

        self.proc.send_signal(signal.SIGSTOP)

    def resume(self):
        import signal

        self.proc.send_signal(signal.SIGCONT)

    def close(self):
        self.resume()
        self.proc.terminate()
        self.proc.wait(10)


@pytest.fixture
def moto_server():
    """A fresh local S3 server of this test's own (see ``MotoServer``)."""
    server = MotoServer()
    yield server
    server.close()


@pytest.fixture(scope="module")
def s3_auth_server():
    """A local S3 server that checks credentials: only ``server.key``/``server.secret``
    (an IAM user allowed everything) are valid there."""
    import json

    server = MotoServer(env={"INITIAL_NO_AUTH_ACTION_COUNT": "4"}, bucket=False)
    try:
        iam = server.client("iam")
        iam.create_user(UserName="ci")
        iam.put_user_policy(UserName="ci", PolicyName="all", PolicyDocument=json.dumps(
            {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}))
        key = iam.create_access_key(UserName="ci")["AccessKey"]
        server.key, server.secret = key["AccessKeyId"], key["SecretAccessKey"]
        server.client().create_bucket(Bucket="jaxckpt-test")  # the 4th and last unchecked request
        yield server
    finally:
        server.close()


def run_workers(worker, nproc, argv, timeout, label="the job", env=None, exits_ok=False):
    """A real multi-process JAX job: ``nproc`` processes of the script ``worker``, each
    started with ``argv(i, port)`` (the arguments after the script); each one's last
    ``RESULT <json>`` line by process id. Every process is killed, and the test fails,
    past ``timeout`` seconds; a process that crashed or printed no result fails it too,
    unless ``exits_ok`` (a test that kills a process on purpose): then its result is
    ``{"pid": i, "exit": <its exit code>, "stderr": <its last 2000 characters>}``."""
    import json
    import subprocess
    import sys
    import time

    port = free_port()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    extra, env = env or {}, dict(os.environ, PYTHONPATH=root, JAX_PLATFORMS="cpu")
    for var in ("XLA_FLAGS", "JAXCKPT_STALL_S", "JAXCKPT_FAULT"):
        env.pop(var, None)
    env.update(extra)
    procs = [subprocess.Popen([sys.executable, worker, *map(str, argv(i, port))], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for i in range(nproc)]
    results, deadline = {}, time.monotonic() + timeout
    for i, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            for q in procs:
                q.communicate(timeout=30)
            raise AssertionError(f"process {i} of {label} did not finish within {timeout}s") from None
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        if not lines and exits_ok:
            results[i] = {"pid": i, "exit": p.returncode, "stderr": err[-2000:]}
            continue
        assert lines, f"process {i} of {label} exited {p.returncode} without a result: {err[-3000:]}"
        results[i] = json.loads(lines[-1][7:])
        assert "crash" not in results[i], results[i]["crash"]
    return results
