#!/usr/bin/env python
"""What an aggregated file layout would cost in speed, against jaxckpt's layout.

jaxckpt writes one file per saved chunk (zarr3, ``bytes`` + ``crc32c`` codecs, under
``arrays/<key>/c/...``; small leaves packed into ``packed/p<k>/``). Aggregated layouts
put many chunks in few files. This benchmark saves and restores the same states with:

* ``jaxckpt``: ``jaxckpt.save`` / ``jaxckpt.restore`` (the baseline);
* ``raw``: the same zarr3 arrays written by tensorstore directly, one file per chunk,
  codecs ``bytes`` + ``crc32c`` as jaxckpt's: comparing the layouts below with this one
  isolates the layout from jaxckpt's own code;
* ``ocdbt``: the same zarr3 arrays (same chunks) in one OCDBT database (tensorstore's
  ``ocdbt`` kvstore over ``file``) for the whole checkpoint (this is one process: one
  database per process), with orbax-checkpoint's options (``config``:
  ``max_inline_value_bytes`` 1024, ``max_decoded_node_bytes`` 1e8, ``manifest_kind``
  ``single``; ``assume_config``; a ``cache_pool#ocdbt`` of 100 MB) except
  ``target_data_file_size``: 64 MiB (``--target-data-file-size``; orbax: 2 GiB), which
  lets a big commit write several data files in parallel; every array created and
  written concurrently, each write its own commit (OCDBT batches pending ones);
* ``ocdbt-txn``: the same, but every create and write in one atomic ``ts.Transaction``,
  committed once (as orbax does with ``use_transaction``);
* ``streams``: format 3's data objects (issue 22): one stream per process (here one),
  every chunk an entry (payload + crc32c, a zarr3 chunk's bytes) at a 64-byte aligned
  offset, leaves in order and chunks in C order, cut into segment files ``p0.<n>`` of
  ``--segment-bytes``; written with ``dataobjects.StreamWriter`` (``pwritev`` from the
  arrays' buffers, fsync of every segment and the directory) and read with
  ``dataobjects.read_entry`` (``preadv`` into 64-byte aligned leaf buffers, crc32c
  checked), both on 4 threads as jaxckpt's direct chunk files;
* ``shard``: the zarr3 ``sharding_indexed`` codec, one shard file per leaf (per
  process's part of a leaf: here the whole leaf) holding its chunks as sub-chunks, each
  with its own crc32c (the shard index too).

States: ``big`` (``--big-mib`` MiB of float32 in ``--big-leaves`` leaves of 4096
columns, each saved as ``--chunks`` row-chunks, as jaxckpt saves ``P('data', None)``
on that many devices: jaxckpt gets jax arrays sharded so over as many forced CPU
devices) and ``many`` (``--many-leaves`` small leaves: kernels of 64 x 16..128 float32
and biases of 16 float32, one chunk each; jaxckpt gets numpy arrays and packs them).

For each layout and state: save time (until durable: jaxckpt fsyncs files and
directories; tensorstore's ``file`` kvstore, ``file_io_sync`` on, fsyncs every file
it writes and its directory), restore time (every leaf read fully into host memory: numpy arrays
from tensorstore, jaxckpt's restore onto the saved shardings for ``big`` and onto numpy
for ``many``), the number of files created and the bytes they take on disk.
Repetitions interleave the layouts (in a rotating order); medians are printed with
each layout's ratio to jaxckpt and to ``raw``. The restored bytes are compared with
the saved ones (bit-exact) on the first repetition of every layout. Restores read a
warm page cache unless ``--cold``: every file of the checkpoint is then fsynced and
dropped from the page cache (``posix_fadvise(DONTNEED)``) before each restore.
Tensorstore layouts open their arrays for reading from the known metadata
(``assume_metadata``, as jaxckpt does from its manifest) in a fresh ``ts.Context``.

    python benchmarks/aggregated.py                   # big 256 MiB + many 1,000, 3 reps
    python benchmarks/aggregated.py --smoke           # tiny, 1 rep, a few seconds
    python benchmarks/aggregated.py --cold --reps 5 --big-mib 1024
    python benchmarks/aggregated.py --layouts raw,ocdbt,shard --states many --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tensorstore as ts

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run import drop_page_cache  # noqa: E402 - the benchmarks' one page-cache drop

LAYOUTS = ("jaxckpt", "raw", "ocdbt", "ocdbt-txn", "shard", "streams")
STATES = ("big", "many")
COLS = 4096
MiB = 1 << 20
BYTES_CODEC = {"name": "bytes", "configuration": {"endian": "little"}}
CHUNK_CODECS = [BYTES_CODEC, {"name": "crc32c"}]


# --- states ---------------------------------------------------------------------------


@dataclass
class Leaf:
    path: tuple[str, ...]  # key path in the tree given to jaxckpt
    data: np.ndarray
    chunk: tuple[int, ...]  # chunk shape (the shard's sub-chunk shape for ``shard``)


@dataclass
class State:
    name: str
    leaves: list[Leaf]
    sharded: bool  # jaxckpt gets jax arrays split by rows over ``chunks`` devices

    @property
    def nbytes(self) -> int:
        return sum(leaf.data.nbytes for leaf in self.leaves)

    def describe(self) -> str:
        n = len(self.leaves)
        chunks = sum(int(np.prod([-(-s // c) for s, c in zip(leaf.data.shape, leaf.chunk)]))
                     for leaf in self.leaves)
        return f"{self.name}: {n} leaves, {self.nbytes / MiB:.1f} MiB, {chunks} chunks"


def big_state(total_mib: float, n_leaves: int, chunks: int) -> State:
    rows = int(total_mib * MiB) // n_leaves // (4 * COLS) // chunks * chunks
    if rows < chunks:
        raise SystemExit(f"--big-mib {total_mib} is too small for {n_leaves} leaves of {chunks} "
                         f"row-chunks of {COLS} float32 columns")
    rng = np.random.default_rng(0)
    leaves = [Leaf(("params", f"w{i}"), rng.standard_normal((rows, COLS), dtype=np.float32),
                   (rows // chunks, COLS)) for i in range(n_leaves)]
    return State("big", leaves, sharded=True)


def many_state(n_leaves: int) -> State:
    rng = np.random.default_rng(1)
    leaves = []
    for i in range(n_leaves):
        layer, kind = divmod(i, 2)
        shape = (64, 16 * (1 + layer % 8)) if kind == 0 else (16,)
        data = rng.standard_normal(shape, dtype=np.float32)
        leaves.append(Leaf(("params", f"layer{layer:04d}", "kernel" if kind == 0 else "bias"), data, shape))
    return State("many", leaves, sharded=False)


# --- layouts: tensorstore -------------------------------------------------------------


def _zarr3(kvstore: dict[str, Any], shape: tuple[int, ...], chunk: tuple[int, ...],
           codecs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "driver": "zarr3",
        "kvstore": kvstore,
        "fill_missing_data_reads": False,  # a missing chunk is an error, never zeros
        "store_data_equal_to_fill_value": True,
        "metadata": {
            "shape": list(shape),
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunk)}},
            "chunk_key_encoding": {"name": "default"},
            "data_type": "float32",
            "codecs": codecs,
            "fill_value": 0,
        },
    }


def _sharded_codecs(sub_chunk: tuple[int, ...]) -> list[dict[str, Any]]:
    return [{"name": "sharding_indexed", "configuration": {
        "chunk_shape": list(sub_chunk),
        "codecs": CHUNK_CODECS,
        "index_codecs": CHUNK_CODECS,
        "index_location": "end",
    }}]


@dataclass
class TsLayout:
    """Zarr3 arrays through tensorstore: ``arrays/<i>/`` for leaf ``i``."""

    name: str
    kind: str  # "raw", "ocdbt" or "shard"
    io_concurrency: int | None
    copy_concurrency: int | None
    transaction: bool = False
    ocdbt_options: dict[str, Any] = field(default_factory=dict)

    def context_spec(self) -> dict[str, Any]:
        spec: dict[str, Any] = {"file_io_sync": True}
        if self.io_concurrency:
            spec["file_io_concurrency"] = {"limit": self.io_concurrency}
        if self.copy_concurrency:
            spec["data_copy_concurrency"] = {"limit": self.copy_concurrency}
        if self.kind == "ocdbt":
            spec["cache_pool#ocdbt"] = {"total_bytes_limit": 100_000_000}
        return spec

    def kvstore(self, root: str, i: int) -> dict[str, Any]:
        if self.kind == "ocdbt":
            return {"driver": "ocdbt", "base": {"driver": "file", "path": os.path.join(root, "ocdbt") + "/"},
                    "path": f"arrays/{i}/", "cache_pool": "cache_pool#ocdbt", **self.ocdbt_options}
        return {"driver": "file", "path": os.path.join(root, "arrays", str(i)) + "/"}

    def spec(self, root: str, i: int, leaf: Leaf) -> dict[str, Any]:
        shape = leaf.data.shape
        if self.kind == "shard":
            return _zarr3(self.kvstore(root, i), shape, shape, _sharded_codecs(leaf.chunk))
        return _zarr3(self.kvstore(root, i), shape, leaf.chunk, CHUNK_CODECS)

    def save(self, root: str, state: State) -> None:
        ctx = ts.Context(self.context_spec())
        txn = ts.Transaction(atomic=True) if self.transaction else None
        opens = [ts.open(self.spec(root, i, leaf), create=True, context=ctx, transaction=txn)
                 for i, leaf in enumerate(state.leaves)]
        writes = [o.result().write(leaf.data) for o, leaf in zip(opens, state.leaves)]
        if txn is None:
            for w in writes:
                w.result()  # committed: written and fsynced
        else:
            for w in writes:
                w.copy.result()
            txn.commit_async().result()

    def restore(self, root: str, state: State) -> list[np.ndarray]:
        ctx = ts.Context(self.context_spec())
        opens = [ts.open(self.spec(root, i, leaf), assume_metadata=True, context=ctx)
                 for i, leaf in enumerate(state.leaves)]
        reads = [o.result().read() for o in opens]
        return [r.result() for r in reads]

    def options(self) -> str:
        """The specs and options of this layout, for the report."""
        ctx = f"context {json.dumps(self.context_spec())}"
        if self.kind == "ocdbt":
            return f"kvstore {json.dumps(self.kvstore('<ckpt>', 0))}; {ctx}; one transaction: {self.transaction}"
        if self.kind == "shard":
            return f"codecs {json.dumps(_sharded_codecs(('<chunk>',)))}; {ctx}"
        return f"codecs {json.dumps(CHUNK_CODECS)}; {ctx}"


# --- layout: streams (format 3's data objects) -----------------------------------------

ALIGN = 64  # format 3: every entry starts at a multiple of 64 in its stream
STREAM_THREADS = 4  # as jaxckpt's direct chunk-file writes and reads


class StreamsLayout:
    """One stream per process through ``jaxckpt._storage.dataobjects`` (imported at the
    first use: jax must not be imported before the jaxckpt layout sets XLA_FLAGS)."""

    name = "streams"

    def __init__(self, segment_bytes: int):
        self.segment_bytes = segment_bytes

    @staticmethod
    def entries(state: State) -> tuple[list[tuple[int, np.ndarray]], int]:
        """``[(offset, payload view)]`` of every chunk in stream order, and the stream length."""
        out, end = [], 0
        for leaf in state.leaves:
            # chunks are row blocks of the full width (big) or the whole leaf (many): each a
            # contiguous view of the C-order array, written from and read into in place
            rows = leaf.chunk[0]
            for block in (leaf.data[r:r + rows] for r in range(0, leaf.data.shape[0], rows)):
                offset = -(-end // ALIGN) * ALIGN
                out.append((offset, block))
                end = offset + block.nbytes + 4
        return out, end

    def _root(self, root: str) -> Any:
        from jaxckpt._storage.location import resolve

        return resolve(os.path.join(root, "ckpt")).child("data")

    def save(self, root: str, state: State) -> None:
        from jaxckpt._storage import dataobjects

        entries, length = self.entries(state)
        with dataobjects.StreamWriter(self._root(root), 0, length, self.segment_bytes) as w:
            with ThreadPoolExecutor(STREAM_THREADS) as pool:
                list(pool.map(lambda e: w.write_entry(*e), entries))

    def restore(self, root: str, state: State) -> list[np.ndarray]:
        from jaxckpt._storage import dataobjects
        from jaxckpt._storage.chunkfiles import aligned_empty

        data = self._root(root)
        outs = [aligned_empty(leaf.data.shape, leaf.data.dtype) for leaf in state.leaves]
        # the same entries, cut from the new buffers: each chunk's rows are its destination
        dests, _ = self.entries(State(state.name, [Leaf(leaf.path, out, leaf.chunk)
                                                  for leaf, out in zip(state.leaves, outs)], state.sharded))

        def read(entry: tuple[int, np.ndarray]) -> None:
            offset, dest = entry
            dataobjects.read_entry(data, 0, offset, dest.nbytes, dest, self.segment_bytes)

        with ThreadPoolExecutor(STREAM_THREADS) as pool:
            list(pool.map(read, dests))
        return outs

    def options(self) -> str:
        return (f"one stream, entries at {ALIGN}-byte offsets, segments of {self.segment_bytes} bytes, "
                f"{STREAM_THREADS} threads; dataobjects.StreamWriter / read_entry")


# --- layout: jaxckpt ------------------------------------------------------------------


class JaxckptLayout:
    """``jaxckpt.save`` / ``jaxckpt.restore``; the tree is built once per state (for
    ``big``: jax arrays split by rows over the forced CPU devices, outside the timing)."""

    name = "jaxckpt"

    def __init__(self, devices: int):
        os.environ["XLA_FLAGS"] = " ".join(
            [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count=")]
            + [f"--xla_force_host_platform_device_count={devices}"])
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        import jax

        import jaxckpt

        if len(jax.devices()) != devices:
            raise SystemExit(f"jaxckpt layout: expected {devices} CPU devices, got {jax.devices()} "
                             "(was jax imported before XLA_FLAGS was set?)")
        self.jax, self.jaxckpt = jax, jaxckpt
        self.devices = devices
        self._trees: dict[int, tuple[Any, Any]] = {}

    def _tree(self, state: State) -> tuple[Any, Any]:
        """(tree to save, restore target) of ``state``."""
        if id(state) in self._trees:
            return self._trees[id(state)]
        jax = self.jax
        if state.sharded:
            from jax.sharding import Mesh, NamedSharding
            from jax.sharding import PartitionSpec as P

            sharding = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), P("data", None))
            for leaf in state.leaves:
                if leaf.chunk[0] * self.devices != leaf.data.shape[0]:
                    raise SystemExit(f"jaxckpt layout: {self.devices} devices do not give {leaf.chunk} chunks")
            put = [jax.device_put(leaf.data, sharding) for leaf in state.leaves]
            jax.block_until_ready(put)
            target = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in put]
        else:
            put = [leaf.data for leaf in state.leaves]
            target = [np.empty_like(a) for a in put]
        tree: dict = {}
        abstract: dict = {}
        for leaf, value, t in zip(state.leaves, put, target):
            _set(tree, leaf.path, value)
            _set(abstract, leaf.path, t)
        self._trees[id(state)] = (tree, abstract)
        return tree, abstract

    def prepare(self, state: State) -> None:
        self._tree(state)

    def save(self, root: str, state: State) -> None:
        self.jaxckpt.save(os.path.join(root, "ckpt"), self._tree(state)[0])

    def restore(self, root: str, state: State) -> list[np.ndarray]:
        back = self.jaxckpt.restore(os.path.join(root, "ckpt"), self._tree(state)[1])
        self.jax.block_until_ready(back)
        return [_get(back, leaf.path) for leaf in state.leaves]

    def options(self) -> str:
        return (f"jaxckpt.save(path, tree) / jaxckpt.restore(path, target); big: jax arrays "
                f"P('data', None) over {self.devices} CPU devices, many: numpy arrays")


def _set(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def _get(tree: Any, path: tuple[str, ...]) -> Any:
    for k in path:
        tree = tree[k]
    return tree


# --- measurement ----------------------------------------------------------------------


def files_of(root: str) -> list[str]:
    return [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]


def disk_usage(root: str) -> tuple[int, int, int]:
    """(files, bytes in them, bytes they take on disk) under ``root``."""
    files = files_of(root)
    stats = [os.stat(f) for f in files]
    return len(files), sum(s.st_size for s in stats), sum(s.st_blocks * 512 for s in stats)


def check_equal(layout: str, state: State, restored: list[Any]) -> None:
    """Fail loudly unless every restored leaf has the saved bytes, bit for bit."""
    if len(restored) != len(state.leaves):
        raise SystemExit(f"FAIL {layout}/{state.name}: {len(restored)} leaves restored, "
                         f"{len(state.leaves)} saved")
    for leaf, got in zip(state.leaves, restored):
        got = np.asarray(got)
        want = leaf.data
        if (got.dtype != want.dtype or got.shape != want.shape
                or not np.array_equal(np.ascontiguousarray(got).view(np.uint8),
                                      np.ascontiguousarray(want).view(np.uint8))):
            raise SystemExit(f"FAIL {layout}/{state.name}: leaf {'/'.join(leaf.path)} restored "
                             f"{got.dtype}{got.shape} differs from the saved {want.dtype}{want.shape}")


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


@dataclass
class Result:
    save_s: list[float] = field(default_factory=list)
    restore_s: list[float] = field(default_factory=list)
    files: int = 0
    nbytes: int = 0
    disk_bytes: int = 0
    verified: bool = False


def run_one(layout: Any, state: State, work: str, cold: bool, verify: bool, res: Result | None) -> None:
    """Save ``state`` with ``layout`` into a new directory under ``work``, restore it,
    record the times (when ``res``), delete it."""
    root = tempfile.mkdtemp(prefix=f"{layout.name}-{state.name}-", dir=work)
    try:
        save_s, _ = timed(lambda: layout.save(root, state))
        files, nbytes, disk = disk_usage(root)
        if cold:
            drop_page_cache(root)
        restore_s, restored = timed(lambda: layout.restore(root, state))
        if verify:
            check_equal(layout.name, state, restored)
        del restored
        if res is not None:
            res.save_s.append(save_s)
            res.restore_s.append(restore_s)
            res.files, res.nbytes, res.disk_bytes = files, nbytes, disk
            res.verified = res.verified or verify
    finally:
        shutil.rmtree(root, ignore_errors=True)


# --- report ---------------------------------------------------------------------------


def _ratio(x: float, base: float | None) -> str:
    return f"{x / base:.2f}x" if base else "-"


def report(states: list[State], layouts: list[Any], results: dict[tuple[str, str], Result],
           reps: int, cold: bool) -> None:
    names = [lay.name for lay in layouts]
    for state in states:
        rs = {n: results[n, state.name] for n in names}
        med = {n: (statistics.median(r.save_s), statistics.median(r.restore_s)) for n, r in rs.items()}
        base = med.get("jaxckpt")
        raw = med.get("raw")
        print(f"\n## {state.describe()}; median of {reps}, {'cold' if cold else 'warm'} restores")
        print("| layout | save [s] | restore [s] | save vs jaxckpt | restore vs jaxckpt | save vs raw "
              "| restore vs raw | files | MiB | MiB on disk |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for n in names:
            r, (s, t) = rs[n], med[n]
            print(f"| {n} | {s:.3f} ({min(r.save_s):.3f}-{max(r.save_s):.3f}) "
                  f"| {t:.3f} ({min(r.restore_s):.3f}-{max(r.restore_s):.3f}) "
                  f"| {_ratio(s, base and base[0])} | {_ratio(t, base and base[1])} "
                  f"| {_ratio(s, raw and raw[0])} | {_ratio(t, raw and raw[1])} "
                  f"| {r.files} | {r.nbytes / MiB:.1f} | {r.disk_bytes / MiB:.1f} |")
        if base:
            for n in names:
                if n != "jaxckpt":
                    print(f"{state.name}: {n} save {med[n][0] / base[0]:.2f}x jaxckpt's time, "
                          f"restore {med[n][1] / base[1]:.2f}x")


# --- main -----------------------------------------------------------------------------


def make_layouts(names: list[str], a: argparse.Namespace) -> list[Any]:
    ocdbt = {
        "config": {"max_inline_value_bytes": a.max_inline_value_bytes, "max_decoded_node_bytes": 100_000_000,
                   "manifest_kind": "single"},
        "assume_config": True,
        "target_data_file_size": a.target_data_file_size,
    }
    io, copy = a.io_concurrency or None, a.copy_concurrency or None
    made = {
        "raw": lambda: TsLayout("raw", "raw", io, copy),
        "ocdbt": lambda: TsLayout("ocdbt", "ocdbt", io, copy, False, ocdbt),
        "ocdbt-txn": lambda: TsLayout("ocdbt-txn", "ocdbt", io, copy, True, ocdbt),
        "shard": lambda: TsLayout("shard", "shard", io, copy),
        "jaxckpt": lambda: JaxckptLayout(a.chunks),
        "streams": lambda: StreamsLayout(a.segment_bytes),
    }
    return [made[n]() for n in names]


def _names(text: str, allowed: tuple[str, ...], what: str) -> list[str]:
    out = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in out if n not in allowed]
    if bad or not out:
        raise SystemExit(f"--{what}: {', '.join(bad) or 'none given'}; choose from {', '.join(allowed)}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--states", default=",".join(STATES), help=f"comma-separated, of {', '.join(STATES)}")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    ap.add_argument("--big-mib", type=float, default=256, help="total size of the big state")
    ap.add_argument("--big-leaves", type=int, default=8)
    ap.add_argument("--chunks", type=int, default=4, help="row-chunks per big leaf (jaxckpt: CPU devices)")
    ap.add_argument("--many-leaves", type=int, default=1000)
    ap.add_argument("--cold", action="store_true", help="drop the checkpoint from the page cache before restores")
    ap.add_argument("--io-concurrency", type=int, default=0,
                    help="tensorstore file_io_concurrency limit (0: tensorstore's default)")
    ap.add_argument("--copy-concurrency", type=int, default=0,
                    help="tensorstore data_copy_concurrency limit (0: tensorstore's default)")
    ap.add_argument("--target-data-file-size", type=int, default=64 * MiB,
                    help="OCDBT target_data_file_size in bytes (0: no limit; orbax: 2 GiB)")
    ap.add_argument("--max-inline-value-bytes", type=int, default=1024,
                    help="OCDBT config max_inline_value_bytes (orbax: 1024)")
    ap.add_argument("--segment-bytes", type=int, default=1 << 30,
                    help="streams: bytes per segment object (format 3's default: 1 GiB)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, 1 rep: a quick check that it runs")
    ap.add_argument("--json", help="also write the raw times to this file")
    a = ap.parse_args()
    if a.smoke:
        a.reps, a.big_mib, a.many_leaves = 1, 16, 100
    if a.reps < 1:
        raise SystemExit("--reps must be at least 1")

    layouts = make_layouts(_names(a.layouts, LAYOUTS, "layouts"), a)
    states = []
    for n in _names(a.states, STATES, "states"):
        states.append(big_state(a.big_mib, a.big_leaves, a.chunks) if n == "big" else many_state(a.many_leaves))
    for lay in layouts:
        if isinstance(lay, JaxckptLayout):
            for s in states:
                lay.prepare(s)

    print(f"tensorstore zarr3 layouts vs jaxckpt; {os.cpu_count()} CPUs, temp dir {tempfile.gettempdir()}")
    for lay in layouts:
        print(f"  {lay.name}: {lay.options()}")
    work = tempfile.mkdtemp(prefix="jaxckpt-aggregated-")
    results = {(lay.name, s.name): Result() for lay in layouts for s in states}
    t0 = time.perf_counter()
    try:
        warm = many_state(4)
        for lay in layouts:  # first-call costs (thread pools, drivers, jax) out of the timings
            if isinstance(lay, JaxckptLayout):
                lay.prepare(warm)
            run_one(lay, warm, work, False, True, None)
        for rep in range(a.reps):
            order = layouts[rep % len(layouts):] + layouts[:rep % len(layouts)]
            for state in states:
                for lay in order:
                    run_one(lay, state, work, a.cold, rep == 0, results[lay.name, state.name])
            print(f"rep {rep + 1}/{a.reps} done ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if not all(r.verified for r in results.values()):
        raise SystemExit("FAIL: some layout was never verified")
    print(f"every layout's restore verified bit-exact against the saved arrays ({time.perf_counter() - t0:.0f} s)")
    report(states, layouts, results, a.reps, a.cold)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "options": {lay.name: lay.options() for lay in layouts},
                       "results": {f"{n}/{s}": vars(r) for (n, s), r in results.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
