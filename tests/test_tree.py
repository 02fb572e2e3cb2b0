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
