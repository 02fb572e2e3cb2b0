"""The code's shape: pure modules stay pure, functions stay short (issue 8, item 12)."""

import ast
import os

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "jaxckpt")


def _imports(module):
    """Package modules and top-level third-party modules that ``module`` imports."""
    with open(os.path.join(PKG, module + ".py")) as f:
        tree = ast.parse(f.read())
    ours, theirs = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                ours.add("_" + node.module.lstrip("_") if node.module.startswith("_") else node.module)
            else:
                ours.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            theirs.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            theirs.update(a.name.split(".")[0] for a in node.names)
    return ours, theirs


def _closure(module):
    seen, todo, third = set(), [module], set()
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        ours, theirs = _imports(m)
        third |= theirs
        todo.extend(ours)
    return seen, third


def test_pure_modules_do_not_reach_storage():
    # validation, layout arithmetic and retention decide from data alone: no tensorstore,
    # no crc32c, no storage module anywhere below them
    for module in ("_manifest", "_layout", "_retention", "_dtypes", "_location"):
        ours, third = _closure(module)
        assert not ({"tensorstore", "crc32c"} & third), (module, third)
        assert not ({"_storage", "_zarr", "_chunkfiles"} & ours), (module, ours)


def test_no_function_over_sixty_lines():
    long = []
    for name in sorted(os.listdir(PKG)):
        if name.endswith(".py"):
            with open(os.path.join(PKG, name)) as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    if node.end_lineno - node.lineno + 1 > 60:
                        long.append(f"{name}:{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert long == []


def test_writer_mirrors_reader_and_shares_the_bounded_runner():
    for module in ("_reader", "_writer"):
        ours, _ = _imports(module)
        assert "_tasks" in ours, module
