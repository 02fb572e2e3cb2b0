"""Key paths and the container description."""

from typing import NamedTuple

import jax
import numpy as np
import pytest

from jaxckpt import CheckpointError, _tree


class Pair(NamedTuple):
    a: int
    b: int


def test_paths_join_keys_indices_and_attributes():
    tree = {"p": [{"w": 1}, Pair(2, 3)], "x/y": {"50%": None}}
    flat, _ = _tree.flatten(tree)
    assert [p for p, _ in flat] == ["p/0/w", "p/1/a", "p/1/b", "x%2Fy/50%25"]
    assert _tree.decode_key("x%2Fy") == "x/y" and _tree.decode_key("50%25") == "50%"


def test_none_is_a_leaf_and_empty_containers_are_described():
    tree = {"a": None, "b": [], "c": {}, "d": (), "e": [None, ()]}
    flat, treedef = _tree.flatten(tree)
    assert [p for p, _ in flat] == ["a", "e/0"]
    desc = _tree.describe(tree)
    values = [v for _, v in flat]
    assert _tree.build(desc, lambda i: values[i]) == tree
    assert _tree.unflatten(treedef, values) == tree


def test_describe_indices_follow_flatten_order():
    tree = {"z": [1, 2], "a": Pair(3, 4)}
    flat, _ = _tree.flatten(tree)
    desc = _tree.describe(tree)
    assert list(_tree.iter_leaf_indices(desc)) == list(range(len(flat)))
    rebuilt = _tree.build(desc, lambda i: flat[i][1])
    assert rebuilt == {"a": {"a": 3, "b": 4}, "z": [1, 2]}  # NamedTuple -> dict without target


def test_int_keys_stay_ints():
    desc = _tree.describe({3: 1, 10: 2})
    assert desc == {"dict": [[3, {"leaf": 0}], [10, {"leaf": 1}]]}


def test_colliding_paths_and_bad_keys_raise():
    from collections import OrderedDict

    with pytest.raises(CheckpointError, match="same key path '1'"):
        _tree.flatten(OrderedDict([(1, 0), ("1", 1)]))
    with pytest.raises(CheckpointError, match="Unsupported dict key"):
        _tree.flatten({(1, 2): np.ones(1)})


def test_custom_node_keys():
    flat, _ = _tree.flatten(jax.tree_util.Partial(lambda x: x, np.ones(2)))
    assert [p for p, _ in flat] == ["0/0"]  # Partial: (args, keywords) by flattened index


def test_dict_mixing_str_and_int_keys_is_our_error(tmp_path):
    import jaxckpt

    bad = {"a": [{"x": {"1": np.ones(2), 1: np.zeros(2)}}]}
    for fn in (_tree.flatten, _tree.describe):
        with pytest.raises(CheckpointError) as err:
            fn(bad)
        assert type(err.value) is CheckpointError
        assert "The dict at 'a/0/x' has keys '1' and 1, which jax cannot sort" in str(err.value)
    ckpt = tmp_path / "ckpt"
    with pytest.raises(CheckpointError, match="dict at 'a/0/x' has keys '1' and 1") as err:
        jaxckpt.save(ckpt, bad)
    assert type(err.value) is CheckpointError
    assert not ckpt.exists()

    jaxckpt.save(ckpt, {"p": {"w": np.ones(2), "b": np.zeros(2)}})
    with pytest.raises(CheckpointError) as err:
        jaxckpt.restore(ckpt, {"p": {"w": np.ones(2), 2: np.zeros(2)}})
    assert type(err.value) is CheckpointError
    assert "The dict at 'p' has keys 'w' and 2" in str(err.value)
    with pytest.raises(CheckpointError, match="dict at the root of the tree has keys None and 'a'"):
        _tree.flatten({None: 1, "a": 2})


def test_tree_deeper_than_the_cap_is_refused_at_save(tmp_path):
    import jaxckpt

    def nested(depth):
        tree = np.ones(2)
        for i in reversed(range(depth)):
            tree = {f"k{i}": tree}
        return tree

    with pytest.raises(CheckpointError) as err:
        jaxckpt.save(tmp_path / "deep", nested(_tree.MAX_DEPTH + 1))
    assert type(err.value) is CheckpointError
    path = "/".join(f"k{i}" for i in range(_tree.MAX_DEPTH))
    assert f"deeper than 100 levels at '{path}'" in str(err.value)
    jaxckpt.save(tmp_path / "ok", nested(_tree.MAX_DEPTH))
    back = jaxckpt.restore(tmp_path / "ok")
    for i in range(_tree.MAX_DEPTH):
        back = back[f"k{i}"]
    np.testing.assert_array_equal(back, np.ones(2))
