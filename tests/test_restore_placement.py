"""Where a restore places each leaf, and that every process gets every leaf it asked for.

A target leaf without a sharding (``jax.eval_shape`` gives none to a step counter or a
typed key) goes replicated on the mesh in context, else on the one mesh of the target;
the plans several processes must agree on follow from global facts only. The
multi-process cases run real ``jax.distributed`` jobs (``mp_place_worker.py``).
"""

import os

import jax
import numpy as np
import pytest
from conftest import assert_bit_equal, mesh, run_workers, sharded
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt import _restore

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "mp_place_worker.py")


def run_place_job(path, read_once, nproc=2, ndev=2, timeout=150):
    return run_workers(WORKER, nproc, lambda i, port: [port, nproc, i, ndev, path], timeout,
                       "the placement job", env={"JAXCKPT_READ_ONCE": read_once})


EXACT_ON_MESH = {"type": "array", "shards": 2, "exact": True, "sharding": True}


@pytest.mark.parametrize("read_once", [pytest.param("0", marks=pytest.mark.slow), "1"])
def test_every_process_gets_every_leaf_placed_on_the_mesh(tmp_path, read_once):
    res = run_place_job(tmp_path / "ckpt", read_once)
    for i in (0, 1):
        r = res[i]
        assert r["read_once"] == read_once
        # read-once: every process shared the same slices (eval_shape: repl, step and key;
        # no target: the key; process 0's leaf stays out of it, the replicated two not)
        assert r["exchanges"] == ([3, 1, 2] if read_once == "1" else []), r["exchanges"]
        # (a) eval_shape under jax.set_mesh: step and key (no sharding) replicated on the mesh
        assert r["eval_shape"] == {"w": EXACT_ON_MESH, "repl": EXACT_ON_MESH, "step": EXACT_ON_MESH,
                                   "key": {**EXACT_ON_MESH, "type": "key"}}, (i, r["eval_shape"])
        # (b) no target: host arrays, and the key replicated over every device of the job
        numpy = {"type": "ndarray", "exact": True}
        assert r["no_target"] == {"w": numpy, "repl": numpy, "repl2": numpy, "step": numpy, "p0": numpy,
                                  "key": {**EXACT_ON_MESH, "type": "key"}}, (i, r["no_target"])
        # (d) a leaf on process 0's devices: its values there, a global array with no part
        # here; the replicated leaves next to it exact (on d7c90e7 with read-once, repl2
        # got repl's bytes: process 0's reads were counted in process 1's plan only)
        assert r["process0"] == {"p0": {"type": "array", "shards": 2 if i == 0 else 0, "exact": True,
                                        "sharding": True},
                                 "repl": EXACT_ON_MESH, "repl2": EXACT_ON_MESH}, (i, r["process0"])


# --- a single process --------------------------------------------------------------------


@pytest.fixture
def state(ckpt):
    w = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)
    tree = {"w": sharded(w, (4,), ("x",), ("x", None)), "step": np.array(9, np.int32),
            "key": jax.random.key(3)}
    jaxckpt.save(ckpt, tree)
    return ckpt, w


def abstract_target(w_sharding):
    return {"w": jax.ShapeDtypeStruct((8, 4), np.float32, sharding=w_sharding),
            "step": jax.ShapeDtypeStruct((), np.int32),
            "key": jax.ShapeDtypeStruct((), jax.random.key(0).dtype)}


def test_unsharded_leaves_go_replicated_on_the_mesh_in_context(state):
    ckpt, w = state
    m = mesh((4,), ("x",))
    with jax.set_mesh(m):
        back = jaxckpt.restore(ckpt, abstract_target(None))
    replicated = NamedSharding(m, P())
    for k in ("w", "step", "key"):
        assert back[k].sharding == replicated, (k, back[k].sharding)
    assert_bit_equal(back["w"], w)
    assert_bit_equal(back["step"], np.array(9, np.int32))
    assert_bit_equal(jax.random.key_data(back["key"]), jax.random.key_data(jax.random.key(3)))


def test_unsharded_leaves_follow_the_one_mesh_of_the_target(state):
    ckpt, w = state
    m = mesh((2, 2), ("a", "b"))
    back = jaxckpt.restore(ckpt, abstract_target(NamedSharding(m, P("a", "b"))))
    assert back["w"].sharding == NamedSharding(m, P("a", "b"))
    assert back["step"].sharding == NamedSharding(m, P())
    assert back["key"].sharding == NamedSharding(m, P())
    assert_bit_equal(back["w"], w)
    assert_bit_equal(back["step"], np.array(9, np.int32))


def test_the_mesh_in_context_wins_over_the_targets_mesh(state):
    ckpt, _ = state
    on_target, in_context = mesh((2, 2), ("a", "b")), mesh((8,), ("z",))
    with jax.set_mesh(in_context):
        back = jaxckpt.restore(ckpt, abstract_target(NamedSharding(on_target, P("a"))))
    assert back["w"].sharding == NamedSharding(on_target, P("a"))
    assert back["step"].sharding == NamedSharding(in_context, P())


def test_without_a_mesh_a_single_process_keeps_the_default_device(state):
    ckpt, _ = state
    one, two = mesh((2,), ("x",)), mesh((4,), ("x",))  # two meshes: none to choose
    target = abstract_target(NamedSharding(one, P("x")))
    target["w2"] = jax.ShapeDtypeStruct((8, 4), np.float32, sharding=NamedSharding(two, P()))
    back = jaxckpt.restore(ckpt, target, key_map={"w2": "w"})
    assert back["step"].sharding == jax.sharding.SingleDeviceSharding(jax.devices()[0])
    assert_bit_equal(back["step"], np.array(9, np.int32))


def test_without_a_mesh_a_multi_process_job_is_told_what_to_pass(monkeypatch):
    monkeypatch.setattr(_restore._distributed, "process_count", lambda: 2)
    leaves = [f"opt/{i}/count" for i in range(7)]
    with pytest.raises(jaxckpt.CheckpointError) as e:
        _restore._unsharded_placement([], leaves, "/ckpt")
    msg = str(e.value)
    assert msg.startswith("Checkpoint '/ckpt': 7 target leaves have no sharding "
                          "(opt/0/count, opt/1/count, opt/2/count, opt/3/count, opt/4/count and 2 more)")
    assert "pass shardings= for them, or restore inside `with jax.set_mesh(mesh):`" in msg
    # a target whose sharded leaves share one mesh needs neither
    m = mesh((4,), ("x",))
    got = _restore._unsharded_placement([NamedSharding(m, P("x"))], leaves, "/ckpt")
    assert got == NamedSharding(m, P())


# --- dotted names: a safetensors convention only ------------------------------------------


def test_a_dotted_target_path_is_not_a_saved_slash_path(ckpt):
    jaxckpt.save(ckpt, {"a": {"b": np.ones(3, np.float32)}})
    with pytest.raises(jaxckpt.TreeMismatchError,
                       match=r"trees differ; not in the checkpoint: a\.b; in the checkpoint but not in "
                             r"the target: a/b") as e:
        jaxckpt.restore(ckpt, {"a.b": np.zeros(3, np.float32)})
    assert e.value.paths == ("a.b", "a/b")
    # a dotted name the user maps to explicitly is still found
    back = jaxckpt.restore(ckpt, {"x": np.zeros(3, np.float32)}, key_map={"x": "a.b"})
    assert_bit_equal(back["x"], np.ones(3, np.float32))


def test_a_dotted_target_path_finds_a_safetensors_tensor(tmp_path):
    from safetensors import numpy as st_numpy

    st_numpy.save_file({"a.b": np.arange(3, dtype=np.float32), "c": np.ones(2, np.int8)},
                       str(tmp_path / "model.safetensors"))
    back = jaxckpt.restore(tmp_path / "model.safetensors", {"a.b": np.zeros(3, np.float32), "c": np.zeros(2, np.int8)})
    assert_bit_equal(back["a.b"], np.arange(3, dtype=np.float32))
