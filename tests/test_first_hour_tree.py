"""Issue 20 items 4, 5 and 11, as a new user met them in their own training script:
near-miss trees (nnx's ``/value``, a ``params/`` wrapper, dotted names) get a "did you
mean key_map=…" that works when pasted, and many mismatches a bounded message; saving a
state a jitted step donated names the leaf; grain's ``bytes`` state saves as itself."""

import base64
import json
import os
import re
import subprocess
import sys

import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_bit_equal, mesh
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt import _manifest


def suggested(err: jaxckpt.TreeMismatchError):
    """The key_map a TreeMismatchError suggests, as the user would paste it."""
    found = re.search(r"Did you mean key_map=(.+?)\? ", str(err))
    assert found, str(err)
    return found.group(1), eval(found.group(1))  # noqa: S307 - the message's own code, as a user pastes it


class Net(nnx.Module):
    def __init__(self, n: int, rngs: nnx.Rngs):
        self.layers = nnx.List([nnx.Linear(4, 4, rngs=rngs) for _ in range(n)])


def nnx_state(n=2):
    return nnx.state(Net(n, nnx.Rngs(0)))


# --- 4. near misses: "did you mean key_map=…" ------------------------------------------


def test_nnx_target_with_value_level_against_a_pure_dict_checkpoint(ckpt):
    state = nnx_state()
    jaxckpt.save(ckpt, nnx.to_pure_dict(state))  # saved as plain dicts: no /value
    target = nnx.state(nnx.eval_shape(lambda: Net(2, nnx.Rngs(0))))
    with pytest.raises(jaxckpt.TreeMismatchError) as e:
        jaxckpt.restore(ckpt, target)
    msg = str(e.value)
    assert "not in the checkpoint: layers/0/bias/value, layers/0/kernel/value, " in msg
    assert ("Did you mean key_map=lambda p: p.removesuffix('/value')? With it every leaf matches: "
            "restore(path, target, key_map=lambda p: p.removesuffix('/value'))") in msg
    assert len(e.value.paths) == 8
    code, key_map = suggested(e.value)
    back = jaxckpt.restore(ckpt, target, key_map=key_map)
    assert isinstance(back, nnx.State)
    for (p, got), (q, want) in zip(jax.tree_util.tree_leaves_with_path(back),
                                   jax.tree_util.tree_leaves_with_path(state)):
        assert p == q
        assert_bit_equal(got, want)


def test_pure_dict_target_against_an_nnx_checkpoint(ckpt):
    state = nnx_state()
    jaxckpt.save(ckpt, {"model": state, "step": 7})  # nnx.State: every path ends in /value
    target = {"model": nnx.to_pure_dict(state), "step": 0}
    with pytest.raises(jaxckpt.TreeMismatchError) as e:
        jaxckpt.restore(ckpt, target)
    code, key_map = suggested(e.value)
    # not p + '/value' everywhere: 'step' has no such level; the guess is scoped to the model
    assert code == "lambda p: p + '/value' if p.startswith('model/') else p"
    assert "With it every leaf matches" in str(e.value)
    back = jaxckpt.restore(ckpt, target, key_map=key_map)
    assert back["step"] == 7
    for got, want in zip(jax.tree.leaves(back["model"]), jax.tree.leaves(nnx.to_pure_dict(state))):
        assert_bit_equal(got, want)


def test_params_wrapper_on_either_side(ckpt, tmp_path):
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = np.arange(4, dtype=np.float32)
    # the checkpoint has the wrapper, the target not
    jaxckpt.save(ckpt, {"params": {"dense": {"w": w, "b": b}}})
    with pytest.raises(jaxckpt.TreeMismatchError) as e:
        jaxckpt.restore(ckpt, {"dense": {"w": np.zeros_like(w), "b": np.zeros_like(b)}})
    code, key_map = suggested(e.value)
    assert code == "{'': 'params'}"
    back = jaxckpt.restore(ckpt, {"dense": {"w": np.zeros_like(w), "b": np.zeros_like(b)}}, key_map=key_map)
    assert_bit_equal(back["dense"]["w"], w) and assert_bit_equal(back["dense"]["b"], b)
    # ... with a sibling that both have: the wrapper is added only under the subtrees that need it
    other = tmp_path / "other"
    jaxckpt.save(other, {"params": {"dense": {"w": w}}, "step": 3})
    with pytest.raises(jaxckpt.TreeMismatchError) as e:
        jaxckpt.restore(other, {"dense": {"w": np.zeros_like(w)}, "step": 0})
    code, key_map = suggested(e.value)
    assert code == "{'dense': 'params/dense'}"
    back = jaxckpt.restore(other, {"dense": {"w": np.zeros_like(w)}, "step": 0}, key_map=key_map)
    assert_bit_equal(back["dense"]["w"], w) and back["step"] == 3
    # the target has the wrapper, the checkpoint not
    third = tmp_path / "third"
    jaxckpt.save(third, {"dense": {"w": w}, "step": 3})
    target = {"params": {"dense": {"w": jax.ShapeDtypeStruct(w.shape, w.dtype)}}, "step": 0}
    with pytest.raises(jaxckpt.TreeMismatchError) as e:
        jaxckpt.restore(third, target)
    code, key_map = suggested(e.value)
    assert code == "{'params': ''}"
    back = jaxckpt.restore(third, target, key_map=key_map)
    assert_bit_equal(back["params"]["dense"]["w"], w) and back["step"] == 3


def test_dotted_names_against_key_paths(ckpt):
    w = np.arange(6, dtype=np.float32)
    jaxckpt.save(ckpt, {"model.layers.0.weight": w})  # a flat dict of Hugging Face names
    target = {"model": {"layers": [{"weight": np.zeros_like(w)}]}}
    with pytest.raises(jaxckpt.TreeMismatchError) as e:
        jaxckpt.restore(ckpt, target)
    code, key_map = suggested(e.value)
    assert code == "lambda p: p.replace('/', '.')"
    assert_bit_equal(jaxckpt.restore(ckpt, target, key_map=key_map)["model"]["layers"][0]["weight"], w)


def test_many_mismatches_give_a_count_and_the_first_few(ckpt):
    state = nnx_state(30)  # 30 layers: 60 leaves, each with /value in the target only
    jaxckpt.save(ckpt, {"a": nnx.to_pure_dict(state), "b": nnx.to_pure_dict(state)})
    target = nnx.state(nnx.eval_shape(lambda: Net(30, nnx.Rngs(0))))
    target_many = {"a": target, "b": target}  # 120 leaves
    with pytest.raises(jaxckpt.TreeMismatchError) as e:
        jaxckpt.restore(ckpt, target_many)
    msg = str(e.value)
    assert len(msg) < 1000, len(msg)
    assert "not in the checkpoint: a/layers/0/bias/value, a/layers/0/kernel/value, " in msg
    assert " and 115 more; in the checkpoint but not in the target: a/layers/0/bias, " in msg
    assert "': trees differ in 240 key paths (all in the error's .paths); not in the checkpoint: " in msg
    assert len(e.value.paths) == 240 and len(set(e.value.paths)) == 240
    code, key_map = suggested(e.value)
    back = jaxckpt.restore(ckpt, target_many, key_map=key_map)
    for got, want in zip(jax.tree.leaves(back["b"]), jax.tree.leaves(state)):
        assert_bit_equal(got, want)


def test_many_leaf_mismatches_are_bounded_too(ckpt):
    jaxckpt.save(ckpt, {f"w{i:03d}": np.zeros(3, np.float32) for i in range(150)})
    with pytest.raises(jaxckpt.TreeMismatchError) as e:  # every shape wrong
        jaxckpt.restore(ckpt, {f"w{i:03d}": np.zeros(4, np.float32) for i in range(150)})
    msg = str(e.value)
    assert len(msg) < 1000 and len(e.value.paths) == 150
    assert msg.endswith("leaf 'w004': shape (4,) in target, (3,) on disk; and 145 more leaves "
                        "(150 in all: the error's .paths)")


# --- 5. saving a donated buffer ---------------------------------------------------------


DONATED = ("Leaf 'params/w' was donated (its buffer is deleted): call save(...) before the step "
           "that donates the state (donate_argnums), or save the step's output")


def donating_step():
    @jax.jit
    def step(state):
        return {"params": {"w": state["params"]["w"] + 1}, "rng": jax.random.split(state["rng"])[0]}
    return jax.jit(lambda s: step(s), donate_argnums=0)


def a_state():
    s = NamedSharding(mesh((4,), ("x",)), P("x"))
    return {"params": {"w": jax.device_put(jnp.arange(16, dtype=jnp.float32), s)}, "rng": jax.random.key(1)}


def test_save_after_the_donating_step_names_the_leaf(ckpt):
    state = a_state()
    new = donating_step()(state)
    assert state["params"]["w"].is_deleted()  # CPU really deletes donated inputs
    with pytest.raises(jaxckpt.CheckpointError) as e:
        jaxckpt.save(ckpt, state)
    assert str(e.value) == DONATED
    assert not ckpt.exists()
    jaxckpt.save(ckpt, new)  # the step's output saves
    assert_bit_equal(jaxckpt.restore(ckpt)["params"]["w"], np.arange(16, dtype=np.float32) + 1)


def test_a_donated_key_is_named_too(ckpt):
    state = a_state()
    state["rng"].delete()
    with pytest.raises(jaxckpt.CheckpointError, match="^Leaf 'rng' was donated"):
        jaxckpt.save(ckpt, state)


def test_manager_async_save_after_the_donating_step_names_the_leaf(tmp_path):
    state = a_state()
    new = donating_step()(state)
    with jaxckpt.CheckpointManager(tmp_path / "run", async_save=True) as mgr:
        with pytest.raises(jaxckpt.CheckpointError) as e:
            mgr.save(1, state)
        assert str(e.value) == DONATED
        assert mgr.save(1, new)
        mgr.wait_until_finished()
        assert mgr.all_steps() == [1]
        assert_bit_equal(mgr.restore(1)["params"]["w"], np.arange(16, dtype=np.float32) + 1)


# --- 11. bytes leaves (grain's DataLoader state) -----------------------------------------


BLOBS = {"empty": b"", "all": bytes(range(256)), "not_utf8": b"\xff\xfe\x00\x80",
         "json": b'{"next_index": 4}'}


def test_bytes_round_trip_with_and_without_a_target(ckpt):
    tree = {"data": dict(BLOBS), "w": np.arange(3, dtype=np.int32)}
    jaxckpt.save(ckpt, tree)
    back = jaxckpt.restore(ckpt)
    for k, v in BLOBS.items():
        assert type(back["data"][k]) is bytes and back["data"][k] == v
    target = {"data": {k: b"" for k in BLOBS}, "w": np.zeros(3, np.int32)}
    back = jaxckpt.restore(ckpt, target)
    for k, v in BLOBS.items():
        assert type(back["data"][k]) is bytes and back["data"][k] == v
    assert_bit_equal(back["w"], tree["w"])
    # strict as ever: bytes do not turn into a str
    with pytest.raises(jaxckpt.TreeMismatchError, match="leaf 'data/json': saved bytes .* cannot be restored "
                                                        "into a target of type str"):
        jaxckpt.restore(ckpt, {**target, "data": {**target["data"], "json": ""}})
    # the manifest: kind 'bytes', base64 (a reader before it refuses the unknown kind)
    leaves = {r["path"]: r for r in json.loads((ckpt / "manifest.json").read_bytes())["leaves"]}
    assert leaves["data/not_utf8"] == {"path": "data/not_utf8", "kind": "bytes", "value": "//4AgA=="}
    assert leaves["data/empty"]["value"] == ""
    assert json.loads((ckpt / "manifest.json").read_bytes())["format_version"] == 3


def test_grain_dataloader_state_through_the_manager(tmp_path):
    def loader():
        return grain.DataLoader(data_source=list(range(40)), operations=[grain.transforms.Batch(8)], worker_count=0,
                                sampler=grain.samplers.IndexSampler(40, shuffle=True, seed=1, num_epochs=None,
                                                                    shard_options=grain.sharding.NoSharding()))
    it = iter(loader())
    next(it)
    state = it.get_state()
    assert type(state) is bytes
    with jaxckpt.CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, {"loader": state, "step": 1})
        mgr.wait_until_finished()
        back = mgr.restore(1, target={"loader": iter(loader()).get_state(), "step": 0})
    assert back["loader"] == state and type(back["loader"]) is bytes
    fresh = iter(loader())
    fresh.set_state(back["loader"])
    for _ in range(6):  # crosses an epoch boundary
        assert_bit_equal(next(fresh), next(it))


def test_bytes_in_metadata_open_and_show(ckpt):
    jaxckpt.save(ckpt, {"data": dict(BLOBS)})
    assert jaxckpt.metadata(ckpt).tree["data"]["not_utf8"] == b"\xff\xfe\x00\x80"
    view = jaxckpt.open(ckpt)
    assert view["data/all"] == bytes(range(256))
    assert {r["path"]: r["dtype"] for r in view.rows()}["data/empty"] == "bytes"
    assert "b&#x27;\\xff\\xfe\\x00\\x80&#x27;" in view._repr_html_()
    p = subprocess.run([sys.executable, "-m", "jaxckpt", "show", str(ckpt)], capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert "not_utf8  = b'\\xff\\xfe\\x00\\x80'" in p.stdout
    assert "empty  = b''" in p.stdout


def test_bytes_sizes_are_bounded_on_save_and_on_read(ckpt):
    big = b"x" * (_manifest.MAX_INLINE_BYTES + 1)
    with pytest.raises(jaxckpt.CheckpointError,
                       match=r"^Leaf 'data': 1048577 bytes is more than the 1048576 a bytes leaf holds \(it is stored "
                             r"in the manifest\); save it as an array: np.frombuffer\(b, np.uint8\)$"):
        jaxckpt.save(ckpt, {"data": big})
    assert not ckpt.exists()
    jaxckpt.save(ckpt, {"data": b"x" * _manifest.MAX_INLINE_BYTES})  # the limit itself saves
    assert len(jaxckpt.restore(ckpt)["data"]) == _manifest.MAX_INLINE_BYTES

    def parse_with(value):
        doc = json.loads((ckpt / "manifest.json").read_bytes())
        del doc["checksum"]
        doc["leaves"][0]["value"] = value
        return _manifest.parse(json.dumps(doc).encode(), "x")

    with pytest.raises(jaxckpt.CorruptCheckpointError, match="leaf 'data': bytes value of 1398108 base64 characters "
                                                             r"\(a bytes leaf holds at most 1048576 bytes\)"):
        parse_with(base64.b64encode(big + b"xx").decode())
    with pytest.raises(jaxckpt.CorruptCheckpointError, match="leaf 'data': bytes value is not valid base64"):
        parse_with("not base64!")
    with pytest.raises(jaxckpt.CorruptCheckpointError, match="leaf 'data': bytes value is not a base64 string"):
        parse_with(12)
    assert parse_with("AAE=").leaves[0].value == b"\x00\x01"
