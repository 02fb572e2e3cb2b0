"""Retention never deletes a step that a restore in another process is reading: the
reader marks the step (``_readers``); the writer's delete is put back and retried after
the next save. A reader killed while reading does not hold the step forever."""

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import assert_bit_equal

import jaxckpt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def state(i):
    return {"w": np.full((512, 1024), i, np.float32), "step": i}


READER = """
    import sys
    import numpy as np
    import jaxckpt
    from jaxckpt import _restore
    real = _restore.restore
    def held(where, **kw):  # the read starts, then waits for the test's go
        print("READING", flush=True)
        sys.stdin.readline()
        return real(where, **kw)
    _restore.restore = held
    with jaxckpt.CheckpointManager({path!r}, read_only=True) as mgr:
        back = mgr.restore({step})
    ok = back["w"].tobytes() == np.full((512, 1024), {step}, np.float32).tobytes()
    print("DONE", ok, flush=True)
"""


def start_reader(path, step):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(READER.format(path=str(path), step=step))],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=env)
    assert child.stdout.readline().strip() == "READING", child.stderr.read()
    return child


def steps_on_disk(path):
    return sorted(int(n) for n in os.listdir(path) if n.isdigit())


def test_retention_waits_for_a_restore_in_another_process(tmp_path):
    with jaxckpt.CheckpointManager(tmp_path, max_to_keep=1) as mgr:
        mgr.save(1, state(1))
        mgr.wait_until_finished()
        reader = start_reader(tmp_path, 1)  # inside its restore of step 1, marked
        mgr.save(2, state(2))
        mgr.wait_until_finished()
        assert mgr.all_steps() == [2]  # no longer the writer's, but still on disk for the reader
        assert steps_on_disk(tmp_path) == [1, 2]
        out, err = reader.communicate("go\n", timeout=60)
        assert reader.returncode == 0 and out.split() == ["DONE", "True"], err[-2000:]
        mgr.save(3, state(3))  # the deferred delete is retried after the next save
        mgr.wait_until_finished()
        assert steps_on_disk(tmp_path) == [3]
        assert os.listdir(tmp_path / ".jaxckpt-readers") == []
        assert_bit_equal(mgr.restore()["w"], state(3)["w"])


def test_a_reader_killed_while_reading_does_not_hold_the_step(tmp_path):
    with jaxckpt.CheckpointManager(tmp_path, max_to_keep=1) as mgr:
        mgr.save(1, state(1))
        mgr.wait_until_finished()
        reader = start_reader(tmp_path, 1)
        reader.send_signal(signal.SIGKILL)
        reader.communicate(timeout=30)
        assert len(os.listdir(tmp_path / ".jaxckpt-readers")) == 1  # its mark is left behind
        mgr.save(2, state(2))
        mgr.wait_until_finished()
        assert steps_on_disk(tmp_path) == [2]  # its pid is gone: the mark was dead
        assert os.listdir(tmp_path / ".jaxckpt-readers") == []


def test_an_explicit_delete_of_a_step_being_read_elsewhere_is_refused(tmp_path):
    with jaxckpt.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, state(1))
        mgr.save(2, state(2))
        mgr.wait_until_finished()
        reader = start_reader(tmp_path, 1)
        try:
            try:
                mgr.delete(1)
                raise AssertionError("delete(1) did not raise")
            except jaxckpt.CheckpointError as e:
                assert str(e) == (f"Step 1 in '{tmp_path}' is being restored by pid {reader.pid} on host "
                                  f"{os.uname().nodename!r} (since " + str(e).split("(since ")[1])
            assert mgr.all_steps() == [1, 2] and steps_on_disk(tmp_path) == [1, 2]
        finally:
            out, err = reader.communicate("go\n", timeout=60)
        assert out.split() == ["DONE", "True"], err[-2000:]
        mgr.delete(1)
        assert mgr.all_steps() == [2] and steps_on_disk(tmp_path) == [2]


POLLER = """
    import sys, time
    import numpy as np
    import jaxckpt
    seen, errors = set(), []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with jaxckpt.CheckpointManager({path!r}, read_only=True) as mgr:
            latest = mgr.latest_step()
            if latest is not None:
                try:
                    back = mgr.restore(latest)
                except jaxckpt.CheckpointNotFoundError:
                    continue  # deleted by retention between listing and reading: fine
                w = back["w"]
                if back["step"] != latest or w.tobytes() != np.full((512, 1024), latest, np.float32).tobytes():
                    errors.append(latest)
                if not seen:
                    print("READY", flush=True)
                seen.add(latest)
                if latest >= {last}:
                    break
    print("SEEN", len(seen), "ERRORS", errors, flush=True)
"""


@pytest.mark.slow
def test_readers_in_another_process_never_see_a_partial_step(tmp_path):
    """A process polling the directory (list the latest, restore it) while the writer
    saves and prunes: every step it reads is whole and is the step it says."""
    last = 30
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with jaxckpt.CheckpointManager(tmp_path, max_to_keep=2) as mgr:
        mgr.save(0, state(0))
        mgr.wait_until_finished()
        poller = subprocess.Popen([sys.executable, "-c", textwrap.dedent(POLLER.format(path=str(tmp_path), last=last))],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        assert poller.stdout.readline().strip() == "READY"  # it read step 0; now the saves begin
        for i in range(1, last + 1):
            mgr.save(i, state(i))
        mgr.wait_until_finished()
        out, err = poller.communicate(timeout=120)
    words = out.split()
    assert poller.returncode == 0 and words[:1] == ["SEEN"], err[-2000:]
    assert int(words[1]) >= 2 and out.strip().endswith("ERRORS []"), out
