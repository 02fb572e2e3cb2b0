"""``verify``: every stored chunk of a checkpoint read and checksummed, the layout
checked, with bounded memory; and what the scans share (``diff`` and per-leaf
statistics are in ``_diff``): the read budget, the progress meter, the reports' JSON.

Each scan plans its chunk reads first, streams them, and folds each chunk into a small
result, so host memory stays near ``SCAN_BUDGET_BYTES`` whatever the checkpoint's size.
``verify`` reads every stored chunk the way a restore does (whole interior chunks of big
leaves with ``_chunkfiles.read_chunk_file`` on a local disk, into one reused buffer per
thread; edge chunks, packed chunks and object stores through tensorstore), so a checksum
fails exactly where a restore would fail. (``diff`` and ``stats`` read regions that are
unions of whole saved chunks through ``_reader.Reader``, a batch of regions within the
budget at a time.) In format 3 every entry of every stream is read once
(``_dataobjects.read_entry``, as a restore reads it), a compressed or quantized one
decoded (``_reader.decode_entry``), and a damaged one names the leaf whose chunk it holds.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any, NamedTuple

import numpy as np

from . import _commit, _dtypes, _formats, _layout, _reader, _streams, _tasks
from ._errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from ._formats import orbaxverify as _orbaxverify
from ._html import human_bytes
from ._manifest import LeafRecord, Manifest, PackedArray
from ._storage import chunkfiles as _chunkfiles
from ._storage import dataobjects as _dataobjects
from ._storage import kvstore as _kvstore
from ._storage import location as _location
from ._storage import objectnames as _objectnames
from ._storage import zarr as _zarr
from ._storage.location import Location

# Bytes of chunk buffers held at once (reads in flight plus the batch being folded); a
# single chunk bigger than this is read alone.
SCAN_BUDGET_BYTES = 64 << 20
READ_THREADS = 4
# Key paths a summary names per damaged file before "and N more".
SUMMARY_NAMES = 5
# Missing data objects of one format-3 stream verify names one by one; a stream missing more
# (lost, or its length a lie) is one problem per leaf there, its objects and entries unwalked.
MISSING_OBJECTS_NAMED = 1024

Progress = Callable[[int, int], None]


# --- results ------------------------------------------------------------------------


def json_value(v: Any) -> Any:
    """``v`` as strict JSON: non-finite floats as ``"nan"``/``"inf"``/``"-inf"``,
    tuples as lists, anything not a JSON scalar as its ``repr``."""
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if v != v else ("inf" if v > 0 else "-inf")
    if isinstance(v, (list, tuple)):
        return [json_value(x) for x in v]
    if isinstance(v, dict):
        return {k: json_value(x) for k, x in v.items()}
    if v is None or type(v) in (bool, int, float, str):
        return v
    return repr(v)


@dataclasses.dataclass
class VerifyReport:
    """What ``verify`` found.

    Attributes:
      path: the checkpoint.
      ok: ``True`` when nothing is wrong (``problems`` is empty).
      leaves: leaves in the manifest (0 when the manifest itself is bad).
      chunks: stored chunks (chunk files or objects) the manifest implies.
      bytes_read: bytes of chunk data read and checksummed without error.
      seconds: wall time of the whole check.
      problems: one dict per problem and leaf, ``{"leaf", "chunk", "message"}``: the
        leaf's key path (``None`` for the manifest or an unowned file), the chunk
        (``"cell [i, j]"`` of a big leaf, ``"packed p<k> offset <n> (cell [i])"`` of a
        small one, or a file name) and what is wrong. Sorted by leaf, then chunk. One
        damaged packed chunk is a problem of every leaf with bytes in it.
      damaged: the same problems grouped, one dict per damaged file (or manifest
        entry) and cause, ``{"file", "message", "leaves", "chunks", "unrestorable"}``:
        the file relative to the checkpoint (``"manifest.json"``,
        ``"packed/p0/c/1"``, ``"arrays/3/zarr.json"``), what is wrong with it, the
        leaves it concerns (sorted) with the chunk of each held there, and whether
        those leaves (or, for the manifest, the whole checkpoint) cannot be restored.
        ``unrestorable`` is ``False`` for a file restores never read: a bad
        ``zarr.json`` (its leaves are then unreadable to other zarr readers only) or an
        unexpected file (no leaves); and for a format-3 data object of the wrong size
        (no leaves): its entries are read all the same, and each one it cuts off is a
        damaged entry of its own, naming its leaf and chunk. ``summary()`` prints it.
    """

    path: str
    ok: bool
    leaves: int
    chunks: int
    bytes_read: int
    seconds: float
    problems: list[dict[str, Any]]
    damaged: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    @property
    def unrestorable(self) -> list[str]:
        """The leaves a damaged chunk or file keeps from being restored (sorted)."""
        return sorted({leaf for d in self.damaged if d["unrestorable"] for leaf in d["leaves"]})

    def summary(self, names: int = SUMMARY_NAMES) -> str:
        """The report as the ``jaxckpt verify`` command prints it: a line for the
        checkpoint, then per damaged file its problem and the first ``names`` leaves
        it concerns with their count.

        Example:
          >>> print(jaxckpt.verify("/ckpts/100").summary())
          /ckpts/100: CORRUPT (55 leaves, 2 chunks, 4.0 MiB in 0.02s): 1 damaged file, 53 of 55 leaves cannot be restored
            packed/p0/c/0: Reading '/ckpts/100/packed/p0' failed: DATA_LOSS: ...
              53 leaves cannot be restored: 'layers/l00/b', 'layers/l00/s', ... and 48 more
        """
        return "\n".join([self._headline(), *(line for d in self.damaged for line in _damage_lines(d, names))])

    def _headline(self) -> str:
        head = (f"{self.path}: {'ok' if self.ok else 'CORRUPT'} ({leaf_count(self.leaves)}, "
                f"{_count(self.chunks, 'chunk')}, {human_bytes(self.bytes_read)} in {self.seconds:.2f}s)")
        if self.ok:
            return head
        head += f": {_count(len({d['file'] for d in self.damaged}), 'damaged file')}"
        lost = len(self.unrestorable)
        if lost:
            head += f", {lost} of {leaf_count(self.leaves)} cannot be restored"
        elif self.leaves:
            head += ", every leaf restorable"
        return head

    def to_json(self) -> dict[str, Any]:
        """The report as a JSON-able dict."""
        return json_value(dataclasses.asdict(self))


def _count(n: int, noun: str, plural: str | None = None) -> str:
    """``1 chunk``, ``2 chunks``: a count with its noun in the right number."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def leaf_count(n: int) -> str:
    return _count(n, "leaf", "leaves")


def _quoted(leaves: Sequence[str], names: int) -> str:
    """The first ``names`` key paths, quoted, and how many more there are."""
    shown = ", ".join(f"'{leaf}'" for leaf in leaves[:names])
    return shown + (f" and {len(leaves) - names} more" if len(leaves) > names else "")


def _damage_lines(d: dict[str, Any], names: int) -> list[str]:
    """One damaged file: a single leaf on one line (``leaf 'x' chunk ...: why``, as
    before grouping), several leaves as the problem then the leaves, never ``None``."""
    leaves, n = d["leaves"], len(d["leaves"])
    if d["unrestorable"] and n == 1:
        return [f"  leaf '{leaves[0]}' chunk {d['chunks'][0]}: {d['message']}"]
    lines = [f"  {d['message']}"]
    if d["unrestorable"] and n:
        lines.append(f"    {n} leaves cannot be restored: {_quoted(leaves, names)}")
    elif d["unrestorable"] and d["file"] == "manifest.json":
        lines.append("    no leaf can be restored without a valid manifest")
    elif n:  # a zarr.json: restores take the array's metadata from the manifest
        lines.append(f"    restores are unaffected; other zarr readers cannot read {leaf_count(n)}: "
                     f"{_quoted(leaves, names)}")
    return lines


class _Problem(NamedTuple):
    """One problem of one leaf (``leaf`` ``None``: of no leaf), with the damaged
    ``file`` it is grouped by, the group's text ``what`` and its ``effect``:
    ``"unrestorable"`` (a restore of the leaf fails or would read wrong bytes),
    ``"metadata"`` (a ``zarr.json``: other zarr readers fail, restores do not),
    ``"stray"`` (an unexpected file, harmful to no leaf) or ``"size"`` (a data object
    of the wrong size: the entries it cuts off are problems of their own)."""

    leaf: str | None
    chunk: str | None
    message: str
    file: str
    what: str
    effect: str


class _Problems:
    """Problems found so far; safe to add to from reading threads."""

    def __init__(self) -> None:
        self.items: list[_Problem] = []
        self._lock = threading.Lock()

    def add(self, leaf: str | None, chunk: str | None, message: str, *, file: str, what: str | None = None,
            effect: str = "unrestorable") -> None:
        with self._lock:
            self.items.append(_Problem(leaf, chunk, message, file, message if what is None else what, effect))

    def sorted(self) -> list[dict[str, Any]]:
        flat = [{"leaf": p.leaf, "chunk": p.chunk, "message": p.message} for p in self.items]
        return sorted(flat, key=lambda p: (p["leaf"] is None, p["leaf"] or "", p["chunk"] or "", p["message"]))

    def grouped(self) -> list[dict[str, Any]]:
        """One entry per damaged file and cause (see ``VerifyReport.damaged``): one bad
        packed chunk is one entry naming its leaves, not one line per leaf."""
        groups: dict[tuple[str, str], dict[str, str]] = {}
        effects: dict[tuple[str, str], str] = {}
        for p in self.items:
            held = groups.setdefault((p.file, p.what), {})
            effects[(p.file, p.what)] = p.effect
            if p.leaf is not None and p.effect != "stray":
                held.setdefault(p.leaf, p.chunk or "")
        out = []
        for (file, what), held in sorted(groups.items(), key=lambda g: (g[0][0] != "manifest.json", g[0])):
            leaves = sorted(held)
            out.append({"file": file, "message": what, "leaves": leaves, "chunks": [held[leaf] for leaf in leaves],
                        "unrestorable": effects[(file, what)] == "unrestorable"})
        return out


class Meter:
    """Bytes done out of a known total, reported to ``progress`` (serialised)."""

    def __init__(self, total: int, progress: Progress | None):
        self.total, self.done, self.good = total, 0, 0
        self._progress, self._lock = progress, threading.Lock()
        if progress is not None:
            progress(0, total)

    def add(self, nbytes: int, ok: bool = True) -> None:
        with self._lock:
            self.done += nbytes
            self.good += nbytes if ok else 0
            if self._progress is not None:
                self._progress(self.done, self.total)


# --- verify -------------------------------------------------------------------------


def verify(path: Any, *, progress: Progress | None = None) -> VerifyReport:
    """Check a checkpoint completely: its manifest, its layout and every stored byte.

    The manifest is validated (a bad one is reported, not raised). Every chunk of
    every leaf is read and its crc32c checked, the same way a restore reads it. Every
    element of every leaf must be stored exactly once: the regular chunk grid of a leaf
    covers its shape once by construction, so what is checked is that each cell is
    stored, and alone: packed byte ranges of small leaves may not overlap (the
    manifest's validation keeps them inside their packed array); on a local disk every
    chunk file must exist with its exact size and no unexpected file may lie under
    ``arrays/`` or ``packed/`` (below the manifest's data prefix, in format 2). In
    format 3 each entry of each stream is read once and checksummed (a compressed or
    quantized one also decoded, as a restore decodes it), and every data object
    ``data/p<k>.<n>`` must exist with its exact size (a bad one names the leaves with
    entries in it; a stream missing more than ``MISSING_OBJECTS_NAMED``, counted in the
    listing first on every store, is one problem per leaf there); the manifest's
    validation keeps entries from overlapping. (On an object store the other listing
    checks are skipped; a missing chunk still fails its read. Data prefixes the manifest
    does not name, attempts dead or in flight, are not the checkpoint's and are not checked.)

    An orbax-checkpoint step (or item) is read whole, chunk by chunk, and each chunk that
    cannot be read (missing, cut short, not decoding) is a problem; orbax stores no
    checksums, so a changed byte that still decodes is not found (``_formats.orbaxverify``).

    Memory stays near ``SCAN_BUDGET_BYTES`` (one chunk, when chunks are bigger).

    Args:
      path: the checkpoint (local path, URL or kvstore spec).
      progress: optional ``callable(bytes_done, bytes_total)``, called (serialised)
        from the reading threads as chunks finish.

    Returns:
      A ``VerifyReport``; ``ok`` is ``False`` when anything is wrong, each problem
      naming the leaf and the chunk.

    Raises:
      CheckpointNotFoundError: ``path`` holds no jaxckpt or orbax checkpoint.
      CheckpointError: it is a safetensors checkpoint (not verified).

    Example:
      >>> report = jaxckpt.verify("/ckpts/100")
      >>> report.ok, report.bytes_read
      (True, 1073741824)
      >>> [p["message"] for p in report.problems]
      []
    """
    return _verify(_location.resolve(path), progress)


def verify_part(path: Any, elsewhere: Collection[int]) -> VerifyReport:
    """``verify`` of a host's own directory of a step (``elsewhere``: processes whose streams others hold)."""
    return _verify(_location.resolve(path), None, frozenset(elsewhere))


def _verify(loc: Location, progress: Progress | None, elsewhere: frozenset[int] = frozenset()) -> VerifyReport:
    start = time.perf_counter()
    try:
        man = _formats.read_manifest(loc)  # also: a manifest copied from another step
    except CorruptCheckpointError as e:
        bad = _Problems()
        bad.add(None, "manifest.json", str(e), file="manifest.json", what=f"manifest.json: {e}")
        return VerifyReport(str(loc), False, 0, 0, 0, time.perf_counter() - start, bad.sorted(), bad.grouped())
    except CheckpointNotFoundError as e:  # an orbax step: every chunk read (it has no checksums)
        found = _orbaxverify.verify_foreign(loc, progress, e)
        return VerifyReport(str(loc), seconds=time.perf_counter() - start, **found)
    problems = _Problems()
    spans = _packed_spans(man)
    _check_overlaps(spans, problems)
    owners = _packed_owners(spans, man.packed)
    skip: set[str] = set()
    root = man.data_root(loc)  # file names below are relative to it
    found = list_files(root.local) if root.local is not None else None
    lost = _lost_streams(root, man, found, problems, elsewhere) | elsewhere
    if found is not None:
        skip = _check_files(found, man, expected_files(man, owners, lost), problems)
    reads, n_chunks = _plan_reads(root, man, owners, skip, lost)
    _check_array_metadata(root, man, owners, {r.array for r in reads}, problems)
    meter = Meter(sum(r.nbytes for r in reads), progress)
    _run_reads(reads, problems, meter)
    return VerifyReport(str(loc), not problems.items, len(man.leaves), n_chunks, meter.good,
                        time.perf_counter() - start, problems.sorted(), problems.grouped())


def _cell_label(cell: Sequence[int]) -> str:
    return f"cell {list(cell)}"


def _chunk_name(key: str, cell: Sequence[int]) -> str:
    """The chunk's file name relative to the checkpoint (zarr3 default key encoding)."""
    return "/".join(["arrays", key, "c", *map(str, cell)])


def _has_data(rec: LeafRecord, store: str) -> bool:
    return rec.kind != "value" and rec.store == store


class _Span(NamedTuple):
    """The bytes of one chunk of a packed leaf in its process's packed array."""

    process: int
    start: int
    end: int
    leaf: str
    label: str


def _packed_spans(man: Manifest) -> list[_Span]:
    out = []
    for rec in man.leaves:
        if not _has_data(rec, "packed"):
            continue
        itemsize = _dtypes.DTYPES[rec.dtype].itemsize
        for cell, (proc, offset) in zip(_layout.chunk_cells(rec.shape, rec.chunk_shape), rec.chunks):
            nbytes = _layout.index_size(_layout.chunk_region(cell, rec.chunk_shape, rec.shape)) * itemsize
            label = f"packed p{proc} offset {offset} ({_cell_label(cell)})"
            out.append(_Span(proc, offset, offset + nbytes, rec.path, label))
    return out


def _check_overlaps(spans: list[_Span], problems: _Problems) -> None:
    """Packed chunks (of different leaves, or of one) that share bytes."""
    reach: _Span | None = None  # the span reaching furthest so far in this process
    for span in sorted(s for s in spans if s.end > s.start):
        if reach is not None and reach.process == span.process and span.start < reach.end:
            message = (f"bytes [{span.start}, {span.end}) of packed p{span.process} overlap bytes "
                       f"[{reach.start}, {reach.end}) of leaf '{reach.leaf}' ({reach.label})")
            problems.add(span.leaf, span.label, message, file="manifest.json", what=f"manifest.json: {message}")
        if reach is None or reach.process != span.process or span.end > reach.end:
            reach = span


def _packed_owners(spans: list[_Span], packed: Sequence[PackedArray]) -> dict[tuple[int, int], dict[str, str]]:
    """Per stored packed chunk ``(process, n)``: the leaves with bytes in it, each with
    its first chunk there (to name when that stored chunk is bad)."""
    chunk_bytes = {p.process: p.chunk_bytes for p in packed}
    owners: dict[tuple[int, int], dict[str, str]] = collections.defaultdict(dict)
    for span in spans:
        if span.end > span.start:
            size = chunk_bytes[span.process]
            for n in range(span.start // size, (span.end - 1) // size + 1):
                owners[(span.process, n)].setdefault(span.leaf, span.label)
    return owners


def _owner_list(owners: dict[tuple[int, int], dict[str, str]], proc: int, n: int) -> tuple:
    held = owners.get((proc, n))
    return tuple(held.items()) if held else ((None, f"packed p{proc} chunk {n}"),)


def expected_files(man: Manifest, owners: Any = None,
                   lost: Collection[int] = ()) -> dict[str, tuple[int | None, tuple]]:
    """Every file the manifest implies (but the data objects of the streams in ``lost``): its
    size (``None``: any) and whom to name when it is missing or wrong (the two-tier copy
    checks that the hosts' listings cover these)."""
    owners = {} if owners is None else owners
    out: dict[str, tuple[int | None, tuple]] = {}
    for rec in man.leaves:
        if not _has_data(rec, "file"):
            continue
        out[f"arrays/{rec.key}/zarr.json"] = (None, ((rec.path, "zarr.json"),))
        # zarr stores edge chunks at full size
        size = math.prod(rec.chunk_shape) * _dtypes.DTYPES[rec.storage_dtype].itemsize + 4
        for cell in _layout.chunk_cells(rec.shape, rec.chunk_shape):
            out[_chunk_name(rec.key, cell)] = (size, ((rec.path, _cell_label(cell)),))
    for p in man.packed:
        out[f"packed/p{p.process}/zarr.json"] = (None, ((None, "zarr.json"),))
        for n in range(-(-p.nbytes // p.chunk_bytes)):
            out[f"packed/p{p.process}/c/{n}"] = (p.chunk_bytes + 4, _owner_list(owners, p.process, n))
    if man.streams:
        held = _segment_owners(man, lost)
        for proc, length in man.streams.items():
            if proc in lost:
                continue
            for n, size in enumerate(_dataobjects.segment_sizes(length, man.segment_bytes)):
                name = _object_name(proc, n)
                out[name] = (size, tuple(held.get(name, {}).items()) or ((None, name),))
    return out


def _object_name(process: int, n: int) -> str:
    """A format-3 data object's name relative to the checkpoint's data root."""
    return f"{_reader.STREAM_DIR}/{_objectnames.object_name(process, n)}"


def _segment_owners(man: Manifest, lost: Collection[int] = ()) -> dict[str, dict[str, str]]:
    """Per data object (not of the streams in ``lost``): the leaves with entries in it, each
    with its first chunk there (to name when the object is missing or of the wrong size)."""
    held: dict[str, dict[str, str]] = collections.defaultdict(dict)
    size = man.segment_bytes
    for rec in man.leaves:
        if not _has_data(rec, "stream"):
            continue
        stride, grid = _streams.stride_for(rec.entry_bytes), _layout.chunk_grid_shape(rec.shape, rec.chunk_shape)
        for proc, first, count, offset in rec.runs:
            entry = rec.sizes[first] if rec.sizes else rec.entry_bytes  # compressed: one chunk a run
            if not entry or proc in lost:
                continue  # an all-zero chunk, stored nowhere; or a stream reported whole
            end = offset + (count - 1) * stride + entry
            for n in range(offset // size, (end - 1) // size + 1):
                i = min(count - 1, max(0, (n * size - offset - rec.entry_bytes) // stride + 1))
                cell = np.unravel_index(first + i, grid) if grid else ()
                held[_object_name(proc, n)].setdefault(rec.path, _cell_label([int(c) for c in cell]))
    return held


def list_files(root: str) -> dict[str, int]:
    """Size of every file under ``root``'s data directories, by relative name."""
    found = {}
    for top in sorted(_commit.DATA_DIRS | {_reader.STREAM_DIR}):
        for dirpath, _, files in os.walk(os.path.join(root, top)):
            for f in files:
                full = os.path.join(dirpath, f)
                try:
                    size = os.stat(full).st_size
                except OSError:  # a dangling link: listed, unreadable
                    size = -1
                found[os.path.relpath(full, root).replace(os.sep, "/")] = size
    return found


def _lost_streams(root: Location, man: Manifest, found: dict[str, int] | None, problems: _Problems, skip: frozenset) -> set[int]:
    """Format 3: the streams missing more than ``MISSING_OBJECTS_NAMED`` of the objects their
    lengths imply (``found``: the local listing, their objects dropped from it; else listed
    here), each one problem per leaf with an entry there (its first chunk there)."""
    at = f"{_reader.STREAM_DIR}/"
    try:
        names = ([n[len(at):] for n in found if n.startswith(at)] if found is not None
                 else _dataobjects.stored_sizes(root.child(_reader.STREAM_DIR)) if man.streams else [])
    except CheckpointError:  # no listing: each entry's read reports what is missing
        return set()
    here = {p: n for p, n in man.streams.items() if p not in skip}
    lost = _objectnames.lost_streams(here, man.segment_bytes, names, MISSING_OBJECTS_NAMED)
    for p, why in lost.items():
        for rec in (r for r in man.leaves if _has_data(r, "stream")):
            first = next((f for q, f, _, _ in rec.runs if q == p and (not rec.sizes or rec.sizes[f])), None)
            if first is not None:
                cell = np.unravel_index(first, _layout.chunk_grid_shape(rec.shape, rec.chunk_shape))
                problems.add(rec.path, _cell_label([int(c) for c in cell]), f"{at}p{p}.*: {why}", file=f"{at}p{p}.*")
    for name in [n for n in names if (_objectnames.object_of(n) or (-1,))[0] in lost] if found is not None else ():
        del found[at + name]
    return set(lost)


def _check_files(found: dict[str, int], man: Manifest, expected: dict[str, tuple[int | None, tuple]],
                 problems: _Problems) -> set[str]:
    """Missing, wrong-sized and unexpected files (``found``: ``list_files``'s listing);
    returns the names not worth reading."""
    bad = set()
    for name, (size, owners) in expected.items():
        got = found.pop(name, None)
        if name.endswith("/zarr.json"):
            continue  # checked (missing too) by _check_array_metadata, on every store
        if got is None:
            why = "is missing"
        elif size is not None and got != size:
            why = f"has {got} bytes, expected {size}"
            if name.startswith(f"{_reader.STREAM_DIR}/") and got >= 0:
                # a data object holds many entries: read them all the same, so that a
                # truncated one costs exactly the chunks it cuts off (each its own problem)
                problems.add(None, name, f"{name} {why}", file=name, effect="size")
                continue
        else:
            continue
        bad.add(name)
        for leaf, chunk in owners:
            problems.add(leaf, chunk, f"{name} {why}", file=name)
    keys = {rec.key: rec.path for rec in man.leaves if _has_data(rec, "file")}
    for name in sorted(found):
        problems.add(_leaf_of(name, keys), name, f"unexpected file {name}", file=name, effect="stray")
    return bad


def _leaf_of(name: str, keys: dict[str, str]) -> str | None:
    """The big leaf whose directory ``arrays/<key>/`` holds file ``name``, if any."""
    parts = name.split("/")
    if parts[0] != "arrays":
        return None
    for i in range(len(parts) - 1, 1, -1):
        key = "/".join(parts[1:i])
        if key in keys:
            return keys[key]
    return None


class _Read(NamedTuple):
    """One stored chunk to read and checksum: the local chunk file ``path`` when set,
    else ``region`` of the tensorstore array ``store``."""

    name: str
    nbytes: int
    path: str | None
    store: Any
    region: _layout.Index
    dtype: np.dtype
    owners: tuple  # (leaf, chunk label) pairs to name when it fails
    array: str  # the array's directory: "arrays/<key>" or "packed/p<k>" (format 3: "data")
    entry: tuple | None = None  # format 3: the entry's (data root, process, stream offset, segment_bytes)
    leaf: LeafRecord | None = None  # format 3: a compressed or quantized leaf, whose entry is decoded too


def _plan_reads(loc: Location, man: Manifest, owners, skip: set[str],
                lost: Collection[int]) -> tuple[list[_Read], int]:
    """One read per stored chunk (not those of ``skip`` and ``lost``, already reported); also their number."""
    ctx = _kvstore.context(loc)
    reads, n_chunks = [], 0
    for rec in man.leaves:
        if not _has_data(rec, "file"):
            continue
        storage = _dtypes.DTYPES[rec.storage_dtype]
        spec = _zarr.array_spec(loc, rec.key, rec.shape, rec.chunk_shape, rec.storage_dtype)
        # opened as a restore opens it (the manifest's metadata), so a bad zarr.json is
        # its own problem (_check_array_metadata), not a failure of every chunk read
        store = _zarr.open_array(spec, ctx, create=False)
        direct = _reader.DIRECT_READS and loc.local is not None and (
            storage.itemsize == 1 or sys.byteorder == "little")
        for cell in _layout.chunk_cells(rec.shape, rec.chunk_shape):
            n_chunks += 1
            name = _chunk_name(rec.key, cell)
            if name in skip:
                continue
            region = _layout.chunk_region(cell, rec.chunk_shape, rec.shape)
            whole = _layout.index_shape(region) == tuple(rec.chunk_shape)  # edge chunks: tensorstore
            path = _chunkfiles.chunk_file(loc, rec.key, cell) if direct and whole else None
            reads.append(_Read(name, _layout.index_size(region) * storage.itemsize, path, store, region,
                               storage, ((rec.path, _cell_label(cell)),), f"arrays/{rec.key}"))
    for p in man.packed:
        store = _zarr.open_array(_zarr.packed_spec(loc, p.process, p.nbytes, p.chunk_bytes), ctx, create=False)
        for n in range(-(-p.nbytes // p.chunk_bytes)):
            n_chunks += 1
            name = f"packed/p{p.process}/c/{n}"
            if name not in skip:
                region = ((n * p.chunk_bytes, min((n + 1) * p.chunk_bytes, p.nbytes)),)
                reads.append(_Read(name, region[0][1] - region[0][0], None, store, region,
                                   np.dtype(np.uint8), _owner_list(owners, p.process, n), f"packed/p{p.process}"))
    n_chunks += sum(count for rec in man.leaves if _has_data(rec, "stream") for _, _, count, _ in rec.runs)
    return reads + _plan_entries(loc, man, skip, lost), n_chunks


def _plan_entries(loc: Location, man: Manifest, skip: set[str], lost: Collection[int]) -> list[_Read]:
    """Format 3: one read per entry (a chunk of a stream leaf), those in a data object
    already reported (``skip``; a run all in ``skip`` passed over whole) or in a stream
    reported whole (``lost``) left out."""
    root = loc.child(_reader.STREAM_DIR)
    reads = []
    for rec in man.leaves:
        if not _has_data(rec, "stream"):
            continue
        stride, grid = _streams.stride_for(rec.entry_bytes), _layout.chunk_grid_shape(rec.shape, rec.chunk_shape)
        for stream, first, count, offset in rec.runs:
            where, proc, size, prefix = root, stream, man.segment_bytes, ""
            if stream >= man.process_count and (ref := man.refs[stream - man.process_count]):  # format 4: a ref
                where = loc.parent().child(ref.pool).child(_reader.STREAM_DIR)
                proc, size, prefix = ref.process, ref.segment_bytes, f"../{ref.pool}/"
            entry = rec.sizes[first] if rec.sizes else rec.entry_bytes  # compressed: one chunk a run
            span = _objectnames.objects_spanned(offset, offset + (count - 1) * stride + entry, size)
            if not entry or (not prefix and (stream in lost or (len(span) <= len(skip) and all(
                    _object_name(proc, n) in skip for n in span)))):
                continue  # stored nowhere, or in data objects already reported: not walked entry by entry
            nbytes = entry - _streams.CRC_BYTES
            for i in range(count):  # (an all-zero compressed chunk is stored nowhere)
                at = offset + i * stride
                objects = [prefix + _object_name(proc, n) for n in range(at // size, (at + entry - 1) // size + 1)]
                if skip.intersection(objects):
                    continue
                name = " and ".join(objects)  # an entry may straddle two data objects
                cell = [int(c) for c in np.unravel_index(first + i, grid)] if grid else []
                reads.append(_Read(name, nbytes, None, None, (), np.dtype(np.uint8), ((rec.path, _cell_label(cell)),),
                                   _reader.STREAM_DIR, (where, proc, at, size),
                                   rec if rec.codec != _streams.CODEC_RAW else None))
    return reads


def _check_array_metadata(loc: Location, man: Manifest, owners, read: set[str], problems: _Problems) -> None:
    """Each array's ``zarr.json`` must agree with the manifest (restores never read it,
    but other zarr readers do): one problem per array whose opening failed, naming
    every leaf stored in it. Checked for the arrays with chunks to ``read`` (an array
    whose every chunk is already reported, e.g. by a manifest copied from elsewhere,
    gains nothing from a second account of the same mismatch)."""
    ctx = _kvstore.context(loc)
    checks = []  # (zarr.json name, leaves stored in the array, the opening)
    for rec in man.leaves:
        if _has_data(rec, "file") and f"arrays/{rec.key}" in read:
            spec = _zarr.array_spec(loc, rec.key, rec.shape, rec.chunk_shape, rec.storage_dtype)
            checks.append((f"arrays/{rec.key}/zarr.json", [rec.path],
                           _zarr.open_array(spec, ctx, create=False, check_metadata=True)))
    for p in man.packed:
        if f"packed/p{p.process}" in read:
            held = sorted({leaf for (proc, _), leaves in owners.items() if proc == p.process for leaf in leaves})
            spec = _zarr.packed_spec(loc, p.process, p.nbytes, p.chunk_bytes)
            checks.append((f"packed/p{p.process}/zarr.json", held,
                           _zarr.open_array(spec, ctx, create=False, check_metadata=True)))
    for name, leaves, opening in checks:
        try:
            opening.result()
        except Exception as e:  # noqa: BLE001 - reported, not raised
            cause = _kvstore.storage_cause(e)
            for leaf in leaves or [None]:
                problems.add(leaf, name, cause, file=name, what=f"{name}: {cause}", effect="metadata")


def _fail(problems: _Problems, read: _Read, error: BaseException) -> None:
    cause = _kvstore.storage_cause(error)
    for leaf, chunk in read.owners:
        problems.add(leaf, chunk, f"{read.name}: {cause}", file=read.name)


def _run_reads(reads: list[_Read], problems: _Problems, meter: Meter) -> None:
    """Tensorstore reads within the byte budget, then direct chunk-file reads on a few
    threads, each into its own reused buffer (as many threads as the budget holds)."""
    _tasks.run_bounded((_tensorstore_job(r, problems, meter) for r in reads if r.path is None and r.entry is None),
                       SCAN_BUDGET_BYTES)
    direct = [r for r in reads if r.path is not None or r.entry is not None]
    biggest = max((r.nbytes + (r.leaf and math.prod(r.leaf.chunk_shape) * _dtypes.DTYPES[r.leaf.dtype].itemsize or 0)
                   for r in direct), default=1)  # an entry held with the chunk it decodes to
    threads = max(1, min(READ_THREADS, SCAN_BUDGET_BYTES // max(biggest, 1)))
    buffers = threading.local()
    _tasks.run_tasks([functools.partial(_direct_read, r, buffers, problems, meter) for r in direct], threads)


def _direct_read(read: _Read, buffers: threading.local, problems: _Problems, meter: Meter) -> None:
    try:
        buf = getattr(buffers, "buf", None)
        if buf is None or buf.nbytes < read.nbytes:
            buffers.buf = None  # drop the old one before allocating its successor
            buf = buffers.buf = _chunkfiles.aligned_empty((read.nbytes,), np.uint8)
        if read.entry is not None:
            root, process, offset, segment_bytes = read.entry
            _dataobjects.read_entry(root, process, offset, read.nbytes, buf[:read.nbytes], segment_bytes)
            if read.leaf is not None:  # as a restore decodes it (the chunk dropped at once)
                _reader.decode_entry(read.leaf, buf[:read.nbytes])
        else:
            _chunkfiles.read_chunk_file(buf[:read.nbytes], read.path)
    except Exception as e:  # noqa: BLE001 - a bad chunk is a problem to report, not to raise
        _fail(problems, read, e)
        meter.add(read.nbytes, ok=False)
        return
    meter.add(read.nbytes)


class _Failed:
    """A future that failed before it started."""

    def __init__(self, error: BaseException):
        self._error = error

    def result(self) -> None:
        raise self._error


def _tensorstore_job(read: _Read, problems: _Problems, meter: Meter):
    held: list[np.ndarray] = []  # the buffer lives from start to finish only

    def start() -> Any:
        try:
            held.append(_chunkfiles.aligned_empty(_layout.index_shape(read.region), read.dtype))
            return _zarr.read_into(held[0], read.store.result(), read.region)
        except Exception as e:  # noqa: BLE001 - reported by finish
            return _Failed(e)

    def finish(future: Any) -> None:
        try:
            future.result()
        except Exception as e:  # noqa: BLE001 - a bad chunk is a problem to report, not to raise
            _fail(problems, read, e)
            meter.add(read.nbytes, ok=False)
        else:
            meter.add(read.nbytes)
        held.clear()

    return read.nbytes, start, finish
