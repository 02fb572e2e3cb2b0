"""Where a restore places each leaf, and that every process gets every leaf it asked for.

A target leaf without a sharding (``jax.eval_shape`` gives none to a step counter or a
typed key, and to every leaf under Auto axes) gets the PartitionSpec it was saved with on
the mesh in context when its axes fit, or with no mesh in context on the saved mesh when
the devices fit it; otherwise it goes replicated on the mesh in context, else on the one
mesh of the target (``_placement``); the plans several processes must agree on follow
from global facts only. The multi-process cases run real ``jax.distributed`` jobs
(``mp_place_worker.py``).
"""

import os

import jax
import numpy as np
import pytest
from conftest import assert_bit_equal, mesh, run_workers, sharded
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt import _placement

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
        # no target: the key; process 0's leaf stays out of it, the replicated two not;
        # each bare target: repl, step and key)
        assert r["exchanges"] == ([3, 1, 2, 3, 3] if read_once == "1" else []), r["exchanges"]
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
        # (e), (f) issue 31: a target without shardings gets the saved specs, alike in both
        # processes: with no mesh, on the saved mesh built of the job's devices (c1abc6a:
        # CheckpointError); under a 2x2 mesh, w split over its x (c1abc6a: replicated)
        bare = {"w": EXACT_ON_MESH, "repl": EXACT_ON_MESH, "step": EXACT_ON_MESH,
                "key": {**EXACT_ON_MESH, "type": "key"}}
        assert r["bare_no_mesh"] == bare, (i, r["bare_no_mesh"])
        assert r["bare_other_mesh"] == bare, (i, r["bare_other_mesh"])


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


def test_unsharded_leaves_get_their_saved_spec_on_the_mesh_in_context(state):
    # issue 31: on c1abc6a w (saved P("x", None)) came back replicated on the mesh
    ckpt, w = state
    m = mesh((4,), ("x",))
    with jax.set_mesh(m):
        back = jaxckpt.restore(ckpt, abstract_target(None))
    assert back["w"].sharding == NamedSharding(m, P("x", None)), back["w"].sharding
    replicated = NamedSharding(m, P())  # step (a numpy leaf) and key (one device) had no spec
    for k in ("step", "key"):
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
    monkeypatch.setattr(_placement._distributed, "process_count", lambda: 2)
    leaves = [f"opt/{i}/count" for i in range(7)]
    with pytest.raises(jaxckpt.CheckpointError) as e:
        _placement.unsharded_placement(None, leaves, "/ckpt")
    msg = str(e.value)
    assert msg.startswith("Checkpoint '/ckpt': 7 target leaves have no sharding "
                          "(opt/0/count, opt/1/count, opt/2/count, opt/3/count, opt/4/count and 2 more)")
    assert "pass shardings= for them, or restore inside `with jax.set_mesh(mesh):`" in msg
    # a target whose sharded leaves share one mesh needs neither
    m = mesh((4,), ("x",))
    got = _placement.unsharded_placement(_placement.one_mesh([NamedSharding(m, P("x"))]), leaves, "/ckpt")
    assert got == NamedSharding(m, P())


# --- the saved PartitionSpec (issue 31) ------------------------------------------------------


BIG = np.arange(512 * 1024, dtype=np.float32).reshape(512, 1024)  # 2 MiB: over the warning's 1 MiB


@pytest.fixture
def saved_specs(ckpt):
    """Leaves saved on a 2x4 mesh (every device: it fits the 8 at hand) and on a 4-device
    mesh (it does not), sharded and replicated, large and small."""
    m24, m4 = mesh((2, 4), ("a", "b")), mesh((4,), ("x",))
    tree = {"ab": sharded(BIG, (2, 4), ("a", "b"), ("a", "b")),
            "x": sharded(BIG, (4,), ("x",), ("x", None)),
            "x2": sharded(BIG + 1, (4,), ("x",), (None, "x")),
            "xsmall": sharded(np.arange(64, dtype=np.int32), (4,), ("x",), ("x",)),
            "rep4": jax.device_put(BIG - 1, NamedSharding(m4, P())),
            "odd": sharded(np.arange(12 * 8, dtype=np.float32).reshape(12, 8), (4,), ("x",), ("x", None)),
            "step": jax.device_put(np.int32(5), NamedSharding(m24, P()))}
    jaxckpt.save(ckpt, tree)
    return ckpt, {k: np.asarray(v) for k, v in tree.items()}


def bare(values):
    """What ``jax.eval_shape`` gives under Auto axes: shapes and dtypes, no shardings."""
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in values.items()}


def test_with_no_mesh_leaves_fitting_the_devices_get_their_saved_mesh_and_the_rest_one_warning(saved_specs):
    # issue 31: on c1abc6a every leaf here landed on device 0, without a word
    ckpt, values = saved_specs
    with pytest.warns(jaxckpt.PlacementWarning) as caught:
        back = jaxckpt.restore(ckpt, bare(values))
    for k, v in values.items():
        assert_bit_equal(back[k], v)
    saved_mesh = back["ab"].sharding.mesh  # built from the devices at hand as the saved one was
    assert dict(saved_mesh.shape) == {"a": 2, "b": 4} and list(saved_mesh.devices.flat) == jax.devices()
    assert back["ab"].sharding == NamedSharding(saved_mesh, P("a", "b"))
    assert back["step"].sharding == NamedSharding(saved_mesh, P())
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])  # x=4 does not fit 8 devices: today's rule
    for k in ("x", "x2", "xsmall", "rep4", "odd"):
        assert back[k].sharding == one, (k, back[k].sharding)
    assert len(caught) == 1  # one warning per restore, naming the large leaves only
    assert str(caught[0].message) == (
        f"Checkpoint '{ckpt}': 3 target leaves without a sharding were placed on one device (no mesh set in "
        "context, none used by the target): 'rep4' (2.0 MiB, saved P() on x=4), 'x' (2.0 MiB, "
        "saved P('x', None) on x=4), 'x2' (2.0 MiB, saved P(None, 'x') on x=4); their "
        "saved sharding does not fit the devices at hand. Give them a sharding (in the target or shardings=), "
        "or restore inside `with jax.set_mesh(mesh):` with a mesh whose axes fit their saved PartitionSpec")


def test_with_a_mesh_in_context_leaves_whose_axes_fit_get_their_saved_spec(saved_specs):
    ckpt, values = saved_specs
    m = mesh((8,), ("x",))
    with pytest.warns(jaxckpt.PlacementWarning) as caught, jax.set_mesh(m):
        back = jaxckpt.restore(ckpt, bare(values))
    for k, v in values.items():
        assert_bit_equal(back[k], v)
    want = {"x": P("x", None), "x2": P(None, "x"), "xsmall": P("x"), "rep4": P(), "step": P(),
            "ab": P(), "odd": P()}  # ab: no axes a, b here; odd: 12 rows do not split over x=8
    assert {k: back[k].sharding for k in want} == {k: NamedSharding(m, spec) for k, spec in want.items()}
    assert len(caught) == 1
    assert str(caught[0].message).startswith(
        f"Checkpoint '{ckpt}': 1 target leaves without a sharding were placed replicated on the mesh (x=8): "
        "'ab' (2.0 MiB, saved P('a', 'b') on a=2, b=4); their saved sharding does not fit the mesh "
        "in context.")


def test_with_no_mesh_in_context_the_targets_mesh_of_the_saved_shape_is_used(saved_specs):
    ckpt, values = saved_specs
    m = mesh((2, 4), ("a", "b"))
    target = bare({"ab": values["ab"], "step": values["step"]})
    target["x"] = jax.ShapeDtypeStruct(BIG.shape, BIG.dtype, sharding=NamedSharding(m, P("b")))
    back = jaxckpt.restore(ckpt, target, partial=True)
    assert back["ab"].sharding == NamedSharding(m, P("a", "b")) and back["step"].sharding == NamedSharding(m, P())
    assert_bit_equal(back["ab"], values["ab"])


def test_fits_checks_names_repeats_and_divisibility():
    assert _placement.fits({"a": 2, "b": 4}, P(("a", "b"), None), (8, 3))
    assert not _placement.fits({"a": 2, "b": 4}, P(("a", "b")), (4,))  # 8 does not divide 4
    assert not _placement.fits({"a": 2}, P("a", "a"), (4, 4))  # an axis twice
    assert not _placement.fits({"a": 2}, P("c"), (4,))  # an axis the mesh lacks
    assert _placement.fits({"a": 2}, P(), ())


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
