"""The demo and the notebook run and do what they print."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_demo_restores_bit_exact_and_continues_identically():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "train_and_reshard.py")],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    assert "restored state equals saved state bit for bit: True" in out
    last = out.strip().splitlines()[-1]
    on8, on2 = last.split("on 8 devices ")[1].split(", on 2 devices ")
    assert on8 == on2


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
    assert "verify ok: True" in text("verify")
    assert "restored: P('data', None) over {'data': 4, 'model': 1}, 4 devices" in text("restore")
    assert "restored state equals the trained state bit for bit: True" in text("restore")
    assert "$ jaxckpt verify 60\n" in text("cli") and ": ok (14 leaves" in text("cli")
