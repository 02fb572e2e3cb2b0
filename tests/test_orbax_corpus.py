"""A corpus of real orbax checkpoints (issue 31 item 2): what orbax users have, saved by
orbax itself, read by jaxckpt strictly and bit for bit as orbax restores it.

States (tests/orbax_corpus.py): the optax zoo as {params, opt_state, step}, a linen
TrainState with a replicated dropout key, an nnx model and optimizer (``nnx.state``), an
equinox model's arrays with its optax state; fresh (step 0, never through jit) or after two
jitted steps; params sharded on a 4-device mesh.

Checkpointers: ``StandardCheckpointer``, ``PyTreeCheckpointer`` and ``CheckpointManager``
(``args.Composite``: the state through ``StandardSave``, a ``JsonSave`` item, metrics), each
with OCDBT on and off.

Every case: ``jaxckpt.restore`` strictly onto the saved shardings and onto a 2x2 mesh;
``jaxckpt.open``, ``show``, ``verify``, ``stats``; ``convert.from_orbax`` then a strict
restore of the import. Each compared with what orbax restores onto the same target.

The fast tier covers every state under every checkpointer, and for each state both OCDBT
settings and both steps; each checkpointer sees all four (OCDBT, step) pairs across the
states (``FAST``). The slow tier adds the opposite pair of each (``SLOW``), so that every
state meets every (checkpointer, OCDBT) and every (checkpointer, step).
"""

import json
import math
import os

import jax
import numpy as np
import orbax.checkpoint as ocp  # a test dependency (pyproject [test])
import orbax_corpus as oc
import pytest
from click.testing import CliRunner
from conftest import assert_bit_equal

import jaxckpt
from jaxckpt.cli import main

CHECKPOINTERS = ["standard", "pytree", "manager"]
# (ocdbt, trained) in a cyclic order in which any three consecutive pairs hold both values of each
_PAIRS = [(True, False), (False, True), (True, True), (False, False)]


def _design(shift):
    return [(name, ck, *_PAIRS[(i + c + shift) % 4])
            for i, name in enumerate(oc.STATES) for c, ck in enumerate(CHECKPOINTERS)]


FAST = _design(0)
SLOW = _design(2)


def _id(case):
    name, ck, ocdbt, trained = case
    return f"{name}-{ck}-{'ocdbt' if ocdbt else 'files'}-{'trained' if trained else 'fresh'}"


CONFIG = {"learning_rate": 0.01, "model": "mlp", "layers": [8, 16, 4]}  # the JsonSave item


def _metrics(trained):
    return {"loss": 0.5 if trained else 1.0, "accuracy": 0.75}


class Case:
    """One orbax checkpoint of one state, saved once; what orbax restores from it, restored once."""

    def __init__(self, root, name, checkpointer, ocdbt, trained):
        self.name, self.checkpointer, self.ocdbt, self.trained = name, checkpointer, ocdbt, trained
        self.state = oc.state(name, trained)
        self.root = root
        self.step = oc.STEPS if trained else 0
        self.path = self._save()
        self._theirs = {}

    def _save(self):
        state = self.state
        if self.checkpointer == "standard":
            path = os.path.join(self.root, "ckpt")
            with ocp.StandardCheckpointer(use_ocdbt=self.ocdbt) as ck:
                ck.save(path, state)
                ck.wait_until_finished()
            return path
        if self.checkpointer == "pytree":
            path = os.path.join(self.root, "ckpt")
            with ocp.PyTreeCheckpointer(use_ocdbt=self.ocdbt) as ck:
                ck.save(path, args=ocp.args.PyTreeSave(state))
            return path
        run = os.path.join(self.root, "run")
        with self._manager(run) as mgr:
            mgr.save(self.step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        extra=ocp.args.JsonSave(CONFIG)),
                     metrics=_metrics(self.trained))
            mgr.wait_until_finished()
        return os.path.join(run, str(self.step))

    def _manager(self, run):
        handlers = {"state": ocp.StandardCheckpointHandler(use_ocdbt=self.ocdbt),
                    "extra": ocp.JsonCheckpointHandler()}
        # metrics are written only for a manager that keeps the best steps (best_fn)
        options = ocp.CheckpointManagerOptions(best_fn=lambda m: m["loss"], best_mode="min")
        return ocp.CheckpointManager(run, item_handlers=handlers, options=options)

    def target(self, where):
        """The user's target: the state's abstract form on its own shardings or on a 2x2 mesh;
        a manager step's target holds both items."""
        target = oc.abstract(self.state) if where == "same" else oc.on_mesh22(self.state)
        return {"state": target, "extra": CONFIG} if self.checkpointer == "manager" else target

    def theirs(self, where):
        """What orbax restores onto ``target(where)``, as a tree shaped like ours."""
        if where not in self._theirs:
            target = self.target(where)
            if self.checkpointer == "standard":
                with ocp.StandardCheckpointer() as ck:
                    got = ck.restore(self.path, target)
            elif self.checkpointer == "pytree":
                args = ocp.args.PyTreeRestore(item=target,
                                              restore_args=ocp.checkpoint_utils.construct_restore_args(target))
                with ocp.PyTreeCheckpointer() as ck:
                    got = ck.restore(self.path, args=args)
            else:
                with self._manager(os.path.dirname(self.path)) as mgr:
                    got = mgr.restore(self.step, args=ocp.args.Composite(
                        state=ocp.args.StandardRestore(target["state"]), extra=ocp.args.JsonRestore()))
                got = {"state": got.state, "extra": got.extra}
            self._theirs[where] = got
        return self._theirs[where]

    def prefix(self):
        return "state/" if self.checkpointer == "manager" else ""


_CASES = {}


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """Saved cases shared by the tests of this module (each saved once)."""

    def get(case):
        if case not in _CASES:
            _CASES[case] = Case(str(tmp_path_factory.mktemp(_id(case))), *case)
        return _CASES[case]

    yield get
    _CASES.clear()


def _is_key(x):
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def assert_same(ours, theirs):
    """Same tree structure, leaf types, shardings, dtypes and bits."""
    flat_ours, tdef_ours = jax.tree_util.tree_flatten_with_path(ours)
    flat_theirs, tdef_theirs = jax.tree_util.tree_flatten_with_path(theirs)
    assert tdef_ours == tdef_theirs, (tdef_ours, tdef_theirs)
    for (path, a), (_, b) in zip(flat_ours, flat_theirs):
        where = jax.tree_util.keystr(path)
        assert type(a) is type(b) or (isinstance(a, jax.Array) and isinstance(b, jax.Array)), where
        if isinstance(b, jax.Array):
            assert a.sharding == b.sharding, (where, a.sharding, b.sharding)
        if _is_key(b):
            assert _is_key(a) and a.dtype == b.dtype, where
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        if isinstance(b, (jax.Array, np.ndarray)):
            assert_bit_equal(a, b)
        else:
            assert a == b, where


def _entry(e):
    for attr in ("key", "idx", "name"):
        if hasattr(e, attr):
            return str(getattr(e, attr))
    raise AssertionError(e)


def _arrays(tree):
    """{key path: array} of the tree's array leaves."""
    return {"/".join(_entry(e) for e in path): x for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
            if isinstance(x, (jax.Array, np.ndarray))}


def _data(x):
    return np.asarray(jax.random.key_data(x) if _is_key(x) else x)


def _run(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.output


def _check_restore(case):
    for where in ("same", "mesh22"):
        target = case.target(where)
        assert_same(jaxckpt.restore(case.path, target), case.theirs(where))


def _check_view_and_cli(case):
    theirs = case.theirs("same")
    arrays = _arrays(theirs)
    view = jaxckpt.open(case.path)
    assert view.format == "orbax"
    rows = {r["path"]: r for r in view.rows()}
    assert {k for k in rows if k in arrays} == set(arrays)
    for key, value in arrays.items():
        got = view[key]
        assert (got.shape, got.dtype) == (value.shape, value.dtype), key
        assert_bit_equal(_data(got[...]), _data(value))
    code, out = _run("show", case.path, "--json")
    assert code == 0, out
    shown = json.loads(out)
    assert shown["leaves"] == len(view.keys())
    assert shown["bytes"] == sum(_data(v).nbytes for v in arrays.values())
    code, out = _run("show", case.path)
    assert code == 0 and out.startswith(f"{case.path}: {len(view.keys())} leaves"), out
    code, out = _run("stats", case.path, "--json")
    assert code == 0, out
    stats = json.loads(out)
    for key, value in arrays.items():
        st, value = stats[key], _data(value)
        if value.dtype.kind == "f" and value.size:
            v = value.astype(np.float64)
            assert (st["min"], st["max"]) == (v.min(), v.max()), key
            assert math.isclose(st["mean"], v.mean(), rel_tol=1e-9, abs_tol=1e-12), key


def _check_verify(case):
    """verify reads every chunk of an orbax step (docs/interop.md): exit 0, nothing damaged."""
    code, out = _run("verify", case.path, "--json")
    assert code == 0, out
    (report,) = json.loads(out)["reports"]
    assert report["ok"] is True and report["damaged"] == [], report


def _check_import(case, tmp_path):
    out = tmp_path / "imported"
    jaxckpt.convert.from_orbax(case.path, out)
    assert_same(jaxckpt.restore(out, case.target("same")), case.theirs("same"))


@pytest.mark.parametrize("case", FAST, ids=_id)
def test_restore_matches_orbax(cases, case):
    _check_restore(cases(case))


@pytest.mark.parametrize("case", FAST, ids=_id)
def test_view_show_stats(cases, case):
    _check_view_and_cli(cases(case))


@pytest.mark.parametrize("case", FAST, ids=_id)
def test_verify(cases, case):
    _check_verify(cases(case))


@pytest.mark.parametrize("case", FAST, ids=_id)
def test_import_then_restore_matches_orbax(cases, case, tmp_path):
    _check_import(cases(case), tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW, ids=_id)
def test_slow_tier(cases, case, tmp_path):
    c = cases(case)
    _check_restore(c)
    _check_view_and_cli(c)
    _check_import(c, tmp_path)
    _check_verify(c)


# --- fixtures made by orbax 0.12.8 (tests/fixtures/make_orbax_0_12_8.py; never regenerated) ---

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "orbax-0.12.8")
# what each fixture holds: (state name, trained, step directory or item within it)
FIXTURE_STATES = {
    "train-state-fresh-ocdbt": ("linen_train_state", False, "train-state-fresh-ocdbt"),
    "nnx-trained-files": ("nnx", True, "nnx-trained-files"),
    "multi-transform-trained-files": ("multi_transform", True, "multi-transform-trained-files"),
    "run-0": ("chain_clip_adamw", False, "run/0"),
    "run-2": ("chain_clip_adamw", True, "run/2"),
}


def _assert_expected(ours, target, name):
    """``ours`` has ``target``'s structure and shardings and the values recorded at generation."""
    with open(os.path.join(FIXTURES, "expected.json")) as f:
        doc = json.load(f)[name]
    with np.load(os.path.join(FIXTURES, f"{name}.npz")) as npz:
        arrays = dict(npz)
    assert jax.tree_util.tree_structure(ours) == jax.tree_util.tree_structure(target)
    seen = []
    for (path, got), want in zip(jax.tree_util.tree_flatten_with_path(ours)[0], jax.tree_util.tree_leaves(target)):
        key = "/".join(_entry(e) for e in path)
        seen.append(key)
        if key in doc["values"]:
            assert type(got) is type(doc["values"][key]) and got == doc["values"][key], key
            continue
        assert isinstance(got, jax.Array) and got.sharding == want.sharding, key
        if key in doc["keys"]:
            assert _is_key(got) and str(jax.random.key_impl(got)) == doc["keys"][key], key
            got = jax.random.key_data(got)
        want = arrays[key]
        assert_bit_equal(got, want.view(doc["dtypes"][key]) if want.dtype.kind == "V" else want)
    assert sorted(seen) == sorted([*arrays, *doc["values"]])


@pytest.mark.parametrize("name", list(FIXTURE_STATES))
def test_orbax_0_12_8_fixture_restores_strictly(name, tmp_path):
    """What orbax 0.12.8 wrote restores strictly, bit for bit, onto the saved shardings and
    onto another mesh, directly and through an import (orbax is not needed to check it)."""
    state_name, trained, where = FIXTURE_STATES[name]
    path = os.path.join(FIXTURES, where)
    state = oc.state(state_name, trained)
    for target in (oc.abstract(state), oc.on_mesh22(state)):
        if name.startswith("run-"):
            got = jaxckpt.restore(path, {"state": target, "extra": CONFIG})
            assert got["extra"] == CONFIG
            got = got["state"]
            assert_same(jaxckpt.restore(os.path.join(path, "state"), target), got)
        else:
            got = jaxckpt.restore(path, target)
        _assert_expected(got, target, name)
    jaxckpt.convert.from_orbax(path, tmp_path / "imported")
    target = {"state": oc.abstract(state), "extra": CONFIG} if name.startswith("run-") else oc.abstract(state)
    got = jaxckpt.restore(tmp_path / "imported", target)
    _assert_expected(got["state"] if name.startswith("run-") else got, oc.abstract(state), name)


def test_orbax_0_12_8_run_directory_holds_two_steps_with_metrics():
    """The run fixture is what orbax's CheckpointManager leaves (for readers of orbax runs):
    steps 0 and 2, each with the state, the JSON item and the metrics orbax recorded."""
    with open(os.path.join(FIXTURES, "expected.json")) as f:
        doc = json.load(f)
    run = os.path.join(FIXTURES, "run")
    assert sorted(os.listdir(run)) == ["0", "2"]
    for step in ("0", "2"):
        with open(os.path.join(run, step, "metrics", "metrics")) as f:
            assert json.load(f) == doc["metrics"][step]
        assert jaxckpt.open(os.path.join(run, step)).info["orbax_items"] == ["extra", "state"]
