"""PyTrees ↔ (key-path string, leaf) lists, and a JSON description of the containers.

Paths join key entries with ``/``: dict keys, sequence indices and attribute names.
A ``/`` or ``%`` inside a key is percent-encoded, so every path splits back into its
entries. ``None`` counts as a leaf here (it is saved as an inline value), so that a
tree and its target flatten to the same paths.
"""

from __future__ import annotations

import collections
import contextlib
import gc
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import jax

from ._errors import CheckpointError

_tu = jax.tree_util

# Containers nest at most this deep in a saved tree: restore rebuilds trees
# recursively and a manifest of a deeper tree would near json's own nesting limit.
# The manifest reader enforces the same cap.
MAX_DEPTH = 100


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while building many small objects.

    Flattening a big tree or parsing a big manifest allocates enough to trigger full
    collections, each a walk of every object of the (jax-sized) heap: ~70 ms apiece
    in a fresh process, half the time of a 1,000-leaf restore. Nothing made here forms
    cycles, so there is nothing for the collector to find.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _is_none(x: Any) -> bool:
    return x is None


def encode_key(key: str) -> str:
    return key.replace("%", "%25").replace("/", "%2F")


def decode_key(key: str) -> str:
    return key.replace("%2F", "/").replace("%25", "%")


def entry_to_str(entry: Any, where: str) -> str:
    """One key-path entry as its path component."""
    if isinstance(entry, _tu.DictKey):
        key = entry.key
        if isinstance(key, str):
            return encode_key(key)
        if isinstance(key, int) and not isinstance(key, bool):
            return str(key)
        raise CheckpointError(
            f"Unsupported dict key {key!r} of type {type(key).__name__} at '{where}': "
            "only str and int keys can be saved."
        )
    if isinstance(entry, _tu.SequenceKey):
        return str(entry.idx)
    if isinstance(entry, _tu.GetAttrKey):
        return encode_key(entry.name)
    if isinstance(entry, _tu.FlattenedIndexKey):
        return str(entry.key)
    raise CheckpointError(f"Unsupported key-path entry {entry!r} at '{where}'.")


def keypath_to_str(path: tuple[Any, ...]) -> str:
    parts: list[str] = []
    for entry in path:
        parts.append(entry_to_str(entry, "/".join(parts)))
    return "/".join(parts)


def flatten(tree: Any) -> tuple[list[tuple[str, Any]], Any]:
    """Flatten ``tree`` into ``[(path, leaf)]`` and a treedef (``None`` is a leaf)."""
    try:
        with_paths, treedef = _tu.tree_flatten_with_path(tree, is_leaf=_is_none)
    except Exception as e:  # noqa: BLE001 - e.g. jax cannot sort {"1": .., 1: ..}
        ours = _flatten_error(tree)
        if ours is None:
            raise
        raise ours from e
    out = [(keypath_to_str(p), leaf) for p, leaf in with_paths]
    seen: set[str] = set()
    for path, _ in out:
        if path in seen:
            raise CheckpointError(
                f"Two leaves map to the same key path '{path}' (e.g. int key 1 and str key "
                "'1' in one dict); rename one of them."
            )
        seen.add(path)
    return out, treedef


def refuse_tracers(tree: Any, doing: str) -> None:
    """Raise ``CheckpointError`` naming the first leaf of ``tree`` that is a JAX tracer:
    a save called inside ``jax.jit`` (or ``vmap``, ``grad``, ``scan``...), where arrays
    have no values yet. Checked before a save does anything. ``doing``: what is refused
    (``"Saving '/ckpt'"``)."""
    try:
        leaves = _tu.tree_leaves(tree, is_leaf=_is_none)
    except Exception as e:  # noqa: BLE001 - e.g. jax cannot sort {"1": .., 1: ..}: our error names it
        ours = _flatten_error(tree)
        if ours is None:
            raise
        raise ours from e
    if not any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
        return
    path, leaf = next((p, x) for p, x in flatten(tree)[0] if isinstance(x, jax.core.Tracer))
    raise CheckpointError(tracer_message(doing, f"leaf '{path}'", leaf))


def tracer_message(doing: str, what: str, tracer: Any) -> str:
    aval = getattr(tracer, "aval", None)
    shown = aval.str_short() if hasattr(aval, "str_short") else type(tracer).__name__
    return (f"{doing} failed: {what} is a JAX tracer ({shown}), not an array with values: save was called "
            "inside a traced function (jax.jit, vmap, grad, ...). Save outside it, on the arrays it returns.")


def unflatten(treedef: Any, leaves: list[Any]) -> Any:
    return _tu.tree_unflatten(treedef, leaves)


def _flatten_error(tree: Any) -> CheckpointError | None:
    """A ``CheckpointError`` naming the container jax failed to flatten, and why.

    jax reports only "Comparator raised exception while sorting pytree dictionary keys";
    find the node whose own flattening fails, shallowest first (``None``: none does).
    """
    found = _unflattenable_node(tree)
    if found is None:
        return None
    path, node, own_error = found
    where = f"'{path}'" if path else "the root of the tree"
    keys = _unsortable_keys(node) if isinstance(node, dict) else None
    if keys is not None:
        return CheckpointError(
            f"The dict at {where} has keys {keys[0]!r} and {keys[1]!r}, which jax cannot sort "
            "against each other (it orders dict keys); use keys of one type, str or int.")
    return CheckpointError(f"Cannot flatten the {type(node).__name__} at {where}: {own_error}")


def _unflattenable_node(tree: Any) -> tuple[str, Any, Exception] | None:
    queue: collections.deque[tuple[str, Any]] = collections.deque([("", tree)])
    while queue:
        path, node = queue.popleft()
        if node is None:
            continue
        try:
            children = _one_level(node)
        except Exception as e:  # noqa: BLE001 - this is the node we are looking for
            return path, node, e
        for entry, child in children or ():
            part = entry_to_str(entry, path)
            queue.append((f"{path}/{part}" if path else part, child))
    return None


def empty_node_paths(tree: Any) -> set[str]:
    """Key paths of the containers of ``tree`` that hold nothing (``()``, ``{}``, an empty
    NamedTuple such as optax's ``EmptyState()``); ``None`` is a leaf here, not one of them."""
    out: set[str] = set()

    def empty(x: Any) -> bool:
        return x is not None and _one_level(x) == []

    def is_leaf(x: Any) -> bool:
        return x is None or empty(x)

    for p, x in _tu.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]:
        if empty(x):
            out.add(keypath_to_str(p))
    return out


def _unsortable_keys(d: dict[Any, Any]) -> tuple[Any, Any] | None:
    """Two keys of ``d`` that ``<`` cannot compare, preferring a pair like ``"1"``/``1``."""
    strs = {k for k in d if isinstance(k, str)}
    for k in d:
        if isinstance(k, int) and str(k) in strs:
            return str(k), k
    one_per_type = list({type(k): k for k in d}.values())
    for i, a in enumerate(one_per_type):
        for b in one_per_type[i + 1:]:
            try:
                _ = a < b, b < a
            except Exception:  # noqa: BLE001 - TypeError, or whatever a key's __lt__ raises
                return a, b
    return None


# --- container description -------------------------------------------------------
#
# A node of the JSON structure is one of
#   {"leaf": i}                                  i indexes the manifest's leaf list
#   {"dict": [[key, node], ...]}                 key is a str or an int
#   {"list": [node, ...]} / {"tuple": [node, ...]}
#   {"node": type name, "items": [[path component, node], ...]}   anything else
# It is built by peeling one level at a time with jax's own flattening, so leaf
# indices come out in exactly the order of ``flatten``.


def _one_level(node: Any) -> list[tuple[Any, Any]] | None:
    """``[(key entry, child)]`` of a container node, ``None`` for a leaf."""
    children, treedef = _tu.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
    if _tu.treedef_is_leaf(treedef) and treedef.num_leaves == 1:
        return None
    return [(p[0], c) for p, c in children]


def describe(tree: Any) -> dict[str, Any]:
    """The JSON description of ``tree``'s containers; leaves get indices in flatten order."""
    counter = iter(range(1 << 62))

    def walk(node: Any, depth: int, trail: Any) -> dict[str, Any]:
        # ``trail`` is (key entry, parent's trail): the key path, joined only for an error.
        if node is None:
            return {"leaf": next(counter)}
        children = _one_level(node)
        if children is None:
            return {"leaf": next(counter)}
        if depth >= MAX_DEPTH and children:
            raise CheckpointError(f"The tree nests containers deeper than {MAX_DEPTH} levels at "
                                  f"'{_trail_to_str(trail)}'; a checkpoint holds at most {MAX_DEPTH}.")
        if type(node) is dict or (isinstance(node, dict) and type(node).__module__ == "collections"):
            return {"dict": [[e.key, walk(c, depth + 1, (e, trail))] for e, c in children]}
        if type(node) is list:
            return {"list": [walk(c, depth + 1, (e, trail)) for e, c in children]}
        if type(node) is tuple:
            return {"tuple": [walk(c, depth + 1, (e, trail)) for e, c in children]}
        items = []
        for e, c in children:
            items.append([entry_to_str(e, type(node).__name__), walk(c, depth + 1, (e, trail))])
        return {"node": type(node).__name__, "items": items}

    try:
        return walk(tree, 0, None)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - see flatten
        ours = _flatten_error(tree)
        if ours is None:
            raise
        raise ours from e


def _trail_to_str(trail: Any) -> str:
    entries = []
    while trail is not None:
        entry, trail = trail
        entries.append(entry)
    return keypath_to_str(tuple(reversed(entries)))


def build(structure: dict[str, Any], leaf_fn: Callable[[int], Any]) -> Any:
    """Rebuild plain containers from a description: dicts, lists and tuples.

    Registered custom nodes (NamedTuples, dataclasses, ``nnx.State``) come back as
    dicts keyed by their path components; pass a target to get the classes back.
    """
    if "leaf" in structure:
        return leaf_fn(structure["leaf"])
    if "dict" in structure:
        return {k: build(c, leaf_fn) for k, c in structure["dict"]}
    if "list" in structure:
        return [build(c, leaf_fn) for c in structure["list"]]
    if "tuple" in structure:
        return tuple(build(c, leaf_fn) for c in structure["tuple"])
    return {decode_key(k): build(c, leaf_fn) for k, c in structure["items"]}


def iter_leaf_indices(structure: dict[str, Any]) -> Iterator[int]:
    if "leaf" in structure:
        yield structure["leaf"]
        return
    if "dict" in structure or "items" in structure:
        kids = [c for _, c in structure.get("dict", structure.get("items", []))]
    else:
        kids = structure.get("list", structure.get("tuple", []))
    for c in kids:
        yield from iter_leaf_indices(c)


# --- near misses ----------------------------------------------------------------------
#
# A target and a checkpoint often name the same leaves one consistent level apart: nnx's
# ``Variable`` adds ``/value`` to every path (``nnx.state`` vs ``nnx.to_pure_dict``), a
# training script wraps the model in ``params/``, safetensors joins names with dots.
# restore guesses such a ``key_map`` from the paths that failed to match, tries it, and
# offers it when it helps ("did you mean").


class KeyMapGuess(NamedTuple):
    """A ``key_map`` that may explain a mismatch: ``code`` to paste, ``key_map`` to try."""

    code: str
    key_map: Any


def _most_common(items: Iterable[str]) -> str | None:
    counts = collections.Counter(items).most_common(1)
    return counts[0][0] if counts else None


def keys_near(paths: Sequence[str], prefix: str, shown: int = 20) -> str:
    """For a key path ``prefix`` under which none of ``paths`` lies, the keys one level
    below its longest part that has some: ``top-level keys: 'opt', 'params'`` or ``keys
    under 'params': 'dense', 'out'`` (in the order of ``paths``, at most ``shown``)."""
    parts = prefix.strip("/").split("/")
    for n in range(len(parts) - 1, -1, -1):
        base = "/".join(parts[:n])
        below = [p[len(base) + 1:] if base else p for p in paths if p.startswith(base + "/" if base else "")]
        keys = list(dict.fromkeys(p.split("/")[0] for p in below))
        if keys:
            more = f", … {len(keys) - shown} more" if len(keys) > shown else ""
            where = f"keys under '{base}'" if base else "top-level keys"
            return f"{where}: " + ", ".join(f"'{k}'" for k in keys[:shown]) + more
    return "no keys at all"


def near_miss_key_maps(absent: Sequence[str], unused: Sequence[str]) -> list[KeyMapGuess]:
    """``key_map`` guesses that map target paths not in a checkpoint (``absent``) onto its
    paths the target does not name (``unused``), one consistent level apart.

    Each guess is in a form ``restore`` accepts (a prefix dict or a callable from a target
    path to a saved one) and its ``code`` is that same map as Python source; the caller
    tries them (they may not fit every leaf).
    """
    saved = set(unused)
    missing = set(absent)
    guesses = []
    # a level at the end: the target has it (nnx.State), the checkpoint does not
    end = _most_common(a.rsplit("/", 1)[1] for a in missing if "/" in a and a.rsplit("/", 1)[0] in saved)
    if end is not None:
        guesses.append(KeyMapGuess(f"lambda p: p.removesuffix({'/' + end!r})",
                                   lambda p, s="/" + end: p.removesuffix(s)))
    # ... or the checkpoint has it and the target does not: everywhere, or under one subtree
    end = _most_common(u.rsplit("/", 1)[1] for u in saved if "/" in u and u.rsplit("/", 1)[0] in missing)
    if end is not None:
        guesses.append(KeyMapGuess(f"lambda p: p + {'/' + end!r}", lambda p, s="/" + end: p + s))
        top = _most_common(u.split("/", 1)[0] for u in saved if "/" in u and u.rsplit("/", 1)[0] in missing)
        under = f"{top}/"
        guesses.append(KeyMapGuess(f"lambda p: p + {'/' + end!r} if p.startswith({under!r}) else p",
                                   lambda p, s="/" + end, t=under: p + s if p.startswith(t) else p))
    # a level at the start: a wrapper (``params/``) in the target, or in the checkpoint
    top = _most_common(a.split("/", 1)[0] for a in missing if "/" in a and a.split("/", 1)[1] in saved)
    if top is not None:
        guesses.append(KeyMapGuess(f"{{{top!r}: ''}}", {top: ""}))
    top = _most_common(u.split("/", 1)[0] for u in saved if "/" in u and u.split("/", 1)[1] in missing)
    if top is not None:
        guesses.append(KeyMapGuess(f"{{'': {top!r}}}", {"": top}))
        # ... only around the subtrees that need it (a 'step' beside the model has none)
        under = {a.split("/", 1)[0]: f"{top}/{a.split('/', 1)[0]}" for a in sorted(missing) if f"{top}/{a}" in saved}
        guesses.append(KeyMapGuess(repr(under), under))
    # dotted names (safetensors, a flat dict of them) for key paths, either way round
    if any("/" in a and a.replace("/", ".") in saved for a in missing):
        guesses.append(KeyMapGuess("lambda p: p.replace('/', '.')", lambda p: p.replace("/", ".")))
    if any("." in a and a.replace(".", "/") in saved for a in missing):
        guesses.append(KeyMapGuess("lambda p: p.replace('.', '/')", lambda p: p.replace(".", "/")))
    return guesses


# --- a manifest's structure, checked (untrusted input) ------------------------------


def check_structure(structure: Any, paths: list[str], bad) -> None:
    """A manifest's ``structure`` (untrusted) against its records' ``paths``; ``bad(message)``
    makes the error to raise. Every leaf referenced once, at the key path its record names:
    a restore without a target builds the tree from ``structure``, one with a target
    matches record paths, and the two must agree on which data lands where."""
    seen = [False] * len(paths)
    stack: list[tuple[Any, tuple[str, ...]]] = [(structure, ())]
    while stack:
        node, at = stack.pop()  # ``at``: the path components down to ``node``
        if len(at) > MAX_DEPTH:  # the tree is rebuilt recursively; save refuses deeper trees too
            raise bad(f"structure is nested deeper than {MAX_DEPTH} levels")
        if not isinstance(node, dict) or len(node) not in (1, 2):
            raise bad("structure is malformed")
        if "leaf" in node:
            i = node["leaf"]
            if not (isinstance(i, int) and not isinstance(i, bool)) or not 0 <= i < len(paths) or seen[i]:
                raise bad(f"structure references leaf {i!r} badly")
            if paths[i] != "/".join(at):  # joined only here: a hostile tree of long keys stays linear
                raise bad(f"structure puts leaf #{i} at '{'/'.join(at)}', but its record's path is '{paths[i]}'")
            seen[i] = True
            continue
        stack.extend((child, (*at, part)) for part, child in _structure_children(node, bad))
    if not all(seen):
        raise bad("structure does not reference every leaf")


def _structure_children(node: dict[str, Any], bad) -> list[tuple[str, Any]]:
    """``(path component, child)`` of one container node of ``structure``."""
    if "dict" in node:
        items = node["dict"]
        if not isinstance(items, list):
            raise bad("structure is malformed")
        for item in items:
            if not (isinstance(item, list) and len(item) == 2 and
                    (isinstance(item[0], (str, int)) and not isinstance(item[0], bool))):
                raise bad("structure has a bad dict key")
        _check_dict_keys([item[0] for item in items], bad)
        return [(encode_key(k) if isinstance(k, str) else str(k), c) for k, c in items]
    if "list" in node or "tuple" in node:
        items = node.get("list", node.get("tuple"))
        if not isinstance(items, list):
            raise bad("structure is malformed")
        return [(str(i), c) for i, c in enumerate(items)]
    if "items" in node and isinstance(node.get("node"), str):
        items = node["items"]
        if not isinstance(items, list):
            raise bad("structure is malformed")
        for item in items:
            if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)):
                raise bad("structure has a bad node item")
        return [(k, c) for k, c in items]
    raise bad("structure is malformed")


def _check_dict_keys(keys: list[str | int], bad) -> None:
    # No saved dict repeats a key; rebuilding one that did would drop a leaf silently.
    if len(set(keys)) != len(keys):
        raise bad("structure has a repeated dict key")
