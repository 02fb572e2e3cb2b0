"""Plain ``s3://`` URLs configured the usual AWS way, through environment variables only
(no spec dicts), and object-store I/O that fails within a bound instead of hanging.

Every endpoint here is on 127.0.0.1: a local moto server, or a closed port.
"""

import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from conftest import MotoServer, assert_bit_equal, free_port

import jaxckpt
from jaxckpt import _storage
from jaxckpt._storage import bounds as _bounds
from jaxckpt._storage import location as _location

BOUND_S = 5.0  # the I/O bound the failure tests configure (JAXCKPT_IO_TIMEOUT_S)
SLACK_S = 4.0  # what a busy 2-core machine may add to it (process start not included)
AWS_NOISE = ("Failed to open file", ".aws/config", ".aws/credentials", "AuthCredentialsProvider",
             "common-io", "Profile credentials")


@pytest.fixture
def aws_env(monkeypatch, tmp_path):
    """A clean AWS environment: keys in the environment, no profile files, no endpoint."""
    for name in list(os.environ):
        if name.startswith("AWS_") or name == "JAXCKPT_IO_TIMEOUT_S":
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    return monkeypatch


def endpoint_of(s3_server):
    return s3_server("x")["endpoint"]


def state(seed=0):
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((256, 128)).astype(np.float32), "b": np.arange(7), "step": seed}


def check_round_trip(url):
    tree = state(1)
    jaxckpt.save(url, tree)
    back = jaxckpt.restore(url, tree)
    assert_bit_equal(back["w"], tree["w"])
    assert back["step"] == 1
    assert jaxckpt.metadata(url).tree["w"].shape == (256, 128)


def check_manager(url):
    with jaxckpt.CheckpointManager(url, max_to_keep=2) as mgr:
        for step in range(3):
            mgr.save(step, state(step))
        mgr.wait_until_finished()
        assert mgr.all_steps() == [1, 2]
    mgr = jaxckpt.CheckpointManager(url, read_only=True)
    assert mgr.latest_step() == 2
    assert_bit_equal(mgr.restore()["w"], state(2)["w"])


# --- the endpoint, the region and the credentials from the environment ---------------


def test_aws_endpoint_url(s3_server, aws_env):
    aws_env.setenv("AWS_ENDPOINT_URL", endpoint_of(s3_server))
    loc = _location.resolve("s3://jaxckpt-test/env/a/ckpt")
    assert loc.kvstore["endpoint"] == endpoint_of(s3_server)
    assert loc.context_spec == {"aws_credentials": {"type": "environment"}}
    check_round_trip("s3://jaxckpt-test/env/a/ckpt")
    check_manager("s3://jaxckpt-test/env/a/run")


def test_aws_endpoint_url_s3_wins_over_aws_endpoint_url(s3_server, aws_env):
    aws_env.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    aws_env.setenv("AWS_ENDPOINT_URL_S3", endpoint_of(s3_server))
    assert _location.resolve("s3://jaxckpt-test/env/b").kvstore["endpoint"] == endpoint_of(s3_server)
    check_round_trip("s3://jaxckpt-test/env/b/ckpt")
    check_manager("s3://jaxckpt-test/env/b/run")


def test_a_spec_dict_wins_over_the_environment(s3_server, aws_env):
    aws_env.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    aws_env.setenv("AWS_REGION", "eu-west-3")
    spec = {"driver": "s3", "bucket": "jaxckpt-test", "path": "env/c/ckpt", "endpoint": endpoint_of(s3_server),
            "aws_region": "us-east-1", "aws_credentials": {"type": "environment"}}
    loc = _location.resolve(spec)
    assert loc.kvstore == dict(spec, path="env/c/ckpt/") and loc.context_spec == {}
    jaxckpt.save(spec, {"x": np.arange(3)})
    assert jaxckpt.restore(spec)["x"].tolist() == [0, 1, 2]


def test_aws_region_over_aws_default_region(aws_env, tmp_path):
    def region():
        return _location.resolve("s3://jaxckpt-test/r").kvstore.get("aws_region")

    assert region() is None
    config = tmp_path / "config"
    config.write_text("[default]\nregion = ap-south-1\n[profile other]\nregion = sa-east-1\n")
    aws_env.setenv("AWS_CONFIG_FILE", str(config))
    assert region() == "ap-south-1"  # the profile's region, as the AWS CLI would
    aws_env.setenv("AWS_PROFILE", "other")
    assert region() == "sa-east-1"
    aws_env.setenv("AWS_DEFAULT_REGION", "us-west-2")
    assert region() == "us-west-2"
    aws_env.setenv("AWS_REGION", "eu-west-3")
    assert region() == "eu-west-3"
    loc = _location.resolve({"driver": "s3", "bucket": "jaxckpt-test", "aws_region": "us-east-1"})
    assert loc.kvstore["aws_region"] == "us-east-1"  # given explicitly: kept


def test_a_profile_from_a_shared_credentials_file(s3_auth_server, aws_env, tmp_path):
    # a server that checks keys: only the profile's are valid there
    aws_env.delenv("AWS_ACCESS_KEY_ID")
    aws_env.delenv("AWS_SECRET_ACCESS_KEY")
    credentials = tmp_path / "credentials"
    credentials.write_text(f"[default]\naws_access_key_id = nobody\naws_secret_access_key = x\n\n"
                           f"[ci]\naws_access_key_id = {s3_auth_server.key}\n"
                           f"aws_secret_access_key = {s3_auth_server.secret}\n")
    aws_env.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    aws_env.setenv("AWS_PROFILE", "ci")
    aws_env.setenv("AWS_ENDPOINT_URL", s3_auth_server.endpoint)
    aws_env.setenv("AWS_REGION", "us-east-1")
    loc = _location.resolve("s3://jaxckpt-test/env/p")
    assert loc.context_spec == {"aws_credentials": {
        "type": "profile", "profile": "ci", "credentials_file": str(credentials), "config_file": os.devnull}}
    check_round_trip("s3://jaxckpt-test/env/p/ckpt")
    check_manager("s3://jaxckpt-test/env/p/run")
    # the listing (boto3) signs with the profile too: the default profile's key is refused
    aws_env.setenv("AWS_PROFILE", "default")
    with pytest.raises(jaxckpt.CheckpointError, match="InvalidAccessKeyId"):
        jaxckpt.save("s3://jaxckpt-test/env/p/other", {"x": 1})


def test_credential_sources_in_the_order_of_the_aws_sdks(aws_env, tmp_path):
    def credentials():
        return _location.resolve("s3://jaxckpt-test/c").context_spec.get("aws_credentials")

    assert credentials() == {"type": "environment"}
    aws_env.delenv("AWS_SECRET_ACCESS_KEY")
    assert credentials() is None  # nothing configured: tensorstore's default chain
    config = tmp_path / "config"
    config.write_text("[profile sso]\nsso_session = corp\n[profile role]\nrole_arn = arn:aws:iam::1:role/r\n"
                      "source_profile = default\n")
    aws_env.setenv("AWS_CONFIG_FILE", str(config))
    aws_env.setenv("AWS_PROFILE", "role")
    assert credentials() == {"type": "profile", "profile": "role", "credentials_file": os.devnull,
                             "config_file": str(config)}
    aws_env.setenv("AWS_PROFILE", "sso")  # a kind the profile provider does not make: the default chain
    assert credentials() == {"type": "default", "profile": "sso"}
    aws_env.delenv("AWS_PROFILE")
    aws_env.setenv("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "/v2/credentials/x")
    assert credentials() == {"type": "ecs"}
    aws_env.setenv("AWS_WEB_IDENTITY_TOKEN_FILE", str(tmp_path / "token"))
    assert credentials() == {"type": "default", "profile": "default"}
    given = {"driver": "s3", "bucket": "b", "aws_credentials": {"type": "anonymous"}}
    assert _location.resolve(given).context_spec == {}


NOISE_SCRIPT = textwrap.dedent("""
    import numpy as np
    import jaxckpt

    tree = {"w": np.arange(1 << 16, dtype=np.float32), "b": np.arange(3)}
    jaxckpt.save("s3://jaxckpt-test/noise/{name}/ckpt", tree)
    assert jaxckpt.restore("s3://jaxckpt-test/noise/{name}/ckpt")["w"].tolist() == tree["w"].tolist()
    with jaxckpt.CheckpointManager("s3://jaxckpt-test/noise/{name}/run") as mgr:
        mgr.save(1, tree)
    print("ok")
""")


@pytest.mark.parametrize("source", ["environment", "profile"])
def test_no_aws_sdk_noise_on_stderr(s3_server, tmp_path, source):
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(HOME=str(tmp_path), AWS_ENDPOINT_URL=endpoint_of(s3_server), AWS_REGION="us-east-1",
               JAX_PLATFORMS="cpu")
    if source == "environment":
        env.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
    else:
        (tmp_path / "credentials").write_text("[ci]\naws_access_key_id = a\naws_secret_access_key = b\n")
        env.update(AWS_PROFILE="ci", AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "credentials"))
    out = subprocess.run([sys.executable, "-c", NOISE_SCRIPT.replace("{name}", source)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
    noise = [line for line in out.stderr.splitlines() if any(n in line for n in AWS_NOISE)]
    assert noise == []


# --- failing, never hanging ---------------------------------------------------------


def test_request_retries_fit_the_bound():
    for bound in (1, 5, 60, 600):
        r = _bounds.request_retries(bound)
        initial, largest = float(r["initial_delay"][:-2]) / 1000, float(r["max_delay"][:-2]) / 1000
        worst = sum(min(initial * 2 ** i + initial, largest) for i in range(r["max_retries"]))
        assert 1 <= r["max_retries"] <= 32 and (worst <= bound / 3 or r["max_retries"] == 1)
    assert _bounds.request_retries(60)["max_retries"] >= 4


def test_the_bound_is_configured_by_the_environment(monkeypatch):
    monkeypatch.delenv("JAXCKPT_IO_TIMEOUT_S", raising=False)
    assert _bounds.io_timeout_s() == 60.0
    monkeypatch.setenv("JAXCKPT_IO_TIMEOUT_S", "7.5")
    assert _bounds.io_timeout_s() == 7.5
    monkeypatch.setenv("JAXCKPT_IO_TIMEOUT_S", "0")
    assert _bounds.io_timeout_s() is None
    monkeypatch.setenv("JAXCKPT_IO_TIMEOUT_S", "soon")
    with pytest.raises(jaxckpt.CheckpointError, match="JAXCKPT_IO_TIMEOUT_S"):
        _bounds.io_timeout_s()


def test_boto3_giving_up_on_a_silent_store_names_its_own_timeouts(monkeypatch):
    # format 3's uploads, listings and batch deletes on S3 go through boto3, whose timeouts
    # (3 attempts of max(1 s, bound / 6): about half the bound) end a request the store does
    # not answer: the cause names those, the bound that fired, not JAXCKPT_IO_TIMEOUT_S
    # alone (which read "30.1 s (JAXCKPT_IO_TIMEOUT_S=60)"); a refused connection keeps botocore's own
    import urllib3.exceptions
    from botocore import exceptions as bx

    from jaxckpt._storage import s3 as _s3

    monkeypatch.setenv("JAXCKPT_IO_TIMEOUT_S", "5")
    started = time.monotonic() - 3.0
    url = "http://store/b/k"
    stalled = [bx.ReadTimeoutError(endpoint_url=url), bx.ConnectTimeoutError(endpoint_url=url),
               bx.ConnectionClosedError(endpoint_url=url, error=urllib3.exceptions.ProtocolError(
                   "Connection aborted.", TimeoutError("timed out")))]
    for error in stalled:  # the bound that fired: boto3's timeouts (3 attempts of max(1 s, bound / 6))
        assert _s3._cause(error, started) == ("no answer from the store in 3 s (3 attempts of 1 s each, "
                                              "boto3's timeouts for JAXCKPT_IO_TIMEOUT_S=5)")
    monkeypatch.setenv("JAXCKPT_IO_TIMEOUT_S", "60")
    assert _s3._cause(stalled[0], time.monotonic() - 30.1) == (
        "no answer from the store in 30.1 s (3 attempts of 10 s each, boto3's timeouts for JAXCKPT_IO_TIMEOUT_S=60)")
    for error in (bx.EndpointConnectionError(endpoint_url=url), bx.ConnectionClosedError(
            endpoint_url=url, error=urllib3.exceptions.ProtocolError("Connection aborted.", ConnectionResetError()))):
        assert _s3._cause(error, started) == str(error)


def timed(fn, *args, **kwargs):
    t = time.monotonic()
    with pytest.raises(jaxckpt.CheckpointError) as e:
        fn(*args, **kwargs)
    return time.monotonic() - t, str(e.value)


@pytest.mark.slow
def test_an_unreachable_endpoint_fails_within_the_bound(aws_env):
    aws_env.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    aws_env.setenv("JAXCKPT_IO_TIMEOUT_S", str(BOUND_S))
    url = "s3://jaxckpt-test/unreachable/ckpt"
    calls = [(jaxckpt.save, url, {"x": np.arange(3)}), (jaxckpt.restore, url), (jaxckpt.metadata, url),
             (jaxckpt.CheckpointManager, "s3://jaxckpt-test/unreachable/run")]
    for fn, *args in calls:
        elapsed, message = timed(fn, *args)
        assert elapsed < BOUND_S + SLACK_S, (fn.__name__, elapsed, message)
        assert "s3://jaxckpt-test/unreachable/" in message and "onnect" in message, message
    elapsed, message = timed(lambda: jaxckpt.CheckpointManager("s3://jaxckpt-test/unreachable/run",
                                                               read_only=True).all_steps())
    assert elapsed < BOUND_S + SLACK_S and "s3://jaxckpt-test/unreachable/run" in message


@pytest.mark.slow
def test_the_cli_fails_within_the_bound(aws_env):
    aws_env.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    aws_env.setenv("JAXCKPT_IO_TIMEOUT_S", str(BOUND_S))
    for command in ("show", "ls"):
        t = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "jaxckpt", command, "s3://jaxckpt-test/cli/ckpt"],
                             capture_output=True, text=True, timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))
        elapsed = time.monotonic() - t
        assert out.returncode == 1, (out.returncode, out.stderr)
        assert "s3://jaxckpt-test/cli/ckpt" in out.stderr and "onnect" in out.stderr, out.stderr
        assert elapsed < BOUND_S + SLACK_S + 10  # + starting python and importing jax


def test_a_server_that_stops_answering_fails_the_save_within_the_bound(moto_server, aws_env):
    aws_env.setenv("AWS_ENDPOINT_URL", moto_server.endpoint)
    aws_env.setenv("JAXCKPT_IO_TIMEOUT_S", str(BOUND_S))
    url = "s3://jaxckpt-test/stalled/run"

    def stop_at_first_chunk(op, key):
        if op == "write":
            moto_server.stop()

    with jaxckpt.CheckpointManager(url, async_save=False) as mgr:
        mgr.save(1, state(1))
        aws_env.setattr(_storage, "fault_hook", stop_at_first_chunk)
        try:
            elapsed, message = timed(mgr.save, 2, state(2))
        finally:
            aws_env.setattr(_storage, "fault_hook", None)
            moto_server.resume()
    assert elapsed < BOUND_S + SLACK_S, (elapsed, message)
    assert "Saving step 2 to 's3://jaxckpt-test/stalled/run' failed" in message
    assert "failed: no answer from the store in " in message, message
    assert message.endswith("s (3 attempts of 1 s each, boto3's timeouts for JAXCKPT_IO_TIMEOUT_S=5)"), message
    # the store is back: step 1 is there, step 2 was never committed
    with jaxckpt.CheckpointManager(url, read_only=True) as mgr:
        assert mgr.all_steps() == [1]
        assert_bit_equal(mgr.restore(1)["w"], state(1)["w"])
    elapsed, message = timed(jaxckpt.restore, f"{url}/2")
    assert "manifest.json" in message


GONE_SCRIPT = textwrap.dedent("""
    import os, signal, time
    import numpy as np
    import jaxckpt
    from jaxckpt import _storage

    def state(i):
        return {"w": np.full((64, 64), i, np.float32), "step": i}

    def store_goes_away(op, key):
        if op == "write":
            _storage.fault_hook = None
            os.kill(int(os.environ["STORE_PID"]), signal.SIGKILL)

    with jaxckpt.CheckpointManager("s3://jaxckpt-test/gone/run") as mgr:
        mgr.save(8, state(8))
        mgr.wait_until_finished()
        _storage.fault_hook = store_goes_away
        mgr.save(9, state(9))
        print("leaving the with", flush=True)
""")


def test_a_store_that_goes_away_the_saves_own_error_leaves_the_with_once(moto_server, aws_env):
    # The user's loop, as written, in a process of its own (so its exit is seen): the store
    # goes away during step 9's write; what leaves the `with` is that save's error, with
    # the failed lease release as a note; nothing is printed again at exit.
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_ENDPOINT")}
    env.update(AWS_ENDPOINT_URL=moto_server.endpoint, JAXCKPT_IO_TIMEOUT_S="2", JAX_PLATFORMS="cpu",
               STORE_PID=str(moto_server.proc.pid))
    out = subprocess.run([sys.executable, "-c", GONE_SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and out.stdout == "leaving the with\n", (out.returncode, out.stdout, out.stderr)
    err = [line for line in out.stderr.splitlines() if not any(n in line for n in AWS_NOISE)]
    raised = [i for i, line in enumerate(err) if line.startswith("jaxckpt._errors.CheckpointError: ")][-1:]
    assert raised and err[raised[0]].startswith("jaxckpt._errors.CheckpointError: Saving step 9 to "
                                     "'s3://jaxckpt-test/gone/run' failed: Writing 's3://jaxckpt-test/gone/run/9/"), err
    assert "Could not connect to the endpoint URL" in err[raised[0]]
    assert err[raised[0] + 1].startswith("Then, closing the manager: Reading '.jaxckpt-writer.json' in "
                                         "'s3://jaxckpt-test/gone/run' failed: "), err
    assert raised[0] + 2 == len(err), err  # the last thing printed: nothing at exit
    assert out.stderr.count("Then, closing the manager: ") == 1, out.stderr
    assert "at exit" not in out.stderr and "_exitfunc" not in out.stderr and "Exception ignored" not in out.stderr


def test_a_store_that_stops_answering_closing_takes_one_bound_in_all(moto_server, aws_env):
    aws_env.setenv("AWS_ENDPOINT_URL", moto_server.endpoint)
    aws_env.setenv("JAXCKPT_IO_TIMEOUT_S", "2")
    url = "s3://jaxckpt-test/silent/run"

    def stop_at_first_chunk(op, key):
        if op == "write":
            aws_env.setattr(_storage, "fault_hook", None)
            moto_server.stop()

    try:
        with pytest.raises(jaxckpt.CheckpointError) as e:
            with jaxckpt.CheckpointManager(url) as mgr:
                mgr.save(8, state(8))
                mgr.wait_until_finished()
                aws_env.setattr(_storage, "fault_hook", stop_at_first_chunk)
                mgr.save(9, state(9))
                left = time.monotonic()
        closing = time.monotonic() - left
    finally:
        moto_server.resume()
    # the write fails (the I/O bound, 2 s); then its clean-up and the lease's: 2 s in all
    assert str(e.value).startswith(f"Saving step 9 to '{url}' failed: Writing '{url}/9/d/"), str(e.value)
    assert "failed: no answer from the store in " in str(e.value), str(e.value)
    assert e.value.__notes__ == [e.value.__notes__[0]], e.value.__notes__
    note = e.value.__notes__[0]
    assert note.startswith(f"Then, closing the manager: Reading '.jaxckpt-writer.json' in '{url}' failed: "), note
    assert note.endswith(" ago and has not answered since (the clean-up after a failure gets 1 s a request, "
                         "one JAXCKPT_IO_TIMEOUT_S=2 in all)"), note
    assert closing < 2 + 2 + SLACK_S, closing
    with jaxckpt.CheckpointManager(url, read_only=True) as mgr:  # the store is back: step 8 only
        assert mgr.all_steps() == [8]


@pytest.mark.slow
def test_a_server_that_stops_answering_fails_a_restore_within_the_bound(aws_env):
    server = MotoServer()
    try:
        aws_env.setenv("AWS_ENDPOINT_URL", server.endpoint)
        aws_env.setenv("JAXCKPT_IO_TIMEOUT_S", str(BOUND_S))
        url = "s3://jaxckpt-test/stalled/ckpt"
        jaxckpt.save(url, state(3))
        server.stop()
        elapsed, message = timed(jaxckpt.restore, url)
        assert elapsed < BOUND_S + SLACK_S, (elapsed, message)
        assert url in message and "no answer from the store" in message, message
        server.resume()
        assert_bit_equal(jaxckpt.restore(url)["w"], state(3)["w"])
    finally:
        server.close()
