"""What a resumable state is made of (docs/training.md), part by part: examples/
flax_nnx.py's checkpoint holds its whole train state as it was (saved, then donated);
typed keys and nnx Rngs, a data iterator's position (the example's cursor and grain's
iterators), the schedule's count and a config dict come back as themselves; the restore
target is built without allocating; the params alone restore for evaluation.

The resume parity itself (preempted, resumed in a fresh process, every leaf and loss
equal bit for bit; another mesh within tolerance) runs the example as a script:
tests/test_examples.py::test_flax_nnx_example_resumes_bit_for_bit_and_on_another_mesh."""

import importlib.util
import os

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_bit_equal
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt import _tree

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("flax_nnx_example", os.path.join(ROOT, "examples", "flax_nnx.py"))
ex = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ex)


@pytest.fixture(scope="module")
def preempted(tmp_path_factory):
    """examples/flax_nnx.py's run, preempted: saved every step with a CheckpointManager
    (async; the next jitted step donates the state just saved) and stopped after step
    SAVE_AT. Returns the manager's directory and the state at that step as numpy."""
    directory = str(tmp_path_factory.mktemp("nnx") / "ckpts")
    state, train_step, data = ex.start_fresh(ex.CONFIG, ex.make_mesh(2, 4))
    with jaxckpt.CheckpointManager(directory, max_to_keep=2) as mgr:
        state, _, _ = ex.train(state, train_step, data, 0, ex.SAVE_AT, mgr, ex.CONFIG)
    assert mgr.all_steps() == [ex.SAVE_AT - 1, ex.SAVE_AT]  # async saves: committed by close()
    return directory, ex.flat_numpy(state, data), state, data


def test_the_checkpoint_holds_every_part_of_the_state_as_it_was(preempted):
    """What a resume starts from (the fresh-process resume itself: tests/test_examples.py)."""
    directory, at_save, _, _ = preempted
    m = ex.make_mesh(2, 4)
    with jax.set_mesh(m):
        back = jaxckpt.restore(os.path.join(directory, str(ex.SAVE_AT)), ex.restore_target(ex.CONFIG))
    assert back["step"] == ex.SAVE_AT and back["config"] == ex.CONFIG
    data = ex.Batches(ex.CONFIG)
    data.set_state(back["data"])
    got = ex.flat_numpy({k: back[k] for k in ("model", "opt", "rng")}, data)
    assert got.keys() == at_save.keys() and len(got) == 25
    for name, value in at_save.items():
        assert_bit_equal(got[name], value)
    assert back["rng"].dtype == jax.random.key(0).dtype
    assert back["opt"]["opt_state"][2]["count"].get_value().dtype == jnp.int32  # the schedule's count


def test_typed_keys_and_nnx_rngs_continue_their_streams(ckpt):
    m = ex.make_mesh(2, 4)
    replicated = NamedSharding(m, P())
    rngs = nnx.Rngs(params=0, dropout=jax.random.key(7, impl="rbg"))
    rngs.dropout()  # the stream has moved: count 1
    keys = jax.device_put(jax.random.split(jax.random.key(3), 8), NamedSharding(m, P("data")))
    jaxckpt.save(ckpt, {"rngs": nnx.state(rngs), "key": jax.device_put(jax.random.key(5), replicated),
                        "keys": keys})

    abstract = {"rngs": nnx.state(nnx.eval_shape(lambda: nnx.Rngs(params=0, dropout=jax.random.key(0, impl="rbg")))),
                "key": jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=replicated),
                "keys": jax.ShapeDtypeStruct((8,), jax.random.key(0).dtype, sharding=NamedSharding(m, P("data")))}
    back = jaxckpt.restore(ckpt, abstract)
    assert back["key"].dtype == jax.random.key(0).dtype and back["key"].sharding == replicated
    assert_bit_equal(jax.random.key_data(jax.random.split(back["key"])), jax.random.key_data(jax.random.split(jax.random.key(5))))
    assert back["keys"].sharding == keys.sharding
    assert_bit_equal(jax.random.key_data(back["keys"]), jax.random.key_data(keys))
    assert str(back["rngs"]["dropout"]["key"].get_value().dtype) == "key<rbg>"

    threefry = jax.tree.map(lambda x: x, abstract)
    threefry["rngs"]["dropout"]["key"].set_value(jax.ShapeDtypeStruct((), jax.random.key(0).dtype))
    with pytest.raises(jaxckpt.TreeMismatchError) as err:
        jaxckpt.restore(ckpt, threefry)
    assert err.value.paths == ("rngs/dropout/key/value",)
    assert "PRNG key dtype key<fry> in target, impl rbg on disk" in str(err.value)

    resumed = nnx.Rngs(params=1, dropout=jax.random.key(1, impl="rbg"))  # other seeds: all overwritten
    nnx.update(resumed, back["rngs"])
    for _ in range(3):
        assert_bit_equal(jax.random.key_data(resumed.dropout()), jax.random.key_data(rngs.dropout()))
        assert_bit_equal(jax.random.key_data(resumed.params()), jax.random.key_data(rngs.params()))


def _global_batches(state, data_size, steps):
    """Per data shard, the examples of each step, with the cursor pipeline of the example."""
    data = ex.Batches(ex.CONFIG)
    data.set_state(state)
    out = []
    for _ in range(steps):
        ids, x, _ = next(data)
        shards = jax.device_put(x, NamedSharding(ex.make_mesh(data_size, 1), P("data")))
        out.append((ids, [np.asarray(s.data) for s in sorted(shards.addressable_shards, key=lambda s: s.index[0].start)]))
    return out, data.get_state()


def test_data_position_restores_and_stays_valid_when_the_data_axis_changes(ckpt):
    data = ex.Batches(ex.CONFIG)
    for _ in range(3):
        next(data)
    jaxckpt.save(ckpt, {"data": data.get_state()})
    back = jaxckpt.restore(ckpt, {"data": {"epoch": 0, "index": 0}})["data"]
    assert back == {"epoch": 0, "index": 3} and all(type(v) is int for v in back.values())
    on2, end2 = _global_batches(back, 2, 3)
    on4, end4 = _global_batches(back, 4, 3)
    assert end2 == end4 == {"epoch": 1, "index": 2}  # crossed an epoch: 4 batches each
    expected = [next(data)[0] for _ in range(3)]
    for (ids2, shards2), (ids4, shards4), ids in zip(on2, on4, expected):
        assert_bit_equal(ids2, ids) and assert_bit_equal(ids4, ids)
        assert len(shards2) == 2 and len(shards4) == 4
        assert_bit_equal(np.concatenate(shards2), np.concatenate(shards4))  # the same global batch


@pytest.mark.slow
def test_grain_iterator_state_round_trips(ckpt):
    ds = grain.MapDataset.range(40).shuffle(seed=4).map(lambda i: i * 10).batch(8).repeat(None)
    it = iter(ds.to_iter_dataset())
    for _ in range(7):
        next(it)
    loader = grain.DataLoader(data_source=list(range(40)), operations=[grain.transforms.Batch(8)], worker_count=0,
                              sampler=grain.samplers.IndexSampler(40, shuffle=True, seed=1, num_epochs=None,
                                                                  shard_options=grain.sharding.NoSharding()))
    loader_it = iter(loader)
    next(loader_it)
    loader_state = loader_it.get_state()
    assert type(loader_state) is bytes  # JSON bytes (saved as themselves too: tests/test_first_hour_tree.py)
    jaxckpt.save(ckpt, {"dataset": it.get_state(), "loader": loader_state.decode()})

    fresh = iter(ds.to_iter_dataset())
    back = jaxckpt.restore(ckpt, {"dataset": fresh.get_state(), "loader": ""})
    fresh.set_state(back["dataset"])
    fresh_loader = iter(loader)
    fresh_loader.set_state(back["loader"].encode())
    for _ in range(6):  # crosses an epoch boundary
        assert_bit_equal(next(fresh), next(it))
        assert_bit_equal(next(fresh_loader), next(loader_it))
    jaxckpt.save(ckpt, {"loader": loader_state}, overwrite=True)
    assert jaxckpt.restore(ckpt, {"loader": b""})["loader"] == loader_state


def test_schedule_count_restores_the_learning_rate(ckpt):
    schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 3, 20)
    tx = optax.adamw(schedule)
    update = jax.jit(tx.update)
    params, grads = {"w": jnp.ones(4)}, {"w": jnp.full(4, 0.5)}
    opt_state = tx.init(params)
    for _ in range(5):
        _, opt_state = update(grads, opt_state, params)
    jaxckpt.save(ckpt, {"opt": opt_state})
    back = jaxckpt.restore(ckpt, {"opt": jax.eval_shape(tx.init, params)})["opt"]
    assert type(back) is type(opt_state) and type(back[2]).__name__ == "ScaleByScheduleState"
    count = back[2].count
    assert count.dtype == jnp.int32 and int(count) == 5
    assert_bit_equal(schedule(count), schedule(opt_state[2].count))
    assert float(schedule(count)) > 0  # past warmup: not the 0.0 a fresh count would give
    assert_bit_equal(back[0].count, opt_state[0].count)  # Adam's bias-correction count too
    assert_bit_equal(update(grads, back, params)[0]["w"], update(grads, opt_state, params)[0]["w"])


def test_config_dict_keeps_its_types_and_refuses_a_narrower_type(ckpt):
    config = {"lr": 3e-4, "layers": 12, "name": "base", "bf16": True, "dropout": None, "betas": [0.9, 0.95]}
    jaxckpt.save(ckpt, {"config": config, "step": 7})
    assert jaxckpt.restore(ckpt) == {"config": config, "step": 7}
    back = jaxckpt.restore(ckpt, {"config": config, "step": 0})
    assert back["config"] == config and [type(v) for v in back["config"]["betas"]] == [float, float]
    assert type(back["config"]["layers"]) is int and type(back["config"]["bf16"]) is bool
    assert jaxckpt.restore(ckpt, {"config": config}, partial=True) == {"config": config}
    with pytest.raises(jaxckpt.TreeMismatchError) as err:
        jaxckpt.restore(ckpt, {"config": {**config, "lr": 0}, "step": 0})
    assert err.value.paths == ("config/lr",)
    assert "saved float 0.0003 cannot be restored into a target of type int" in str(err.value)


def test_restore_target_is_built_without_allocating(preempted):
    directory, at_save, _, _ = preempted
    m = ex.make_mesh(2, 4)
    n = len(at_save) - 2  # the arrays: all but the data position's two ints
    before = jax.live_arrays()  # held, so that none of them is freed (and its id reused) meanwhile
    old = {id(a) for a in before}

    def allocated():
        return [a for a in jax.live_arrays() if id(a) not in old]

    with jax.set_mesh(m):
        target = ex.restore_target(ex.CONFIG)
    assert allocated() == []
    leaves = jax.tree.leaves(target)
    arrays = [x for x in leaves if isinstance(x, jax.ShapeDtypeStruct)]
    # every Variable has its annotation's sharding; the typed key has none (the restore
    # replicates it on the mesh in context: asserted below)
    assert len(arrays) == n and [x.sharding is None for x in arrays].count(True) == 1
    assert target["rng"].sharding is None
    assert not any(isinstance(x, jax.Array) for x in leaves)
    with jax.set_mesh(m):
        back = jaxckpt.restore(os.path.join(directory, str(ex.SAVE_AT)), target)
    assert len(allocated()) == n
    kernel = back["model"]["lin1"]["kernel"].get_value()
    assert kernel.sharding == NamedSharding(m, P(None, "model"))
    assert back["rng"].sharding == NamedSharding(m, P())


def test_params_only_restore_for_evaluation(preempted):
    directory, _, state, data = preempted
    m = ex.make_mesh(2, 4)
    with jax.set_mesh(m):
        (graph, _), abstract = nnx.eval_shape(lambda: ex.create(ex.CONFIG))
        _, weights, rest = nnx.split(nnx.merge(graph, abstract["model"]), (nnx.Param, nnx.BatchStat), ...)
        with jaxckpt.CheckpointManager(directory, read_only=True) as mgr:
            back = mgr.restore(target={"model": weights}, partial=True)  # no moments, no RNG read
            with pytest.raises(jaxckpt.TreeMismatchError) as err:
                mgr.restore(target={"model": weights})
    assert "in the checkpoint but not in the target: config/batch, " in str(err.value)
    named = {p for p, _ in _tree.flatten({"model": weights})[0]}
    assert len(named) == 7
    assert set(err.value.paths) == set(jaxckpt.open(os.path.join(directory, str(ex.SAVE_AT))).keys()) - named
    got = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(back)}
    assert got == {f"['model']['{a}']['{b}'].value" for a, b in [
        ("lin1", "kernel"), ("lin2", "kernel"), ("lin2", "bias"), ("bn", "scale"), ("bn", "bias"), ("bn", "mean"),
        ("bn", "var")]}
    model = nnx.merge(graph, back["model"], rest)  # the dropout RNG stays abstract: eval never draws
    model.eval()
    trained = nnx.merge(graph, state["model"])
    trained.eval()
    x = jnp.asarray(data.x[:8])
    assert_bit_equal(model(x), trained(x))
