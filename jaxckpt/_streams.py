"""Format 3's layout: where each chunk of each array leaf lies in its writer's byte stream.

Each writing process writes one stream of *entries*, one per chunk it writes: leaves in
manifest order, then each leaf's chunks in C order (flat index). An entry is the chunk's
full payload followed by its crc32c (``CRC_BYTES``), and starts on an ``ALIGN``-byte
boundary (zeros before it). Bytes ``[n*S, (n+1)*S)`` of process ``k``'s stream are the
data object ``p<k>.<n>`` (named and counted by ``_storage.objectnames``). A leaf records its entries as *runs*
``(process, first, count, offset)``: chunks ``first .. first+count-1`` lie in ``process``'s
stream at ``offset + i * stride``, ``stride = round_up(entry_bytes, ALIGN)``.

Pure arithmetic over the global tree (every process plans the same layout, so process 0
writes the manifest without asking the others), and the validation of the runs and
streams a manifest brings (untrusted input). No I/O, no jax.
"""

from __future__ import annotations

import bisect
import itertools
import operator
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from ._errors import CorruptCheckpointError

SEGMENT_BYTES = 1 << 30  # the default size of a data object (the last of a stream is shorter)
ALIGN = 64  # bytes; every entry starts on this boundary (aligned host buffers, as packed leaves had)
CRC_BYTES = 4  # the crc32c after each payload, little endian: an entry is a zarr3 chunk file's bytes
CODEC_RAW = "raw"
# Lossless codecs (``_codecs``): entries of varying sizes, one run per chunk and ``sizes``.
COMPRESSED = ("zstd", "blosc")
# Lossy forms (``_quantize``): entries of a size fixed by the chunk shape, runs as raw ones.
LOSSY = ("int8", "int4")
CODECS = (CODEC_RAW, *COMPRESSED, *LOSSY)

# Limits on untrusted input. A segment smaller than a page would make one entry's read a
# list of pieces about as big as the entry itself (``segments``); object stores refuse
# objects over 5 TiB.
MIN_SEGMENT_BYTES = 4096
MAX_SEGMENT_BYTES = 5 << 40
# A petabyte per process is past any host's share of any state, and keeps every offset
# sum and ``count * stride`` of a validated run inside int64.
MAX_STREAM_BYTES = 1 << 50
# Data objects a manifest may imply, ``ceil(length / segment_bytes)`` summed over its
# streams: verify, the listings and the copies between tiers walk them one by one. A
# million is a petabyte of the default 1 GiB objects; a 1 KB manifest declaring 16 TiB
# leaves in 4 KiB objects implied 17 billion (and verify walked them).
MAX_DATA_OBJECTS = 1 << 20
# The caller bounds a leaf's chunks (``_manifest``: 2**20); this bound only keeps the
# sums of counts here inside int64 whatever the caller passes.
_MAX_CHUNKS = 1 << 31
_MAX_MESSAGE = 500  # characters of a validation message (a hostile repr may be huge), as _manifest
_PROCESS_KEY = re.compile(r"0|[1-9][0-9]{0,7}")  # a stream's key: the process, in decimal

Run = tuple[int, int, int, int]  # (process, first, count, offset); format 4: a ref's stream id for process
MAX_REFS = 1 << 16  # format 4: the other steps' streams one manifest refers to
_POOL_NAME = re.compile(r"[0-9a-z][0-9a-z-]{0,63}")  # a pool entry: an attempt's token
_HASH = re.compile(r"[0-9a-f]{32}")  # a run's content hash: blake3, 128 bits, hex


class Ref(NamedTuple):
    """Format 4: a stream of another step's save that runs of this manifest refer to
    (stream id ``process_count + i`` for ``refs[i]``): process ``process``'s stream of
    the pool entry ``pool``, written by ``step``, in objects of ``segment_bytes``."""

    step: int
    pool: str
    process: int
    segment_bytes: int
    length: int


class Layout(NamedTuple):
    """The outcome of ``plan``: each leaf's runs (in the order given) and each writing
    process's stream length in bytes (only processes that write something)."""

    runs: list[tuple[Run, ...]]
    streams: dict[int, int]


def entry_bytes_for(payload_bytes: int) -> int:
    """An entry's bytes: the full chunk's payload, then its crc32c."""
    return payload_bytes + CRC_BYTES


def stride_for(entry_bytes: int) -> int:
    """The distance between consecutive entries of a run: ``entry_bytes`` rounded up to ``ALIGN``."""
    return -(-entry_bytes // ALIGN) * ALIGN


# --- planning ----------------------------------------------------------------------------


class _Pattern(NamedTuple):
    """One writer list's runs before offsets. Computed once per list: the leaves of a
    model's layers share one (``_snapshot`` caches writer lists per kind of leaf)."""

    procs: np.ndarray  # per run: its process
    firsts: np.ndarray  # per run: its first chunk
    counts: np.ndarray  # per run: its chunks
    rank: np.ndarray  # per run: chunks of this leaf its process writes before the run
    writers: np.ndarray  # the processes writing this leaf, sorted, distinct
    totals: np.ndarray  # per writer: the chunks of this leaf it writes


def _pattern(writers: Sequence[int] | np.ndarray) -> _Pattern:
    """The maximal runs of one leaf's writer list, and each run's rank among its
    process's chunks of the leaf (all vectorised: a leaf may have a million chunks)."""
    w = np.asarray(writers, dtype=np.int64)
    if w.ndim != 1:
        raise ValueError(f"writers must be one process per chunk, got shape {w.shape}")
    if w.size == 0:
        empty = np.zeros(0, np.int64)
        return _Pattern(empty, empty, empty, empty, empty, empty)
    if w.min() < 0:  # per-host groups mark chunks nobody in the group writes: not a format-3 layout
        raise ValueError(f"writer {int(w.min())}: every chunk needs a writing process")
    firsts = np.flatnonzero(np.concatenate(([True], w[1:] != w[:-1])))
    procs = w[firsts]
    counts = np.diff(np.append(firsts, w.size))
    # A process's runs in a leaf follow each other in its stream: its rank in the leaf is the
    # chunks of its earlier runs. Grouping runs by process (stable) makes that a cumsum.
    order = np.argsort(procs, kind="stable")
    by_proc, by_count = procs[order], counts[order]
    new = np.concatenate(([True], by_proc[1:] != by_proc[:-1]))
    before = np.cumsum(by_count) - by_count
    group_start = before[new]
    rank = np.empty_like(before)
    rank[order] = before - group_start[np.cumsum(new) - 1]
    totals = np.diff(np.append(group_start, w.size))
    return _Pattern(procs, firsts, counts, rank, by_proc[new], totals)


def _grown(a: np.ndarray, size: int) -> np.ndarray:
    """``a`` zero-extended to at least ``size`` (doubling, so growing costs O(1) a process)."""
    if size <= a.size:
        return a
    out = np.zeros(max(size, 2 * a.size), np.int64)
    out[: a.size] = a
    return out


def _one_writer(writers: Sequence[int] | np.ndarray) -> int:
    """The number of chunks when one process writes all of a leaf's (at least one) chunks,
    else 0. A list is checked in C (``count``): a single-process save's every leaf."""
    if len(writers) == 1:
        return 1
    if isinstance(writers, list) and writers and writers.count(writers[0]) == len(writers):
        return len(writers)
    return 0


def _place_whole(quick: dict[int, tuple[int, int]] | None, pos: np.ndarray, pad: np.ndarray, p: int, n: int,
                 entry: int) -> tuple[int, np.ndarray, np.ndarray]:
    """``plan``'s step for ``n`` entries of ``entry`` bytes that process ``p`` writes one
    after the other: their first offset, its ends moved on (``quick``, or the arrays)."""
    step = stride_for(entry)
    if quick is not None:
        offset = quick.get(p, (0, 0))[0]
    else:
        pos, pad = _grown(pos, p + 1), _grown(pad, p + 1)
        offset = int(pos[p])
    if offset + (n - 1) * step + entry > MAX_STREAM_BYTES:
        raise ValueError(f"a stream of more than {MAX_STREAM_BYTES} bytes")
    if quick is not None:
        quick[p] = (offset + n * step, step - entry)
    else:
        pos[p], pad[p] = offset + n * step, step - entry
    return offset, pos, pad


def _as_arrays(quick: dict[int, tuple[int, int]], column: int) -> np.ndarray:
    out = np.zeros(max(quick, default=-1) + 1, np.int64)
    for p, pair in quick.items():
        out[p] = pair[column]
    return out


def plan(leaves: Iterable[tuple[int, Sequence[int] | np.ndarray]]) -> Layout:
    """Lay the chunks of array leaves out in one stream per writing process.

    ``leaves``: per array leaf, in manifest order, ``(payload_bytes, writers)``: the bytes
    of one full chunk (edge chunks are padded to it) and the writing process of each chunk
    in C order. A writer list passed for several leaves is analysed once (it must not
    change during the call). A pure function of the global tree.

    Example:
        >>> plan([(60, [0, 1, 0, 1]), (4, [1])])
        Layout(runs=[((0, 0, 1, 0), (1, 1, 1, 0), (0, 2, 1, 64), (1, 3, 1, 64)), ((1, 0, 1, 128),)], \
streams={0: 128, 1: 136})
    """
    # per process: the next free (aligned) offset of its stream, and the padding after its
    # last entry (not in the stream); in dicts while every leaf so far is one writer's, then
    # in arrays (``pos``/``pad``: numpy from the first leaf analysed as a pattern on)
    quick: dict[int, tuple[int, int]] | None = {}
    pos = pad = np.zeros(0, np.int64)
    patterns: dict[int, tuple[Any, _Pattern]] = {}  # holds the lists, so no id is reused meanwhile
    tables: list[Any] = []  # per leaf its runs (a leaf one process writes whole: as returned; else a table)
    for payload, writers in leaves:
        if payload < 0:
            raise ValueError(f"payload of {payload} bytes")
        if (n := _one_writer(writers)) and int(writers[0]) >= 0:  # one chunk, or one writer: no numpy analysis
            p = int(writers[0])
            offset, pos, pad = _place_whole(quick, pos, pad, p, n, entry_bytes_for(payload))
            tables.append(((p, 0, n, offset),))  # its runs as they are returned
            continue
        if quick is not None:  # from here on in arrays
            pos, pad, quick = _as_arrays(quick, 0), _as_arrays(quick, 1), None
        hit = patterns.get(id(writers))
        if hit is None or hit[0] is not writers:
            hit = patterns[id(writers)] = (writers, _pattern(writers))
        pat = hit[1]
        if pat.procs.size == 0:  # a zero-size array has no chunks
            tables.append(pat.procs.reshape(0, 4))
            continue
        entry = entry_bytes_for(payload)
        step = stride_for(entry)
        pos, pad = _grown(pos, int(pat.writers[-1]) + 1), _grown(pad, int(pat.writers[-1]) + 1)
        offsets = pos[pat.procs] + step * pat.rank
        pos[pat.writers] += step * pat.totals
        pad[pat.writers] = step - entry
        if int(pos[pat.writers].max()) - step + entry > MAX_STREAM_BYTES:  # a reader would refuse it
            raise ValueError(f"a stream of more than {MAX_STREAM_BYTES} bytes")
        tables.append(np.stack((pat.procs, pat.firsts, pat.counts, offsets), axis=1))
    if quick is not None:  # every leaf written whole by one process: no numpy
        return Layout(list(tables), {p: at - gap for p, (at, gap) in sorted(quick.items()) if at})
    tables = [np.array(t, np.int64) if type(t) is tuple else t for t in tables]
    runs = _split(np.concatenate(tables) if tables else np.zeros((0, 4), np.int64), [len(t) for t in tables])
    written = np.flatnonzero(pos)
    return Layout(runs, dict(zip(written.tolist(), (pos[written] - pad[written]).tolist())))


# --- reading -----------------------------------------------------------------------------


def locate(runs: Sequence[Run], flat: int, stride: int) -> tuple[int, int]:
    """``(process, offset)`` of chunk ``flat`` of a leaf with these runs (sorted by first).

    Example:
        >>> locate([(0, 0, 2, 0), (1, 2, 3, 128)], 3, 64)
        (1, 192)
    """
    i = bisect.bisect_right(runs, flat, key=operator.itemgetter(1)) - 1
    if i < 0 or flat >= runs[i][1] + runs[i][2]:
        raise IndexError(f"chunk {flat} lies in no run")
    process, first, _, offset = runs[i]
    return process, offset + (flat - first) * stride


def find_entry(runs: Sequence[Run], entry_bytes: int, sizes: Sequence[int], flat: int) -> tuple[int, int, int]:
    """``(process, stream offset, entry bytes)`` of chunk ``flat`` of a stream leaf with
    these runs; a compressed leaf (``sizes``: one run per chunk) gives its chunk's size,
    0 for an all-zero chunk stored nowhere.

    Example:
        >>> find_entry([(0, 0, 1, 0), (1, 1, 1, 64)], 68, [40, 0], 0)
        (0, 0, 40)
    """
    if sizes:
        process, _, _, offset = runs[flat]
        return process, offset, sizes[flat]
    process, offset = locate(runs, flat, stride_for(entry_bytes))
    return process, offset, entry_bytes


def stored_bytes(runs: Sequence[Run], entry_bytes: int, sizes: Sequence[int]) -> int:
    """The bytes a stream leaf's entries take in the data objects (checksums included)."""
    return sum(sizes) if sizes else sum(r[2] for r in runs) * entry_bytes


# --- the manifest's fields ---------------------------------------------------------------


def runs_to_json(runs: Sequence[Run]) -> list[list[int]]:
    """A leaf's runs as the manifest writes them: ``[[process, first, count, offset], ...]``.

    Example:
        >>> runs_to_json(((0, 0, 3, 0),))
        [[0, 0, 3, 0]]
    """
    return [list(r) for r in runs]


def streams_to_json(streams: Mapping[int, int]) -> dict[str, int]:
    """The manifest's ``"streams"``: ``{"<process>": length}``, by process.

    Example:
        >>> streams_to_json({2: 76, 0: 12})
        {'0': 12, '2': 76}
    """
    return {str(p): streams[p] for p in sorted(streams)}


# --- validation of untrusted input ---------------------------------------------------------


def _bad(where: str, msg: str) -> CorruptCheckpointError:
    """The error of an invalid manifest, worded as ``_manifest.parse`` words its own."""
    if len(msg) > _MAX_MESSAGE:
        msg = msg[:_MAX_MESSAGE] + "…"
    return CorruptCheckpointError(f"Checkpoint '{where}': invalid manifest: {msg}")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)  # true == 1 in Python, not in a manifest


def segment_bytes_from_json(raw: Any, where: str) -> int:
    """The manifest's ``"segment_bytes"``, checked: an int in ``[MIN_SEGMENT_BYTES, MAX_SEGMENT_BYTES]``."""
    if not _is_int(raw) or not MIN_SEGMENT_BYTES <= raw <= MAX_SEGMENT_BYTES:
        raise _bad(where, f"segment_bytes {raw!r:.100} is not between {MIN_SEGMENT_BYTES} and "
                          f"{MAX_SEGMENT_BYTES}")
    return raw


def streams_from_json(raw: Any, process_count: int, where: str) -> dict[int, int]:
    """The manifest's ``"streams"``, checked: ``{"<process>": length}``, a process below
    ``process_count`` in plain decimal, a length in ``[1, MAX_STREAM_BYTES]``."""
    if not isinstance(raw, dict):
        raise _bad(where, "streams is not an object")
    if len(raw) > process_count:  # bounded before the loop: keys are distinct processes
        raise _bad(where, f"{len(raw)} streams for {process_count} processes")
    out = {}
    for key, length in raw.items():
        if not (_PROCESS_KEY.fullmatch(key) and int(key) < process_count):
            raise _bad(where, f"streams: key {key!r:.100} is not a process below process_count "
                              f"{process_count}")
        if not _is_int(length) or not 1 <= length <= MAX_STREAM_BYTES:
            raise _bad(where, f"streams: process {key}'s length {length!r:.100} is not between 1 and "
                              f"{MAX_STREAM_BYTES}")
        out[int(key)] = length
    return dict(sorted(out.items()))


def pool_name_ok(name: Any) -> bool:
    """A pool entry's name (an attempt's token): one safe path component."""
    return isinstance(name, str) and _POOL_NAME.fullmatch(name) is not None


def refs_from_json(raw: Any, where: str) -> tuple[Ref, ...]:
    """Format 4's ``"refs"``, checked: a list of at most ``MAX_REFS`` objects ``{"step",
    "pool", "process", "segment_bytes", "length"}``, no two alike."""
    if not isinstance(raw, list) or len(raw) > MAX_REFS:
        raise _bad(where, f"refs is not a list of at most {MAX_REFS} streams")
    out = []
    for i, r in enumerate(raw):
        if not isinstance(r, dict) or sorted(r) != sorted(Ref._fields):
            raise _bad(where, f"ref #{i} is not an object of {', '.join(Ref._fields)}")
        if not (_is_int(r["step"]) and 0 <= r["step"] < 1 << 63):
            raise _bad(where, f"ref #{i}: step {r['step']!r:.100}")
        if not pool_name_ok(r["pool"]):
            raise _bad(where, f"ref #{i}: pool {r['pool']!r:.100} is not a pool entry's name")
        if not (_is_int(r["process"]) and 0 <= r["process"] < 1 << 20):
            raise _bad(where, f"ref #{i}: process {r['process']!r:.100}")
        if not (_is_int(r["length"]) and 1 <= r["length"] <= MAX_STREAM_BYTES):
            raise _bad(where, f"ref #{i}: length {r['length']!r:.100} is not between 1 and {MAX_STREAM_BYTES}")
        out.append(Ref(r["step"], r["pool"], r["process"], segment_bytes_from_json(r["segment_bytes"], where),
                       r["length"]))
    if len({(r.pool, r.process) for r in out}) != len(out):
        raise _bad(where, "refs names a stream twice")
    return tuple(out)


def hashes_from_json(raw: Any, path: str, n_chunks: int, where: str) -> tuple[str, ...]:
    """A format-4 leaf's ``"hashes"``: one per run (at most one per chunk), 32 hex digits each."""
    if not (isinstance(raw, list) and len(raw) <= n_chunks
            and all(isinstance(h, str) and _HASH.fullmatch(h) for h in raw)):
        raise _bad(where, f"leaf '{path}': hashes is not a list of 32-digit hex strings, one per run")
    return tuple(raw)


def _run_table(raw: list[Any], bad) -> np.ndarray:
    """``raw`` as an ``(R, 4)`` int64 array, each run a list of four ints (no bools, no
    floats, nothing past int64). Type checks run in C (``map``) for the common case."""
    flat = list(itertools.chain.from_iterable(raw)) if set(map(type, raw)) <= {list} else None
    if flat is not None and set(map(len, raw)) <= {4} and set(map(type, flat)) <= {int}:
        try:
            return np.array(flat, dtype=np.int64).reshape(-1, 4)
        except OverflowError:
            pass
    for i, r in enumerate(raw):  # the slow path names the first bad run
        if not (isinstance(r, list) and len(r) == 4
                and all(_is_int(v) and -(1 << 63) <= v < 1 << 63 for v in r)):
            raise bad(f"run #{i} {r!r:.100} is not [process, first, count, offset] of integers")
    raise AssertionError("unreachable")  # pragma: no cover


def _first(mask: np.ndarray) -> int | None:
    """The index of the first ``False`` in ``mask``, or ``None``."""
    bad = np.flatnonzero(~mask)
    return int(bad[0]) if bad.size else None


def _check_cover(t: np.ndarray, n_chunks: int, bad) -> None:
    """Runs sorted by first cover chunks ``0 .. n_chunks-1`` exactly once."""
    first, count = t[:, 1], t[:, 2]
    if (i := _first((count >= 1) & (count <= n_chunks))) is not None:
        raise bad(f"run #{i} {t[i].tolist()}: count {count[i]} is not between 1 and the leaf's "
                  f"{n_chunks} chunks")
    ends = np.cumsum(count)  # <= R * n_chunks: inside int64
    expected = ends - count
    if (i := _first(first == expected)) is not None:
        raise bad(f"run #{i} {t[i].tolist()}: starts at chunk {first[i]}, but the runs before it end "
                  f"at chunk {expected[i]} (runs cover every chunk once, in order)")
    end = int(ends[-1]) if ends.size else 0
    if end != n_chunks:
        raise bad(f"runs cover {end} chunks, but the leaf has {n_chunks}")


class _StreamTable(NamedTuple):
    """The declared streams as sorted arrays, built once per manifest for every leaf's checks."""

    processes: np.ndarray
    lengths: np.ndarray
    by_process: dict[int, int]  # the same, for the one-run leaves' plain checks

    @classmethod
    def of(cls, streams: Mapping[int, int]) -> _StreamTable:
        order = sorted(streams)
        return cls(np.array(order, dtype=np.int64), np.array([streams[p] for p in order], dtype=np.int64),
                   dict(streams))


_FEW_RUNS = 16  # up to this many runs a leaf is checked in plain Python


def _few_valid_runs(raw: list[Any], n_chunks: int, entry_bytes: int, streams: _StreamTable) -> bool:
    """Whether ``raw`` is a few runs (up to ``_FEW_RUNS``) that pass every check: the
    common leaf (all its chunks by one writer, one chunk, or one run a process of a leaf
    sharded over a few processes), checked in plain Python, microseconds, where the
    table's numpy calls cost tens (1,000 small leaves of 4 processes: most of the
    manifest's parse). The same checks as ``_check_cover`` and ``_check_places``; any
    doubt answers ``False``, and the table's checks name what is wrong."""
    if not 1 <= len(raw) <= _FEW_RUNS:
        return False
    stride = stride_for(entry_bytes)
    expected, prev = 0, None
    for run in raw:
        if type(run) is not list or len(run) != 4 or {type(v) for v in run} != {int}:
            return False  # (type is int: no bool)
        process, first, count, offset = run
        length = streams.by_process.get(process)
        if (length is None or first != expected or not 1 <= count <= n_chunks or offset < 0 or offset % ALIGN
                or offset + (count - 1) * stride + entry_bytes > length):
            return False
        if prev is not None and prev[0] == process and offset == prev[3] + prev[2] * stride:
            return False  # continues the run before it: runs are maximal
        expected, prev = first + count, run
    return expected == n_chunks


def _check_places(t: np.ndarray, entry_bytes: int, streams: _StreamTable, bad) -> None:
    """Every run's entries lie in a declared stream, aligned, and runs are maximal."""
    proc, count, offset = t[:, 0], t[:, 2], t[:, 3]
    keys = streams.processes
    at = np.minimum(np.searchsorted(keys, proc), max(keys.size - 1, 0))
    if (i := _first((keys[at] == proc) if keys.size else np.zeros(len(t), bool))) is not None:
        raise bad(f"run #{i} {t[i].tolist()}: process {proc[i]} has no stream")
    if (i := _first((offset >= 0) & (offset % ALIGN == 0))) is not None:
        raise bad(f"run #{i} {t[i].tolist()}: offset {offset[i]} is not a non-negative multiple of {ALIGN}")
    stride = stride_for(entry_bytes)
    room = streams.lengths[at] - entry_bytes - offset  # bytes after the run's first entry: no overflow
    if (i := _first((room >= 0) & (count - 1 <= room // stride))) is not None:
        end = int(offset[i]) + (int(count[i]) - 1) * stride + entry_bytes
        raise bad(f"run #{i} {t[i].tolist()}: its entries end at byte {end}, past the end of process "
                  f"{proc[i]}'s stream ({streams.lengths[at[i]]} bytes)")
    # a reader never needs maximal runs, but every writer makes them: a run that continues
    # the one before is a digit changed on disk
    joins = (proc[1:] == proc[:-1]) & (offset[1:] == offset[:-1] + count[:-1] * stride)
    if (i := _first(~joins)) is not None:
        raise bad(f"run #{i + 1} {t[i + 1].tolist()} continues run #{i} {t[i].tolist()} (runs are maximal)")


def _checked_table(raw: Any, path: str, n_chunks: int, entry_bytes: int, streams: _StreamTable,
                   where: str) -> np.ndarray:
    """One leaf's runs as an ``(R, 4)`` array, every check of ``runs_from_json`` passed."""

    def bad(msg: str) -> CorruptCheckpointError:
        return _bad(where, f"leaf '{path}': {msg}")

    if not isinstance(raw, list):
        raise bad("runs is not a list")
    if not 0 <= n_chunks <= _MAX_CHUNKS:
        raise bad(f"{n_chunks} chunks is too many")
    if len(raw) > n_chunks:  # bounded before any conversion: every run holds a chunk
        raise bad(f"{len(raw)} runs for {n_chunks} chunks")
    if isinstance(entry_bytes, np.ndarray):  # a compressed leaf: its entries' sizes
        return _checked_sized(raw, n_chunks, entry_bytes, streams, bad)
    if _few_valid_runs(raw, n_chunks, entry_bytes, streams):
        return np.array(raw, dtype=np.int64)
    t = _run_table(raw, bad)
    _check_cover(t, n_chunks, bad)
    _check_places(t, entry_bytes, streams, bad)
    return t


def _checked_sized(raw: list[Any], n_chunks: int, sizes: np.ndarray, streams: _StreamTable, bad) -> np.ndarray:
    """A compressed leaf's runs: one per chunk, in order; each stored entry (size > 0)
    aligned inside its process's stream. A chunk of size 0 is stored nowhere: its run's
    process and offset are not looked at."""
    if len(raw) != n_chunks:
        raise bad(f"{len(raw)} runs for {n_chunks} chunks (a compressed leaf has a run per chunk)")
    t = _run_table(raw, bad) if raw else np.zeros((0, 4), np.int64)
    _check_cover(t, n_chunks, bad)
    rows = np.flatnonzero(sizes)
    proc, offset, size = t[rows, 0], t[rows, 3], sizes[rows]
    keys = streams.processes
    at = np.minimum(np.searchsorted(keys, proc), max(keys.size - 1, 0))
    if (i := _first((keys[at] == proc) if keys.size else np.zeros(len(rows), bool))) is not None:
        raise bad(f"run #{rows[i]} {t[rows[i]].tolist()}: process {proc[i]} has no stream")
    if (i := _first((offset >= 0) & (offset % ALIGN == 0))) is not None:
        raise bad(f"run #{rows[i]} {t[rows[i]].tolist()}: offset {offset[i]} is not a non-negative multiple of {ALIGN}")
    if (i := _first(offset <= streams.lengths[at] - size)) is not None:
        raise bad(f"run #{rows[i]} {t[rows[i]].tolist()}: its entry ends at byte {offset[i] + size[i]}, past the "
                  f"end of process {proc[i]}'s stream ({streams.lengths[at[i]]} bytes)")
    return t


def runs_from_json(raw: Any, path: str, n_chunks: int, entry_bytes: int, streams: Mapping[int, int],
                   where: str) -> tuple[Run, ...]:
    """One leaf's ``"runs"``, checked against its ``n_chunks`` chunks (computed by the
    caller from its validated shapes), its ``entry_bytes`` and the declared ``streams``:
    lists of four ints, sorted by first, covering every chunk exactly once, maximal, each
    entry ``ALIGN``-ed and inside its process's stream. Overlaps between runs are
    ``validate``'s, which checks every leaf of a manifest at once.

    Example:
        >>> runs_from_json([[0, 0, 2, 0]], "w", 2, 68, {0: 196}, "/ckpt")
        ((0, 0, 2, 0),)
    """
    table = _checked_table(raw, path, n_chunks, entry_bytes, _StreamTable.of(streams), where)
    return tuple(map(tuple, table.tolist()))


def max_stored_bytes(entry_bytes: int) -> int:
    """The most bytes a compressed entry of a chunk of ``entry_bytes`` raw may take: what
    the codecs add to data that does not compress is far less (a reader allocates this
    much at most for one entry)."""
    return 2 * entry_bytes + 4096


def sizes_from_json(raw: Any, path: str, n_chunks: int, entry_bytes: int, where: str) -> tuple[int, ...]:
    """A compressed leaf's ``"sizes"``, checked: per chunk (flat C order) its entry's bytes
    (encoded payload + crc32c), or 0 for a chunk whose bytes are all zero (nothing stored).

    Example:
        >>> sizes_from_json([0, 40], "w", 2, 68, "/ckpt")
        (0, 40)
    """
    if not isinstance(raw, list) or len(raw) != n_chunks:
        raise _bad(where, f"leaf '{path}': sizes is not a list of its {n_chunks} chunks' entry sizes")
    cap = max_stored_bytes(entry_bytes)
    if not (set(map(type, raw)) <= {int} and all(v == 0 or CRC_BYTES < v <= cap for v in raw)):
        i = next(i for i, v in enumerate(raw) if not (_is_int(v) and (v == 0 or CRC_BYTES < v <= cap)))
        raise _bad(where, f"leaf '{path}': size {raw[i]!r:.100} of chunk {i} is not 0 or from {CRC_BYTES + 1} "
                          f"to {cap} bytes")
    return tuple(raw)


def entry_bytes_from_json(raw: Mapping[str, Any], path: str, payload_bytes: int, where: str) -> int:
    """A format-3 array leaf's ``codec`` (``"raw"``) and ``entry_bytes``, checked: the
    latter is ``payload_bytes + CRC_BYTES``, the full chunk's bytes as the caller computes
    them from its validated ``chunk_shape`` and dtype.

    Example:
        >>> entry_bytes_from_json({"codec": "raw", "entry_bytes": 68}, "w", 64, "/ckpt")
        68
    """
    codec = raw.get("codec")
    if codec not in CODECS:
        raise _bad(where, f"leaf '{path}': codec {codec!r:.100} (this jaxckpt reads {', '.join(CODECS)})")
    entry = raw.get("entry_bytes")
    if not _is_int(entry) or entry != entry_bytes_for(payload_bytes):
        raise _bad(where, f"leaf '{path}': entry_bytes {entry!r:.100}, but its chunks are {payload_bytes} "
                          f"bytes and a crc32c of {CRC_BYTES}")
    return entry


def validate(leaves: Sequence[tuple[str, int, Any, Any]], streams: Mapping[int, int],
             where: str, refs: Mapping[int, int] | None = None) -> list[tuple[Run, ...]]:
    """Every array leaf's runs, checked; returns them. ``leaves``: per leaf ``(path,
    n_chunks, entry_bytes, raw runs)`` (a compressed leaf: its chunks' sizes, an int64
    array, for entry_bytes); ``streams`` as ``streams_from_json`` gives them.

    Each leaf's runs pass ``runs_from_json``'s checks; across leaves, runs never overlap
    within a stream, and each declared stream ends where its last entry does (no stream
    without entries, no bytes past them). A run spans ``[offset, offset + (count-1) *
    stride + entry_bytes)``; spans that interleave are refused even where the entries
    would fit in each other's gaps: no writer lays a stream out so. ``refs`` (format 4):
    the lengths of other steps' streams, by stream id: runs lie inside them, and each
    has one at least, but need not reach its end (the rest is another step's).

    Example:
        >>> validate([("a", 1, 12, [[0, 0, 1, 0]]), ("b", 1, 12, [[0, 0, 1, 64]])], {0: 76}, "/ckpt")
        [((0, 0, 1, 0),), ((0, 0, 1, 64),)]
    """
    table = _StreamTable.of({**streams, **(refs or {})})
    tables = [_checked_table(raw, path, n, entry, table, where) for path, n, entry, raw in leaves]
    rows, proc, start, end, leaf, run = _spans(tables, [entry for _, _, entry, _ in leaves])
    stored = end > start  # a compressed leaf's all-zero chunks are stored nowhere
    proc, start, end, leaf, run = proc[stored], start[stored], end[stored], leaf[stored], run[stored]
    order = np.lexsort((start, proc))
    proc, start, end, leaf, run = proc[order], start[order], end[order], leaf[order], run[order]
    same = proc[1:] == proc[:-1]
    if (i := _first(~same | (start[1:] >= end[:-1]))) is not None:
        a, b = i, i + 1
        raise _bad(where, f"leaf '{leaves[leaf[b]][0]}': run #{run[b]} (bytes {start[b]}..{end[b]}) "
                          f"overlaps leaf '{leaves[leaf[a]][0]}' run #{run[a]} (bytes {start[a]}..{end[a]}) "
                          f"in the stream of process {proc[b]}")
    last = np.flatnonzero(np.append(~same, True)) if proc.size else []  # each process's last span
    ends = {int(proc[k]): (int(end[k]), k) for k in last}
    for p in (refs or {}):
        if p not in ends:
            raise _bad(where, f"ref stream {p}: no run lies in it")
    for p, length in streams.items():
        if p not in ends:
            raise _bad(where, f"stream of process {p}: {length} bytes, but no run lies in it")
        stop, k = ends[p]
        if stop != length:
            raise _bad(where, f"stream of process {p}: {length} bytes, but its last entry (leaf "
                              f"'{leaves[leaf[k]][0]}' run #{run[k]}) ends at byte {stop}")
    return _split(rows, [len(t) for t in tables])


def _spans(tables: Sequence[np.ndarray], entries: Sequence[int | np.ndarray]) -> tuple[np.ndarray, ...]:
    """Every run of every leaf in one ``(R, 4)`` table, and each run's ``process, start,
    end, leaf, run`` (its byte span in its stream, where it comes from). One table, not a
    loop over leaves: a 70B state has 2,169 leaves and 432,099 runs. ``entries``: a leaf's
    entry bytes, or (compressed) each of its runs' one entry's."""
    sizes = np.array([len(t) for t in tables], dtype=np.int64)
    rows = np.concatenate(tables) if tables else np.zeros((0, 4), np.int64)
    if any(isinstance(e, np.ndarray) for e in entries):
        entry = np.concatenate([e if isinstance(e, np.ndarray) else np.full(n, e, np.int64)
                                for e, n in zip(entries, sizes.tolist())] or [np.zeros(0, np.int64)])
    else:
        entry = np.repeat(np.array(entries, dtype=np.int64), sizes)
    stride = -(-entry // ALIGN) * ALIGN
    leaf = np.repeat(np.arange(len(tables)), sizes)
    run = np.arange(len(rows)) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    return rows, rows[:, 0], rows[:, 3], rows[:, 3] + (rows[:, 2] - 1) * stride + entry, leaf, run


def _split(rows: np.ndarray, sizes: Sequence[int]) -> list[tuple[Run, ...]]:
    """``rows`` (every leaf's runs, one table) as each leaf's tuple of runs. Columns to
    lists of ints, zipped into tuples: no list per run, so hundreds of thousands of runs
    do not set off the garbage collector's full passes over a big heap (measured 3× faster)."""
    flat = list(zip(*rows.T.tolist())) if len(rows) else []
    bounds = [0, *itertools.accumulate(sizes)]
    return [tuple(flat[a:b]) for a, b in zip(bounds, bounds[1:])]


class ManifestStreams:
    """A format-3 manifest's stream fields while ``_manifest.parse`` reads it: the
    top-level ``segment_bytes`` and ``streams``, checked when made; each array leaf's
    codec and entry bytes, checked by ``leaf``, its raw runs kept; then ``runs``: every
    leaf's, checked together (``validate``, which bounds each leaf's runs by its chunks
    before converting any)."""

    FIELDS = ("segment_bytes", "streams")

    def __init__(self, doc: Mapping[str, Any], process_count: int, where: str):
        self.segment_bytes = segment_bytes_from_json(doc["segment_bytes"], where)
        self.streams = streams_from_json(doc["streams"], process_count, where)
        self.ref_base = process_count  # format 4: refs[i] is stream process_count + i
        objects = sum(-(-n // self.segment_bytes) for n in self.streams.values() if n > 0)  # objectnames.object_count
        if objects > MAX_DATA_OBJECTS:
            raise _bad(where, f"streams of {sum(self.streams.values())} bytes in data objects of {self.segment_bytes} "
                              f"bytes are {objects} data objects (at most {MAX_DATA_OBJECTS})")
        self.where = where
        self._leaves: list[tuple[str, int, Any, Any]] = []  # (path, n_chunks, entry_bytes or sizes, raw runs)
        # format 4 (``_manifest`` lets "refs" and "hashes" through in that version only)
        self.v4 = "pool" in doc
        self.refs = refs_from_json(doc["refs"], where) if self.v4 else ()
        self.hashes: list[tuple[str, ...]] = []  # per array leaf, as ``leaf`` saw them

    def leaf(self, raw: Mapping[str, Any], path: str, n_chunks: int,
             payload_bytes: int) -> tuple[str, int, tuple[int, ...]]:
        """An array leaf's ``(codec, entry_bytes, sizes)`` (sizes: compressed leaves only),
        checked; its raw runs kept for ``runs``."""
        entry = entry_bytes_from_json(raw, path, payload_bytes, self.where)
        sizes = None
        if raw["codec"] in COMPRESSED:
            sizes = sizes_from_json(raw.get("sizes"), path, n_chunks, entry, self.where)
        elif "sizes" in raw:
            raise _bad(self.where, f"leaf '{path}': sizes with codec {raw['codec']!r} (only compressed leaves "
                                   "have them)")
        self._leaves.append((path, n_chunks, entry if sizes is None else np.array(sizes, np.int64), raw.get("runs")))
        if "hashes" in raw and not self.v4:
            raise _bad(self.where, f"leaf '{path}': field 'hashes' needs format_version 4")
        self.hashes.append(hashes_from_json(raw["hashes"], path, n_chunks, self.where) if "hashes" in raw else ())
        return raw["codec"], entry, sizes or ()

    def runs(self) -> list[tuple[Run, ...]]:
        """Every array leaf's runs (in the order ``leaf`` saw them), validated."""
        base = self.ref_base
        runs = validate(self._leaves, self.streams, self.where,
                        {base + i: r.length for i, r in enumerate(self.refs)})
        for (path, _, _, _), got, hashes in zip(self._leaves, runs, self.hashes):
            if hashes and len(hashes) != len(got):
                raise _bad(self.where, f"leaf '{path}': {len(hashes)} hashes for {len(got)} runs")
        return runs
