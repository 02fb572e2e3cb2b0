"""Library manners (issue 19, DESIGN.md rule 9): a library call changes nothing
process-wide the user did not ask for (the environment, malloc, signal handlers), and
the ``jaxckpt`` command does only what its documentation says."""

import os
import signal
import subprocess
import sys
import threading
import types

import numpy as np
import pytest
from conftest import assert_bit_equal

import jaxckpt
from jaxckpt import cli
from jaxckpt._formats import stream as _stream
from jaxckpt._manager import preemption as _preemption
from jaxckpt._storage import bounds as _bounds

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CURL = ("TENSORSTORE_CURL_CONNECT_TIMEOUT_SECONDS", "TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS")


def _state(i):
    return {"w": np.arange(64 * 1024, dtype=np.float32) + i, "b": np.arange(8) + i, "step": i}


# --- the environment -------------------------------------------------------------------


def test_object_store_calls_leave_the_environment_alone(s3_server, monkeypatch):
    """tensorstore reads curl's timeouts from the environment only: a library call used
    to set them (unless set) when it made a store's context. A bound no earlier test used
    makes a new context here."""
    for name in CURL:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("JAXCKPT_IO_TIMEOUT_S", "47.5")
    before = dict(os.environ)
    spec = s3_server("manners/env")
    url = dict(spec, path="manners/env/ckpt")
    jaxckpt.save(url, _state(1))
    assert_bit_equal(jaxckpt.restore(url)["w"], _state(1)["w"])
    assert jaxckpt.metadata(url).tree["step"] == 1 and jaxckpt.verify(url).ok
    with jaxckpt.CheckpointManager(dict(spec, path="manners/env/run"), async_save=False) as mgr:
        mgr.save(2, _state(2))
        assert mgr.restore(2)["step"] == 2
    assert dict(os.environ) == before


def test_the_command_sets_the_curl_timeouts_the_user_left_unset():
    """The ``jaxckpt`` command owns its process: it sets them from the bound, before
    tensorstore reads them, and keeps a value the user set."""
    code = ("import os, sys; from jaxckpt import cli; cli._http_timeouts(); "
            "print(os.environ['TENSORSTORE_CURL_CONNECT_TIMEOUT_SECONDS'], "
            "os.environ['TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS'])")
    env = {k: v for k, v in os.environ.items() if k not in CURL}
    env.update(PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", JAXCKPT_IO_TIMEOUT_S="120",
               TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS="33")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["10", "33"]
    assert _bounds.http_timeouts(60) == {"TENSORSTORE_CURL_CONNECT_TIMEOUT_SECONDS": "5",
                                          "TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS": "8"}


# --- malloc ----------------------------------------------------------------------------


@pytest.fixture
def mallopt_calls(monkeypatch):
    """Every ``mallopt`` call jaxckpt makes, recorded instead of made."""
    calls = []

    class Libc:
        @staticmethod
        def mallopt(param, value):
            calls.append((param, value))
            return 1

    monkeypatch.setattr(_stream, "ctypes", types.SimpleNamespace(CDLL=lambda name: Libc))
    return calls


@pytest.mark.parametrize("keep, expected", [("1", []), ("", [(-3, 1 << 20)]), ("0", [(-3, 1 << 20)])])
def test_the_commands_honour_jaxckpt_keep_malloc(tmp_path, monkeypatch, mallopt_calls, keep, expected):
    jaxckpt.save(tmp_path / "c", {"w": np.arange(64, dtype=np.float32)})
    monkeypatch.setenv("JAXCKPT_KEEP_MALLOC", keep)
    assert cli.run(["export", str(tmp_path / "c"), str(tmp_path / "w.safetensors")]) == 0
    assert cli.run(["convert", str(tmp_path / "c"), str(tmp_path / "d")]) == 0
    assert mallopt_calls == expected * 2
    assert_bit_equal(jaxckpt.restore(tmp_path / "d")["w"], np.arange(64, dtype=np.float32))


# --- the SIGTERM handler ---------------------------------------------------------------


def test_a_python_sigterm_handler_installed_before_still_runs_and_is_given_back(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    ran = threading.Event()

    def users_handler(signum, frame):
        ran.set()

    signal.signal(signal.SIGTERM, users_handler)
    try:
        with jaxckpt.CheckpointManager(tmp_path, async_save=False) as mgr:
            assert mgr.reached_preemption(1) is False
            assert signal.getsignal(signal.SIGTERM) is not users_handler  # the watch's own
            os.kill(os.getpid(), signal.SIGTERM)
            assert ran.wait(10)
            assert mgr.reached_preemption(2) is True  # the preemption step
            mgr.save(2, _state(2), force=True)
        assert signal.getsignal(signal.SIGTERM) is users_handler  # given back on close
        assert jaxckpt.restore(tmp_path / "2")["step"] == 2
    finally:
        signal.signal(signal.SIGTERM, before)
        _preemption._SIGTERM.received = False  # the notice is remembered per process: not for other tests


NATIVE_HANDLER = """
import faulthandler, os, signal, sys, tempfile
import numpy as np
import jaxckpt

# A native SIGTERM handler (Python's getsignal sees SIG_DFL): it dumps the stacks.
dump = open(sys.argv[1], "w")
faulthandler.register(signal.SIGTERM, file=dump, chain=False)
assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
directory = tempfile.mkdtemp()
with jaxckpt.CheckpointManager(directory, async_save=False) as mgr:
    assert mgr.reached_preemption(1) is False
    os.kill(os.getpid(), signal.SIGTERM)
    dump.flush()
    print("watched dump", os.path.getsize(sys.argv[1]) > 0, flush=True)
    print("preempted", mgr.reached_preemption(2), flush=True)
    mgr.save(2, {"w": np.arange(4.0)}, force=True)
size = os.path.getsize(sys.argv[1])
os.kill(os.getpid(), signal.SIGTERM)  # after close: faulthandler's again, the process lives on
dump.flush()
print("closed dump", os.path.getsize(sys.argv[1]) > size, flush=True)
print("restored", float(jaxckpt.restore(os.path.join(directory, "2"))["w"][3]), flush=True)
"""


def test_a_native_sigterm_handler_installed_before_still_runs_and_is_given_back(tmp_path):
    """``faulthandler.register`` (or a C library) installs SIGTERM handlers Python's
    ``signal.getsignal`` does not see: installing ours replaced it for good."""
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", NATIVE_HANDLER, str(tmp_path / "dump.txt")],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, (out.returncode, out.stdout, out.stderr[-3000:])
    assert out.stdout.splitlines() == ["watched dump True", "preempted True", "closed dump True", "restored 3.0"]
    assert "Current thread" in (tmp_path / "dump.txt").read_text()  # faulthandler's stack dump
