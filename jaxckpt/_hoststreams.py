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
same view. No I/O, no jax.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from . import _streams
from ._streams import Layout, Run


def _places(runs: Sequence[Run], n: int, stride: int, skip: int) -> tuple[np.ndarray, np.ndarray]:
    """Per chunk of a leaf of ``n`` chunks: its process and stream offset (``-1`` for
    chunks of runs by process ``skip``, or of no run)."""
    proc = np.full(n, -1, np.int64)
    off = np.zeros(n, np.int64)
    t = np.asarray(runs, np.int64).reshape(-1, 4)
    t = t[t[:, 0] != skip]
    counts = t[:, 2]
    within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    at = np.repeat(t[:, 1], counts) + within
    proc[at] = np.repeat(t[:, 0], counts)
    off[at] = np.repeat(t[:, 3], counts) + within * stride
    return proc, off


def runs_of(proc: np.ndarray, off: np.ndarray, stride: int) -> tuple[Run, ...]:
    """The maximal runs of per-chunk places (consecutive chunks of one process at
    consecutive strides merge).

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


def _group_places(payloads: Sequence[int], writers: Sequence[np.ndarray], designated: Sequence[np.ndarray],
                  virtual: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """One group's entries, per leaf and chunk: (process, offset), ``-1`` where the group
    holds no copy. Its designated entries first (``_streams.plan``), then the others,
    each process's second part starting where its first ends (aligned)."""
    first = _streams.plan(zip(payloads, [np.where(d, w, virtual) for w, d in zip(writers, designated)]))
    rest = _streams.plan(zip(payloads, [np.where(~d & (w >= 0), w, virtual) for w, d in zip(writers, designated)]))
    base = np.zeros(virtual + 1, np.int64)
    for p, length in first.streams.items():
        base[p] = _streams.stride_for(length)  # rounded up to ALIGN
    out = []
    for payload, w, runs1, runs2 in zip(payloads, writers, first.runs, rest.runs):
        stride = _streams.stride_for(_streams.entry_bytes_for(payload))
        p1, o1 = _places(runs1, w.size, stride, virtual)
        p2, o2 = _places(runs2, w.size, stride, virtual)
        second = p2 >= 0
        p1[second], o1[second] = p2[second], o2[second] + base[p2[second]]
        out.append((p1, o1))
    return out


def plan_view(payloads: Sequence[int], writers: Sequence[Sequence[np.ndarray]], view: int) -> Layout:
    """The runs and streams of group ``view``'s directory.

    ``payloads``: per array leaf (manifest order) the bytes of one full chunk;
    ``writers``: per group, ordered by the group's lowest process, per leaf each chunk's
    writer in that group (``-1``: the group holds no copy). Every chunk is held by some
    group. Raises ``ValueError`` otherwise.

    Example (one leaf of two chunks; group 0 = process 0 holds chunk 0, group 1 =
    process 1 holds both: its stream has chunk 1, designated, then its copy of chunk 0):
        >>> w = [[np.array([0, -1])], [np.array([1, 1])]]
        >>> plan_view([60], w, 1)
        Layout(runs=[((1, 0, 1, 64), (1, 1, 1, 0))], streams={1: 128})
        >>> plan_view([60], w, 0)
        Layout(runs=[((0, 0, 1, 0), (1, 1, 1, 0))], streams={0: 64, 1: 64})
    """
    held = [np.stack([g[i] >= 0 for g in writers]) for i in range(len(payloads))]
    if any(not h.any(axis=0).all() for h in held if h.size):
        raise ValueError("a chunk no group holds")
    owner = [np.argmax(h, axis=0) for h in held]  # the first group holding each chunk
    virtual = 1 + max((int(w.max()) for g in writers for w in g if w.size), default=0)
    places = [_group_places(payloads, g, [o == k for o in owner], virtual) for k, g in enumerate(writers)]
    runs, ends = [], {}
    for i, payload in enumerate(payloads):
        entry = _streams.entry_bytes_for(payload)
        stride = _streams.stride_for(entry)
        proc, off = places[view][i]
        for k in range(len(writers)):
            take = (owner[i] == k) & (proc < 0)  # chunks this view's group holds no copy of
            proc[take], off[take] = places[k][i][0][take], places[k][i][1][take]
        runs.append(runs_of(proc, off, stride))
        for p, _, count, offset in runs[-1]:
            ends[p] = max(ends.get(p, 0), offset + (count - 1) * stride + entry)
    return Layout(runs, dict(sorted(ends.items())))
