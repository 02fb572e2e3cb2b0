"""Format 3 with a directory per host (issue 22): the streams of each host's copy.

With a local directory per host, each group of processes sharing a directory writes a
copy of every chunk its processes hold (``_snapshot``: writers balanced over the group's
holders; ``-1`` where no process of the group holds the chunk). A chunk several hosts
hold (replicated state) is then in each of their streams. Process numbers differ across
groups, so every host's data objects have names of their own, and together the hosts'
objects are one set of streams.

One chunk's copy is *designated*: the one in the first group (by its lowest process)
that holds it. Each stream puts its designated entries first, then the others; so the
designated entries of process ``k`` are a prefix of its stream, and the persistent tier
copies that prefix of each stream and nothing twice.

The manifest of a host's directory (its *view*) locates the chunks its group holds in
its own streams and every other chunk at its designated copy (on another host, not in
this directory, as format 1 names the chunk files only other hosts hold). The view of
the group holding process 0 locates every chunk at its designated copy: it is the
manifest of the persistent copy as well. Each view declares, per process, the stream
length up to the last entry it locates there (the object sizes it implies are what a
copy of that view holds).

A pure function of the global tree and the groups: every process of a group plans the
same view. No I/O, no jax. Entries of a fixed size only (raw and quantized leaves);
compressed leaves' entries follow them in each stream and are placed in each view once
written (``_writer.place_compressed``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from . import _streams
from ._streams import Layout, Run


def _group_places(writers: np.ndarray, designated: np.ndarray, stride: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One group's entries, per chunk of the whole tree (leaves concatenated): its
    process and stream offset (``-1``: the group holds no copy). Each process's
    designated entries first, then its others, each part in tree order (a stable sort by
    process keeps it); offsets are sums of strides (every one a multiple of ALIGN)."""
    proc = np.full(writers.size, -1, np.int64)
    off = np.zeros(writers.size, np.int64)
    held = writers >= 0
    base = None  # per process: where its second part starts (the strides of its first)
    for part in (held & designated, held & ~designated):
        at = np.flatnonzero(part)
        p = writers[at]
        order = np.argsort(p, kind="stable")
        by_proc, strides = p[order], stride[at][order]
        ends = np.cumsum(strides)
        new = np.concatenate(([True], by_proc[1:] != by_proc[:-1])) if by_proc.size else np.zeros(0, bool)
        starts = (ends - strides)[new]
        within = np.empty_like(ends)
        within[order] = ends - strides - starts[np.cumsum(new) - 1]
        proc[at], off[at] = p, within + (base[p] if base is not None else 0)
        base = np.zeros(int(writers.max(initial=0)) + 1, np.int64)
        base[by_proc[new]] = np.diff(np.append(starts, ends[-1] if ends.size else 0))
    return proc, off


def runs_of(proc: np.ndarray, off: np.ndarray, stride: int) -> tuple[Run, ...]:
    """The maximal runs of one leaf's per-chunk places (consecutive chunks of one process
    at consecutive strides merge).

    Example:
        >>> runs_of(np.array([0, 0, 1]), np.array([0, 64, 0]), 64)
        ((0, 0, 2, 0), (1, 2, 1, 0))
    """
    n = proc.size
    if not n:
        return ()
    new = np.concatenate(([True], (proc[1:] != proc[:-1]) | (off[1:] != off[:-1] + stride)))
    firsts = np.flatnonzero(new)
    counts = np.diff(np.append(firsts, n))
    return tuple(zip(proc[firsts].tolist(), firsts.tolist(), counts.tolist(), off[firsts].tolist()))


def plan_view(payloads: Sequence[int], owners: Sequence[np.ndarray], writers: Mapping[int, Sequence[np.ndarray]],
              view: int) -> Layout:
    """The runs and streams of group ``view``'s directory.

    ``payloads``: per array leaf (manifest order) the bytes of one full chunk;
    ``owners``: per leaf, each chunk's designated group (the first, by lowest process,
    that holds it); ``writers``: per group, per leaf, each chunk's writer in that group
    (``-1``: the group holds no copy), for ``view`` and for every group designated for
    a chunk ``view`` holds no copy of (no other is needed). Raises ``ValueError`` when
    a chunk's designated group holds no copy of it.

    Example (one leaf of two chunks; group 0 = process 0 holds chunk 0, group 1 =
    process 1 holds both: its stream has chunk 1, designated, then its copy of chunk 0):
        >>> owners = [np.array([0, 1])]
        >>> w = {0: [np.array([0, -1])], 1: [np.array([1, 1])]}
        >>> plan_view([60], owners, w, 1)
        Layout(runs=[((1, 0, 1, 64), (1, 1, 1, 0))], streams={1: 128})
        >>> plan_view([60], owners, w, 0)
        Layout(runs=[((0, 0, 1, 0), (1, 1, 1, 0))], streams={0: 64, 1: 64})
    """
    sizes = np.array([o.size for o in owners], np.int64)
    entries = np.array([_streams.entry_bytes_for(p) for p in payloads], np.int64)
    strides = -(-entries // _streams.ALIGN) * _streams.ALIGN
    owner = np.concatenate(owners) if owners else np.zeros(0, np.int64)
    stride = np.repeat(strides, sizes)
    proc, off = _group_places(np.concatenate(writers[view]) if owners else owner, owner == view, stride)
    for k in sorted(set(writers) - {view}):
        take = (owner == k) & (proc < 0)
        if take.any():
            p, o = _group_places(np.concatenate(writers[k]), owner == k, stride)
            proc[take], off[take] = p[take], o[take]
    if (proc < 0).any():
        raise ValueError("a chunk its designated group holds no copy of")
    return _layout(proc, off, sizes, strides, entries)


def _layout(proc: np.ndarray, off: np.ndarray, sizes: np.ndarray, strides: np.ndarray, entries: np.ndarray) -> Layout:
    """Every leaf's maximal runs of the concatenated places, and each process's stream
    length (the end of its last entry)."""
    starts = np.cumsum(sizes) - sizes
    leaf = np.repeat(np.arange(sizes.size), sizes)
    stride = strides[leaf]
    first = np.zeros(proc.size, bool)
    first[starts[sizes > 0]] = True
    new = first.copy()
    new[1:] |= (proc[1:] != proc[:-1]) | (off[1:] != off[:-1] + stride[1:])
    at = np.flatnonzero(new)
    counts = np.diff(np.append(at, proc.size))
    rows = np.stack((proc[at], at - starts[leaf[at]], counts, off[at]), axis=1)
    ends = np.zeros(int(proc.max(initial=0)) + 1, np.int64)
    np.maximum.at(ends, rows[:, 0], rows[:, 3] + (rows[:, 2] - 1) * stride[at] + entries[leaf[at]])
    bounds = np.searchsorted(leaf[at], np.arange(sizes.size + 1))
    flat = list(zip(*rows.T.tolist())) if len(rows) else []
    runs = [tuple(flat[a:b]) for a, b in zip(bounds.tolist(), bounds[1:].tolist())]
    return Layout(runs, {p: int(ends[p]) for p in np.flatnonzero(ends).tolist()})


def lay_out(payloads: Sequence[int], chunk_lists: Sequence[Sequence[Any]], groups: Sequence[tuple[int, ...]],
            group: tuple[int, ...], own: Sequence[Sequence[int]],
            writers_of: Callable[[tuple[int, ...]], Sequence[Sequence[int]]]) -> Layout:
    """``plan_view`` of ``group``'s directory from the tree: ``chunk_lists`` per leaf (each
    chunk with its ``holders``; leaves of one kind share one list), ``groups`` every group
    of the job, ``own`` this group's writers per leaf, ``writers_of(g)`` another group's
    (computed only for the groups this one needs: those designated for a chunk it holds
    no copy of; with replicated state, none)."""
    ordered = sorted(groups, key=min)  # the group of process 0 first: its view is the persistent one
    gid = {p: k for k, g in enumerate(ordered) for p in g}
    cache: dict[int, np.ndarray] = {}
    owners = []
    for chunks in chunk_lists:
        hit = cache.get(id(chunks))
        if hit is None:
            hit = cache[id(chunks)] = np.array([min(gid[h] for h in c.holders) for c in chunks], np.int64)
        owners.append(hit)
    view = ordered.index(group)
    converted: dict[int, tuple[Any, np.ndarray]] = {}  # a writer list shared by leaves of a kind: once

    def as_array(w: Sequence[int]) -> np.ndarray:
        hit = converted.get(id(w))
        if hit is None or hit[0] is not w:
            hit = converted[id(w)] = (w, np.asarray(w, np.int64))  # the list kept: its id stays its
        return hit[1]

    mine = [as_array(w) for w in own]
    lacking = [o[w < 0] for o, w in zip(owners, mine) if o.size]
    needed = set(np.unique(np.concatenate(lacking)).tolist()) if lacking else set()
    writers = {k: [as_array(w) for w in writers_of(ordered[k])] for k in needed - {view}}
    writers[view] = mine
    return plan_view(payloads, owners, writers, view)
