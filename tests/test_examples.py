"""The demo, the examples and the notebook run and do what they print."""

import os
import re
import subprocess
import sys

import numpy as np
import pytest
from conftest import assert_bit_equal

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_demo_restores_bit_exact_and_continues_identically():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "train_and_reshard.py")],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    assert "restored state equals saved state bit for bit: True" in out
    last = out.strip().splitlines()[-1]
    on8, on2 = last.split("on 8 devices ")[1].split(", on 2 devices ")
    assert on8 == on2


@pytest.mark.slow
def test_notebook_executes_in_a_kernel_and_shows_its_results(tmp_path):
    """Run notebooks/explore.ipynb top to bottom in a real ipykernel (a copy, in a temp
    directory: the committed file and its outputs stay as they are)."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(os.path.join(ROOT, "notebooks", "explore.ipynb"), as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    NotebookClient(nb, timeout=300, startup_timeout=120, kernel_name="python3", record_timing=False,
                   resources={"metadata": {"path": str(tmp_path)}}).execute()

    outputs = {c.id: c.outputs for c in nb.cells if c.cell_type == "code"}
    errors = [(cid, o.get("ename")) for cid, outs in outputs.items() for o in outs if o.output_type == "error"]
    assert not errors

    def text(cid):
        return "".join(o.get("text", "") + o.get("data", {}).get("text/plain", "") for o in outputs[cid])

    assert "committed steps on disk: [50, 55, 60]" in text("train")
    assert "<b>CheckpointManager</b>" in outputs["mgr-html"][0]["data"]["text/html"]
    assert "12 records, 3 still committed" in text("history")
    assert any("image/png" in o.get("data", {}) for o in outputs["plot"])
    assert "jaxckpt-view" in outputs["open"][0]["data"]["text/html"]
    policy_view = "".join(o.get("data", {}).get("text/html", "") for o in outputs["policy"])
    assert "save_policy=any_of(goodput(mtbf_s=60, max_overhead=None), on_preemption()); next save: " in policy_view
    assert "saved " in text("policy") and "saved 1 of" not in text("policy")  # goodput saved again, measured
    assert "verify ok: True" in text("verify")
    assert "restored: P('data', None) over {'data': 4, 'model': 1}, 4 devices" in text("restore")
    assert "restored state equals the trained state bit for bit: True" in text("restore")
    assert "$ jaxckpt verify 60\n" in text("cli") and ": ok (14 leaves" in text("cli")


def _run_example(name, *args, timeout=300):
    p = subprocess.run([sys.executable, os.path.join(ROOT, "examples", name), *args], capture_output=True, text=True,
                       timeout=timeout)
    assert p.returncode == 0, p.stderr[-4000:]
    return p.stdout


def _within_tolerance(line):
    """``... max abs difference ... X, ... Y (... tolerance T): True`` -> the line says so and
    every measured number (between "max abs" and the last parenthesis) is at most T."""
    m = re.search(r"tolerance ([0-9.e+-]+)\): (True|False)$", line)
    assert m and "max abs" in line, line
    measured = [float(x) for x in re.findall(r"\d[\d.]*(?:e[+-]?\d+)?", line[line.index("max abs"):line.rindex("(")])]
    return m.group(2) == "True" and measured != [] and all(x <= float(m.group(1)) for x in measured)


@pytest.mark.slow
def test_flax_nnx_example_resumes_bit_for_bit_and_on_another_mesh(tmp_path):
    """The resume parity: preempted after step 5 of 10, resumed in a fresh process: every
    leaf of the train state (params, AdamW moments, counts, the schedule's count, the
    dropout RNG stream, the noise key, batch statistics, the data position) and every
    loss equal the uninterrupted run's bit for bit; on another mesh (4 devices, model
    axis 1) the same data order, the integer parts exact, the floats within tolerance."""
    out = _run_example("flax_nnx.py", "--keep", str(tmp_path))
    parts = re.findall(r"^  ([a-zA-Z ]+): (\d+) leaves bit for bit equal: (True|False)$", out, re.M)
    assert {p for p, _, _ in parts} == PARTS
    assert all(ok == "True" and int(n) > 0 for _, n, ok in parts), parts
    assert "fresh process, same mesh: resumed at step 5, ran to 10" in out
    assert "  losses bit for bit equal: True" in out
    assert out.count("  data order equal: True") == 2
    assert "  counters, RNG streams, data position equal: True" in out
    assert _within_tolerance(out.strip().splitlines()[-1])

    # and, independently of what it printed, leaf by leaf from what each run wrote
    ref, same, other = (dict(np.load(tmp_path / f"{n}.npz")) for n in ("reference", "same", "other"))
    ref_losses, ref_seen = ref.pop("losses")[5:], ref.pop("seen")[5:]
    assert int(same.pop("start")) == int(other.pop("start")) == 5
    assert len(ref) == 25 and {_part(k) for k in ref} == PARTS
    assert same.keys() - {"losses", "seen"} == ref.keys() == other.keys() - {"losses", "seen"}
    for name, value in ref.items():
        assert_bit_equal(same[name], value)
    assert_bit_equal(same["losses"], ref_losses)
    assert_bit_equal(same["seen"], ref_seen)
    assert_bit_equal(other["seen"], ref_seen)
    worst = 0.0
    for name, value in ref.items():
        if _part(name) in ("data position", "counters", "RNG streams"):
            assert_bit_equal(other[name], value)
        else:
            assert other[name].dtype == value.dtype == np.float32
            worst = max(worst, float(np.max(np.abs(other[name] - value))))
    worst = max(worst, float(np.max(np.abs(other["losses"] - ref_losses))))
    assert worst <= 1e-5


PARTS = {"params", "batch statistics", "RNG streams", "counters", "optimizer moments", "data position"}


def _part(name):
    for key, label in [("data/", "data position"), ("'rngs'", "RNG streams"), ("'rng'", "RNG streams"),
                       ("'mean'", "batch statistics"), ("'var'", "batch statistics"), ("'mu'", "optimizer moments"),
                       ("'nu'", "optimizer moments"), ("'count'", "counters"), ("'step'", "counters"),
                       ("'model'", "params")]:
        if key in name:
            return label
    raise AssertionError(name)


@pytest.mark.slow
def test_flax_linen_example_restores_a_train_state_and_resumes_bit_for_bit():
    out = _run_example("flax_linen.py")
    assert "restored step 3 as TrainState (apply_fn and tx from the target); params/Dense_0/kernel " \
           "P(None, 'model'), key key<fry>" in out
    assert out.strip().splitlines()[-1] == "state equal to the uninterrupted run's bit for bit: True; losses: True"


@pytest.mark.slow
def test_equinox_example_restores_through_partition_and_combine():
    out = _run_example("equinox.py")
    assert "saved step 3: params as 5 arrays and 7 None (the places of static fields)" in out
    assert ("restored step 3: params as Model, bn as State, opt as ScaleByAdamState; combined model: Model "
            "with lin1.weight (32, 16)") in out
    assert out.strip().splitlines()[-1] == "state equal to the uninterrupted run's bit for bit: True; losses: True"


@pytest.mark.slow
def test_grain_example_resumes_the_data_exactly_on_any_data_axis():
    out = _run_example("grain_pipeline.py")
    assert "preempted after step 4; the checkpoint holds the iterator state {'next_index': 4}" in out
    for n in (4, 2):
        assert (f"fresh process, data axis {n}: resumed at step 4, same batches in the same order: True, "
                "iterator state at the end {'next_index': 8}") in out
    assert "  state and losses equal to the uninterrupted run's bit for bit: True" in out
    assert _within_tolerance(out.strip().splitlines()[-1])


@pytest.mark.slow
def test_multihost_example_saves_in_two_processes_and_resumes():
    out = _run_example("multihost.py", timeout=240)
    for pid in (0, 1):
        assert re.search(rf"^process {pid} \(devices \[\d+, \d+\]\): committed steps \[2, 3\], resumed at step 3: "
                         r"its 20 shards equal the reference's bit for bit: True, losses: True$", out, re.M), out
    assert "both processes saw the same losses: True" in out
    assert "one process, 4 devices: restored step 3 (written by 2 processes)" in out
    assert _within_tolerance(out.strip().splitlines()[-1])
