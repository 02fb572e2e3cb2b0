"""Which chunks an array leaf is cut into and which process writes each: the chunk lists
of a save's leaves (``chunks``; shared, cached per shape and sharding), every chunk's
writer (``writers_of``: the same lists again for a repeated save of the same leaves),
and what one process writes of a leaf (``mine``: its chunks, and the pieces
``_snapshot`` hands the writer). Pure functions of the global tree (and, for ``mine``,
of the process asking): every process plans the same."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from . import _layout


class Chunk(NamedTuple):
    region: _layout.Index  # what the chunk covers (global coordinates)
    nbytes: int
    holders: tuple[int, ...]  # processes holding a copy: the candidates to write it
    shard: _layout.Index  # the saved shard it lies in


def piece_plan(chunks: list[Chunk]) -> tuple[tuple[Any, Any], ...]:
    """How ``_snapshot._ArrayLeaf.pieces`` cuts ``chunks`` (in C order): ``(shard, None)`` for a
    shard whose every row-block chunk is among them (one piece), ``(None, chunks)`` for
    a run of chunks of one shard that are pieces of their own."""
    out: list[tuple[Any, Any]] = []
    i = 0
    while i < len(chunks):
        first, j = chunks[i], i + 1
        shard = first.shard
        while j < len(chunks) and (chunks[j].shard is shard or chunks[j].shard == shard):
            j += 1
        region = first.region
        if region and region[1:] == shard[1:] and j - i > 1 and region[0][0] == shard[0][0] \
                and (shard[0][1] - shard[0][0]) == (j - i) * (region[0][1] - region[0][0]):
            out.append((shard, None))
        else:
            out.append((None, chunks[i:j]))
        i = j
    return tuple(out)


# What one process writes of a chunk list with a writer list (both shared between saves
# and between leaves of one kind, ``chunks_cached``/``fixed_writers``): its chunks, their
# pieces (``piece_plan``) and the shards they lie in; kept with the lists, so their ids
# stay theirs. The blocking part of an async save reads it instead of walking every chunk.
_MINE: dict[tuple[int, int, int], tuple[Any, Any, tuple[Any, Any, Any]]] = {}


def mine(chunks: list[Chunk], writers: list[int], me: int) -> tuple[
        list[Chunk], tuple[tuple[Any, Any], ...], tuple[_layout.Index, ...]]:
    """``(the chunks process me writes, their piece_plan, the shards they lie in)``.
    The result is shared: never mutated."""
    key = (id(chunks), id(writers), me)
    hit = _MINE.get(key)
    if hit is not None and hit[0] is chunks and hit[1] is writers:
        return hit[2]
    mine = [c for c, w in zip(chunks, writers) if w == me]
    out = (mine, piece_plan(mine), tuple(dict.fromkeys(c.shard for c in mine)))
    if len(_MINE) >= _CACHE_LIMIT:
        _MINE.clear()
    _MINE[key] = (chunks, writers, out)
    return out


# Leaves of one shape and sharding (a model's layers) share one chunk list and, when
# every chunk has one holder, one writer list: a state of thousands of leaves sharded
# over thousands of devices is chunked once per kind of leaf (see benchmarks/scale_sim.py).
_CHUNK_LISTS: dict[tuple[Any, ...], tuple[Any, list[Chunk]]] = {}
_FIXED_WRITERS: dict[int, tuple[list[Chunk], list[int], dict[int, int]] | None] = {}
_CACHE_LIMIT = 1024


def chunks_cached(shape: tuple[int, ...], chunk_shape: tuple[int, ...], shards: tuple[_layout.Shard, ...],
                  itemsize: int) -> list[Chunk]:
    """``chunks`` of ``shards`` as ``_layout.shards_of`` gives them (one object per
    sharding and shape). The result is shared: never mutated."""
    key = (shape, chunk_shape, id(shards), itemsize)
    hit = _CHUNK_LISTS.get(key)
    if hit is not None and hit[0] is shards:
        return hit[1]
    if len(_CHUNK_LISTS) >= _CACHE_LIMIT:
        _CHUNK_LISTS.clear()
        _FIXED_WRITERS.clear()
    out = chunks(shape, chunk_shape, shards, itemsize)
    _CHUNK_LISTS[key] = (shards, out)
    return out


def fixed_writers(chunks: list[Chunk]) -> tuple[list[int], dict[int, int]] | None:
    """The writers and per-process bytes of a chunk list whose every chunk has a single
    holder (no choice to make); ``None`` when some chunk is held by several processes."""
    hit = _FIXED_WRITERS.get(id(chunks))
    if hit is not None and hit[0] is chunks:
        return hit[1], hit[2]
    if any(len(c.holders) != 1 for c in chunks):
        return None
    writers = [c.holders[0] for c in chunks]
    loads: dict[int, int] = {}
    for c, w in zip(chunks, writers):
        loads[w] = loads.get(w, 0) + c.nbytes
    if len(_FIXED_WRITERS) >= _CACHE_LIMIT:
        _FIXED_WRITERS.clear()
    _FIXED_WRITERS[id(chunks)] = (chunks, writers, loads)
    return writers, loads


def chunks(shape: tuple[int, ...], chunk_shape: tuple[int, ...], shards: tuple[_layout.Shard, ...],
           itemsize: int) -> list[Chunk]:
    """Every chunk of an array of ``shape`` cut in ``chunk_shape``, in C order, with the
    shard it lies in (the last one overlapping it) and that shard's holders."""
    cells = _layout.chunk_cells(shape, chunk_shape)
    if len(cells) == 1 and len(shards) == 1:  # the common small-leaf case
        region = _layout.chunk_region(cells[0], chunk_shape, shape)
        return [Chunk(region, _layout.index_size(region) * itemsize, shards[0].processes, shards[0].index)]
    if shape and tuple(chunk_shape[1:]) == tuple(shape[1:]):  # row blocks (format 3's fine chunks)
        return row_chunks(shape, chunk_shape[0], shards, itemsize)
    owner: dict[tuple[int, ...], _layout.Shard] = {}
    for shard in shards:
        for cell, _ in _layout.chunks_overlapping(shard.index, chunk_shape):
            owner[cell] = shard
    out = []
    for cell in cells:
        region = _layout.chunk_region(cell, chunk_shape, shape)
        shard = owner[cell]
        out.append(Chunk(region, _layout.index_size(region) * itemsize, shard.processes, shard.index))
    return out


def row_chunks(shape: tuple[int, ...], height: int, shards: tuple[_layout.Shard, ...],
               itemsize: int) -> list[Chunk]:
    """``chunks`` where every chunk is a block of ``height`` whole rows: each shard's
    blocks by arithmetic (the owner of a block: the last shard overlapping it)."""
    n, rest = shape[0], tuple((0, d) for d in shape[1:])
    row_bytes = math.prod(shape[1:]) * itemsize
    owner: dict[int, _layout.Shard] = {}
    for shard in shards:
        a, b = shard.index[0]
        if b > a and all(y > x for x, y in shard.index[1:]):
            owner.update(dict.fromkeys(range(a // height, (b - 1) // height + 1), shard))
    out = []
    for k in range(-(-n // height) if all(shape[1:]) else 0):
        lo, hi, shard = k * height, min(k * height + height, n), owner[k]
        out.append(Chunk(((lo, hi), *rest), (hi - lo) * row_bytes, shard.processes, shard.index))
    return out


def repeated(last: list[Any], lists: Sequence[Any], key: tuple[Any, ...], make: Callable[[], Any]) -> Any:
    """``make()``, or what it gave the last time for the same ``lists`` (the very objects:
    shared, never mutated) and the same ``key``. For a plan that is a pure function of
    them: a training loop's repeated save of the same leaves reuses it. ``last``: the
    cache, one entry ``[key, lists (kept, so their ids stay theirs), result]``."""
    last_key, last_lists, result = last
    if key == last_key and len(lists) == len(last_lists) and all(a is b for a, b in zip(lists, last_lists)):
        return result
    result = make()
    last[:] = [key, tuple(lists), result]
    return result


_LAST_WRITERS: list[Any] = [None, (), None]  # ``writers_of``'s ``repeated`` entry


def writers_of(chunk_lists: list[list[Chunk]]) -> list[list[int]]:
    """Every chunk's writer, per chunk list (a save's array leaves, in order), balanced over
    the whole tree: the same plan in every process. Chunks with a single holder have no
    choice (counted first, whole lists at once, ``fixed_writers``); the rest are balanced
    on top (``_layout.assign_with_loads``).

    A repeated save of the same leaves (a training loop's: the same shared chunk lists)
    gets the same writer lists back, the very objects (``repeated``), so that what is
    cached per writer list (``mine``, the stream layout) is reused: replicated leaves no
    longer cost a new plan per save. The lists returned are shared: never mutated."""
    return repeated(_LAST_WRITERS, chunk_lists, (), functools.partial(_writers, chunk_lists))


def _writers(chunk_lists: list[list[Chunk]]) -> list[list[int]]:
    out: list[Any] = [None] * len(chunk_lists)
    load: dict[int, int] = {}
    flexible = []
    for i, chunks in enumerate(chunk_lists):
        fixed = fixed_writers(chunks)
        if fixed is None:
            flexible.append(i)
            continue
        out[i] = fixed[0]
        for p, n in fixed[1].items():
            load[p] = load.get(p, 0) + n
    picked = iter(_layout.assign_with_loads([(c.nbytes, c.holders) for i in flexible for c in chunk_lists[i]], load))
    for i in flexible:
        out[i] = [next(picked) for _ in chunk_lists[i]]
    return out
