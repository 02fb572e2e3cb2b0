"""save / restore / metadata: round trips, resharding, strictness, corruption."""

import dataclasses
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import assert_bit_equal, mesh, sharded
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt import _reader, _storage

DTYPES = [
    np.float16, np.float32, np.float64, jnp.bfloat16,
    ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2, ml_dtypes.float8_e4m3fnuz,
    ml_dtypes.float8_e5m2fnuz, ml_dtypes.float8_e4m3b11fnuz, ml_dtypes.float8_e3m4,
    ml_dtypes.float8_e4m3, ml_dtypes.float8_e8m0fnu,
    ml_dtypes.int4, ml_dtypes.uint4,
    np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
    np.bool_, np.complex64, np.complex128,
]


def _values(dtype, shape, seed=0):
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, shape).astype(bool)
    if dtype.name in ("int4", "uint4"):
        info = ml_dtypes.iinfo(dtype)
        return rng.integers(int(info.min), int(info.max) + 1, shape).astype(dtype)
    if dtype.kind in "iu":
        return np.frombuffer(rng.bytes(int(np.prod(shape)) * dtype.itemsize), dtype).reshape(shape)
    if dtype.kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
    return rng.standard_normal(shape).astype(np.float32).astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_every_dtype_round_trips_bit_exact(ckpt, dtype):
    with jax.enable_x64(np.dtype(dtype).itemsize == 8 or np.dtype(dtype) == np.complex128):
        _round_trip_dtype(ckpt, dtype)


def _round_trip_dtype(ckpt, dtype):
    host = _values(dtype, (16, 8))
    jax_sharded = sharded(host, (4, 2), ("a", "b"), ("a", "b"))
    tree = {"host": host, "jax": jax_sharded, "scalar0d": np.array(host[0, 0])}
    jaxckpt.save(ckpt, tree)
    back = jaxckpt.restore(ckpt)
    for k in tree:
        assert isinstance(back[k], np.ndarray)
        assert_bit_equal(back[k], tree[k])
    # with a target the jax leaf comes back sharded as asked
    target = {"host": host, "jax": jax.ShapeDtypeStruct((16, 8), host.dtype, sharding=jax_sharded.sharding),
              "scalar0d": tree["scalar0d"]}
    back = jaxckpt.restore(ckpt, target)
    assert isinstance(back["jax"], jax.Array)
    assert back["jax"].sharding == jax_sharded.sharding
    assert_bit_equal(back["jax"], host)


class OptState(NamedTuple):
    count: jax.Array
    mu: dict
    nu: dict


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    step: int
    params: dict
    opt: OptState
    rng: jax.Array


def _train_state():
    m = mesh((2, 4), ("data", "model"))
    w = jax.device_put(np.arange(64, dtype=np.float32).reshape(8, 8), NamedSharding(m, P("data", "model")))
    b = jax.device_put(np.arange(8, dtype=np.float32), NamedSharding(m, P()))
    params = {"dense": {"kernel": w, "bias": b}, "layers": [w * 2, w * 3]}
    opt = OptState(jnp.int32(7), jax.tree.map(jnp.zeros_like, params), jax.tree.map(jnp.ones_like, params))
    return TrainState(step=7, params=params, opt=opt, rng=jax.random.key(3))


def test_train_state_containers_round_trip_with_target(ckpt):
    state = _train_state()
    jaxckpt.save(ckpt, state)
    back = jaxckpt.restore(ckpt, target=state)
    assert type(back) is TrainState and type(back.opt) is OptState
    assert back.step == 7
    assert jax.random.key_impl(back.rng) == jax.random.key_impl(state.rng)
    assert_bit_equal(jax.random.key_data(back.rng), jax.random.key_data(state.rng))
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state)):
        if isinstance(a, jax.Array):
            assert a.sharding == b.sharding
            if not jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
                assert_bit_equal(a, b)


def test_no_target_gives_numpy_in_plain_containers(ckpt):
    tree = {
        "a": {0: np.arange(3), 5: {"x": 1.5}},  # int keys stay ints
        "l": [np.int32(4), "s", True, None, [], {}, ()],
        "t": (1, (2.0,)),
        "slash/key": {"50%": np.ones(2, np.float32)},
    }
    jaxckpt.save(ckpt, tree)
    back = jaxckpt.restore(ckpt)
    assert list(back["a"]) == [0, 5]
    assert_bit_equal(back["a"][0], tree["a"][0])
    assert back["a"][5] == {"x": 1.5}
    assert back["l"][1:] == ["s", True, None, [], {}, ()]
    assert isinstance(back["l"][0], np.int32) and back["l"][0] == 4
    assert back["t"] == (1, (2.0,))
    assert_bit_equal(back["slash/key"]["50%"], np.ones(2, np.float32))
    info = jaxckpt.metadata(ckpt)
    assert info.tree["slash/key"]["50%"].path == "slash%2Fkey/50%25"


def test_optax_and_flax_states(ckpt):
    import optax
    from flax import nnx, struct

    class Model(nnx.Module):
        def __init__(self):
            self.lin = nnx.Linear(4, 3, rngs=nnx.Rngs(0))

    model_state = nnx.state(Model())
    opt_state = optax.adam(1e-3).init({"w": jnp.ones((4, 3))})

    @struct.dataclass
    class Holder:
        a: jax.Array
        name: str = struct.field(pytree_node=False, default="x")

    tree = {"model": model_state, "opt": opt_state, "holder": Holder(jnp.arange(3.0))}
    jaxckpt.save(ckpt, tree)
    back = jaxckpt.restore(ckpt, target=tree)
    assert type(back["model"]) is type(model_state)
    assert type(back["opt"][0]) is type(opt_state[0])
    assert type(back["holder"]) is Holder
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(tree)):
        assert_bit_equal(a, b)
    plain = jaxckpt.restore(ckpt)
    assert_bit_equal(plain["model"]["lin"]["kernel"]["value"], model_state["lin"]["kernel"].value)
    assert_bit_equal(plain["opt"][0]["mu"]["w"], opt_state[0].mu["w"])


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_prng_keys(ckpt, impl):
    m = mesh((4,), ("x",))
    keys = jax.device_put(jax.random.split(jax.random.key(1, impl=impl), 8), NamedSharding(m, P("x")))
    legacy = jax.random.PRNGKey(5)
    jaxckpt.save(ckpt, {"keys": keys, "single": jax.random.key(2, impl=impl), "legacy": legacy})
    m2 = mesh((2,), ("y",))
    target = {
        "keys": jax.ShapeDtypeStruct((8,), keys.dtype, sharding=NamedSharding(m2, P("y"))),
        "single": jax.random.key(0, impl=impl),
        "legacy": legacy,
    }
    back = jaxckpt.restore(ckpt, target)
    assert back["keys"].dtype == keys.dtype
    assert back["keys"].sharding == NamedSharding(m2, P("y"))
    assert_bit_equal(jax.random.key_data(back["keys"]), jax.random.key_data(keys))
    assert_bit_equal(jax.random.key_data(back["single"]), jax.random.key_data(jax.random.key(2, impl=impl)))
    assert_bit_equal(back["legacy"], legacy)
    # the restored keys draw the same numbers
    assert_bit_equal(jax.random.normal(back["keys"][3], (4,)), jax.random.normal(keys[3], (4,)))
    info = jaxckpt.metadata(ckpt)
    assert info.tree["keys"].shape == (8,) and info.tree["keys"].dtype == keys.dtype


def test_single_device_and_replicated_and_zero_size(ckpt):
    tree = {
        "single": jax.device_put(np.arange(6.0), SingleDeviceSharding(jax.devices()[3])),
        "repl": sharded(np.arange(8.0), (8,), ("x",), ()),
        "empty": sharded(np.zeros((0, 8), np.float32), (2, 4), ("a", "b"), (None, "b")),
        "empty_host": np.zeros((3, 0), np.int32),
        "scalar": jnp.float32(2.5),
    }
    jaxckpt.save(ckpt, tree)
    back = jaxckpt.restore(ckpt, target=tree)
    for k in tree:
        assert type(back[k]) is type(tree[k])
        if isinstance(tree[k], jax.Array):
            assert back[k].sharding == tree[k].sharding, k
        assert_bit_equal(back[k], tree[k])


# (saved mesh shape, names, spec) -> (target mesh shape, names, spec)
RESHARD = [
    (((8,), ("x",), ("x", None)), ((2, 4), ("a", "b"), ("a", "b"))),
    (((2, 2, 2), ("a", "b", "c"), ("a", ("b", "c"))), ((8,), ("x",), (None, "x"))),
    (((4, 2), ("d", "m"), ("d", "m")), ((1,), ("x",), ())),  # sharded -> replicated
    (((8,), ("x",), ()), ((4, 2), ("d", "m"), ("m", "d"))),  # replicated -> sharded
    (((8,), ("x",), ("x",)), ((4,), ("y",), (None, "y"))),  # 8 devices -> 4
    (((4,), ("y",), (None, "y")), ((8,), ("x",), ("x",))),  # 4 -> 8
    (((2, 4), ("a", "b"), ("b", "a")), ((2, 2), ("p", "q"), ("q", None))),
    (((8,), ("x",), ("x",)), ((1,), ("solo",), ("solo",))),  # 8 devices -> 1
]


@pytest.mark.parametrize("src,dst", RESHARD, ids=[f"{s[0]}{s[2]}->{d[0]}{d[2]}" for s, d in RESHARD])
def test_reshard_matrix(ckpt, src, dst):
    host = np.arange(16 * 32, dtype=np.float32).reshape(16, 32)
    saved = sharded(host, *src)
    jaxckpt.save(ckpt, {"w": saved})
    target_sharding = NamedSharding(mesh(dst[0], dst[1]), P(*dst[2]))
    back = jaxckpt.restore(ckpt, {"w": jax.ShapeDtypeStruct(host.shape, host.dtype, sharding=target_sharding)})
    assert back["w"].sharding == target_sharding
    assert_bit_equal(back["w"], host)
    for shard in back["w"].addressable_shards:
        assert_bit_equal(shard.data, host[shard.index])
    # shardings= alone works the same way
    back2 = jaxckpt.restore(ckpt, shardings={"w": target_sharding})
    assert back2["w"].sharding == target_sharding
    assert_bit_equal(back2["w"], host)


def _file_bytes_read():
    import tensorstore as ts

    for m in ts.experimental_collect_matching_metrics("/tensorstore/kvstore/file/bytes_read"):
        return m["values"][0]["value"]
    return 0


@pytest.mark.format1
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "tensorstore"])
def test_restore_reads_each_distinct_slice_once(ckpt, monkeypatch, direct):
    monkeypatch.setattr(_reader, "DIRECT_READS", direct)
    small = np.arange(64 * 1024, dtype=np.float32).reshape(256, 256)  # 256 KiB: packed store
    big = np.arange(8 * 512 * 1024, dtype=np.float32).reshape(8 * 512, 1024)  # 16 MiB, 8 chunks
    jaxckpt.save(ckpt, {"big": sharded(big, (8,), ("x",), ("x", None)),
                        "small": sharded(small, (8,), ("x",), ("x", None))})

    # Replicated on 8 devices: each saved chunk read once, not once per device; the
    # small leaf's 8 shards lie back to back in the packed array: one read.
    repl = NamedSharding(mesh((8,), ("x",)), P())
    _storage.reset_io_stats()
    before = _file_bytes_read()
    back = jaxckpt.restore(ckpt, shardings={"big": repl, "small": repl})
    stats = _storage.io_stats()
    assert stats == {**stats, "reads": 9, "bytes_read": big.nbytes + small.nbytes}
    assert_bit_equal(back["big"], big)
    assert_bit_equal(back["small"], small)
    if not direct:
        # what tensorstore pulled from disk: the data plus checksums and metadata
        disk = _file_bytes_read() - before
        assert big.nbytes + small.nbytes <= disk < (big.nbytes + small.nbytes) * 1.01

    # 4 row blocks, each replicated over 2 devices: still 8 chunk reads + 1 packed read.
    blocks = NamedSharding(mesh((4, 2), ("r", "c")), P("r", None))
    _storage.reset_io_stats()
    back = jaxckpt.restore(ckpt, shardings={"big": blocks, "small": blocks})
    stats = _storage.io_stats()
    assert stats["reads"] == 9
    assert stats["bytes_read"] == big.nbytes + small.nbytes
    assert_bit_equal(back["small"], small)


def test_restore_reads_only_the_slices_of_addressable_devices(ckpt, monkeypatch):
    """As in a multi-process job where this process addresses devices 2 and 5 of 8."""
    host = np.arange(8 * 65536, dtype=np.float32).reshape(8 * 64, 1024)  # 2 MiB: file store
    jaxckpt.save(ckpt, {"w": sharded(host, (8,), ("x",), ("x", None))})
    from jaxckpt import _layout

    real_needed = _layout.needed_indices
    monkeypatch.setattr(_layout, "needed_indices", lambda sharding, shape: {
        d: i for d, i in real_needed(sharding, shape).items() if d.id in (2, 5)})
    assembled = {}

    def capture(shape, sharding, arrays):
        assembled["arrays"] = arrays
        return "assembled"

    monkeypatch.setattr(jax, "make_array_from_single_device_arrays", capture)
    _storage.reset_io_stats()
    back = jaxckpt.restore(ckpt, shardings={"w": NamedSharding(mesh((8,), ("x",)), P("x", None))})
    assert back == {"w": "assembled"}
    stats = _storage.io_stats()
    assert stats["reads"] == 2
    assert stats["bytes_read"] == host.nbytes // 4
    by_device = {a.devices().pop().id: a for a in assembled["arrays"]}
    assert_bit_equal(by_device[2], host[128:192])
    assert_bit_equal(by_device[5], host[320:384])


@pytest.mark.format1
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "tensorstore"])
def test_reshard_reads_each_saved_chunk_once(ckpt, monkeypatch, direct):
    """Rows saved in 4 blocks, restored as 2 column halves: every saved chunk is needed by
    both halves, yet read (and checksummed) once."""
    monkeypatch.setattr(_reader, "DIRECT_READS", direct)
    host = np.arange(8 * 65536, dtype=np.float32).reshape(512, 1024)
    jaxckpt.save(ckpt, {"w": sharded(host, (4,), ("x",), ("x", None))})
    before = _file_bytes_read()
    _storage.reset_io_stats()
    cols = NamedSharding(mesh((2,), ("y",)), P(None, "y"))
    back = jaxckpt.restore(ckpt, shardings={"w": cols})
    assert _storage.io_stats() == {**_storage.io_stats(), "reads": 4, "bytes_read": host.nbytes}
    if not direct:
        assert host.nbytes <= _file_bytes_read() - before < host.nbytes * 1.01
    assert_bit_equal(back["w"], host)


def test_restore_subset_reads_only_that_leaf(ckpt):
    a = np.arange(1 << 20, dtype=np.float32)
    b = np.arange(1 << 18, dtype=np.float32)
    jaxckpt.save(ckpt, {"a": a, "b": b})
    _storage.reset_io_stats()
    back = jaxckpt.restore(ckpt, {"b": b}, partial=True)
    assert list(back) == ["b"]
    assert_bit_equal(back["b"], b)
    assert _storage.io_stats()["bytes_read"] == b.nbytes


def test_dtype_cast_on_restore(ckpt):
    x = np.linspace(-2, 2, 32, dtype=np.float32)
    jaxckpt.save(ckpt, {"x": x, "i": np.arange(4, dtype=np.int32)})
    back = jaxckpt.restore(ckpt, {"x": jax.ShapeDtypeStruct((32,), jnp.bfloat16), "i": np.zeros(4, np.int64)})
    assert back["x"].dtype == jnp.bfloat16
    assert_bit_equal(back["x"], x.astype(jnp.bfloat16))
    assert back["i"].dtype == np.int64 and back["i"].tolist() == [0, 1, 2, 3]
    with pytest.raises(jaxckpt.TreeMismatchError, match="'x'.*int32.*cannot hold float32"):
        jaxckpt.restore(ckpt, {"x": np.zeros(32, np.int32), "i": np.zeros(4, np.int32)})


def test_strict_mismatch_names_every_path(ckpt):
    jaxckpt.save(ckpt, {"a": np.ones(3), "b": {"c": np.ones(2), "d": 1}})
    target = {"a": np.ones(4), "b": {"c": np.ones(2)}, "e": np.ones(1)}
    with pytest.raises(jaxckpt.TreeMismatchError) as err:
        jaxckpt.restore(ckpt, target)
    assert err.value.paths == ("e", "b/d")
    msg = str(err.value)
    assert str(ckpt) in msg and "not in the checkpoint: e" in msg and "b/d" in msg
    assert isinstance(err.value, ValueError)
    # partial=True allows the subset but still refuses a missing key and a bad shape
    with pytest.raises(jaxckpt.TreeMismatchError) as err:
        jaxckpt.restore(ckpt, target, partial=True)
    assert err.value.paths == ("e",)
    with pytest.raises(jaxckpt.TreeMismatchError) as err:
        jaxckpt.restore(ckpt, {"a": np.ones(4)}, partial=True)
    assert err.value.paths == ("a",)
    assert "shape (4,) in target, (3,) on disk" in str(err.value)


def test_partial_returns_only_what_was_asked(ckpt):
    jaxckpt.save(ckpt, {"params": {"w": np.ones(3), "b": np.zeros(2)}, "opt": {"m": np.ones(3)}, "step": 3})
    back = jaxckpt.restore(ckpt, {"params": {"w": np.zeros(3)}, "step": 0}, partial=True)
    assert back.keys() == {"params", "step"}
    assert back["params"].keys() == {"w"}
    assert back["step"] == 3
    assert_bit_equal(back["params"]["w"], np.ones(3))


def test_metadata_reads_no_array_data(ckpt):
    w = sharded(np.ones((16, 4), np.float32), (4, 2), ("d", "m"), ("d", None))
    jaxckpt.save(ckpt, {"w": w, "step": 9, "cfg": {"lr": 0.1, "name": "run"}}, metadata={"run": "abc"})
    _storage.reset_io_stats()
    info = jaxckpt.metadata(ckpt)
    assert _storage.io_stats()["reads"] == 0
    leaf = info.tree["w"]
    assert leaf.shape == (16, 4) and leaf.dtype == np.float32
    assert leaf.sharding.type == "named" and leaf.sharding.mesh_shape == {"d": 4, "m": 2}
    assert leaf.sharding.spec == P("d", None)
    assert leaf.sharding.to_sharding() == NamedSharding(mesh((4, 2), ("d", "m")), P("d", None))
    assert info.tree["step"] == 9 and info.tree["cfg"] == {"lr": 0.1, "name": "run"}
    assert info.metadata == {"run": "abc"}
    assert info.format_version == 3


@pytest.mark.format1
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "tensorstore"])
def test_corrupted_chunk_is_detected(ckpt, monkeypatch, direct):
    monkeypatch.setattr(_reader, "DIRECT_READS", direct)
    big = np.arange(1 << 19, dtype=np.float32)  # 2 MiB: a file-store leaf
    small = np.arange(64, dtype=np.float32)  # packed leaf
    jaxckpt.save(ckpt, {"big": sharded(big, (4,), ("x",), ("x",)), "small": small})
    chunk = os.path.join(ckpt, "arrays", "0", "c", "2")
    with open(chunk, "r+b") as f:
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(jaxckpt.CorruptCheckpointError, match=r"leaf 'big' could not be read.*[Dd]igest"):
        jaxckpt.restore(ckpt)
    # the other leaf is still readable on its own
    back = jaxckpt.restore(ckpt, {"small": small}, partial=True)
    assert_bit_equal(back["small"], small)
    # a missing chunk is an error too, never silently zero-filled
    # a truncated chunk too
    with open(chunk, "r+b") as f:
        f.truncate(100)
    with pytest.raises(jaxckpt.CorruptCheckpointError, match="leaf 'big' could not be read"):
        jaxckpt.restore(ckpt)
    os.remove(chunk)
    with pytest.raises(jaxckpt.CorruptCheckpointError, match="leaf 'big'.*missing"):
        jaxckpt.restore(ckpt)


@pytest.mark.format1
def test_corrupted_packed_data_is_detected(ckpt):
    leaves = {f"p{i}": np.arange(1024, dtype=np.float32) + i for i in range(3)}
    jaxckpt.save(ckpt, leaves)
    chunk = os.path.join(ckpt, "packed", "p0", "c", "0")
    with open(chunk, "rb") as f:
        data = bytearray(f.read())
    data[5000] ^= 0xFF  # inside leaf p1 (each leaf is 4 KiB)
    with open(chunk, "wb") as f:
        f.write(bytes(data))
    with pytest.raises(jaxckpt.CorruptCheckpointError, match="leaf 'p0', 'p1', 'p2' could not be read.*[Dd]igest"):
        jaxckpt.restore(ckpt)


def test_not_a_checkpoint(tmp_path):
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "arrays").mkdir()
    with pytest.raises(jaxckpt.CheckpointNotFoundError, match="manifest.json is missing") as err:
        jaxckpt.restore(tmp_path / "half")
    assert isinstance(err.value, FileNotFoundError)
    assert str(tmp_path / "half") in str(err.value)
    with pytest.raises(jaxckpt.CheckpointNotFoundError):
        jaxckpt.metadata(tmp_path / "nothing")


def test_overwrite(ckpt):
    jaxckpt.save(ckpt, {"x": np.ones(3)})
    with pytest.raises(jaxckpt.CheckpointError, match="already exists; pass overwrite=True"):
        jaxckpt.save(ckpt, {"x": np.zeros(3)})
    assert_bit_equal(jaxckpt.restore(ckpt)["x"], np.ones(3))
    jaxckpt.save(ckpt, {"y": np.zeros(2)}, overwrite=True)
    assert list(jaxckpt.restore(ckpt)) == ["y"]
    # nothing left behind next to the checkpoint
    assert sorted(os.listdir(ckpt.parent)) == ["ckpt"]


def test_refuses_to_overwrite_a_foreign_directory(tmp_path):
    target = tmp_path / "mine"
    target.mkdir()
    (target / "notes.txt").write_text("precious")
    with pytest.raises(jaxckpt.CheckpointError, match="not a jaxckpt checkpoint"):
        jaxckpt.save(target, {"x": np.ones(1)}, overwrite=True)
    assert (target / "notes.txt").read_text() == "precious"


def test_failed_save_leaves_nothing_visible(ckpt, monkeypatch):
    def boom(op, key):
        raise OSError("disk on fire")

    monkeypatch.setattr(_storage, "fault_hook", boom)
    with pytest.raises(jaxckpt.CheckpointError, match="disk on fire"):
        jaxckpt.save(ckpt, {"a": np.ones(3), "b": np.ones(1 << 20)})
    assert not ckpt.exists()
    assert os.listdir(ckpt.parent) == []


def test_unsupported_leaf_type_names_path(ckpt):
    with pytest.raises(jaxckpt.CheckpointError, match="Leaf 'a/f' has type object"):
        jaxckpt.save(ckpt, {"a": {"f": object()}})
    assert not ckpt.exists()


def test_metadata_must_be_json(ckpt):
    with pytest.raises(jaxckpt.CheckpointError, match="JSON-serialisable"):
        jaxckpt.save(ckpt, {"a": 1}, metadata={"f": object()})


def test_memory_kvstore_round_trip():
    x = np.arange(10, dtype=np.int16)
    jaxckpt.save("memory://unit/ckpt", {"x": x, "s": "hi"})
    back = jaxckpt.restore("memory://unit/ckpt")
    assert_bit_equal(back["x"], x)
    assert back["s"] == "hi"


def test_restored_arrays_can_be_donated(ckpt):
    """Restored buffers may be adopted from host memory and shared between devices
    holding the same slice; donating them must still compute the right values."""
    host = np.arange(64 * 1024, dtype=np.float32).reshape(256, 256)
    jaxckpt.save(ckpt, {"w": host, "v": np.ones(3000, np.float32) * 2})
    m = mesh((2,), ("x",))
    repl = NamedSharding(m, P())
    back = jaxckpt.restore(ckpt, shardings={"w": repl, "v": repl})
    per_device = jax.jit(
        jax.shard_map(lambda w: w + jax.lax.axis_index("x").astype(jnp.float32) * 1000, mesh=m,
                      in_specs=P(), out_specs=P("x")),
        donate_argnums=0)
    out = per_device(back["w"])
    assert_bit_equal(out, np.concatenate([host, host + 1000]))
    again = jaxckpt.restore(ckpt, shardings={"w": repl, "v": repl})
    assert_bit_equal(again["w"], host)
    assert_bit_equal(jax.jit(lambda v: v * 3, donate_argnums=0)(again["v"]), np.ones(3000, np.float32) * 6)


def test_target_none_with_a_sharding_and_odd_target_leaves(ckpt):
    host = np.arange(16, dtype=np.float32)
    jaxckpt.save(ckpt, {"w": host, "n": 3})
    s = NamedSharding(mesh((2,), ("x",)), P("x"))
    back = jaxckpt.restore(ckpt, {"w": None, "n": None}, shardings={"w": s, "n": None})
    assert back["w"].sharding == s and back["n"] == 3
    assert_bit_equal(back["w"], host)
    with pytest.raises(jaxckpt.TreeMismatchError, match="leaf 'w': target leaf of type object is neither"):
        jaxckpt.restore(ckpt, {"w": object(), "n": 0})
    with pytest.raises(jaxckpt.TreeMismatchError, match="leaf 'w': saved an array, target is None"):
        jaxckpt.restore(ckpt, {"w": None, "n": 0})


def test_metadata_errors_name_the_key_path(ckpt):
    cyclic = {"a": []}
    cyclic["a"].append(cyclic)
    cases = [
        ({"opt": {"lr": np.ones(2)}},
         "metadata['opt']['lr']: value of type ndarray is not JSON-serialisable"),
        ({"opt": [1, {"x": object()}]},
         "metadata['opt'][1]['x']: value of type object is not JSON-serialisable"),
        ({"opt": {(1, 2): 3}}, "metadata['opt']: key (1, 2) of type tuple is not a str"),
        ({1: "a"}, "metadata: key 1 of type int is not a str"),  # json would make it "1" silently
        ({"big": [10**40]}, "metadata['big'][0]: int has more than 40 digits"),
        (cyclic, "metadata['a'][0]['a'][0]"),
        (cyclic, "nested deeper than 100 levels (or contains itself)"),
    ]
    for metadata, message in cases:
        with pytest.raises(jaxckpt.CheckpointError) as err:
            jaxckpt.save(ckpt, {"a": 1}, metadata=metadata)
        assert type(err.value) is jaxckpt.CheckpointError
        assert message in str(err.value)
        assert not ckpt.exists()
    jaxckpt.save(ckpt, {"a": 1}, metadata={"loss": float("nan"), "t": (1, 10**40 - 1)})
    saved = jaxckpt.metadata(ckpt).metadata
    assert np.isnan(saved["loss"]) and saved["t"] == [1, 10**40 - 1]


# --- save inside a traced function ------------------------------------------------------

TRACED_HINT = ("not an array with values: save was called inside a traced function (jax.jit, vmap, grad, ...). "
               "Save outside it, on the arrays it returns.")


@pytest.mark.parametrize("trace", ["jit", "vmap", "grad"])
def test_save_inside_jit_vmap_or_grad_names_the_traced_leaf(tmp_path, trace):
    # refused before anything starts: no directory, nothing to clean
    ckpt = tmp_path / "ckpt"

    def step(x):
        jaxckpt.save(ckpt, {"step": 3, "params": {"dense": {"kernel": x * 2, "bias": np.ones(2)}}, "key": None})
        return x.sum()

    traced = {"jit": jax.jit(step), "vmap": jax.vmap(step), "grad": jax.grad(step)}[trace]
    with pytest.raises(jaxckpt.CheckpointError) as err:
        traced(jnp.ones((4, 2)))
    shape = {"jit": "float32[4,2]", "vmap": "float32[2]", "grad": "float32[4,2]"}[trace]
    assert str(err.value) == (f"Saving '{ckpt}' failed: leaf 'params/dense/kernel' is a JAX tracer ({shape}), "
                              + TRACED_HINT)
    assert not ckpt.exists() and os.listdir(tmp_path) == []
    jaxckpt.save(ckpt, {"x": jnp.ones(2)})  # outside it: saved
    assert jaxckpt.restore(ckpt)["x"].tolist() == [1.0, 1.0]


def test_save_inside_jit_names_a_traced_key(tmp_path):
    @jax.jit
    def step(seed):
        jaxckpt.save(tmp_path / "ckpt", {"rng": [jax.random.key(0), jax.random.key(seed)]})
        return seed

    with pytest.raises(jaxckpt.CheckpointError, match=r"leaf 'rng/0' is a JAX tracer \(key<fry>\[\]\)"):
        step(1)
    assert os.listdir(tmp_path) == []
