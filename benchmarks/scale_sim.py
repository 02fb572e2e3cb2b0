"""Scale, by simulation: plan a save of a 70B-parameter-shaped train state on 2,048
devices in 256 processes, without any data or devices.

The state is Llama-2-70B-shaped (80 layers, hidden 8192, MLP 28672, 8 KV heads, vocab
32000): bfloat16 params plus float32 Adam moments (mu, nu), ~840 GiB. The mesh is
``('fsdp', 'tensor') = (256, 8)``, 8 devices per process (the tensor axis inside a
host); matrices are ``P('fsdp', 'tensor')``, norms replicated. A sharding here is a
stand-in with jax's ``devices_indices_map`` arithmetic and devices that only know their
process, so jaxckpt's own planning code (``_layout.shards_of``, ``chunk_shape_for``,
``_snapshot``'s chunking and writer assignment) runs unchanged, as each process would
run it.

Measured: the per-process planning time (every process plans the whole tree), the
manifest's size and parse time, and the files per checkpoint, against orbax's OCDBT
layout (a few files per process) and against format 3 (issue 22: one stream per writing
process in segments of ``_streams.SEGMENT_BYTES``, laid out by ``_streams.plan``).

Usage: python benchmarks/scale_sim.py [--processes 256] [--per-process 8] [--layers 80]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxckpt import (
    _chunking,
    _dtypes,
    _layout,
    _manifest,
    _snapshot,
    _streams,
    _tree,  # noqa: E402
)
from jaxckpt._manifest import LeafRecord, Manifest  # noqa: E402
from jaxckpt._storage import objectnames as _objectnames  # noqa: E402


class SimDevice:
    __slots__ = ("id", "process_index")

    def __init__(self, i: int, per_process: int):
        self.id, self.process_index = i, i // per_process

    def __repr__(self) -> str:
        return f"SimDevice({self.id})"


class SimSharding:
    """A ``NamedSharding`` stand-in over a mesh of simulated devices (row-major)."""

    def __init__(self, devices: list[SimDevice], axes: tuple[tuple[str, int], ...], spec: tuple):
        self.devices, self.axes, self.spec = devices, axes, spec
        self._key = (len(devices), axes, spec)

    def __hash__(self) -> int:
        return hash(self._key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SimSharding) and self._key == other._key

    def _parts(self, dim: int) -> tuple[int, tuple[str, ...]]:
        entry = self.spec[dim] if dim < len(self.spec) else None
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        sizes = dict(self.axes)
        return math.prod(sizes[n] for n in names), names

    def shard_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(n // self._parts(d)[0] for d, n in enumerate(shape))

    def devices_indices_map(self, shape: tuple[int, ...]) -> dict:
        names = [n for n, _ in self.axes]
        sizes = [s for _, s in self.axes]
        out = {}
        for flat, dev in enumerate(self.devices):
            coord, rest = {}, flat
            for n, s in zip(reversed(names), reversed(sizes)):
                coord[n], rest = rest % s, rest // s
            index = []
            for d, n in enumerate(shape):
                parts, axes = self._parts(d)
                pos = 0
                for a in axes:
                    pos = pos * dict(self.axes)[a] + coord[a]
                step = n // parts
                index.append(slice(pos * step, (pos + 1) * step))
            out[dev] = tuple(index)
        return out


def llama70b_leaves(layers: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(path, shape, 'matrix'|'norm') of the params."""
    h, f, kv, vocab = 8192, 28672, 1024, 32000
    out = [("embed", (vocab, h), "matrix"), ("lm_head", (h, vocab), "matrix"), ("final_norm", (h,), "norm")]
    for i in range(layers):
        for name, shape in (("wq", (h, h)), ("wk", (h, kv)), ("wv", (h, kv)), ("wo", (h, h)),
                            ("w1", (h, f)), ("w3", (h, f)), ("w2", (f, h))):
            out.append((f"layers/{i}/{name}", shape, "matrix"))
        out += [(f"layers/{i}/attn_norm", (h,), "norm"), (f"layers/{i}/ffn_norm", (h,), "norm")]
    return out


def plan(processes: int, per_process: int, layers: int, fine: bool = False) -> tuple[list, list, float, float]:
    """Every leaf's chunks and writers, as ``_snapshot`` plans them; ``fine``: format 3's
    chunks (``_layout.fine_chunk_shape`` for ``processes`` saving processes)."""
    devices = [SimDevice(i, per_process) for i in range(processes * per_process)]
    axes = (("fsdp", processes), ("tensor", per_process))
    matrix = SimSharding(devices, axes, ("fsdp", "tensor"))
    norm = SimSharding(devices, axes, ())
    arrays, specs = [], []
    t0 = time.perf_counter()
    for tree, dtype, itemsize in (("params", "bfloat16", 2), ("opt/mu", "float32", 4), ("opt/nu", "float32", 4)):
        for path, shape, kind in llama70b_leaves(layers):
            sharding = matrix if kind == "matrix" else norm
            shards = _layout.shards_of(sharding, shape)
            chunk_shape = _layout.chunk_shape_for(sharding, shape, itemsize)
            if fine:
                chunk_shape = _layout.fine_chunk_shape(chunk_shape, shape, itemsize, processes)
            nbytes = math.prod(shape) * itemsize
            fields = {"path": f"{tree}/{path}", "kind": "array", "key": str(len(arrays)), "dtype": dtype,
                      "shape": shape, "sharding": {"type": "named", "axis_names": ["fsdp", "tensor"],
                                                   "axis_sizes": [processes, per_process],
                                                   "spec": list(sharding.spec)},
                      "chunk_shape": chunk_shape, "storage_dtype": dtype, "nbytes": nbytes, "store": "file"}
            arrays.append(_snapshot._ArrayLeaf(len(arrays), fields,
                                               _chunking.chunks_cached(shape, chunk_shape, shards, itemsize), {}))
            specs.append(sharding)
    t_chunks = time.perf_counter() - t0
    t1 = time.perf_counter()
    _snapshot._assign(arrays, ())
    t_assign = time.perf_counter() - t1
    return arrays, specs, t_chunks, t_assign


def format3(arrays: list, order: dict[str, int], processes: int) -> tuple[float, _streams.Layout, int, float]:
    """Seconds ``_streams.plan`` takes for the tree (leaves in manifest order), its
    layout, the JSON bytes its runs add to the manifest, and the seconds a reader takes
    to parse those runs and check them (``json.loads`` + ``_streams.validate``)."""
    leaves = sorted(arrays, key=lambda x: order[x.fields["path"]])
    payloads = [math.prod(x.fields["chunk_shape"]) * _dtypes.DTYPES[x.fields["dtype"]].itemsize for x in leaves]
    t0 = time.perf_counter()
    layout = _streams.plan([(p, x.writers) for p, x in zip(payloads, leaves)])
    seconds = time.perf_counter() - t0
    text = json.dumps({"streams": _streams.streams_to_json(layout.streams),
                       "runs": [_streams.runs_to_json(r) for r in layout.runs]}, separators=(",", ":"))
    t1 = time.perf_counter()
    raw = json.loads(text)
    streams = _streams.streams_from_json(raw["streams"], processes, "sim")
    _streams.validate([(x.fields["path"], len(x.writers), _streams.entry_bytes_for(p), r)
                       for x, p, r in zip(leaves, payloads, raw["runs"])], streams, "sim")
    return seconds, layout, len(text), time.perf_counter() - t1


class _NoReader:
    """Stands in for the storage reader: the exchange's planning is what is timed."""

    def add(self, rec: LeafRecord, index: _layout.Index) -> None:
        pass


def exchange_planning(records: list[LeafRecord], specs: list, processes: int) -> tuple[float, int, int]:
    """Seconds process 0 spends planning a read-once restore of ``records`` onto
    ``specs`` (``_exchange.ReadOnce.add_global`` + ``plan_pieces``), the number of
    shared slices and of pieces it plans."""
    from jaxckpt import _distributed, _exchange

    index, count = _distributed.process_index, _distributed.process_count
    _distributed.process_index, _distributed.process_count = (lambda: 0), (lambda: processes)
    try:
        t0 = time.perf_counter()
        ro = _exchange.ReadOnce(_NoReader, "sim", True)
        for rec, sharding in zip(records, specs):
            mine = {sh.index for sh in _layout.shards_of(sharding, rec.shape) if 0 in sh.processes}
            ro.add_global(rec, sharding, mine)
        plan = _exchange.plan_pieces(ro.shared, ro.load, True, {})
        return time.perf_counter() - t0, len(ro.shared), sum(len(p) for p in plan)
    finally:
        _distributed.process_index, _distributed.process_count = index, count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--processes", type=int, default=256)
    ap.add_argument("--per-process", type=int, default=8)
    ap.add_argument("--layers", type=int, default=80)
    a = ap.parse_args()
    t0 = time.perf_counter()
    arrays, specs, t_chunks, t_assign = plan(a.processes, a.per_process, a.layers)
    t_plan = time.perf_counter() - t0
    total = sum(x.fields["nbytes"] for x in arrays)
    chunks = sum(len(x.chunks) for x in arrays)
    mine = sum(1 for x in arrays for w in x.writers if w == 0)
    records = [LeafRecord(**x.fields) for x in arrays]
    nested: dict = {}
    for rec in records:
        *parents, last = rec.path.split("/")
        node = nested
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = 0
    order = {path: i for i, (path, _) in enumerate(_tree.flatten(nested)[0])}
    records.sort(key=lambda r: order[r.path])
    man = Manifest(format_version=_manifest.FORMAT_VERSION, structure=_tree.describe(nested), leaves=tuple(records),
                   metadata={}, process_count=a.processes, info={})
    data = man.to_bytes()
    t2 = time.perf_counter()
    _manifest.parse(data, "sim")
    t_parse = time.perf_counter() - t2
    files = chunks + len(arrays) + 1  # chunk files, a zarr.json per leaf, the manifest
    print(f"state: {len(arrays)} leaves, {total / 2**30:.0f} GiB, {a.processes} processes x {a.per_process} devices")
    print("| measure | value | target |")
    print("|---|---:|---|")
    print(f"| planning per process (whole tree) [s] | {t_plan:.2f} (chunks {t_chunks:.2f}, "
          f"writers {t_assign:.2f}) | ≤ 1 |")
    print(f"| chunks written by process 0 | {mine} | |")
    print(f"| manifest size [MiB] | {len(data) / 2**20:.2f} | ≤ 16 |")
    print(f"| manifest parse [s] | {t_parse:.3f} | ≤ 1 |")
    print(f"| files per checkpoint | {files:,} ({files / a.processes:,.0f} per process) | |")
    print(f"| orbax OCDBT files per checkpoint (its layout: a data file or a few per process, "
          f"plus a manifest per process and a few metadata files) | ~{3 * a.processes + 5:,} | |")
    arrays3 = plan(a.processes, a.per_process, a.layers, fine=True)[0]
    chunks3 = sum(len(x.chunks) for x in arrays3)
    t_f3, layout, runs_bytes, t_check = format3(arrays3, order, a.processes)
    per = _objectnames.objects_per_process(layout.streams)
    f3 = sum(per.values()) + 1  # the data objects and the manifest
    runs = sum(len(r) for r in layout.runs)
    print(f"| format 3: objects per checkpoint (data objects of {_streams.SEGMENT_BYTES >> 20} MiB + the "
          f"manifest) | {f3:,} ({min(per.values())}..{max(per.values())} data objects per process, "
          f"{len(per)} writing; {files / f3:,.0f}× fewer than {files:,}) | ≤ 1,000 |")
    print(f"| format 3: plan [s] (`_streams.plan`, the whole tree) | {t_f3:.3f} ({chunks3:,} chunks, "
          f"{runs:,} runs) | |")
    print(f"| format 3: runs and streams in the manifest [MiB] | {runs_bytes / 2**20:.2f} | |")
    print(f"| format 3: runs parsed and validated (`json.loads` + `_streams.validate`) [s] | {t_check:.3f} | |")
    # a training loop saves the same leaves again: writers and stream layout are reused
    t0 = time.perf_counter()
    _snapshot._lay_out_streams(arrays3)  # as a first save lays them out (the writers: in plan())
    t_first = time.perf_counter() - t0
    t0 = time.perf_counter()
    again = plan(a.processes, a.per_process, a.layers, fine=True)[0]
    _snapshot._lay_out_streams(again)
    t_again = time.perf_counter() - t0
    print(f"| format 3: a save's stream layout, first / the same leaves saved again (chunks, writers "
          f"and layout) [s] | {t_first:.3f} / {t_again:.3f} | |")
    # restores from an object store plan the read-once exchange (jaxckpt/_exchange.py)
    records = [LeafRecord(**x.fields) for x in arrays]
    same = exchange_planning(records, specs, a.processes)
    devices = specs[0].devices
    axes = (("fsdp", a.processes), ("tensor", a.per_process))
    dp = [SimSharding(devices, axes, (None, "tensor")) if len(r.shape) == 2 else sh for r, sh in zip(records, specs)]
    onto_dp = exchange_planning(records, dp, a.processes)
    for label, (sec, nshared, npieces) in (("same layout", same), ("matrices onto P(None, 'tensor')", onto_dp)):
        print(f"| read-once planning per process, restore {label} [s] | {sec:.2f} ({nshared:,} shared slices, "
              f"{npieces:,} pieces) | ≤ 1 |")


if __name__ == "__main__":
    main()
