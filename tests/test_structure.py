"""The code's shape: pure modules stay pure, functions stay short (issue 8, item 12), and
the house (issue 21): wings a newcomer can see, no module over ~700 lines, a manager
class that fits on a page, and no private name used outside its wing."""

import ast
import os

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "jaxckpt")
WINGS = ("_storage", "_manager", "_formats")


def _modules():
    """Every module of the package by its dotted name under ``jaxckpt`` (a wing's
    ``__init__`` is the wing's name), with its file."""
    out = {}
    for root, _, files in os.walk(PKG):
        for name in files:
            if not name.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(root, name), PKG)[:-3].split(os.sep)
            if rel[-1] == "__init__":
                rel = rel[:-1]
            out[".".join(rel) or "__init__"] = os.path.join(root, name)
    return out


MODULES = _modules()


def _package_of(module):
    """The package a module's relative imports start from."""
    path = MODULES[module]
    if os.path.basename(path) == "__init__.py":
        return module if module != "__init__" else ""
    return module.rpartition(".")[0]


def _resolve(module, node):
    """The package modules one ``from ... import`` names (its source, and each name that
    is itself a module)."""
    if node.level == 0:
        if not (node.module or "").startswith("jaxckpt"):
            return []
        base = node.module[len("jaxckpt"):].lstrip(".")
    else:
        parts = _package_of(module).split(".") if _package_of(module) else []
        parts = parts[: len(parts) - (node.level - 1)]
        base = ".".join(parts + ([node.module] if node.module else []))
    found = [base] if base in MODULES else []
    for alias in node.names:
        sub = f"{base}.{alias.name}" if base else alias.name
        if sub in MODULES:
            found.append(sub)
    return found


def _imports(module):
    """Package modules and top-level third-party modules that ``module`` imports."""
    with open(MODULES[module]) as f:
        tree = ast.parse(f.read())
    ours, theirs = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0 and not (node.module or "").startswith("jaxckpt"):
                theirs.add(node.module.split(".")[0])
            else:
                ours.update(_resolve(module, node))
        elif isinstance(node, ast.Import):
            theirs.update(a.name.split(".")[0] for a in node.names)
    for m in list(ours):  # importing a wing's module runs the wing's __init__ first
        if "." in m:
            ours.add(m.split(".")[0])
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
    # no crc32c, no storage I/O module anywhere below them
    io = {"_storage.kvstore", "_storage.zarr", "_storage.chunkfiles", "_storage.s3"}
    for module in ("_manifest", "_layout", "_manager.retention", "_dtypes", "_storage.location", "_streams",
                   "_storage.objectnames", "_hoststreams"):
        ours, third = _closure(module)
        assert not ({"tensorstore", "crc32c"} & third), (module, third)
        assert not (io & ours), (module, ours)


def test_the_wings_exist_and_the_flat_list_is_the_core():
    flat = sorted(m for m in MODULES if "." not in m and m not in WINGS)
    assert flat == sorted([
        "__init__", "__main__", "_version", "_errors", "convert", "inspect", "cli",
        "_checkpoint", "_restore", "_snapshot", "_writer", "_reader", "_exchange", "_commit",
        "_claims", "_manifest", "_tree", "_layout", "_dtypes", "_distributed", "_tasks",
        "_verify", "_diff", "_html", "_plot", "_untrusted", "_owner", "_streams", "_hoststreams", "_waves", "_chunking",
        "_quantize", "_codecs", "_placement", "policies"])


def _function_lengths(path):
    with open(path) as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node.end_lineno - node.lineno + 1


def test_no_function_over_sixty_lines():
    long = [f"{m}:{name} ({n} lines)" for m, path in sorted(MODULES.items())
            for name, n in _function_lengths(path) if n > 60]
    assert long == []


def test_no_module_over_seven_hundred_lines():
    big = {}
    for m, path in MODULES.items():
        with open(path) as f:
            n = sum(1 for _ in f)
        if n > 720:
            big[m] = n
    assert big == {}


def test_the_manager_class_fits_on_a_page():
    with open(MODULES["_manager.manager"]) as f:
        tree = ast.parse(f.read())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CheckpointManager"]
    assert cls.end_lineno - cls.lineno + 1 <= 450


def _wing(module):
    head = module.split(".")[0]
    return head if head in WINGS else "core"


def _aliases(module, tree):
    """Local name -> package module, for every ``from ... import`` of a package module."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("jaxckpt")):
            found = _resolve(module, node)
            base = found[0] if found and found[0] not in [f"{found[0]}.{a.name}" for a in node.names] else None
            for alias in node.names:
                sub = None
                for f in found:
                    if f.endswith("." + alias.name) or f == alias.name:
                        sub = f
                if sub is not None:
                    names[alias.asname or alias.name] = sub
                elif alias.name.startswith("_") and base is not None and _wing(base) != _wing(module):
                    names.setdefault("<from-import>", []).append(f"{base}.{alias.name}")
    return names


def test_no_private_name_used_outside_its_wing():
    """``module._name`` (or ``from module import _name``) only within the module's own
    wing; across wings only public names."""
    crossing = []
    for module, path in sorted(MODULES.items()):
        with open(path) as f:
            tree = ast.parse(f.read())
        names = _aliases(module, tree)
        crossing += [f"{module}: {n}" for n in names.pop("<from-import>", [])]
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in names and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                target = names[node.value.id]
                if f"{target}.{node.attr}" in MODULES:
                    continue
                if _wing(target) != _wing(module):
                    crossing.append(f"{module}: {target}.{node.attr}")
    assert sorted(set(crossing)) == []


def test_writer_mirrors_reader_and_shares_the_bounded_runner():
    for module in ("_reader", "_writer"):
        ours, _ = _imports(module)
        assert "_tasks" in ours, module


def test_manager_options_hold_the_line():
    # The options are a contract (DESIGN.md §2). Adding one is a decision, not a drift: a
    # new option replaces or joins one (issue 21); wave 3 brings compression, quantize and
    # peer_copies, each named in DESIGN.md already; issue 33 save_policy (DESIGN.md §2);
    # issue 35 dedup (its text names CheckpointManager(..., dedup=True)).
    import inspect

    import jaxckpt

    params = inspect.signature(jaxckpt.CheckpointManager.__init__).parameters
    assert [p for p in params if p not in ("self", "directory")] == [
        "max_to_keep", "keep_period", "keep_time_interval", "best_metric", "best_mode", "keep_best",
        "save_interval_steps", "async_save", "max_pending", "timeout_s", "clock", "read_only",
        "persistent_directory", "persistent_interval_steps", "persistent_max_to_keep",
        "verify_before_delete", "max_staging_bytes", "peer_copies", "compression", "quantize", "save_policy",
        "dedup"]
