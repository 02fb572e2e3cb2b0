"""The docs' code blocks run as they are shown (issue 20, item 10).

Every ```python block of README.md and docs/**/*.md is executed: the blocks of a page
in page order, in one namespace (a fresh module), in a temporary working directory, with
the 8 CPU devices tests/conftest.py sets. Every ``$ jaxckpt ...`` line of a ```console
block runs through the command's own entry point (``jaxckpt.cli.run``) at its place in
the page, and must exit 0, or N where the line ends with ``# exits N``.

A block that cannot run on its own is marked on the line before its fence with
``<!-- fragment: why -->`` (docs/contributing.md); only those are skipped, and a marker
without a reason, or with no fence after it, fails here.
"""

import contextlib
import glob
import io
import linecache
import os
import re
import shlex
import sys
import types
from typing import NamedTuple

import pytest

import jaxckpt
from jaxckpt import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*)$")
MARKER = re.compile(r"^\s*<!--\s*fragment\b(?P<rest>.*?)-->\s*$")
EXITS = re.compile(r"#\s*exits\s+(?P<code>\d+)\b")
PYTHON = {"python", "py"}
SHELL_OPERATORS = {"|", "||", "&", "&&", ";", ">", ">>", "<", "(", ")"}


class Block(NamedTuple):
    page: str  # relative to the repository
    line: int  # of the first line of code (1-based)
    lang: str
    code: str
    fragment: str | None  # the marker's reason; None: the block runs


def read(page: str) -> str:
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return f.read()


def pages() -> list[str]:
    found = glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True)
    return ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in found)


def parse(page: str) -> list[Block]:
    """The fenced blocks of ``page``, each dedented by its fence's indentation (fences
    inside admonitions are indented), with the fragment marker that precedes it."""
    lines = read(page).splitlines()
    blocks, marker, i = [], None, 0
    while i < len(lines):
        m, mark = FENCE.match(lines[i]), MARKER.match(lines[i])
        if mark:
            reason = mark.group("rest").strip().lstrip(":").strip()
            if not mark.group("rest").strip().startswith(":") or not reason:
                raise AssertionError(f"{page}:{i + 1}: a fragment marker says why: <!-- fragment: why -->")
            marker = (i + 1, reason)
        elif m:
            indent, fence = m.group("indent"), m.group("fence")
            end = next((j for j in range(i + 1, len(lines))
                        if lines[j].strip().startswith(fence[0] * len(fence)) and not lines[j].strip().strip(fence[0])),
                       None)
            if end is None:
                raise AssertionError(f"{page}:{i + 1}: a fence that is never closed")
            code = "\n".join(x[len(indent):] if x.startswith(indent) else x.lstrip() for x in lines[i + 1:end])
            lang = (m.group("info").split() or [""])[0].lower()
            blocks.append(Block(page, i + 2, lang, code + "\n", marker[1] if marker else None))
            marker, i = None, end
        elif marker and lines[i].strip():
            raise AssertionError(f"{page}:{marker[0]}: a fragment marker must come right before a fence")
        i += 1
    if marker:
        raise AssertionError(f"{page}:{marker[0]}: a fragment marker with no fence after it")
    return blocks


def jaxckpt_commands(block: Block) -> list[tuple[int, list[str], int]]:
    """The ``$ jaxckpt ...`` lines of a console block: (line, argv, expected exit code)."""
    commands, lines = [], block.code.splitlines()
    for k, text in enumerate(lines):
        if not text.startswith("$ jaxckpt "):
            continue
        while text.endswith("\\") and k + 1 < len(lines):
            k += 1
            text = text[:-1] + " " + lines[k].strip()
        exits = EXITS.search(text)
        lexer = shlex.shlex(text[2:], posix=True, punctuation_chars=True)
        lexer.whitespace_split, lexer.commenters = True, "#"
        argv = list(lexer)
        if SHELL_OPERATORS & set(argv):
            raise AssertionError(f"{block.page}:{block.line + k}: a shell pipeline or redirection; show the plain "
                                 "command, or mark the block <!-- fragment: why -->")
        commands.append((block.line + k, argv[1:], int(exits.group("code")) if exits else 0))
    return commands


def runnable(block: Block) -> bool:
    if block.fragment is not None:
        return False
    return block.lang in PYTHON or (block.lang == "console" and "\n$ jaxckpt " in "\n" + block.code)


def run_python(block: Block, namespace: dict) -> None:
    name = f"<{block.page}:{block.line}>"
    linecache.cache[name] = (len(block.code), None, block.code.splitlines(True), name)  # tracebacks show the doc
    exec(compile(block.code, name, "exec"), namespace)


def run_console(block: Block) -> None:
    for line, argv, expected in jaxckpt_commands(block):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli.run(argv)
        assert code == expected, (f"{block.page}:{line}: `jaxckpt {shlex.join(argv)}` exited {code}, "
                                  f"not {expected}\n{out.getvalue()}{err.getvalue()}")


def has_runnable(page: str) -> bool:
    try:
        return any(runnable(b) for b in parse(page))
    except AssertionError:
        return True  # a malformed page: its test reports it


RUN_PAGES = [p for p in pages() if has_runnable(p)]


@pytest.mark.parametrize("page", RUN_PAGES)
def test_page_runs(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MPLBACKEND", "Agg")  # plot_history draws without a display
    module = types.ModuleType("docs_" + re.sub(r"\W", "_", page))
    monkeypatch.setitem(sys.modules, module.__name__, module)  # dataclasses look their module up
    try:
        for block in filter(runnable, parse(page)):
            if block.lang in PYTHON:
                run_python(block, module.__dict__)
            else:
                run_console(block)
    finally:  # a notebook leaves its read-only managers open; the test process goes on
        for value in list(module.__dict__.values()):
            if isinstance(value, jaxckpt.CheckpointManager):
                value.close()


def test_every_python_fence_is_parsed_and_every_fragment_says_why():
    """The parser sees every ```python fence of every page (none run or skipped unseen;
    one inside another block, as in docs/contributing.md, is that block's text),
    and the skipped blocks are exactly the marked ones, each with its reason."""
    for page in pages():
        text = read(page)
        blocks = parse(page)
        opened = {b.line - 1 for b in blocks if b.lang in PYTHON}
        inside = {n for b in blocks for n in range(b.line, b.line + b.code.count("\n"))}  # e.g. ````markdown
        fences = {n for n, x in enumerate(text.splitlines(), 1) if re.match(r"\s*(`{3,}|~{3,})\s*(python|py)\b", x)}
        assert fences - inside == opened, page
        assert [b for b in blocks if b.lang in PYTHON and not runnable(b)] == \
            [b for b in blocks if b.lang in PYTHON and b.fragment], page
        assert all(len(b.fragment) > 10 for b in blocks if b.fragment), page
    # the pages whose claims the issue named run, not skipped as fragments
    assert {"README.md", "docs/getting-started.md", "docs/explore.md", "docs/guides/training.md"} <= set(RUN_PAGES)


def test_a_fragment_marker_needs_a_reason_and_a_fence(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
    (tmp_path / "a.md").write_text("<!-- fragment -->\n```python\nx\n```\n")
    with pytest.raises(AssertionError, match=r"a\.md:1: a fragment marker says why"):
        parse("a.md")
    (tmp_path / "b.md").write_text("<!-- fragment: needs S3 -->\nsome prose\n```python\nx\n```\n")
    with pytest.raises(AssertionError, match=r"b\.md:1: a fragment marker must come right before a fence"):
        parse("b.md")
    (tmp_path / "c.md").write_text("!!! note\n\n    <!-- fragment: the shape of it -->\n    ```python\n"
                                   "    if x:\n        y\n    ```\n\n```console\n$ jaxckpt ls d  # exits 2\n"
                                   "$ jaxckpt diff a b | jq .\n```\n")
    (py, console) = parse("c.md")
    assert py == Block("c.md", 5, "python", "if x:\n    y\n", "the shape of it")
    with pytest.raises(AssertionError, match=r"c\.md:11: a shell pipeline"):
        jaxckpt_commands(console)
    assert jaxckpt_commands(console._replace(code="$ jaxckpt ls d  # exits 2\n")) == [(10, ["ls", "d"], 2)]
