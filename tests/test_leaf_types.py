"""Every leaf kind comes back as the type docs/training.md says, with and without a target.

The table in docs/training.md ("Every leaf keeps its type") is the test's data: each
row's value expression is evaluated, all rows are saved in one checkpoint, and the
manifest's record kind and the restored types must equal the row's columns; the value
itself must come back bit for bit. A row added to the table is tested; a behaviour
change fails here until the table says it. `python tests/test_leaf_types.py` prints the
rows as the library restores them now (to write a new row).
"""

import json
import math
import os
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt import _tree

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "training.md")


def _table(name):
    """The rows of the table between ``<!-- name:start -->`` and ``<!-- name:end -->``, as
    lists of cells with their backticks stripped (header and rule skipped)."""
    with open(DOC, encoding="utf-8") as f:
        text = f.read()
    body = re.search(f"<!-- {name}:start -->\n(.*?)<!-- {name}:end -->", text, re.S).group(1)
    rows = []
    for line in body.strip().splitlines()[2:]:
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        rows.append([c.replace("\\|", "|").strip("`") for c in cells])
    return rows


def _namespace():
    import collections

    import optax
    from flax import nnx
    from flax.training import train_state

    return {"jax": jax, "jnp": jnp, "np": np, "ml_dtypes": ml_dtypes, "NamedSharding": NamedSharding, "P": P,
            "mesh": jax.make_mesh((4,), ("x",), devices=jax.devices()[:4]), "collections": collections,
            "optax": optax, "nnx": nnx, "train_state": train_state}


def describe(x):
    """What a restored leaf is, as the table writes it."""
    if isinstance(x, jax.Array):
        s = x.sharding
        where = ("P(" + ", ".join(map(repr, s.spec)) + ")" if isinstance(s, NamedSharding)
                 else f"{len(s.device_set)} device")
        return f"jax.Array {x.dtype} {tuple(x.shape)} {where}"
    if isinstance(x, np.ndarray):
        return f"numpy.ndarray {x.dtype} {x.shape}"
    if isinstance(x, np.generic):
        return f"{type(x).__module__}.{type(x).__name__}"
    return "None" if x is None else type(x).__name__


def target_of(x):
    """The target the table's last column restores into: a ShapeDtypeStruct with the
    array's sharding for a jax.Array (what eval_shape + shardings give), else the value."""
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    return x


def _plain(x):
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return ("key", str(jax.random.key_impl(x)), np.asarray(jax.random.key_data(x)))
    return x


def assert_same_value(got, want):
    got, want = _plain(got), _plain(want)
    if isinstance(want, tuple):
        assert got[:2] == want[:2]
        got, want = got[2], want[2]
    if isinstance(want, (jax.Array, np.ndarray, np.generic)) and not isinstance(want, (np.str_, np.bytes_)):
        got, want = np.asarray(got), np.asarray(want)
        assert (got.dtype, got.shape, got.tobytes()) == (want.dtype, want.shape, want.tobytes())
    elif isinstance(want, float) and math.isnan(want):
        assert math.isnan(got)
    else:
        assert got == want and (not isinstance(want, float) or math.copysign(1, got) == math.copysign(1, want))


ROWS = _table("leaf-types")
CONTAINERS = _table("containers")
REFUSED = _table("refused-leaves")


def test_the_tables_cover_every_kind():
    assert len(ROWS) >= 30 and all(len(r) == 5 for r in ROWS)
    assert len(CONTAINERS) >= 8 and all(len(r) == 4 for r in CONTAINERS) and REFUSED
    assert {r[2] for r in ROWS} == {"array", "prng_key", "value", "bytes"}
    assert len({r[1] for r in ROWS}) == len(ROWS)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    ns = _namespace()
    tree = {f"leaf{i}": eval(row[1], ns) for i, row in enumerate(ROWS)}  # noqa: S307 - the doc's own examples
    path = tmp_path_factory.mktemp("leaves") / "ckpt"
    jaxckpt.save(path, tree)
    return path, tree


@pytest.mark.parametrize("i", range(len(ROWS)), ids=[r[0] for r in ROWS])
def test_leaf_round_trips_as_the_table_says(saved, i):
    path, tree = saved
    kind, without, with_target = ROWS[i][2:]
    key = f"leaf{i}"
    value = tree[key]
    records = {r["path"]: r for r in json.loads((path / "manifest.json").read_text())["leaves"]}
    assert records[key]["kind"] == kind

    back = jaxckpt.restore(path, {key: None} if value is None else {key: target_of(value)}, partial=True)[key]
    assert describe(back) == with_target
    assert_same_value(back, value)
    if isinstance(value, jax.Array):
        assert back.sharding == value.sharding

    plain = jaxckpt.restore(path)[key]
    assert describe(plain) == without
    assert_same_value(plain, value)


@pytest.mark.parametrize("expr, without, with_target", [r[1:] for r in CONTAINERS], ids=[r[0] for r in CONTAINERS])
def test_container_round_trips_as_the_table_says(tmp_path, expr, without, with_target):
    value = eval(expr, _namespace())  # noqa: S307 - the doc's own examples
    jaxckpt.save(tmp_path / "c", {"v": value})
    plain = jaxckpt.restore(tmp_path / "c")["v"]
    back = jaxckpt.restore(tmp_path / "c", {"v": value})["v"]
    assert type(plain).__name__ == without and type(back).__name__ == with_target
    assert jax.tree.structure(back) == jax.tree.structure(value)
    want = dict(_tree.flatten(value)[0])  # by key path: a plain dict's leaves follow other orders
    for tree in (plain, back):
        got = dict(_tree.flatten(tree)[0])
        assert got.keys() == want.keys()
        for p in want:
            assert_same_value(got[p], want[p])


@pytest.mark.parametrize("expr, message", REFUSED)
def test_refused_leaves_raise_on_save(tmp_path, expr, message):
    value = eval(expr, _namespace())  # noqa: S307 - the doc's own examples
    with pytest.raises(jaxckpt.CheckpointError) as err:
        jaxckpt.save(tmp_path / "c", {"v": value})
    assert message in str(err.value)
    assert not (tmp_path / "c").exists()


if __name__ == "__main__":  # print the rows as restored now
    import tempfile

    jax.config.update("jax_num_cpu_devices", 8)  # as tests/conftest.py
    ns = _namespace()
    for name, expr, *_ in ROWS:
        v = eval(expr, ns)  # noqa: S307
        d = os.path.join(tempfile.mkdtemp(), "c")
        jaxckpt.save(d, {"v": v})
        with open(os.path.join(d, "manifest.json")) as f:
            kind = json.load(f)["leaves"][0]["kind"]
        tgt = jaxckpt.restore(d, {"v": target_of(v)})["v"]
        print(f"| {name} | `{expr}` | {kind} | `{describe(jaxckpt.restore(d)['v'])}` | `{describe(tgt)}` |")
