"""Preemption (issue 12 item 5): after a real SIGTERM, ``reached_preemption(step)`` is
True at one step, the same in every process; the loop saves that step and exits 0."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import jaxckpt
from jaxckpt._manager import preemption as _preemption

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "preempt_worker.py")
W0 = np.arange(16 * 32, dtype=np.float32).reshape(16, 32)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args):
    # one CPU device per process of a job; two in a single process (a mesh of one device
    # trips a bug in _snapshot._start_transfers: it pops from jax's cached device_set)
    devices = 1 if "nproc" in args else 2
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    return subprocess.Popen([sys.executable, WORKER, json.dumps(args)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def preempt(procs, target, ready, deadline):
    """Wait until ``procs[target]`` paused after its step ``pause_at``; SIGTERM it, then
    let it go on."""
    while not os.path.exists(ready):
        for p in procs:
            assert p.poll() is None, p.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the worker never reached its pause"
        time.sleep(0.01)
    os.kill(procs[target].pid, signal.SIGTERM)
    procs[target].stdin.write("go\n")
    procs[target].stdin.flush()


def finish(procs, deadline):
    results = []
    for i, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"process {i} timed out")
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        assert lines, f"process {i} exited {p.returncode} without a result: {err[-3000:]}"
        result = json.loads(lines[-1][7:])
        assert "crash" not in result, result["crash"]
        result["exit"] = p.returncode
        results.append(result)
    return results


def check_saved(path, step):
    """The step is committed and restores bit for bit to the state after ``step`` steps."""
    assert os.path.exists(os.path.join(path, str(step), "manifest.json"))
    back = jaxckpt.CheckpointManager(path, read_only=True).restore(step)
    assert np.asarray(back["w"]).tobytes() == (W0 + np.float32(step)).tobytes()
    assert int(back["n"]) == step


def test_single_process_sigterm_saves_the_next_step_and_exits_0(tmp_path):
    path, ready = str(tmp_path / "ckpts"), str(tmp_path / "ready")
    deadline = time.monotonic() + 60
    proc = start({"path": path, "ready": ready, "pause_at": 5, "interval": 4, "max_steps": 50, "prev": True})
    preempt([proc], 0, ready, deadline)
    (res,) = finish([proc], deadline)
    assert res["exit"] == 0  # not killed by the signal
    # the signal arrived while step 5 was paused: the next call (step 6) is the one
    assert res["preempted"] == 6 and res["last_step"] == 6, res
    assert res["mode"] == "signal"
    assert "step must be a non-negative int" in res["negative"], res
    assert res["steps"] == [4, 6]  # step 4 by the interval, step 6 forced
    # the handler that was there before ran once (chained) and is back after close()
    assert res["prev_calls"] == [signal.SIGTERM] and res["restored_handler"], res
    check_saved(path, 6)


@pytest.mark.parametrize("target", [1, pytest.param(0, marks=pytest.mark.slow)])
def test_sigterm_to_one_of_two_processes_both_save_the_same_step(tmp_path, target):
    path, ready = str(tmp_path / "ckpts"), str(tmp_path / "ready")
    deadline = time.monotonic() + 90
    port = free_port()
    # process 0 steps every 2 ms, process 1 every 10 ms: they drift apart between saves
    procs = [start({"path": path, "ready": ready, "pause_at": 5, "interval": 50, "max_steps": 3000,
                    "sleep": 0.002 if i == 0 else 0.01, "port": port, "nproc": 2, "pid": i, "target": target})
             for i in range(2)]
    preempt(procs, target, ready, deadline)
    res = finish(procs, deadline)
    for r in res:
        assert r["exit"] == 0 and r["mode"] == "jax", r
        assert "step must be a non-negative int" in r["negative"], r
    step = res[0]["preempted"]
    assert step is not None and step > 5, res
    assert res[1]["preempted"] == step and res[0]["last_step"] == res[1]["last_step"] == step, res
    assert res[0]["steps"] == res[1]["steps"] == [s for s in range(50, step, 50)] + [step], res
    check_saved(path, step)
    # JAX notices SIGTERM within 1 s, then the slow process catches up with the fast one
    assert res[target]["after_go_s"] < 15, res
    print(f"\nSIGTERM to process {target}: both saved step {step}; "
          f"{res[target]['after_go_s']:.2f} s from the signal to the committed save")


# --- the SIGTERM handler, in this process (a private flag, so nothing leaks) -----------


def test_handler_installed_on_first_use_chained_and_given_back():
    flag, before = _preemption._SigtermFlag(), signal.getsignal(signal.SIGTERM)
    calls = []
    signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))
    previous = signal.getsignal(signal.SIGTERM)
    try:
        a, b = _preemption.PreemptionWatch(_flag=flag), _preemption.PreemptionWatch(_flag=flag)
        assert a.mode is None and signal.getsignal(signal.SIGTERM) is previous  # nothing until used
        assert a.reached(1) is False and b.reached(1) is False
        assert a.mode == b.mode == "signal" and signal.getsignal(signal.SIGTERM) == flag._handle
        assert a.reached(2) is False
        signal.raise_signal(signal.SIGTERM)
        assert calls == [signal.SIGTERM]  # the previous handler still ran
        # True at the first call after the signal, again for that same step, never after
        assert [a.reached(s) for s in (3, 3, 4, 5)] == [True, True, False, False]
        a.close()
        assert signal.getsignal(signal.SIGTERM) == flag._handle  # b still watches
        assert b.reached(9) is True  # the notice is remembered for the process
        b.close()
        assert signal.getsignal(signal.SIGTERM) is previous
        with pytest.raises(jaxckpt.CheckpointError, match="closed"):
            a.reached(6)
    finally:
        signal.signal(signal.SIGTERM, before)


def test_handler_installed_only_from_the_main_thread():
    flag, before = _preemption._SigtermFlag(), signal.getsignal(signal.SIGTERM)
    watch = _preemption.PreemptionWatch(_flag=flag)
    got = []
    t = threading.Thread(target=lambda: got.append(watch.reached(1)))
    t.start()
    t.join()
    try:
        assert got == [False] and watch.mode is None and signal.getsignal(signal.SIGTERM) == before
        assert watch.reached(2) is False and watch.mode == "signal"
        signal.raise_signal(signal.SIGTERM)
        assert watch.reached(3) is True
    finally:
        watch.close()
        signal.signal(signal.SIGTERM, before)
    assert signal.getsignal(signal.SIGTERM) == before


def test_unwatched_handler_lets_sigterm_terminate():
    # closed from another thread, the handler cannot be removed: with nobody watching it
    # forwards SIGTERM to the default action, so the process still dies of it
    code = (
        "import os, signal, threading\n"
        "from jaxckpt._manager import preemption as _preemption\n"
        "w = _preemption.PreemptionWatch()\n"
        "assert w.reached(1) is False\n"
        "t = threading.Thread(target=w.close); t.start(); t.join()\n"
        "assert signal.getsignal(signal.SIGTERM) == _preemption._SIGTERM._handle\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "print('survived', flush=True)\n"
    )
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == -signal.SIGTERM, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    assert "survived" not in proc.stdout
