#!/usr/bin/env python
"""Peak host memory and throughput of jaxckpt.convert (issue 10, item 5).

    python benchmarks/convert_rss.py                  # 1 GiB in 8 leaves, 3 reps, medians
    python benchmarks/convert_rss.py --size-gib 0.25 --reps 1

One checkpoint of ``--leaves`` float32 leaves (``--size-gib`` in all, random data so
that orbax's compression cannot shrink it), each ``P('data', None)`` over 4 CPU
devices, saved with jaxckpt and, when orbax-checkpoint is installed and jaxckpt reads
it, with orbax (``StandardCheckpointer``). Then, each in a fresh interpreter:

* ``import``: ``convert.from_orbax`` (``import_source`` of the jaxckpt copy without orbax);
* ``export``: ``convert.to_safetensors`` into a directory (one shard + index), and
  ``export-bf16`` with ``dtype="bfloat16"``;
* ``relayout``: ``convert.relayout`` onto ``P(None, 'b')`` of an ``AbstractMesh((2, 2))``
  (column chunks: every chunk is a strided view of the row-major leaf);
* ``raw-read``: the files the operation reads, read once with ``readinto`` into one
  16 MiB buffer, and ``raw-copy``: the same plus writing them to new files with fsync.

Each conversion runs twice: as a library call, and as the ``jaxckpt`` commands run it
(``(cli)``: after ``_stream.limit_malloc_retention()``, which keeps chunks tensorstore
decodes on its threads from piling up in malloc's arenas).

Peak RSS is ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` at the end minus its value
after the imports and device setup, printed as a multiple of the largest leaf (target:
below 1.5). Throughput is leaf bytes per second, and its ratio to ``raw-read`` of the
same source in the same run. Page caches are not dropped: the sources were just written,
so reads mostly hit the page cache, for the operations and the raw baselines alike.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_ROOT = os.path.join(REPO, "bench_out")  # gitignored
MARK = "@@CONVERT "
NDEV = 4
MiB, GiB = 1 << 20, 1 << 30


def _setup_jax():
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={NDEV}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, REPO)
    import jax

    assert len(jax.devices()) == NDEV, jax.devices()
    return jax


def _maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


# --- worker side ----------------------------------------------------------------------


def _make(work: str, size_gib: float, leaves: int) -> dict:
    jax = _setup_jax()
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxckpt
    from jaxckpt import _formats

    cols = 4096
    rows = max(NDEV, int(size_gib * GiB / leaves / 4 / cols) // NDEV * NDEV)
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(NDEV), ("data",))
    rng = np.random.default_rng(0)
    tree = {f"layer{i}": {"w": jax.device_put(rng.standard_normal((rows, cols), np.float32),
                                              NamedSharding(mesh, P("data", None)))} for i in range(leaves)}
    jaxckpt.save(os.path.join(work, "src"), tree)
    out = {"leaf_bytes": rows * cols * 4, "total_bytes": rows * cols * 4 * leaves, "orbax": False}
    try:
        import orbax.checkpoint as ocp

        with ocp.StandardCheckpointer() as ck:
            ck.save(os.path.join(work, "orbax"), tree)
            ck.wait_until_finished()
        out["orbax"] = _formats.open_source(os.path.join(work, "orbax")).format == "orbax"
    except Exception as e:  # noqa: BLE001 - import then runs from the jaxckpt copy
        out["orbax_error"] = f"{type(e).__name__}: {e}"
    return out


def _raw_read(src: str, copy_to: str | None) -> int:
    buf = bytearray(16 * MiB)
    view = memoryview(buf)
    total = 0
    for root, _, files in os.walk(src):
        for name in sorted(files):
            path = os.path.join(root, name)
            out = None
            if copy_to is not None:
                os.makedirs(copy_to, exist_ok=True)
                out = open(os.path.join(copy_to, f"{total}-{name}"), "wb")  # noqa: SIM115
            with open(path, "rb", buffering=0) as f:
                while n := f.readinto(view):
                    total += n
                    if out is not None:
                        out.write(view[:n])
            if out is not None:
                out.flush()
                os.fsync(out.fileno())
                out.close()
    return total


def _op(op: str, work: str, orbax: bool) -> None:
    src = os.path.join(work, "src")
    dest = os.path.join(work, "dest")
    if op in ("raw-read", "raw-copy"):
        _raw_read(os.path.join(work, "orbax" if orbax else "src"), dest if op == "raw-copy" else None)
        return
    if op in ("raw-read-src", "raw-copy-src"):
        _raw_read(src, dest if op == "raw-copy-src" else None)
        return
    from jax.sharding import AbstractMesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxckpt import _formats, convert

    if op == "import":
        if orbax:
            convert.from_orbax(os.path.join(work, "orbax"), dest)
        else:
            convert.import_source(_formats.open_source(src), dest)
    elif op == "export":
        convert.to_safetensors(src, dest)
    elif op == "export-bf16":
        convert.to_safetensors(src, dest, dtype="bfloat16")
    elif op == "relayout":
        convert.relayout(src, dest, shardings=NamedSharding(AbstractMesh((2, 2), ("a", "b")), P(None, "b")))
    else:
        raise ValueError(op)


def worker(args: argparse.Namespace) -> None:
    if args.op == "make":
        print(MARK + json.dumps(_make(args.work, args.size_gib, args.leaves)), flush=True)
        return
    _setup_jax()
    import jaxckpt  # noqa: F401 - the imports belong to the baseline
    from jaxckpt import convert  # noqa: F401

    if args.cli_malloc:  # what the jaxckpt commands do
        from jaxckpt._formats import stream as _stream

        assert _stream.limit_malloc_retention()
    base = _maxrss()
    t0 = time.perf_counter()
    _op(args.op, args.work, args.orbax)
    seconds = time.perf_counter() - t0
    print(MARK + json.dumps({"op": args.op, "seconds": seconds, "peak": _maxrss() - base, "base": base}),
          flush=True)


# --- parent side ----------------------------------------------------------------------


def _run(args: list[str]) -> dict:
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", *args],
                       capture_output=True, text=True, timeout=3600)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith(MARK)]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"worker {args} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return json.loads(lines[-1][len(MARK):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--leaves", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None, help="Also write every sample here.")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--op", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--work", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--orbax", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cli-malloc", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    os.makedirs(OUT_ROOT, exist_ok=True)
    work = os.path.join(OUT_ROOT, f"convert_rss-{os.getpid()}")
    os.makedirs(work)
    try:
        made = _run(["--op", "make", "--work", work, "--size-gib", str(args.size_gib), "--leaves", str(args.leaves)])
        samples = _measure(work, made, args.reps)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _report(made, samples, args)


OPS = ("raw-read", "raw-copy", "import", "raw-read-src", "raw-copy-src", "export", "export-bf16", "relayout")
CONVERSIONS = ("import", "export", "export-bf16", "relayout")
ROWS = [(op, False) for op in OPS] + [(op, True) for op in CONVERSIONS]


def _name(op: str, cli_malloc: bool) -> str:
    return op + (" (cli)" if cli_malloc else "")


def _measure(work: str, made: dict, reps: int) -> dict[str, list[dict]]:
    samples: dict[str, list[dict]] = {_name(*row): [] for row in ROWS}
    for _ in range(reps):
        for op, cli_malloc in ROWS:
            flags = (["--orbax"] if made["orbax"] else []) + (["--cli-malloc"] if cli_malloc else [])
            samples[_name(op, cli_malloc)].append(_run(["--op", op, "--work", work, *flags]))
            shutil.rmtree(os.path.join(work, "dest"), ignore_errors=True)
            os.sync()
    return samples


def _report(made: dict, samples: dict[str, list[dict]], args: argparse.Namespace) -> None:
    leaf, total = made["leaf_bytes"], made["total_bytes"]
    print(f"{args.leaves} leaves x {leaf / MiB:.0f} MiB = {total / GiB:.2f} GiB; import from "
          f"{'orbax (StandardCheckpointer)' if made['orbax'] else 'jaxckpt (orbax not readable: ' + made.get('orbax_error', '?') + ')'}"
          f"; medians of {args.reps}")
    print(f"{'op':<19}{'seconds':>9}{'GiB/s':>8}{'x raw read':>12}{'peak RSS MiB':>14}{'x largest leaf':>16}")
    med = {op: {k: statistics.median(s[k] for s in v) for k in ("seconds", "peak")} for op, v in samples.items()}
    for op, cli_malloc in ROWS:
        m = med[_name(op, cli_malloc)]
        raw = med["raw-read" if op in ("raw-read", "raw-copy", "import") else "raw-read-src"]
        speed = total / m["seconds"]
        print(f"{_name(op, cli_malloc):<19}{m['seconds']:>9.2f}{speed / GiB:>8.2f}{speed / (total / raw['seconds']):>12.2f}"
              f"{m['peak'] / MiB:>14.0f}{m['peak'] / leaf:>16.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"made": made, "samples": samples, "medians": med}, f, indent=2)


if __name__ == "__main__":
    main()
