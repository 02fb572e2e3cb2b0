#!/usr/bin/env python
"""This tree's jaxckpt against an earlier commit's, in one interleaved run.

Each round runs ``run.py`` twice with the same arguments: once from a ``git archive``
of the base commit (its own ``run.py`` and its own ``jaxckpt``), once from this tree,
the order alternating round by round so that drift on a shared machine falls on both.
Every row is the median over rounds of each run's own median; the table prints base,
now and now/base, for the comparison rows (``--cases``) and the restore matrix rows
(``--reshard``): time, peak RSS over the bytes restored, bytes read over the bytes held.

    python benchmarks/vs_commit.py --base d7c90e7 --rounds 3 -- --cases big,many --libs jaxckpt --reps 1
    python benchmarks/vs_commit.py --base d7c90e7 --rounds 3 -- --reshard --libs jaxckpt --reps 1

Only the jaxckpt column is compared (pass ``--libs jaxckpt`` through). The base tree is
kept under ``bench_out/base-<commit>`` between runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_ROOT = os.path.join(REPO, "bench_out")
MATRIX_KEYS = (("s", "time [s]"), ("rss/restored", "RSS/restored"), ("self/held", "read/held (jx)"))


def base_tree(commit: str) -> str:
    """The base commit's files, extracted once (``git archive``)."""
    sha = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", commit], check=True,
                         capture_output=True, text=True).stdout.strip()
    out = os.path.join(OUT_ROOT, f"base-{sha}")
    if not os.path.isdir(out):
        os.makedirs(OUT_ROOT, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix="base-", dir=OUT_ROOT)
        tar = subprocess.run(["git", "-C", REPO, "archive", "--format=tar", sha], check=True,
                             capture_output=True).stdout
        with tempfile.TemporaryFile() as f:
            f.write(tar)
            f.seek(0)
            with tarfile.open(fileobj=f) as t:
                t.extractall(tmp, filter="data")
        os.rename(tmp, out)
    return out


def run_once(tree: str, args: list[str], tag: str) -> dict:
    """``run.py`` of ``tree`` with ``args``; its JSON result."""
    fd, path = tempfile.mkstemp(prefix=f"{tag}-", suffix=".json", dir=OUT_ROOT)
    os.close(fd)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    cmd = [sys.executable, os.path.join(tree, "benchmarks", "run.py"), *args, "--json", path]
    print(f"  {tag}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    subprocess.run(cmd, check=False, cwd=tree, env=env, stdout=subprocess.DEVNULL)
    try:
        with open(path) as f:
            result = json.load(f)
        files = (result.get("config") or {}).get("jaxckpt_files")
        print(f"  {tag}: jaxckpt from {', '.join(files or ['?'])}", file=sys.stderr, flush=True)
        return result
    finally:
        os.unlink(path)


def rows_of(result: dict) -> dict[str, float]:
    """``{row: value}`` for the jaxckpt column of one run."""
    out = {}
    for case, rows in (result.get("table") or {}).items():
        for r in rows:
            v = r["median"].get("jaxckpt")
            if v is not None:
                out[f"{case}: {r['label']} [{r['unit']}]"] = v
    for r in result.get("matrix") or []:
        med = r["median"].get("jaxckpt", {})
        per = r["per_lib"].get("jaxckpt", {})
        for key, name in MATRIX_KEYS:
            v = med.get(key) if key == "s" else per.get(key)
            if v is not None:
                out[f"{r['label']}: {name}"] = v
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the commit to compare against")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("run_args", nargs=argparse.REMAINDER, help="-- then run.py's arguments")
    args = ap.parse_args(argv)
    run_args = [a for a in args.run_args if a != "--"]
    base = base_tree(args.base)
    got: dict[str, dict[str, list[float]]] = {"base": {}, "now": {}}
    for i in range(args.rounds):
        order = [("base", base), ("now", REPO)] if i % 2 == 0 else [("now", REPO), ("base", base)]
        for tag, tree in order:
            for row, v in rows_of(run_once(tree, run_args, tag)).items():
                got[tag].setdefault(row, []).append(v)
    head = _commit(REPO)
    print(f"base {args.base} vs now {head}: medians over {args.rounds} interleaved rounds of run.py "
          f"{' '.join(run_args)}")
    print(f"{'row':<58}{'base':>10}{'now':>10}{'now/base':>10}")
    for row, vals in got["now"].items():
        b = got["base"].get(row)
        now = statistics.median(vals)
        if b is None:
            print(f"{row:<58}{'-':>10}{now:>10.3f}{'-':>10}")
            continue
        bm = statistics.median(b)
        print(f"{row:<58}{bm:>10.3f}{now:>10.3f}{(now / bm if bm else float('nan')):>10.2f}")
    return 0


def _commit(tree: str) -> str:
    return subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], check=False,
                          capture_output=True, text=True).stdout.strip() or "?"


if __name__ == "__main__":
    sys.exit(main())
