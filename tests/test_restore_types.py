"""Restore keeps values and types exact: no silent narrowing, numpy scalars come back as
themselves, Python scalar targets are type-checked, abstract-mesh targets resolve."""

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import assert_bit_equal, mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt


def _restore_one(ckpt, key, target, **kw):
    return jaxckpt.restore(ckpt, {key: target}, partial=True, **kw)[key]


def test_integer_narrowing_only_when_every_value_fits(ckpt, monkeypatch):
    jaxckpt.save(ckpt, {
        "big": np.array([300, -1], np.int64),
        "small": np.array([5, -3], np.int64),
        "u8": np.array([200, 7], np.uint8),
        "u8_small": np.array([100, 7], np.uint8),
        "i32_pos": np.array([5, 3], np.int32),
        "f": np.array([1.5, -2.25], np.float32),
        "flags": np.array([True, False]),
    })
    where = f"Checkpoint '{ckpt}': leaf 'big': saved int64 values in [-1, 300] do not fit target dtype"
    for dtype, rng in [(np.int8, "[-128, 127]"), (np.uint8, "[0, 255]"), (ml_dtypes.int4, "[-8, 7]")]:
        with pytest.raises(jaxckpt.TreeMismatchError) as err:
            _restore_one(ckpt, "big", np.zeros(2, dtype))
        assert err.value.paths == ("big",)
        assert f"{where} {np.dtype(dtype).name} {rng}; pass allow_narrowing=True" in str(err.value)
    # the device path checks what it reads: a small leaf whole, a big one slice by slice
    s = NamedSharding(mesh((2,), ("x",)), P("x"))
    with pytest.raises(jaxckpt.TreeMismatchError, match=r"leaf 'big': saved int64 values in \[-1, 300\]"):
        _restore_one(ckpt, "big", jax.ShapeDtypeStruct((2,), jnp.int8, sharding=s))
    monkeypatch.setattr(jaxckpt._restore, "WHOLE_LEAF_BYTES", 0)  # as for a big leaf
    with pytest.raises(jaxckpt.TreeMismatchError, match=r"leaf 'big': saved int64 values in \[300, 300\]"):
        _restore_one(ckpt, "big", jax.ShapeDtypeStruct((2,), jnp.int8, sharding=s))
    monkeypatch.undo()
    with pytest.raises(jaxckpt.TreeMismatchError,
                       match=r"leaf 'u8': saved uint8 values in \[7, 200\] .* int8"):
        _restore_one(ckpt, "u8", np.zeros(2, np.int8))
    # the opt-in wraps like numpy's astype
    assert_bit_equal(_restore_one(ckpt, "big", np.zeros(2, np.int8), allow_narrowing=True),
                     np.array([44, -1], np.int8))
    assert_bit_equal(_restore_one(ckpt, "big", np.zeros(2, np.uint8), allow_narrowing=True),
                     np.array([44, 255], np.uint8))
    # values that fit are cast
    assert_bit_equal(_restore_one(ckpt, "small", np.zeros(2, np.int8)), np.array([5, -3], np.int8))
    assert_bit_equal(_restore_one(ckpt, "small", np.zeros(2, ml_dtypes.int4)),
                     np.array([5, -3], ml_dtypes.int4))
    assert_bit_equal(_restore_one(ckpt, "u8_small", np.zeros(2, np.int8)), np.array([100, 7], np.int8))
    assert_bit_equal(_restore_one(ckpt, "i32_pos", np.zeros(2, np.uint8)), np.array([5, 3], np.uint8))
    back = _restore_one(ckpt, "small", jax.ShapeDtypeStruct((2,), jnp.int8, sharding=s))
    assert back.sharding == s
    assert_bit_equal(back, np.array([5, -3], np.int8))
    # precision casts, int -> float and bool -> number stay allowed; float -> int and -> bool do not
    assert_bit_equal(_restore_one(ckpt, "f", np.zeros(2, jnp.bfloat16)), np.array([1.5, -2.25], jnp.bfloat16))
    assert_bit_equal(_restore_one(ckpt, "big", np.zeros(2, np.float32)), np.array([300, -1], np.float32))
    assert_bit_equal(_restore_one(ckpt, "flags", np.zeros(2, np.int8)), np.array([1, 0], np.int8))
    with pytest.raises(jaxckpt.TreeMismatchError, match="dtype int64 in target cannot hold float32"):
        _restore_one(ckpt, "f", np.zeros(2, np.int64), allow_narrowing=True)
    with pytest.raises(jaxckpt.TreeMismatchError, match="dtype bool in target cannot hold int64"):
        _restore_one(ckpt, "small", np.zeros(2, bool))


def test_saved_scalars_into_python_targets_are_type_checked(ckpt):
    jaxckpt.save(ckpt, {"np": np.float32(2.7), "jnp": jnp.float32(2.7), "i": np.int64(-5),
                        "u": np.uint64(2**64 - 1), "b": np.bool_(True), "c": np.complex64(1 + 2j)})
    for key in ("np", "jnp"):
        for target, name in [(0, "int"), ("s", "str"), (False, "bool")]:
            with pytest.raises(jaxckpt.TreeMismatchError) as err:
                _restore_one(ckpt, key, target)
            assert err.value.paths == (key,)
            assert (f"Checkpoint '{ckpt}': leaf '{key}': target of type {name} cannot hold a float32 "
                    "scalar from disk") in str(err.value)
        back = _restore_one(ckpt, key, 0.0)
        assert type(back) is float and back == float(np.float32(2.7))
    back = _restore_one(ckpt, "i", 0)
    assert type(back) is int and back == -5
    back = _restore_one(ckpt, "u", 0)  # Python ints hold every integer
    assert type(back) is int and back == 2**64 - 1
    back = _restore_one(ckpt, "b", 0.0)
    assert type(back) is float and back == 1.0
    back = _restore_one(ckpt, "b", False)
    assert type(back) is bool and back is True
    back = _restore_one(ckpt, "c", 0j)
    assert type(back) is complex and back == 1 + 2j
    with pytest.raises(jaxckpt.TreeMismatchError, match="target of type float cannot hold a complex64"):
        _restore_one(ckpt, "c", 0.0)
    with pytest.raises(jaxckpt.TreeMismatchError, match="target of type bool cannot hold a int64"):
        _restore_one(ckpt, "i", True)


def test_inline_values_into_other_python_types(ckpt):
    jaxckpt.save(ckpt, {"i": 3, "big": 300, "f": 2.7, "s": "a", "t": True, "n": None})
    back = _restore_one(ckpt, "i", 0.0)
    assert type(back) is float and back == 3.0
    back = _restore_one(ckpt, "t", 0)
    assert type(back) is int and back == 1
    back = _restore_one(ckpt, "i", np.int8(0))
    assert type(back) is np.int8 and back == 3
    back = _restore_one(ckpt, "f", np.float32(0))
    assert type(back) is np.float32 and back == np.float32(2.7)
    for key, target in [("f", None), ("s", None), ("n", None), ("i", None)]:
        assert _restore_one(ckpt, key, target) == {"i": 3, "f": 2.7, "s": "a", "n": None}[key]
    for key, target, msg in [
        ("f", 0, "saved float 2.7 cannot be restored into a target of type int"),
        ("s", 0, "saved str 'a' cannot be restored into a target of type int"),
        ("i", False, "saved int 3 cannot be restored into a target of type bool"),
        ("i", "", "saved int 3 cannot be restored into a target of type str"),
        ("n", 0, "saved an inline value None, target is int"),
        ("big", np.int8(0),
         "saved 300 does not fit target dtype int8 [-128, 127]; pass allow_narrowing=True"),
    ]:
        with pytest.raises(jaxckpt.TreeMismatchError) as err:
            _restore_one(ckpt, key, target)
        assert err.value.paths == (key,)
        assert f"Checkpoint '{ckpt}': leaf '{key}': {msg}" in str(err.value)
    back = _restore_one(ckpt, "big", np.int8(0), allow_narrowing=True)
    assert type(back) is np.int8 and back == 44


def test_numpy_scalars_round_trip_as_their_own_type(ckpt):
    tree = {
        "f64": np.float64(0.1), "f32": np.float32(0.1), "f16": np.float16(0.1), "i64": np.int64(-7),
        "u8": np.uint8(9), "b": np.bool_(False), "c128": np.complex128(1 - 1j),
        "str_": np.str_("héllo/€"), "bytes_": np.bytes_(b"a\xff\x00b"),
        "py_float": 0.1, "py_str": "x", "py_int": 4,
    }
    jaxckpt.save(ckpt, tree)
    for back in (jaxckpt.restore(ckpt), jaxckpt.restore(ckpt, tree)):
        for k, v in tree.items():
            assert type(back[k]) is type(v), k
            if isinstance(v, np.generic) and v.dtype.kind in "biufc":
                assert_bit_equal(back[k], v)
            else:
                assert back[k] == v, k
    info = jaxckpt.metadata(ckpt)
    assert type(info.tree["str_"]) is np.str_ and type(info.tree["bytes_"]) is np.bytes_
    doc = json.loads((ckpt / "manifest.json").read_text())
    leaves = {r["path"]: r for r in doc["leaves"]}
    assert leaves["f64"]["kind"] == "array" and leaves["f64"]["scalar"] is True
    assert leaves["str_"] == {"path": "str_", "kind": "value", "value": "héllo/€", "type": "numpy.str_"}
    assert leaves["bytes_"]["type"] == "numpy.bytes_"
    assert "type" not in leaves["py_str"]


@pytest.mark.parametrize("type_name, value, msg", [
    ("builtins.eval", "x", "inline value type 'builtins.eval'"),
    ("numpy.str_", 3, "inline value type 'numpy.str_'"),
    ("numpy.bytes_", "\u0100", "inline numpy.bytes_ value is not latin-1"),
])
def test_inline_type_field_is_validated(ckpt, type_name, value, msg):
    jaxckpt.save(ckpt, {"s": np.str_("a")})
    path = ckpt / "manifest.json"
    doc = json.loads(path.read_text())
    doc["leaves"][0].update(type=type_name, value=value)
    path.write_text(json.dumps(doc))
    with pytest.raises(jaxckpt.CorruptCheckpointError, match=f"leaf 's': {msg}"):
        jaxckpt.restore(ckpt)


def _flax_model():
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self, rngs):
            init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
            self.lin = nnx.Linear(8, 16, kernel_init=init, rngs=rngs)

    return nnx, Model


def test_flax_abstract_mesh_target(ckpt):
    nnx, Model = _flax_model()
    m = mesh((2, 4), ("data", "model"))
    with jax.set_mesh(m):
        state = nnx.state(Model(rngs=nnx.Rngs(0)))
        target = nnx.state(nnx.eval_shape(lambda: Model(rngs=nnx.Rngs(0))))
    assert isinstance(target["lin"]["kernel"].get_value().sharding.mesh, jax.sharding.AbstractMesh)
    jaxckpt.save(ckpt, state)
    with jax.set_mesh(m):
        back = jaxckpt.restore(ckpt, target)
    assert type(back) is type(state)
    assert back["lin"]["kernel"].get_value().sharding == NamedSharding(m, P(None, "model"))
    assert back["lin"]["bias"].get_value().sharding == NamedSharding(m, P())
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state), strict=True):
        assert_bit_equal(a, b)
    # no mesh in context: a clear error, unless concrete shardings are passed
    with pytest.raises(jaxckpt.CheckpointError) as err:
        jaxckpt.restore(ckpt, target)
    assert str(err.value) == (
        f"Checkpoint '{ckpt}': leaf 'lin/bias/value': the target's sharding is on an abstract mesh "
        "(data=2, model=4) and no concrete mesh is set; restore inside `with jax.set_mesh(mesh):` "
        "or pass shardings= with concrete shardings")
    concrete = jax.tree.map(lambda x: NamedSharding(m, x.sharding.spec), target)
    back = jaxckpt.restore(ckpt, target, shardings=concrete)
    assert back["lin"]["kernel"].get_value().sharding == NamedSharding(m, P(None, "model"))
    assert_bit_equal(back["lin"]["kernel"].get_value(), state["lin"]["kernel"].get_value())
    # a mesh in context with other axis sizes is refused
    with jax.set_mesh(mesh((4, 2), ("data", "model"))), pytest.raises(jaxckpt.CheckpointError) as err:
        jaxckpt.restore(ckpt, target)
    assert ("abstract mesh (data=2, model=4) but the mesh set in context has axes (data=4, model=2)"
            in str(err.value))
