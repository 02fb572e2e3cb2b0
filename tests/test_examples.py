"""The demo and the notebook's code run and do what they print."""

import json
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


def test_notebook_cells_run():
    with open(os.path.join(ROOT, "notebooks", "explore.ipynb")) as f:
        nb = json.load(f)
    code = "\n".join(c["source"] for c in nb["cells"] if c["cell_type"] == "code")
    code += "\nassert info.metadata == {'note': 'notebook'} and w.shape == (64, 32)\n"
    code += "assert arrays['params']['w'].sum() == 64 * 32 and arrays['step'] == 10\n"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
