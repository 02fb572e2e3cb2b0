"""HTML for notebooks: a checkpoint as a collapsible tree (``CheckpointView._repr_html_``),
and a manager's steps as a table (``CheckpointManager._repr_html_``).

Pure HTML (the tree: one ``<style>`` block scoped to ``.jaxckpt-view``; the manager's
table: inline styles): no JavaScript, no external resources. Colours come from
JupyterLab's CSS variables with neutral fallbacks, so both read in light and dark
themes alike. Everything that comes from the checkpoint (key names, values, metadata,
metrics, the path) is escaped.

The markup is compact (tables with implied end tags, a one-leaf subtree drawn as its
leaf's row, no per-row titles past ``TITLE_LEAVES``) and built as one list joined once:
a 10,000-leaf LLM-shaped checkpoint renders in about 0.1 s into 1.7 MB.
"""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import Callable, Iterable, Mapping
from html import escape
from typing import Any

from . import _tree
from ._manifest import LeafRecord

CLASS = "jaxckpt-view"
_VALUE_CHARS = 80  # of an inline value's repr shown in its row
_METADATA_CHARS = 20_000  # of the metadata JSON shown in the header
# Up to this many leaves, each row's name shows its full key path on hover; beyond, the
# titles are left out to keep the page small (they would be a third of it).
TITLE_LEAVES = 2_000

_STYLE = f"""<style>
.{CLASS}{{color:var(--jp-ui-font-color1,inherit);font-family:var(--jp-ui-font-family,inherit);
font-size:var(--jp-ui-font-size1,13px);line-height:1.45;max-width:100%}}
.{CLASS} .jh{{background:var(--jp-layout-color2,transparent);border:1px solid var(--jp-border-color2,#8888);
border-radius:4px;padding:6px 10px;margin-bottom:6px}}
.{CLASS} .jh code,.{CLASS} pre{{font-family:var(--jp-code-font-family,monospace)}}
.{CLASS} .jh .m{{color:var(--jp-ui-font-color2,inherit);opacity:.85}}
.{CLASS} pre{{margin:4px 0 0;max-height:20em;overflow:auto;white-space:pre-wrap;font-size:12px;
background:transparent;color:inherit}}
.{CLASS} details{{margin:0}}
.{CLASS} .jt details>:not(summary){{margin-left:6px;padding-left:9px;box-sizing:border-box;width:calc(100% - 6px);
border-left:1px solid var(--jp-border-color2,#8888)}}
.{CLASS} summary{{display:flex;list-style:none;cursor:pointer;padding:1px 0;white-space:nowrap;
font-family:var(--jp-code-font-family,monospace);font-size:12px}}
.{CLASS} summary::-webkit-details-marker{{display:none}}
.{CLASS} summary::before{{content:"\\25b8";width:15px;flex:none;opacity:.7}}
.{CLASS} details[open]>summary::before{{content:"\\25be"}}
.{CLASS} summary:hover,.{CLASS} tr:hover{{background:var(--jp-layout-color2,#8882)}}
.{CLASS} summary>b{{flex:1;font-weight:600;overflow:hidden;text-overflow:ellipsis}}
.{CLASS} .jh summary>b{{flex:none;padding-right:1em}}
.{CLASS} summary>i{{flex:none;font-style:normal;opacity:.7;padding-right:1em}}
.{CLASS} summary>i+i{{opacity:1;width:9ch;text-align:right;padding-right:4px}}
.{CLASS} table{{table-layout:fixed;width:100%;border-collapse:separate;border-spacing:0;margin:0;
font-family:var(--jp-code-font-family,monospace);font-size:12px;color:inherit;background:transparent}}
.{CLASS} td{{padding:1px 4px;white-space:nowrap;overflow:hidden;text-overflow:ellipsis;text-align:left;
border:0;background:transparent;color:inherit}}
.{CLASS} td:first-child{{padding-left:15px}}
.{CLASS} td:nth-child(2){{width:19ch}}.{CLASS} td:nth-child(3){{width:13ch}}
.{CLASS} td:nth-child(4){{width:10ch}}.{CLASS} td:nth-child(5){{width:20ch}}
.{CLASS} td:nth-child(6){{width:16ch}}.{CLASS} td:nth-child(7){{width:9ch;text-align:right}}
.{CLASS} td:nth-child(8){{width:16ch;text-align:right}}
.{CLASS} summary>i+i+i{{width:16ch}}.{CLASS} summary>i.z{{padding-right:8px}}
.{CLASS} tr.jc td{{opacity:.7;border-bottom:1px solid var(--jp-border-color2,#8888)}}
.{CLASS} tr.jz td{{padding-top:0;padding-bottom:0}}
.{CLASS} td.v{{opacity:.85;font-style:italic}}
</style>"""

_COLUMNS = "<table><tr class=jc><td>key<td>kind<td>shape<td>dtype<td>sharding<td>mesh<td>size"
# A first row of plain cells fixes the column widths of a table whose first row is a value
# (a ``colspan`` cell would otherwise spread one column's width over five).
_SIZER = "<tr class=jz><td><td><td><td><td><td><td>"
# A checkpoint with compressed leaves has an eighth column: what each leaf and subtree
# takes as stored, with the codec (in the size cell it was cut off at 9 characters).
_STORED = "<td>stored"


def human_bytes(n: float) -> str:
    """``n`` bytes for people: ``512 B``, ``1.5 KiB``, ``2.0 MiB`` … ``3.0 TiB`` (1024-based)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


class _Node:
    """A subtree: children by key (a ``_Node`` or a ``LeafRecord``), leaf count, bytes."""

    __slots__ = ("children", "count", "nbytes", "stored")

    def __init__(self) -> None:
        self.children: dict[str, _Node | LeafRecord] = {}
        self.count = 0
        self.nbytes = 0
        self.stored = 0  # the bytes its arrays take as stored


def build_tree(records: Iterable[LeafRecord], prefix: str = "") -> _Node:
    """The key-path tree of ``records`` (paths relative to ``prefix``), in manifest order,
    with every subtree's leaf count, bytes and stored bytes summed."""
    root = _Node()
    for rec in records:
        parts = rec.path[len(prefix):].split("/")
        node, trail = root, [root]
        for part in parts[:-1]:
            child = node.children.get(part)
            if not isinstance(child, _Node):  # a leaf and a subtree never share a key path
                child = node.children[part] = _Node()
            node = child
            trail.append(node)
        node.children[parts[-1]] = rec
        stored = 0 if rec.kind == "value" else rec.stored_nbytes
        for n in trail:
            n.count += 1
            n.nbytes += rec.nbytes
            n.stored += stored
    return root


def single_leaf_chain(part: str, child: Any, only_child: Callable[[Any], tuple[str, Any] | None]
                      ) -> tuple[list[str], Any]:
    """The keys from ``part`` down through the subtrees that hold a single leaf, and the
    node reached (the leaf, or the first subtree of several leaves).

    Such a subtree (nnx's ``kernel`` over its one ``value``) is drawn as its leaf's row,
    named by the keys down to it (``kernel/value``): the row already says what the
    subtree's summary would. ``only_child`` gives a node's ``(key, child)`` when it is a
    subtree holding exactly one leaf, ``None`` otherwise. The HTML view and ``jaxckpt
    show`` both merge with it.
    """
    parts = [part]
    while (only := only_child(child)) is not None:
        part, child = only
        parts.append(part)
    return parts, child


def _only_child(node: _Node | LeafRecord) -> tuple[str, _Node | LeafRecord] | None:
    if isinstance(node, _Node) and node.count == 1:
        return next(iter(node.children.items()))
    return None


def _name(part: str) -> str:
    return escape(_tree.decode_key(part)) if part else "&#x27;&#x27;"


def spec_text(spec: list[Any]) -> str:
    """A saved PartitionSpec as ``P(None, 'model')`` (tuples of axes as ``('data', 'model')``)."""
    def entry(e: Any) -> str:
        if isinstance(e, list):
            return "(" + ", ".join(repr(a) for a in e) + ("," if len(e) == 1 else "") + ")"
        return repr(e)
    return "P(" + ", ".join(entry(e) for e in spec) + ")"


def sharding_cells(sharding: dict[str, Any] | None) -> str:
    """The sharding and mesh cells of a leaf row, escaped: ``P(…)`` and ``data=2, model=4``,
    ``host`` (a numpy leaf), ``single device`` or ``other (N devices)``."""
    if sharding is None:
        return "<td>host<td>"
    kind = sharding.get("type")
    if kind == "named":
        mesh = ", ".join(f"{a}={s}" for a, s in zip(sharding["axis_names"], sharding["axis_sizes"]))
        return f"<td>{escape(spec_text(sharding['spec']))}<td>{escape(mesh)}"
    if kind == "single_device":
        return "<td>single device<td>"
    n = sharding.get("num_devices")
    title = escape(str(sharding.get("repr", "")), quote=True)
    return f'<td title="{title}">other{f" ({n} devices)" if n else ""}<td>'


def _leaf_row(out: list[str], name: str, rec: LeafRecord, titles: bool, stored: bool) -> None:
    path = f' title="{escape(rec.path, quote=True)}"' if titles else ""
    if rec.kind == "value":
        text = repr(rec.value)
        if len(text) > _VALUE_CHARS:
            text = text[:_VALUE_CHARS - 1] + "…"
        out.append(f'<tr><td{path}>{name}<td>value<td colspan=5 class=v>{escape(text)}'
                   f" <span>({escape(type(rec.value).__name__)})</span>")
        return
    if rec.kind == "prng_key":
        kind = escape(f"key<{rec.impl}>")
        shape, dtype = rec.shape[:rec.key_ndim], f"{rec.dtype}{list(rec.shape[rec.key_ndim:])}"
    else:
        kind, shape, dtype = rec.kind, rec.shape, rec.dtype
    out.append(f'<tr><td{path}>{name}<td>{kind}<td>{shape}<td>{escape(dtype)}'
               f"{sharding_cells(rec.sharding)}<td>{human_bytes(rec.nbytes)}")
    if stored:
        codec = "" if rec.codec in ("", "raw") else f" {escape(rec.codec)}"  # 16 characters at most
        out.append(f'<td title="{rec.stored_nbytes:,} bytes stored">{human_bytes(rec.stored_nbytes)}{codec}')


def _summary(out: list[str], name: str, node: _Node, open_: bool, stored: bool) -> None:
    leaves = f"{node.count} lea{'f' if node.count == 1 else 'ves'}"
    size = f"<i{' class=z' if stored else ''} title=\"{node.nbytes:,} bytes\">{human_bytes(node.nbytes)}</i>"
    if stored:
        size += f'<i title="{node.stored:,} bytes stored">{human_bytes(node.stored)}</i>'
    out.append(f"<details{' open' if open_ else ''}><summary><b>{name}</b><i>{leaves}</i>{size}</summary>")


def _render_children(out: list[str], node: _Node, trail: str, expand: frozenset[str], titles: bool,
                     stored: bool) -> None:
    """Rows of ``node``'s children: runs of leaves as one table, each subtree a ``<details>``.

    A subtree holding a single leaf is that leaf's row, named by the keys down to it
    (``q/kernel``): the row already says what its summary would.
    """
    in_table = False
    for key, kid in node.children.items():
        parts, child = single_leaf_chain(key, kid, _only_child)
        part, name = parts[-1], "/".join(_name(p) for p in parts)
        if isinstance(child, _Node):
            if in_table:
                out.append("</table>")
                in_table = False
            path = trail + part
            _summary(out, name, child, path in expand, stored)
            _render_children(out, child, path + "/", expand, titles, stored)
            out.append("</details>")
        else:
            if not in_table:
                sizer = _SIZER + "<td>" * stored if child.kind == "value" else ""
                out.append("<table>" + sizer)
                in_table = True
            _leaf_row(out, name, child, titles, stored)
    if in_table:
        out.append("</table>")


def _created(info: dict[str, Any]) -> str:
    created = info.get("created")
    if not isinstance(created, str):
        return ""
    try:
        when = datetime.datetime.fromisoformat(created)
    except ValueError:
        return escape(created)
    text = when.strftime("%Y-%m-%d %H:%M:%S")
    return text + (" UTC" if when.utcoffset() == datetime.timedelta(0) else when.strftime(" %z"))


def _metadata(metadata: dict[str, Any]) -> str:
    if not metadata:
        return "<div class=m>no user metadata</div>"
    text = json.dumps(metadata, indent=2, default=repr, ensure_ascii=False)
    if len(text) > _METADATA_CHARS:
        text = text[:_METADATA_CHARS] + "\n…"
    n = len(metadata)
    return (f"<details><summary><b>metadata</b><i>{n} key{'s' * (n != 1)}</i>"
            f"</summary><pre>{escape(text)}</pre></details>")


def stored_size(records: Iterable[LeafRecord]) -> tuple[int, list[str]]:
    """The bytes the arrays of ``records`` take as stored, and the codecs of the compressed
    or quantized ones, sorted (``[]``: none is)."""
    arrays = [r for r in records if r.kind != "value"]
    return sum(r.stored_nbytes for r in arrays), sorted({r.codec for r in arrays if r.codec not in ("", "raw")})


def _stored(records: list[LeafRecord]) -> str:
    """`` (3.1 MiB stored, zstd)`` when some of ``records`` are compressed, else ``""``."""
    stored, codecs = stored_size(records)
    if not codecs:
        return ""
    return f' <span title="{stored:,} bytes stored">({human_bytes(stored)} stored, {escape(", ".join(codecs))})</span>'


def _header(view: Any, root: _Node) -> str:
    man = view._man
    info = man.info
    where = str(view._loc) + (f" : {view._prefix.rstrip('/')}" if view._prefix else "")
    facts = [f"{root.count:,} lea{'f' if root.count == 1 else 'ves'}",
             f'<span title="{root.nbytes:,} bytes">{human_bytes(root.nbytes)}</span>'
             + _stored([r for r in view._man.leaves if r.path in view._by_path]),
             f"format v{man.format_version}" if getattr(view, "format", "jaxckpt") == "jaxckpt"
             else f"read from {escape(view.format)}"]
    if created := _created(info):
        facts.append(f"saved {created}")
    versions = [f"{name} {escape(str(info[key]))}" for name, key in
                (("jaxckpt", "library_version"), ("jax", "jax_version")) if key in info]
    if versions:
        facts.append("by " + ", ".join(versions))
    kind = "jaxckpt checkpoint" if getattr(view, "format", "jaxckpt") == "jaxckpt" else f"{escape(view.format)} checkpoint"
    return (f"<div class=jh><b>{kind}</b> <code>{escape(where)}</code>"
            f"<div class=m>{' · '.join(facts)}</div>{_metadata(man.metadata)}</div>")


def render_view(view: Any, expand: Iterable[str] = ()) -> str:
    """The HTML of a ``CheckpointView``: a header (path, leaf count, size, format version,
    creation time, user metadata collapsed) and the key-path tree, each subtree a
    ``<details>`` summarising its leaf count and bytes, each leaf a row (key, kind,
    shape, dtype, PartitionSpec, mesh axes, size; with compressed leaves also the
    stored size, of subtrees too).

    Args:
      view: the ``CheckpointView`` (its manifest records are read, nothing else).
      expand: key paths (relative to the view) of subtrees to show open; by default
        only the top level is visible and every subtree is collapsed.
    """
    records = [r for r in view._man.leaves if r.path in view._by_path]
    root = build_tree(records, view._prefix)
    stored = bool(stored_size(records)[1])
    out = [f'<div class="{CLASS}">', _STYLE, _header(view, root), "<div class=jt>",
           _COLUMNS + _STORED * stored + "</table>"]
    expand = frozenset(p.strip("/") for p in expand)
    _render_children(out, root, "", expand, root.count <= TITLE_LEAVES, stored)
    out.append("</div></div>")
    return "".join(out)


# --- the manager's view (``CheckpointManager._repr_html_``) ------------------------------

_MANAGER_ROWS = 200  # newest steps shown
_MANAGER_METRICS = 12  # metric columns shown
_TD = "padding:1px 8px"
_TR = "border-bottom:1px solid var(--jp-border-color2, #ccc)"
_TH = "padding:1px 8px;border-bottom:1px solid var(--jp-border-color1, #999)"


def render_manager(directory: str, mode: str, infos: Mapping[int, Mapping[str, Any]], now: float,
                   advice: Any, best: tuple[int, str, str] | None = None, policy: str | None = None) -> str:
    """The manager as HTML that reads in light and dark JupyterLab themes (no fixed colours):
    its committed steps (``infos``: step -> manifest info, with ``stored_bytes`` and
    ``codecs`` for compressed steps), totals, the best step (``best``: ``(step, metric,
    mode)``) marked, the save policy with its next save (``policy``), and the last
    ``CadenceAdvice`` (``None``: how to get one)."""
    esc = escape
    steps = sorted(infos, reverse=True)
    shown = steps[:_MANAGER_ROWS]
    names = list(dict.fromkeys(k for s in shown for k in _info_metrics(infos[s])))
    stored = any("stored_bytes" in infos[s] for s in shown)
    columns = ["step", "committed", "age", "size", *(["stored"] if stored else []), "blocking s", "total s",
               *names[:_MANAGER_METRICS]]
    head = "".join(f"<th style='{_TH}'>{esc(c)}</th>" for c in columns)
    if len(names) > _MANAGER_METRICS:
        head += f"<th style='{_TH}'>… {len(names) - _MANAGER_METRICS} more metrics</th>"
    best_step = None if best is None else best[0]
    rows = "".join(_html_row(s, infos[s], names[:_MANAGER_METRICS], now, stored, s == best_step) for s in shown)
    if len(steps) > len(shown):
        rows += (f"<tr><td colspan='{len(columns)}' style='{_TD};text-align:left'>… {len(steps) - len(shown)} "
                 "more (older steps not shown)</td></tr>")
    total_bytes = sum(_num(i.get("bytes")) or 0 for i in infos.values())
    blocking = sum(_num(i.get("blocking_seconds")) or 0.0 for i in infos.values())
    total_s = sum(_num(i.get("total_seconds")) or 0.0 for i in infos.values())
    summary = (f"{len(steps)} committed step{'s' if len(steps) != 1 else ''}, {human_bytes(total_bytes)}"
               + _stored_total(infos.values()) + "; "
               + ("" if best is None else f"best {best[1]} ({best[2]}): step {best[0]}; ")
               + f"saves blocked {blocking:.3g} s in all, {total_s:.3g} s from save to commit in all")
    table = (f"<table style='border-collapse:collapse;color:inherit;text-align:right'><thead><tr>{head}</tr></thead>"
             f"<tbody>{rows}</tbody></table>") if steps else "<div>no committed step yet</div>"
    return (
        "<div style='font-family:var(--jp-ui-font-family, inherit);color:var(--jp-ui-font-color1, inherit)'>"
        f"<div><b>CheckpointManager</b> <code>{esc(directory)}</code> ({esc(mode)})</div>"
        f"<div>{esc(summary)}</div>{table}"
        + (f"<div style='margin-top:4px'>{esc(policy)}</div>" if policy else "")
        + f"<div style='margin-top:4px'>{_html_advice(advice)}</div></div>"
    )


def _stored_total(infos: Iterable[Mapping[str, Any]]) -> str:
    """`` (1.2 MiB stored, zstd)`` over the steps, when some are compressed: a step
    without ``stored_bytes`` counts its ``bytes``."""
    infos = list(infos)
    codecs = sorted({c for i in infos for c in i.get("codecs", ())})
    if not codecs:
        return ""
    stored = sum(_num(i.get("stored_bytes", i.get("bytes"))) or 0 for i in infos)
    return f" ({human_bytes(stored)} stored, {', '.join(codecs)})"


def _html_row(step: int, info: Mapping[str, Any], names: list[str], now: float, stored: bool, best: bool) -> str:
    esc = escape
    when = _num(info.get("commit_time"))
    when = _num(info.get("created_unix")) if when is None else when
    committed = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(when)) if when is not None else "?"
    age = _human_age(now - when) if when is not None else "?"
    size = _num(info.get("bytes"))
    metrics = _info_metrics(info)
    kept = _num(info.get("stored_bytes"))
    cells = [f"★ {step}" if best else str(step), committed, age, human_bytes(size) if size is not None else "?",
             *([f"{human_bytes(kept)} {', '.join(info['codecs'])}" if kept is not None else ""] if stored else []),
             _fmt(info.get("blocking_seconds")), _fmt(info.get("total_seconds")),
             *(_fmt(metrics.get(n)) for n in names)]
    style = _TR + (";font-weight:bold" if best else "")
    return f"<tr style='{style}'>" + "".join(f"<td style='{_TD}'>{esc(c)}</td>" for c in cells) + "</tr>"


def _html_advice(advice: Any) -> str:
    esc = escape
    if advice is None:
        return ("Cadence advice: call <code>mgr.advise_interval(mtbf_s=...)</code> with the job's mean "
                "time between failures.")
    text = (f"Cadence (MTBF {_human_age(advice.mtbf_s)}, save cost {advice.save_cost_s:.3g} s, "
            f"{advice.samples} recent saves): save every {advice.interval_steps} steps "
            f"(~{_human_age(advice.interval_s)}); now every {advice.current_interval_steps} steps "
            f"(~{_human_age(advice.current_interval_s)}). Expected time lost: "
            f"{advice.lost_fraction_now:.2%} now, {advice.lost_fraction_advised:.2%} advised.")
    return esc(text)


def _info_metrics(info: Mapping[str, Any]) -> dict[str, Any]:
    metrics = info.get("metrics")
    return metrics if isinstance(metrics, dict) else {}


def _num(v: Any) -> float | None:
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def _human_age(seconds: float) -> str:
    for limit, unit, div in ((120, "s", 1), (7200, "min", 60), (172800, "h", 3600)):
        if abs(seconds) < limit:
            return f"{seconds / div:.0f} {unit}" if unit == "s" else f"{seconds / div:.1f} {unit}"
    return f"{seconds / 86400:.1f} d"
