"""The ``jaxckpt`` command: a thin shell over the public Python API.

Each command parses its arguments, calls one or two public functions (the same ones a
notebook calls) and prints the result, as a table on a terminal or as JSON with
``--json``. Errors are one line on stderr: exit 2 for a usage error or a path that is
not a checkpoint, 1 for anything else that failed (``verify``: a corrupt checkpoint;
``diff``: the checkpoints differ). Long operations show a progress bar on a terminal
and nothing when piped.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import click

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class _Exit(Exception):
    def __init__(self, code: int, message: str = ""):
        super().__init__(message)
        self.code, self.message = code, message


def _emit_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, default=_json_default, allow_nan=True))


def _json_default(x: Any) -> Any:
    if hasattr(x, "to_json"):
        return x.to_json()
    if hasattr(x, "_asdict"):
        return x._asdict()
    return str(x)


def _human(n: float) -> str:
    from ._html import human_bytes

    return human_bytes(n)


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def _table(headers: list[str], rows: list[list[Any]]) -> None:
    """Plain aligned columns (readable piped into grep, and on a terminal)."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    click.echo("  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip())
    for row in cells:
        click.echo("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())


@contextlib.contextmanager
def _progress(label: str) -> Iterator[Callable[[int, int], None] | None]:
    """A ``progress(done, total)`` callback drawing a bar on a terminal; ``None`` when
    stderr is not a terminal (piped output stays clean)."""
    if not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(TextColumn(label), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(label, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update


# --- commands ---------------------------------------------------------------------


class _Commands(click.Group):
    """``--help`` lists each command with its first sentence whole, wrapped: click's own
    list cuts it to one line ("Rewrite the checkpoint SRC at DEST with its chunks laid...")."""

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, cmd.get_short_help_str(limit=1 << 20)) for name in self.list_commands(ctx)
                if (cmd := self.get_command(ctx, name)) is not None and not cmd.hidden]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="jaxckpt", prog_name="jaxckpt")
def main() -> None:
    """Explore, check and manage jaxckpt checkpoints without the model code."""


def _is_checkpoint(path: str) -> bool:
    from . import _commit
    from ._storage import location as _location

    return _commit.has_manifest(_location.resolve(path))


@main.command("ls")
@click.argument("directory")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--mtbf", type=float, default=None, metavar="SECONDS",
              help="Mean time between failures: also print the advised save interval.")
@click.option("--persistent", default=None, metavar="URL",
              help="The run's persistent tier: list its steps too, with the tier holding each.")
def ls_command(directory: str, as_json: bool, mtbf: float | None, persistent: str | None) -> None:
    """The committed steps of a manager DIRECTORY (or one checkpoint), and dead attempts."""
    import jaxckpt

    if _is_checkpoint(directory):
        info = jaxckpt.metadata(directory)
        row = {"path": info.path, "created": info.info.get("created"), "bytes": info.info.get("bytes"),
               "format_version": info.format_version}
        if as_json:
            _emit_json({"checkpoints": [row]})
        else:
            _table(["path", "created", "size"], [[row["path"], row["created"], _human(row["bytes"] or 0)]])
        return
    if not os.path.isdir(directory) and "://" not in directory:
        raise _Exit(EXIT_USAGE, f"'{directory}' is not a checkpoint or a manager directory")
    with jaxckpt.CheckpointManager(directory, read_only=True, persistent_directory=persistent) as mgr:
        tiers = mgr.step_tiers()
        steps = [{**_step_row(mgr, s), "tiers": list(tiers[s])} for s in mgr.all_steps()]
        attempts = mgr.attempts()
        advice = mgr.advise_interval(mtbf_s=mtbf) if mtbf is not None else None
    if as_json:
        _emit_json({"directory": directory, "steps": steps, "attempts": attempts,
                    "advice": None if advice is None else advice._asdict()})
        return
    _print_steps(directory, steps)
    if steps and mgr.info(steps[0]["step"]).get("format") == "orbax":
        click.echo(f"\nan orbax-checkpoint run: read here, never written; `jaxckpt import-orbax {directory} OUT` imports it")
    if attempts:
        click.echo("\nuncommitted attempts (not checkpoints; `jaxckpt gc` removes dead ones):")
        _table(["name", "step", "size", "state"],
               [[a["name"], a["step"], _human(a.get("bytes") or 0), "in use by a live writer" if a.get("writer_alive") else "dead"]
                for a in attempts])
    if advice is not None:
        _print_advice(advice)


def _step_row(mgr: Any, step: int) -> dict[str, Any]:
    info = mgr.info(step)
    when = info.get("commit_time", info.get("created_unix"))
    return {"step": step, "commit_time": when, "age_s": None if when is None else max(0.0, time.time() - when),
            "bytes": info.get("bytes"), "stored_bytes": info.get("stored_bytes"), "codecs": info.get("codecs", []),
            "metrics": info.get("metrics"), **({"dedup": info["dedup"]} if "dedup" in info else {}),
            "total_seconds": info.get("total_seconds"), "blocking_seconds": info.get("blocking_seconds")}


def _print_steps(directory: str, steps: list[dict[str, Any]]) -> None:
    if not steps:
        click.echo(f"no committed steps in '{directory}'")
        return
    rows, stored, dedup = [], any(s.get("codecs") for s in steps), any(s.get("dedup") for s in steps)
    for s in steps:
        when = "-" if s["commit_time"] is None else datetime.datetime.fromtimestamp(
            s["commit_time"]).strftime("%Y-%m-%d %H:%M:%S")
        metrics = " ".join(f"{k}={_short(v)}" for k, v in (s["metrics"] or {}).items())
        # as the manager's HTML view: what the training loop waited, and save to commit
        blocking, total = (_seconds(s["blocking_seconds"]), _seconds(s["total_seconds"]))
        tiers = [",".join(s["tiers"])] if "tiers" in s and any(t != ["local"] for t in
                                                                 (x["tiers"] for x in steps)) else []
        kept = [f"{_human(s['stored_bytes'])} {','.join(s['codecs'])}" if s.get("codecs") else "-"] * stored
        kept += [_written(s.get("dedup"))] * dedup
        size = "-" if s["bytes"] is None else _human(s["bytes"])  # unknown for an orbax step
        rows.append([s["step"], when, _age(s["age_s"]), size, *kept, blocking, total, *tiers, metrics])
    show_tiers = any(s.get("tiers", ["local"]) != ["local"] for s in steps)
    _table(["step", "committed", "age", "size", *(["stored"] if stored else []), *(["written"] if dedup else []),
            "blocking", "total",
            *(["tier"] if show_tiers else []), "metrics"], rows)


def _written(dedup: dict[str, Any] | None) -> str:
    """A deduplicated step's bytes written, and those it refers to in other steps."""
    if not dedup:
        return "-"
    return f"{_human(dedup['written_bytes'])} (+{_human(dedup['referred_bytes'])} in earlier steps)"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}s"


def _count(n: int, noun: str, plural: str | None = None) -> str:
    """``1 leaf``, ``5 leaves``: a count with its noun in the right number."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"


def _leaves(n: int) -> str:
    return _count(n, "leaf", "leaves")


def _short(v: Any) -> str:
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def _print_advice(advice: Any) -> None:
    a = advice._asdict() if hasattr(advice, "_asdict") else dict(advice)
    click.echo(f"\ncadence (Young-Daly, MTBF {a['mtbf_s']:.0f}s, save cost {a['save_cost_s']:.3g}s): "
               f"save every {a['interval_s']:.0f}s"
               + (f" (~{_count(a['interval_steps'], 'step')})" if a.get("interval_steps") else "")
               + f"; time lost now {100 * a['lost_fraction_now']:.2f}%, advised "
               f"{100 * a['lost_fraction_advised']:.2f}%")


@main.command("show")
@click.argument("path")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--depth", type=click.IntRange(min=0), default=None,
              help="Fold subtrees deeper than this into one line with their totals.")
def show_command(path: str, as_json: bool, depth: int | None) -> None:
    """The tree of the checkpoint at PATH: shape, dtype, sharding and bytes per leaf and subtree."""
    import jaxckpt

    info = jaxckpt.metadata(path)
    tree = _describe(info.tree, "", depth, 0)
    codecs, stored_bytes = _stored(info.tree)
    if as_json:
        doc = {"path": info.path, "format_version": info.format_version, "metadata": info.metadata,
               "bytes": tree["bytes"], "leaves": tree["leaves"], "tree": tree}
        if codecs:
            doc.update(codecs=codecs, stored_bytes=stored_bytes)
        if "dedup" in info.info:
            doc["dedup"] = info.info["dedup"]
        _emit_json(doc)
        return
    stored = f" ({_human(stored_bytes)} stored, {', '.join(codecs)})" if codecs else ""
    if (d := info.info.get("dedup")) and d["referred_steps"]:
        stored += f" ({_human(d['written_bytes'])} written, {_human(d['referred_bytes'])} in steps {d['referred_steps']})"
    click.echo(f"{info.path}: {_leaves(tree['leaves'])}, {_human(tree['bytes'])}{stored}, "
               f"format version {info.format_version}")
    if info.metadata:
        click.echo(f"metadata: {json.dumps(info.metadata, default=str)}")
    _print_node(tree, 0)


def _stored(tree: Any) -> tuple[list[str], int]:
    """A ``metadata()`` tree's codecs of compressed/quantized leaves, and its arrays' stored bytes."""
    from . import LeafInfo

    found: set[str] = set()
    total, stack = 0, [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, LeafInfo):
            total += node.nbytes if node.stored_bytes is None else node.stored_bytes
            if node.codec != "raw":
                found.add(node.codec)
        elif isinstance(node, (dict, list, tuple)):
            stack.extend(node.values() if isinstance(node, dict) else node)
    return sorted(found), total


def _describe(node: Any, path: str, depth: int | None, level: int) -> dict[str, Any]:
    """A JSON-able tree: leaves with their fields; subtrees with totals (folded below ``depth``)."""
    from . import LeafInfo

    if isinstance(node, LeafInfo):
        sh = node.sharding
        spec = None if sh is None else (str(sh.spec) if sh.type == "named" else sh.type)
        mesh = None if sh is None or sh.type != "named" else sh.mesh_shape
        out = {"path": path, "kind": "array", "shape": list(node.shape), "dtype": str(node.dtype),
               "spec": spec, "mesh": mesh, "bytes": node.nbytes, "leaves": 1}
        if node.codec != "raw":  # compressed or quantized (issue 23)
            out.update(codec=node.codec, stored_bytes=node.stored_bytes)
        return out
    if isinstance(node, (dict, list, tuple)):
        items = node.items() if isinstance(node, dict) else enumerate(node)
        kids = [_describe(v, f"{path}/{k}" if path else str(k), depth, level + 1) for k, v in items]
        out = {"path": path, "kind": "tree", "bytes": sum(k["bytes"] for k in kids),
               "leaves": sum(k["leaves"] for k in kids)}
        if depth is None or level < depth or out["leaves"] == 1:  # one leaf: its line, merged
            out["children"] = kids
        return out
    return {"path": path, "kind": "value", "value": node, "bytes": 0, "leaves": 1}


def _print_node(node: dict[str, Any], indent: int) -> None:
    from ._html import single_leaf_chain

    for entry in node.get("children", []):
        # nnx's ``kernel`` over its one ``value``: one line ``kernel/value``, as the HTML view
        parts, kid = single_leaf_chain(_key_of(entry), entry, _only_child)
        name = "/".join(parts)
        pad = "  " * indent
        if kid["kind"] == "array":
            where = kid["spec"] or "host"
            if kid["mesh"]:
                where += " on " + ",".join(f"{k}={v}" for k, v in kid["mesh"].items())
            stored = f" ({kid['codec']}: {_human(kid['stored_bytes'])} stored)" if "codec" in kid else ""
            click.echo(f"{pad}{name}  {kid['dtype']}{kid['shape']}  {where}  {_human(kid['bytes'])}{stored}")
        elif kid["kind"] == "value":
            click.echo(f"{pad}{name}  = {kid['value']!r}")
        else:
            folded = "" if "children" in kid else "  …"
            click.echo(f"{pad}{name}/  {_leaves(kid['leaves'])}, {_human(kid['bytes'])}{folded}")
            _print_node(kid, indent + 1)


def _key_of(node: dict[str, Any]) -> str:
    return node["path"].rsplit("/", 1)[-1]


def _only_child(node: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """``(key, child)`` of a described subtree holding one leaf and nothing else."""
    kids = node.get("children")
    if node["kind"] == "tree" and node["leaves"] == 1 and kids and len(kids) == 1:
        return _key_of(kids[0]), kids[0]
    return None


@main.command("verify")
@click.argument("paths", nargs=-1, required=True)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def verify_command(paths: tuple[str, ...], as_json: bool) -> None:
    """Read every chunk of each checkpoint and check it: exit 0 intact, 1 corrupt."""
    import jaxckpt

    reports, missing = [], []
    for path in paths:
        try:
            with _progress(f"verify {path}") as progress:
                reports.append(jaxckpt.verify(path, progress=progress))
        except jaxckpt.CheckpointNotFoundError as e:
            missing.append({"path": path, "error": str(e)})
    if as_json:
        _emit_json({"reports": reports, "not_checkpoints": missing})
    else:
        for r in reports:
            click.echo(r.summary())  # one entry per damaged file, naming the leaves it holds
        for m in missing:
            click.echo(f"jaxckpt: {m['error']}", err=True)
    if missing:
        raise _Exit(EXIT_USAGE)
    if any(not r.ok for r in reports):
        raise _Exit(EXIT_FAILED)


@main.command("diff")
@click.argument("a")
@click.argument("b")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def diff_command(a: str, b: str, as_json: bool) -> None:
    """Compare two checkpoints leaf by leaf: exit 0 identical, 1 different."""
    import jaxckpt

    with _progress("diff") as progress:
        report = jaxckpt.diff(a, b, progress=progress)
    if as_json:
        _emit_json(report.to_json())
    else:
        click.echo(report.summary())  # the differences, then "n of m leaves differ: ..."
    if not report.identical:
        raise _Exit(EXIT_FAILED)


@main.command("stats")
@click.argument("path")
@click.argument("keys", nargs=-1)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def stats_command(path: str, keys: tuple[str, ...], as_json: bool) -> None:
    """min, max, mean, std, NaN and Inf counts per leaf (all leaves, or KEYS), streamed."""
    import jaxckpt

    view = jaxckpt.open(path)
    found: dict[str, Any] = {}
    with _progress("stats") as progress:
        for key in keys or (None,):
            if key is not None and key not in view and not _is_prefix(view, key):
                raise _Exit(EXIT_USAGE, f"'{key}' is not a key path in checkpoint '{view.path}'")
            got = view.stats(key, progress=progress)
            found.update(got if isinstance(got, dict) else {key: got})
    rows = {k: (v.to_json() if hasattr(v, "to_json") else v) for k, v in found.items()}
    if as_json:
        _emit_json(rows)
        return
    fields = ("min", "max", "mean", "std", "nan", "inf")
    table = [[k, *(_short(st[f]) if st["numeric"] else "-" for f in fields), st["dtype" if st["numeric"] else "kind"]]
             for k, st in rows.items() if st["kind"] != "value"]
    values = [[k, r if len(r := repr(found[k].value)) <= 60 else r[:59] + "…", type(found[k].value).__name__]
              for k, st in rows.items() if st["kind"] == "value"]  # a step counter, a string: its value
    if table or not values:
        _table(["leaf", *fields, "dtype"], table)
    if values:
        click.echo("\n" * bool(table), nl=False)
        _table(["leaf", "value", "type"], values)


def _is_prefix(view: Any, key: str) -> bool:
    prefix = key.strip("/") + "/"
    return any(k.startswith(prefix) for k in view.keys())


@main.command("rm")
@click.argument("directory")
@click.argument("steps", nargs=-1, required=True, type=click.IntRange(min=0))
def rm_command(directory: str, steps: tuple[int, ...]) -> None:
    """Delete committed STEPS of a manager DIRECTORY (each vanishes from listings first)."""
    import jaxckpt

    with jaxckpt.CheckpointManager(directory) as mgr:
        missing = [s for s in steps if s not in mgr.all_steps()]
        if missing:
            raise _Exit(EXIT_FAILED, f"no committed step {', '.join(map(str, missing))} in '{directory}'")
        for s in steps:
            mgr.delete(s)
            click.echo(f"deleted step {s}")


@main.command("gc")
@click.argument("directory")
@click.option("--yes", is_flag=True, help="Remove them (otherwise only say what would be removed).")
def gc_command(directory: str, yes: bool) -> None:
    """Remove the attempts dead writers left in DIRECTORY (never a live writer's)."""
    import jaxckpt

    with jaxckpt.CheckpointManager(directory, read_only=True) as mgr:
        attempts = mgr.attempts()
    live = [a for a in attempts if a.get("writer_alive")]
    if live:
        raise _Exit(EXIT_FAILED, f"a live writer holds '{directory}'; its attempts may be in use "
                                 f"({', '.join(a['name'] for a in live)}); nothing removed")
    if not attempts:
        click.echo("nothing to remove")
        return
    for a in attempts:
        click.echo(f"{'removing' if yes else 'would remove'} {a['name']} ({_human(a.get('bytes') or 0)})")
    if yes:
        jaxckpt.CheckpointManager(directory).close()  # a writer cleans dead attempts when it starts
    else:
        click.echo("run again with --yes to remove them")


@main.command("import-orbax")
@click.argument("src")
@click.argument("dest")
@click.option("--overwrite", is_flag=True, help="Replace a checkpoint already at DEST.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def import_orbax_command(src: str, dest: str, overwrite: bool, as_json: bool) -> None:
    """Convert the orbax checkpoint (or run directory, with metrics) SRC into jaxckpt's at DEST."""
    from . import convert
    from ._formats import stream as _stream

    _stream.limit_malloc_retention()  # this process only converts: no decoded chunks piling up in malloc
    with _progress("import") as progress:
        result = convert.from_orbax(src, dest, overwrite=overwrite, progress=progress)
    run = {"steps": list(result.steps), "skipped": list(result.skipped)} if hasattr(result, "steps") else None
    _print_copy(src, result.path, result.leaves, result.total_size, as_json, run)


@main.command("export")
@click.argument("path")
@click.argument("out")
@click.option("--select", "select", multiple=True, metavar="PREFIX",
              help="Export only the leaves under this key path prefix (repeatable); names are below it.")
@click.option("--dtype", default=None, help="Cast floating-point arrays to this dtype (e.g. bfloat16).")
@click.option("--max-shard-bytes", "max_shard", default=None, metavar="N",
              help="Directory OUT: tensor bytes per file (default 5GB; suffixes KB MB GB KiB MiB GiB).")
@click.option("--rename", "renames", multiple=True, metavar="OLD=NEW",
              help="Rename tensors whose name starts with OLD to start with NEW (repeatable; the longest OLD "
                   "wins; =NEW prefixes every name, OLD= strips OLD).")
@click.option("--keep-value", is_flag=True,
              help="Keep nnx's value level in the names (kernel.value; by default kernel).")
@click.option("--overwrite", is_flag=True, help="Replace an export already at OUT.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def export_command(path: str, out: str, select: tuple[str, ...], dtype: str | None, max_shard: str | None,
                   renames: tuple[str, ...], keep_value: bool, overwrite: bool, as_json: bool) -> None:
    """Export the arrays of PATH as safetensors: OUT ending in .safetensors is one file,
    otherwise a directory of model-0000k-of-0000N.safetensors shards and their index.

    Names are the key paths below --select with '.' separators, without nnx's value
    level (kernel/value is kernel), then renamed by --rename."""
    from . import convert
    from ._formats import stream as _stream

    key_map = _parse_renames(renames)
    _stream.limit_malloc_retention()  # this process only converts: no decoded chunks piling up in malloc
    with _progress("export") as progress:
        result = convert.to_safetensors(path, out, select=list(select) or None, dtype=dtype,
                                        max_shard_bytes=_parse_bytes(max_shard), key_map=key_map,
                                        keep_value=keep_value, overwrite=overwrite, progress=progress)
    if as_json:
        _emit_json(result._asdict())
        return
    for f in result.files:
        click.echo(f"{f}  {_human(os.path.getsize(f))}")
    click.echo(f"{_count(result.tensors, 'tensor')}, {_human(result.total_size)}"
               + (f"; not tensors, skipped: {', '.join(result.skipped)}" if result.skipped else ""))


def _parse_renames(renames: tuple[str, ...]) -> dict[str, str] | None:
    """``--rename OLD=NEW`` options as ``to_safetensors``'s ``key_map``."""
    key_map: dict[str, str] = {}
    for text in renames:
        old, eq, new = text.partition("=")
        if not eq:
            raise _Exit(EXIT_USAGE, f"--rename {text!r}: expected OLD=NEW, e.g. layers=model.layers")
        if old in key_map:
            raise _Exit(EXIT_USAGE, f"--rename: '{old}' is renamed twice ('{key_map[old]}' and '{new}')")
        key_map[old] = new
    return key_map or None


_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}


def _parse_bytes(text: str | None) -> int | None:
    if text is None:
        return None
    number = text.strip().rstrip("BbIiKkMmGgTt")
    unit = text.strip()[len(number):].upper()
    try:
        n = float(number) * _SIZE_UNITS[unit]
    except (ValueError, KeyError):
        raise _Exit(EXIT_USAGE, f"--max-shard-bytes: {text!r} is not a byte count (e.g. 5GB, 500MiB, 1000000)") from None
    if n < 1:
        raise _Exit(EXIT_USAGE, f"--max-shard-bytes must be positive, got {text!r}")
    return int(n)


@main.command("convert")
@click.argument("src")
@click.argument("dest")
@click.option("--mesh", "mesh", default=None, metavar="AXIS=SIZE,...",
              help="The target mesh, e.g. a=2,b=4 (no devices needed).")
@click.option("--spec", "specs", multiple=True, metavar="[GLOB=]SPEC",
              help="A PartitionSpec on --mesh, e.g. 'a,None'; GLOB= limits it to matching key paths (repeatable).")
@click.option("--dtype", default=None, help="Cast floating-point arrays to this dtype (e.g. bfloat16).")
@click.option("--select", "select", multiple=True, metavar="PREFIX",
              help="Keep only the leaves under this key path prefix (repeatable).")
@click.option("--overwrite", is_flag=True, help="Replace a checkpoint already at DEST (DEST may be SRC).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def convert_command(src: str, dest: str, mesh: str | None, specs: tuple[str, ...], dtype: str | None,
                    select: tuple[str, ...], overwrite: bool, as_json: bool) -> None:
    """Rewrite the checkpoint SRC at DEST with its chunks laid out for another mesh,
    floats cast, or a subset of its leaves, one leaf at a time.

    SPEC has one entry per dimension, comma-separated: a mesh axis, None, or axes joined
    by + (a+b: split over both); '' replicates. An array with fewer dimensions than its
    SPEC is replicated. With GLOB=SPEC the spec applies to the key paths matching GLOB
    (fnmatch, e.g. 'params/*/kernel'); the first matching GLOB wins, then a plain SPEC;
    leaves matching none keep their recorded layout. Example:

    \b
    jaxckpt convert ckpt/1000 ckpt/1000-tp --mesh data=2,model=4 \\
        --spec '*/embed=model,None' --spec 'None,model'
    """
    from . import convert
    from ._formats import stream as _stream

    shardings = _layout_from_options(src, mesh, specs)
    _stream.limit_malloc_retention()  # this process only converts: no decoded chunks piling up in malloc
    with _progress("convert") as progress:
        convert.relayout(src, dest, shardings=shardings, dtype=dtype, select=list(select) or None,
                         overwrite=overwrite, progress=progress)
    _print_written(src, dest, as_json)


def _layout_from_options(src: str, mesh: str | None, specs: tuple[str, ...]) -> Any:
    """A PyTree of shardings on the abstract ``--mesh`` for the leaves of ``src`` (``None``:
    keep), from the ``--spec`` rules; ``None`` without options."""
    if not specs and mesh is None:
        return None
    if mesh is None:
        raise _Exit(EXIT_USAGE, "--spec needs --mesh (the mesh its axes name)")
    if not specs:
        raise _Exit(EXIT_USAGE, "--mesh needs at least one --spec")
    import fnmatch

    import jax

    import jaxckpt

    from . import _tree

    abstract = _parse_mesh(mesh)
    rules = [(glob or None, _parse_spec(spec, abstract)) for glob, _, spec in (s.rpartition("=") for s in specs)]
    info = jaxckpt.metadata(src)
    is_leaf = lambda x: x is None or isinstance(x, jaxckpt.LeafInfo)  # noqa: E731 - LeafInfo is a NamedTuple
    flat, treedef = jax.tree_util.tree_flatten_with_path(info.tree, is_leaf=is_leaf)
    out = []
    for keys, leaf in flat:
        path = _tree.keypath_to_str(keys)
        spec = None
        if isinstance(leaf, jaxckpt.LeafInfo):
            spec = next((sp for g, sp in rules if g is not None and fnmatch.fnmatchcase(path, g)),
                        next((sp for g, sp in rules if g is None), None))
        if spec is not None and len(spec) > len(leaf.shape):
            spec = jax.sharding.PartitionSpec()
        out.append(None if spec is None else jax.sharding.NamedSharding(abstract, spec))
    return _tree.unflatten(treedef, out)


def _parse_mesh(text: str) -> Any:
    import jax

    names, sizes = [], []
    for part in text.split(","):
        name, _, size = part.strip().partition("=")
        if not name or not size.isdigit() or int(size) < 1 or name in names:
            raise _Exit(EXIT_USAGE, f"--mesh {text!r}: expected distinct AXIS=SIZE pairs, e.g. a=2,b=4")
        names.append(name)
        sizes.append(int(size))
    return jax.sharding.AbstractMesh(tuple(sizes), tuple(names))


def _parse_spec(text: str, mesh: Any) -> Any:
    import jax

    entries: list[Any] = []
    for part in (p.strip() for p in text.split(",")) if text.strip() else ():
        axes = tuple(a.strip() for a in part.split("+"))
        if part in ("None", "none", "-"):
            entries.append(None)
            continue
        for a in axes:
            if a not in mesh.axis_names:
                raise _Exit(EXIT_USAGE, f"--spec {text!r}: axis '{a}' is not in the mesh "
                                        f"({', '.join(mesh.axis_names)})")
        entries.append(axes[0] if len(axes) == 1 else axes)
    return jax.sharding.PartitionSpec(*entries)


def _print_written(src: str, dest: str, as_json: bool) -> None:
    import jaxckpt

    info = jaxckpt.metadata(dest)
    tree = _describe(info.tree, "", 0, 0)
    _print_copy(src, info.path, tree["leaves"], tree["bytes"], as_json)


def _print_copy(src: str, dest: str, leaves: int, nbytes: int, as_json: bool, run: Any = None) -> None:
    if as_json:
        _emit_json({"src": src, "dest": dest, "leaves": leaves, "bytes": nbytes, **(run or {})})
        return
    steps = f"{_count(len(run['steps']), 'step')} {run['steps']}, " if run else ""
    skipped = f"; imported before: {_count(len(run['skipped']), 'step')} {run['skipped']}" if run and run["skipped"] else ""
    click.echo(f"{src} -> {dest}: {steps}{_leaves(leaves)}, {_human(nbytes)}{skipped}")


def run(argv: list[str] | None = None) -> int:
    """The console script: every error is one line on stderr, never a traceback."""
    import jaxckpt

    try:
        main.main(args=argv, prog_name="jaxckpt", standalone_mode=False)
        return EXIT_OK
    except _Exit as e:
        if e.message:
            click.echo(f"jaxckpt: {e.message}", err=True)
        return e.code
    except click.UsageError as e:
        if type(e).__name__.startswith("NoArgsIsHelp"):  # bare `jaxckpt`: the help is the answer
            click.echo(e.ctx.get_help() if e.ctx else e.format_message(), err=True)
        else:
            click.echo(f"jaxckpt: {_one_line_text(e.format_message())}", err=True)
        return EXIT_USAGE
    except click.exceptions.Exit as e:
        return e.exit_code
    except click.Abort:
        return 130
    except jaxckpt.CheckpointNotFoundError as e:
        click.echo(f"jaxckpt: {_one_line(e)}", err=True)
        return EXIT_USAGE
    except (jaxckpt.CheckpointError, OSError, ValueError, KeyError) as e:
        click.echo(f"jaxckpt: {_one_line(e)}", err=True)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - the CLI promises one line, not a traceback
        click.echo(f"jaxckpt: internal error: {type(e).__name__}: {_one_line(e)} "
                   "(set JAXCKPT_DEBUG=1 for the traceback)", err=True)
        if os.environ.get("JAXCKPT_DEBUG"):
            raise
        return EXIT_FAILED


def _one_line(e: BaseException) -> str:
    return _one_line_text(str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e))


def _one_line_text(text: str) -> str:
    return " ".join(text.split())


def console() -> None:
    """The ``jaxckpt`` command's process (the console script, ``python -m jaxckpt``)."""
    _http_timeouts()
    sys.exit(run())


def _http_timeouts() -> None:
    """The command owns its process: curl's timeouts for the I/O bound, where the user left them unset."""
    from ._storage import bounds as _bounds
    for name, value in _bounds.command_http_timeouts().items():
        os.environ.setdefault(name, value)


if __name__ == "__main__":
    console()
