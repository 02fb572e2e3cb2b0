"""Issue 20, items 7 and 8, as the user met them: an nnx model's state saved, then
``jaxckpt show`` and ``jaxckpt export`` (jaxckpt/cli.py, jaxckpt/convert.py).

7. nnx's ``value`` level: ``show`` printed two lines per leaf (``kernel`` and its
   ``value``); the exported tensors were named ``up.kernel.value``.
8. Export edges: a single file into a directory that does not exist failed naming a
   hidden temporary file; ``export`` had no ``--overwrite``.
"""

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_bit_equal
from flax import nnx
from safetensors.numpy import load_file

import jaxckpt
from jaxckpt import _tree, convert

EXE = os.path.join(os.path.dirname(sys.executable), "jaxckpt")
NAMES = {"up.kernel", "up.bias", "down.kernel", "down.bias", "norm.scale", "norm.bias", "norm.mean",
         "norm.var", "scale"}


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.Linear(4, 8, rngs=rngs)
        self.down = nnx.Linear(8, 4, rngs=rngs)
        self.norm = nnx.BatchNorm(4, rngs=rngs)
        self.scale = nnx.Param(jnp.linspace(0.5, 2.0, 4))


def cli(*args, ok=(0,)):
    p = subprocess.run([EXE, *map(str, args)], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert p.returncode in ok, (p.returncode, p.stdout, p.stderr)
    assert "Traceback" not in p.stderr
    return p.returncode, p.stdout, p.stderr


@pytest.fixture
def nnx_ckpt(tmp_path):
    """A saved ``nnx.state`` of a small model, and its arrays by key path (``up/kernel/value``)."""
    state = nnx.state(MLP(nnx.Rngs(0)))
    jaxckpt.save(tmp_path / "ckpt", state)
    arrays = {p: np.asarray(x) for p, x in _tree.flatten(state)[0]}
    assert len(arrays) == 9 and all(p.endswith("/value") for p in arrays)
    return tmp_path / "ckpt", arrays


def by_name(arrays, keep_value=False):
    """The arrays by the tensor name an export gives them."""
    return {(p if keep_value else p[:-len("/value")]).replace("/", "."): v for p, v in arrays.items()}


# --- 7: show --------------------------------------------------------------------------------


def test_show_prints_one_line_per_nnx_leaf(nnx_ckpt):
    ckpt, _ = nnx_ckpt
    _, out, _ = cli("show", ckpt)
    lines = out.splitlines()
    # the header, the three modules, the nine leaves (18952db: 22, a `value` line under each leaf)
    assert len(lines) == 1 + 3 + 9, out
    assert "  kernel/value  float32[4, 8]  single_device  128 B" in lines
    assert "scale/value  float32[4]  single_device  16 B" in lines
    assert "up/  2 leaves, 160 B" in lines
    assert not any(line.strip().startswith("value ") for line in lines)
    # as the notebook view names it
    assert ">kernel/value<" in jaxckpt.open(ckpt)._repr_html_()
    # folded at --depth 1, a one-leaf subtree is still its leaf's line (18952db: `scale/  1 leaves, 16 B  …`)
    _, out, _ = cli("show", ckpt, "--depth", 1)
    assert out.splitlines()[1:] == ["down/  2 leaves, 144 B  …", "norm/  4 leaves, 64 B  …",
                                    "scale/value  float32[4]  single_device  16 B", "up/  2 leaves, 160 B  …"]


# --- 7: export names ------------------------------------------------------------------------


def test_export_drops_nnx_value_level_by_default(nnx_ckpt, tmp_path):
    ckpt, arrays = nnx_ckpt
    result = convert.to_safetensors(ckpt, tmp_path / "m.safetensors")
    loaded = load_file(tmp_path / "m.safetensors")
    assert set(loaded) == NAMES and result.tensors == 9 and result.skipped == ()
    for name, v in by_name(arrays).items():
        assert_bit_equal(loaded[name], v)
    # the command, a sharded directory: the index names the same tensors
    _, out, _ = cli("export", ckpt, tmp_path / "hf", "--max-shard-bytes", "200")
    assert "9 tensors, 384 B" in out
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == NAMES
    merged = {}
    for f in set(index["weight_map"].values()):
        merged.update(load_file(tmp_path / "hf" / f))
    for name, v in by_name(arrays).items():
        assert_bit_equal(merged[name], v)


def test_keep_value_keeps_the_names_as_saved(nnx_ckpt, tmp_path):
    ckpt, arrays = nnx_ckpt
    convert.to_safetensors(ckpt, tmp_path / "a.safetensors", keep_value=True)
    cli("export", ckpt, tmp_path / "b.safetensors", "--keep-value")
    for f in ("a", "b"):
        loaded = load_file(tmp_path / f"{f}.safetensors")
        assert set(loaded) == {n + ".value" for n in NAMES}
        for name, v in by_name(arrays, keep_value=True).items():
            assert_bit_equal(loaded[name], v)


def test_rename_as_restore_key_map(nnx_ckpt, tmp_path):
    ckpt, arrays = nnx_ckpt
    # the command: a prefix for every name, a longer prefix winning over it, '.' or '/' alike
    _, out, _ = cli("export", ckpt, tmp_path / "a.safetensors", "--rename", "=model",
                    "--rename", "up=model.mlp.up_proj", "--rename", "norm/scale=model.norm.weight")
    loaded = load_file(tmp_path / "a.safetensors")
    expected = {"model.mlp.up_proj.kernel", "model.mlp.up_proj.bias", "model.down.kernel", "model.down.bias",
                "model.norm.weight", "model.norm.bias", "model.norm.mean", "model.norm.var", "model.scale"}
    assert set(loaded) == expected
    assert_bit_equal(loaded["model.mlp.up_proj.kernel"], arrays["up/kernel/value"])
    assert_bit_equal(loaded["model.norm.weight"], arrays["norm/scale/value"])
    assert_bit_equal(loaded["model.scale"], arrays["scale/value"])
    # the API: a callable, None leaving tensors out (listed as skipped); and a dict's None
    result = convert.to_safetensors(ckpt, tmp_path / "b.safetensors",
                                    key_map=lambda n: None if n.startswith("norm.") else "w." + n)
    assert result.skipped == ("norm/bias/value", "norm/mean/value", "norm/scale/value", "norm/var/value")
    assert set(load_file(tmp_path / "b.safetensors")) == {"w.up.kernel", "w.up.bias", "w.down.kernel",
                                                          "w.down.bias", "w.scale"}
    result = convert.to_safetensors(ckpt, tmp_path / "c.safetensors", key_map={"norm": None, "up.kernel": "w_up"})
    assert set(load_file(tmp_path / "c.safetensors")) == {"w_up", "up.bias", "down.kernel", "down.bias", "scale"}
    # the export reads back with restore's key_map, the other way round
    back = jaxckpt.restore(tmp_path / "a.safetensors", {"up": {"kernel": {"value": arrays["up/kernel/value"]}}},
                           key_map={"up/kernel/value": "model.mlp.up_proj.kernel"}, partial=True)
    assert_bit_equal(back["up"]["kernel"]["value"], arrays["up/kernel/value"])


def test_rename_refuses_two_leaves_on_one_name_and_a_rename_of_nothing(nnx_ckpt, tmp_path):
    ckpt, _ = nnx_ckpt
    with pytest.raises(jaxckpt.CheckpointError, match=r"leaves 'down/bias/value' and 'up/bias/value' would both "
                                                      r"be tensor 'down\.bias'; select them separately or rename one"):
        convert.to_safetensors(ckpt, tmp_path / "m.safetensors", key_map={"up": "down"})
    with pytest.raises(jaxckpt.CheckpointError, match="key_map: no tensor name starts with 'upp'"):
        convert.to_safetensors(ckpt, tmp_path / "m.safetensors", key_map={"upp": "x"})
    _, _, err = cli("export", ckpt, tmp_path / "m.safetensors", "--rename", "up=down", ok=(1,))
    assert "leaves 'down/bias/value' and 'up/bias/value' would both be tensor 'down.bias'" in err
    _, _, err = cli("export", ckpt, tmp_path / "m.safetensors", "--rename", "up", ok=(2,))
    assert err == "jaxckpt: --rename 'up': expected OLD=NEW, e.g. layers=model.layers\n"
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # nothing written


# --- 8: export edges --------------------------------------------------------------------------


def test_single_file_export_creates_its_directory(nnx_ckpt, tmp_path):
    ckpt, arrays = nnx_ckpt
    # 18952db: FileNotFoundError: [Errno 2] No such file or directory: '…/new/.m.safetensors.jaxckpt-tmp-…'
    convert.to_safetensors(ckpt, tmp_path / "new" / "m.safetensors")
    _, out, _ = cli("export", ckpt, tmp_path / "deep" / "er" / "m.safetensors", "--select", "up")
    assert out.startswith(f"{tmp_path}/deep/er/m.safetensors  ")
    assert os.listdir(tmp_path / "new") == ["m.safetensors"]
    assert_bit_equal(load_file(tmp_path / "new" / "m.safetensors")["up.kernel"], arrays["up/kernel/value"])
    assert_bit_equal(load_file(tmp_path / "deep" / "er" / "m.safetensors")["kernel"], arrays["up/kernel/value"])


def test_export_overwrite_file(nnx_ckpt, tmp_path):
    ckpt, arrays = nnx_ckpt
    out = tmp_path / "out" / "m.safetensors"
    cli("export", ckpt, out, "--select", "up")
    _, _, err = cli("export", ckpt, out, "--dtype", "bfloat16", ok=(1,))
    assert err == f"jaxckpt: '{out}' already exists; pass overwrite=True (jaxckpt export --overwrite) to replace it\n"
    assert set(load_file(out)) == {"kernel", "bias"}  # untouched
    cli("export", ckpt, out, "--dtype", "bfloat16", "--overwrite")
    loaded = load_file(out)
    assert set(loaded) == NAMES
    assert_bit_equal(loaded["up.kernel"], arrays["up/kernel/value"].astype(jnp.bfloat16))
    assert os.listdir(tmp_path / "out") == ["m.safetensors"]  # no temporary file left
    with pytest.raises(jaxckpt.CheckpointError, match="already exists; pass overwrite=True"):
        convert.to_safetensors(ckpt, out)
    convert.to_safetensors(ckpt, out, overwrite=True)
    assert_bit_equal(load_file(out)["up.kernel"], arrays["up/kernel/value"])


def test_export_overwrite_directory_replaces_the_export_and_keeps_other_files(nnx_ckpt, tmp_path):
    ckpt, arrays = nnx_ckpt
    out = tmp_path / "hf"
    cli("export", ckpt, out, "--max-shard-bytes", "100")
    shards = sorted(n for n in os.listdir(out) if n.endswith(".safetensors"))
    assert len(shards) == 5
    (out / "config.json").write_text("{}")
    _, _, err = cli("export", ckpt, out, ok=(1,))
    assert err == (f"jaxckpt: '{out}' already exists and holds an export ({out}/{shards[0]}); "
                   "pass overwrite=True (jaxckpt export --overwrite) to replace it\n")
    cli("export", ckpt, out, "--overwrite", "--select", "up")
    assert sorted(os.listdir(out)) == ["config.json", "model-00001-of-00001.safetensors",
                                       "model.safetensors.index.json"]  # the old shards are gone
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == dict.fromkeys(["bias", "kernel"], "model-00001-of-00001.safetensors")
    back = jaxckpt.restore(out)
    assert back.keys() == {"bias", "kernel"}
    assert_bit_equal(back["kernel"], arrays["up/kernel/value"])
    assert_bit_equal(back["bias"], arrays["up/bias/value"])
    # a file where a directory export goes is refused, overwrite or not
    (tmp_path / "plain").write_text("x")
    with pytest.raises(jaxckpt.CheckpointError, match="'.*/plain' exists and is not a directory"):
        convert.to_safetensors(ckpt, tmp_path / "plain", overwrite=True)
