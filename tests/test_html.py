"""The notebook view of a checkpoint: a collapsible, escaped, compact HTML tree (issue 9, item 2)."""

import time
from html.parser import HTMLParser

import jax
import numpy as np
import pytest
from conftest import sharded

import jaxckpt
from jaxckpt import _html
from jaxckpt._manifest import LeafRecord, Manifest
from jaxckpt.inspect import CheckpointView


class _Tree(HTMLParser):
    """Reads back the rendered tree: each ``<details>`` (its summary's name, leaf count,
    exact bytes, open or not, the names of the details around it) and each leaf row
    (its cells' text, the names of the details around it; by its full key path, the
    name cell's title, in ``rows``)."""

    def __init__(self, page):
        super().__init__(convert_charrefs=True)
        self.stack, self.details, self.rows, self.all_rows = [], [], {}, []
        self.field = self.row = None
        self.in_tree = False  # the header's metadata <details> is not part of the tree
        self.feed(page)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "div" and attrs.get("class") == "jt":
            self.in_tree = True
        if not self.in_tree:
            return
        if tag == "details":
            d = {"open": "open" in attrs, "outer": [x["name"] for x in self.stack], "name": ""}
            self.stack.append(d)
            self.details.append(d)
        elif tag in ("b", "i") and self.stack and self.row is None:  # in a summary
            title = attrs.get("title", "")
            self.field = ("name" if tag == "b" else "count" if not title else
                          "stored" if title.endswith(" stored") else "size")
            if self.field in ("size", "stored"):
                key = "bytes" if self.field == "size" else "stored_bytes"
                self.stack[-1][key] = int(title.split()[0].replace(",", ""))
        elif tag == "tr":
            self.row = None
            if attrs.get("class") not in ("jc", "jz"):  # not the column titles, not a sizer
                self.row = {"outer": [x["name"] for x in self.stack], "cells": []}
                self.all_rows.append(self.row)
        elif tag == "td" and self.row is not None:
            if not self.row["cells"] and "title" in attrs:
                self.rows[attrs["title"]] = self.row
            self.row["cells"].append("")

    def handle_endtag(self, tag):
        if not self.in_tree:
            return
        if tag == "details":
            self.stack.pop()
        elif tag in ("b", "i"):
            self.field = None
        elif tag == "table":
            self.row = None

    def handle_data(self, data):
        if self.row is not None:
            self.row["cells"][-1] += data
        elif self.field and self.stack:
            self.stack[-1][self.field] = self.stack[-1].get(self.field, "") + data


@pytest.fixture
def saved(ckpt):
    tree = {
        "params": {"layers": [
            {"kernel": sharded(np.ones((8, 16), np.float32), (2, 4), ("data", "model"), ("data", "model")),
             "bias": np.zeros(16, np.float32)},
            {"kernel": sharded(np.ones((8, 16), np.float32), (2, 4), ("data", "model"), (None, "model")),
             "bias": np.zeros(16, np.float32)},
        ], "embed": jax.device_put(np.ones((4, 3), np.float16), jax.devices()[0])},
        "step": 7,
        "rng": jax.random.key(0),
    }
    jaxckpt.save(ckpt, tree, metadata={"lr": 0.5})
    return ckpt


def test_human_bytes():
    assert [_html.human_bytes(n) for n in (0, 1023, 1024, 1536, 2 << 20, 3 << 30, 5 << 50)] == [
        "0 B", "1023 B", "1.0 KiB", "1.5 KiB", "2.0 MiB", "3.0 GiB", "5120.0 TiB"]


def test_nesting_rows_and_totals(saved):
    view = jaxckpt.open(saved)
    page = view._repr_html_()
    tree = _Tree(page)
    rows = tree.rows
    assert rows["params/layers/0/kernel"] == {
        "outer": ["params", "layers", "0"],
        "cells": ["kernel", "array", "(8, 16)", "float32", "P('data', 'model')", "data=2, model=4", "512 B"]}
    assert rows["params/layers/1/kernel"]["cells"][4:] == ["P(None, 'model')", "data=2, model=4", "512 B"]
    assert rows["params/layers/1/bias"] == {
        "outer": ["params", "layers", "1"], "cells": ["bias", "array", "(16,)", "float32", "host", "", "64 B"]}
    assert rows["params/embed"]["cells"] == ["embed", "array", "(4, 3)", "float16", "single device", "", "24 B"]
    assert rows["rng"] == {"outer": [], "cells": ["rng", "key<threefry2x32>", "()", "uint32[2]",
                                                  "single device", "", "8 B"]}
    assert rows["step"] == {"outer": [], "cells": ["step", "value", "7 (int)"]}
    assert sorted(rows) == view.keys()
    # every subtree's summary: its leaves and the sum of their bytes
    assert [(d["outer"], d["name"], d["count"], d["bytes"]) for d in tree.details] == [
        ([], "params", "5 leaves", 512 + 64 + 512 + 64 + 24),
        (["params"], "layers", "4 leaves", 512 + 64 + 512 + 64),
        (["params", "layers"], "0", "2 leaves", 576),
        (["params", "layers"], "1", "2 leaves", 576),
    ]
    for d in tree.details:
        under = [r for r in view._by_path.values() if r.path.startswith("/".join(d["outer"] + [d["name"]]) + "/")]
        assert d["bytes"] == sum(r.nbytes for r in under) and d["count"] == f"{len(under)} leaves"
    assert "<table>" in page and 'class="jaxckpt-view"' in page


def test_compressed_leaves_show_their_stored_size_in_a_column_of_its_own(tmp_path):
    # issue 31: the stored size was a note inside the 9-character size cell ("256.0 KiB
    # (zstd: 660 B)"), cut off on the page; now it is a column of its own, 16 characters
    # wide, and subtrees sum it too
    w = np.tile(np.arange(256, dtype=np.float32), (256, 1))
    tree = {"params": {"w": w, "b": np.arange(64, dtype=np.float32)}, "opt": np.ones(8, np.float32), "step": 3}
    jaxckpt.save(tmp_path / "c", tree, compression={"params/*": "zstd"})
    view = jaxckpt.open(tmp_path / "c")
    stored = {k: view[k].stored_nbytes for k in ("params/w", "params/b", "opt")}
    assert stored["params/w"] < 1024 and stored["opt"] > 32  # compressed; raw, with its checksum
    page = _html.render_view(view, expand=("params",))
    got = _Tree(page)
    h = _html.human_bytes
    assert got.rows["params/w"]["cells"] == [
        "w", "array", "(256, 256)", "float32", "host", "", "256.0 KiB", f"{h(stored['params/w'])} zstd"]
    assert got.rows["params/b"]["cells"][6:] == ["256 B", f"{h(stored['params/b'])} zstd"]
    assert got.rows["opt"]["cells"][6:] == ["32 B", h(stored["opt"])]  # raw: no codec
    assert got.rows["step"]["cells"] == ["step", "value", "3 (int)"]
    (params,) = got.details
    assert (params["name"], params["bytes"], params["stored_bytes"]) == (
        "params", w.nbytes + 256, stored["params/w"] + stored["params/b"])
    assert "<td>mesh<td>size<td>stored</table>" in page and "td:nth-child(8){width:16ch;" in page
    assert all(len(r["cells"][7]) <= 16 for r in got.all_rows if len(r["cells"]) == 8)
    # without compressed leaves: the seven columns, no stored sizes
    jaxckpt.save(tmp_path / "raw", tree)
    page = _html.render_view(jaxckpt.open(tmp_path / "raw"), expand=("params",))
    assert "<td>mesh<td>size</table>" in page and " stored" not in page
    assert _Tree(page).rows["params/w"]["cells"][6:] == ["256.0 KiB"]


def test_collapsed_below_the_top_level_unless_expanded(saved):
    view = jaxckpt.open(saved)
    assert [d["open"] for d in _Tree(view._repr_html_()).details] == [False] * 4
    page = _html.render_view(view, expand=("params", "params/layers/0"))
    assert [(d["name"], d["open"]) for d in _Tree(page).details] == [
        ("params", True), ("layers", False), ("0", True), ("1", False)]
    # a sub-view shows its own top level; expand paths are relative to it
    sub = view["params"]
    tree = _Tree(_html.render_view(sub, expand=("layers",)))
    assert [(d["outer"], d["name"], d["open"]) for d in tree.details] == [
        ([], "layers", True), (["layers"], "0", False), (["layers"], "1", False)]
    assert tree.rows["params/embed"]["outer"] == []
    assert "jaxckpt checkpoint" in sub._repr_html_()


def test_header(saved):
    page = jaxckpt.open(saved)._repr_html_()
    info = jaxckpt.open(saved).info
    assert f"7 leaves · <span title=\"{1184:,} bytes\">1.2 KiB</span> · format v3 · saved " in page
    assert info["created"][:10] in page and f"jaxckpt {jaxckpt.__version__}" in page
    assert "<details><summary><b>metadata</b><i>1 key</i>" in page
    assert "<pre>{\n  &quot;lr&quot;: 0.5\n}</pre>" in page


def test_everything_user_controlled_is_escaped(tmp_path):
    evil = "<script>alert(1)</script>"
    where = tmp_path / "a<b>&c"
    tree = {evil: {"w": np.ones(2, np.float32), "b": 0}, "x": {evil: "<img src=x onerror=alert(2)>", "a/b": 1.0}}
    jaxckpt.save(where, tree, metadata={evil: ["</pre>" + evil, "\"'&"]})
    page = jaxckpt.open(where)._repr_html_()
    assert "<script" not in page and "<img" not in page and "a<b>" not in page
    assert page.count("</pre>") == 1
    assert "<summary><b>&lt;script&gt;alert(1)&lt;/script&gt;</b>" in page
    assert "class=v>&#x27;&lt;img src=x onerror=alert(2)&gt;&#x27; <span>(str)</span>" in page
    assert "&lt;/pre&gt;&lt;script&gt;" in page and "a&lt;b&gt;&amp;c" in page
    rows = _Tree(page).rows
    key = evil.replace("/", "%2F")  # the key path percent-encodes a / inside a key
    assert rows["x/" + key]["cells"][:2] == [evil, "value"]  # shown decoded
    assert rows["x/a%2Fb"]["cells"][0] == "a/b"
    assert rows[key + "/w"]["outer"] == [evil]


def test_long_values_are_truncated(ckpt):
    jaxckpt.save(ckpt, {"s": "x" * 1000})
    rows = _Tree(jaxckpt.open(ckpt)._repr_html_()).rows
    assert rows["s"]["cells"][2] == "'" + "x" * 78 + "… (str)"


def test_partition_spec_text():
    assert _html.spec_text([]) == "P()"
    assert _html.spec_text([["data", "fsdp"], None, "model"]) == "P(('data', 'fsdp'), None, 'model')"
    assert _html.spec_text([["data"]]) == "P(('data',))"
    assert _html.sharding_cells({"type": "other", "repr": "<Gspmd>", "num_devices": 8}) == (
        '<td title="&lt;Gspmd&gt;">other (8 devices)<td>')


def test_a_subtree_of_one_leaf_is_that_leafs_row(ckpt):
    w = np.ones((2, 2), np.float32)
    jaxckpt.save(ckpt, {"attention": {"q": {"kernel": w}, "k": {"kernel": w, "bias": w[0]}}, "a": {"b": {"c": 1}}})
    tree = _Tree(jaxckpt.open(ckpt)._repr_html_())
    assert [(d["outer"], d["name"]) for d in tree.details] == [([], "attention"), (["attention"], "k")]
    assert tree.rows["attention/q/kernel"] == {"outer": ["attention"], "cells": [
        "q/kernel", "array", "(2, 2)", "float32", "host", "", "16 B"]}
    assert tree.rows["a/b/c"] == {"outer": [], "cells": ["a/b/c", "value", "1 (int)"]}


def _llm_manifest(n_leaves):
    """An LLM-shaped manifest: long key paths, most modules holding a single kernel."""
    sharding = {"type": "named", "axis_names": ["data", "model"], "axis_sizes": [2, 4], "spec": [None, "model"]}
    modules = ["attention/query/kernel", "attention/query/bias", "attention/key/kernel", "attention/value/kernel",
               "attention/out/kernel", "mlp/wi_0/kernel", "mlp/wi_1/kernel", "mlp/wo/kernel",
               "pre_attention_norm/scale", "pre_mlp_norm/scale"]
    paths = [f"{top}/decoder/layers_{i}/{m}" for top in ("params", "opt_state/0/mu/params", "opt_state/0/nu/params")
             for i in range(-(-n_leaves // 30)) for m in modules][:n_leaves]
    leaves = tuple(LeafRecord(path=p, kind="array", dtype="bfloat16", shape=(4096, 14336), sharding=sharding,
                              key=str(i), chunk_shape=(4096, 3584), storage_dtype="bfloat16",
                              nbytes=4096 * 14336 * 2) for i, p in enumerate(paths))
    return Manifest(1, {}, leaves, {"run": "big"}, 1, {"created": "2026-01-02T03:04:05+00:00"})


def test_ten_thousand_leaves_render_fast_and_small():
    view = CheckpointView("/ckpts/big", _llm_manifest(10_000))
    start = time.perf_counter()
    page = view._repr_html_()
    elapsed = time.perf_counter() - start
    size = len(page.encode())
    print(f"10,000 leaves: {elapsed * 1000:.0f} ms, {size / 1e6:.2f} MB of HTML")
    assert size < 2_000_000
    tree = _Tree(page)
    assert len(tree.all_rows) == 10_000 and tree.rows == {}  # no per-row key path titles this big
    assert tree.all_rows[0] == {"outer": ["params", "decoder", "layers_0", "attention", "query"], "cells": [
        "kernel", "array", "(4096, 14336)", "bfloat16", "P(None, 'model')", "data=2, model=4", "112.0 MiB"]}
    assert tree.all_rows[2]["cells"][0] == "key/kernel"
    assert [(d["name"], d["count"], d["bytes"]) for d in tree.details[:2]] == [
        ("params", "3340 leaves", 3340 * 4096 * 14336 * 2), ("decoder", "3340 leaves", 3340 * 4096 * 14336 * 2)]
    # params, its decoder; opt_state, 0, mu and nu, each with params and decoder; 1000 layers of
    # layers_i, attention, query (2 leaves) and mlp
    assert len(tree.details) == 2 + 8 + 4 * 1000


def test_key_path_titles_up_to_a_limit():
    small = _Tree(CheckpointView("/c", _llm_manifest(_html.TITLE_LEAVES))._repr_html_())
    assert len(small.rows) == _html.TITLE_LEAVES
    assert small.rows["params/decoder/layers_0/mlp/wo/kernel"]["cells"][0] == "wo/kernel"
