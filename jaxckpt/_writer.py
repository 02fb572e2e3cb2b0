"""The second half of a save: write this process's part of a ``Snapshot``, all in flight
at once, and return when every byte is durable. Mirrors ``_reader``: plan the writes,
then execute them.

Whole chunks of big leaves on a local disk are written as zarr3 chunk files directly
(``_chunkfiles.write_chunk_file``: no encode copy, hardware crc32c) by a few threads;
everything else (the packed small leaves, edge chunks, object stores) goes through
tensorstore within a byte budget that bounds its encode buffers.

Format 3 (``Snapshot.streams``, issue 22): every chunk this process writes is an entry
of its one stream (``_storage.dataobjects.StreamWriter`` under ``data/``), at the
offset its leaf's runs give, written from the snapshot's host buffers by a few threads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np

from . import _distributed, _dtypes, _layout, _quantize, _storage, _streams, _tasks
from ._errors import CheckpointError
from ._manifest import LeafRecord
from ._snapshot import Snapshot, cell_of
from ._storage import chunkfiles as _chunkfiles
from ._storage import codecs as _tscodecs
from ._storage import dataobjects as _dataobjects
from ._storage import kvstore as _kvstore
from ._storage import zarr as _zarr
from ._storage.location import Location
from ._waves import Wave

# Bytes of writes in flight at once: bounds tensorstore's encode buffers (host memory)
# while keeping the disk busy.
WRITE_BUDGET_BYTES = 256 << 20
WRITE_THREADS = 4
# Whole chunks of big leaves on a local disk are written without tensorstore (see
# _chunkfiles.write_chunk_file); False sends every write through tensorstore.
DIRECT_WRITES = True


class _Write(NamedTuple):
    """One chunk (or the packed array) to write: to the local file ``path`` if set, else
    through the tensorstore array ``store`` (an opening) at ``index``."""

    index: tuple[tuple[int, int], ...]
    data: np.ndarray  # in the storage dtype
    key: str  # for fault points and messages
    path: str | None
    store: Any


def write_data(staging: Location, snap: Snapshot) -> bytes:
    """Write this process's part of every leaf; return when every write is durable. What
    it returns is for process 0's manifest: where this process's compressed entries went
    (``compressed_table``; empty when it wrote none)."""
    try:
        _storage.fault("data:start", str(staging))
        if snap.streams is not None:
            return _write_stream(staging, snap)
        if snap.waves is not None:
            return _write_waves(staging, snap)
        writes = plan(staging, snap)
        execute(writes, staging)
        return b""
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - named for the user, chained for the details
        raise CheckpointError(f"Writing checkpoint '{staging}' failed: {e}") from e


def _write_waves(staging: Location, snap: Snapshot) -> bytes:
    """A snapshot staged in waves (``_snapshot.snapshot``'s budget): create the arrays
    once, then write each wave as it is staged and free it before taking the next."""
    assert snap.waves is not None
    _create_arrays(staging, snap)
    while (wave := snap.waves.take()) is not None:
        try:
            _write_wave(staging, snap, wave)
        finally:
            snap.waves.done(wave)
    return b""


# --- format 3: one stream per process ---------------------------------------------------


STREAM_DIR = "data"  # format 3's data objects: <checkpoint>/data/p<k>.<n>
# Consecutive entries up to this many bytes are written by one task: small chunks one
# after the other on one thread (threads only contend for the GIL over them), big ones
# spread over WRITE_THREADS.
ENTRY_BATCH_BYTES = 16 << 20


def _write_stream(staging: Location, snap: Snapshot) -> bytes:
    """Format 3: write this process's entries (every wave's, staged in waves) into its
    stream, then make the stream durable (``close``: fsync) before returning. A failure
    abandons the stream unsynced.

    Compressed leaves' entries go after the raw ones and their sizes make the stream's
    length, which the stream needs before its first entry: each compressed chunk is
    encoded once to learn its size (``_Encoder.size``, a few threads; the encoded bytes
    kept only within ``ENCODED_KEEP_BYTES``), the stream is opened, and it is encoded again
    (unless kept) as its entry is written (``_Encoder.write``). The encoded bytes held at
    once are thus bounded whatever the state's size (``ENCODED``). What is returned says
    where they went (``compressed_table``). In waves, a wave taken before every compressed
    chunk was sized (they are staged first) waits, holding its budget, for the stream."""
    assert snap.streams is not None
    me = _distributed.process_index()
    coder = _Encoder(snap)
    taken: list[Wave] = []
    written = 0
    try:
        with contextlib.ExitStack() as opened:
            stream, table = None, None
            for wave in _parts(snap):
                taken.append(wave)
                coder.size(snap, wave.sizing)
                if not wave.shards:  # sized only: its budget goes back at once
                    _release(snap, taken.pop())
                elif snap.waves is not None and wave.sizing_nbytes:  # held for the stream: its sized part goes
                    snap.waves.sized(wave)
                if not coder.sized:
                    continue  # later waves hold compressed chunks still to size
                if table is None:
                    table, length = coder.lay_out(snap.streams.get(me, 0))
                    if length:
                        stream = opened.enter_context(
                            _dataobjects.StreamWriter(staging.child(STREAM_DIR), me, length, snap.segment_bytes))
                while taken:
                    part = taken.pop(0)
                    try:
                        written += _write_entries(stream, snap, part.shards)
                        coder.write(stream, snap, part.shards)
                    finally:
                        _release(snap, part)
            coder.check_written()
            expected = sum(c for rec in snap.records for p, _, c, _ in rec.runs if p == me)
            if written != expected:  # a snapshot that does not match its own layout: never made durable
                raise CheckpointError(f"process {me} wrote {written} entries of its stream, its layout has {expected}")
    finally:
        coder.drop_kept()
        for part in taken:
            _release(snap, part)
    return table or b""


def _parts(snap: Snapshot) -> Iterator[Wave]:
    """What the writer takes in turn: the waves, or the whole snapshot as one."""
    if snap.waves is None:
        yield Wave(snap.file_shards, None, 0, sizing=snap.file_shards)
        return
    while (wave := snap.waves.take()) is not None:
        yield wave


def _release(snap: Snapshot, part: Wave) -> None:
    if snap.waves is not None:
        snap.waves.done(part)


# Encoded bytes of compressed chunks kept from the sizing pass for the write (so that a
# small state is encoded once); beyond it a chunk is encoded again as it is written. Not
# with a staging budget (max_staging_bytes): then only the chunks in flight are held.
ENCODED_KEEP_BYTES = 64 << 20


class _Held:
    """Encoded bytes of compressed chunks this process holds at once (``now``) and the most
    so far (``peak``; tests and benchmarks read it, ``reset`` starts it again)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.now = self.peak = 0

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.now += nbytes
            self.peak = max(self.peak, self.now)

    def sub(self, nbytes: int) -> None:
        with self._lock:
            self.now -= nbytes

    def reset(self) -> None:
        with self._lock:
            self.peak = self.now


ENCODED = _Held()


class _Encoder:
    """One save's compressed chunks of this process: sized (encoded, the bytes dropped or
    kept), laid out after the raw entries, then written (encoded again unless kept), each
    on ``WRITE_THREADS`` threads. Encoding counts as progress (``_storage.count``), as a
    write does, so a long encode is never taken for a hang by the peers waiting for it;
    fault point ``encode`` (key ``<leaf path>@<chunk>``) before each chunk is encoded."""

    def __init__(self, snap: Snapshot):
        self.keep_left = ENCODED_KEEP_BYTES if snap.waves is None else 0
        if snap.waves is None:
            self.expected = len(self._jobs(snap, snap.file_shards))
        else:
            self.expected = snap.encodes
        self.sizes: dict[tuple[int, int], int] = {}  # (slot, flat) -> encoded bytes; 0: all zero
        self.kept: dict[tuple[int, int], bytes] = {}
        self.offsets: dict[tuple[int, int], int] = {}
        self.done: set[tuple[int, int]] = set()
        self._lock = threading.Lock()

    @property
    def sized(self) -> bool:
        return len(self.sizes) >= self.expected

    @staticmethod
    def _jobs(snap: Snapshot, shards: dict[int, list[tuple[_layout.Index, np.ndarray]]]) -> list[
            tuple[int, int, LeafRecord, np.ndarray]]:
        jobs = []
        for slot, chunks in shards.items():
            rec = snap.records[slot]
            if rec.codec_config is None:
                continue
            grid = _layout.chunk_grid_shape(rec.shape, rec.chunk_shape)
            for region, data in split_rows(rec, chunks):
                jobs.append((slot, _layout.chunk_flat_index(cell_of(region, rec.chunk_shape), grid), rec, data))
        return jobs

    @staticmethod
    def _encode(rec: LeafRecord, flat: int, data: np.ndarray) -> bytes | None:
        _storage.fault("encode", f"{rec.path}@{flat}")
        out = _tscodecs.encode(rec.codec, rec.codec_config, entry_payload(rec, data))
        _storage.count()  # progress (see the class)
        return out

    def size(self, snap: Snapshot, shards: dict[int, list[tuple[_layout.Index, np.ndarray]]]) -> None:
        """Encode these chunks (``Snapshot.file_shards``' form; raw leaves' are skipped) to
        learn their sizes; keep their bytes while ``keep_left`` allows."""
        def one(slot: int, flat: int, rec: LeafRecord, data: np.ndarray) -> None:
            enc = self._encode(rec, flat, data)
            n = 0 if enc is None else len(enc)
            ENCODED.add(n)
            with self._lock:
                if (slot, flat) in self.sizes:
                    raise CheckpointError(f"leaf '{rec.path}': chunk {flat} was staged twice for encoding")
                self.sizes[slot, flat] = n
                keep = enc is not None and n <= self.keep_left
                if keep:
                    self.kept[slot, flat] = enc
                    self.keep_left -= n
            if not keep:
                ENCODED.sub(n)

        _tasks.run_tasks([functools.partial(one, *job) for job in self._jobs(snap, shards)], WRITE_THREADS)

    def lay_out(self, fixed: int) -> tuple[bytes, int]:
        """The compressed entries after the ``fixed`` bytes of raw ones, each aligned, in
        leaf then chunk order: the table for process 0 (``{"length": stream length,
        "leaves": {slot: [[flat, offset, entry bytes], ...]}}``, entry bytes 0 for a chunk
        stored nowhere) and the stream's length."""
        if not self.sizes:
            return b"", fixed
        pos, length = _streams.stride_for(fixed), fixed
        leaves: dict[str, list[list[int]]] = {}
        for slot, flat in sorted(self.sizes):
            n = self.sizes[slot, flat]
            rows = leaves.setdefault(str(slot), [])
            if not n:
                rows.append([flat, 0, 0])
                continue
            rows.append([flat, pos, n + _streams.CRC_BYTES])
            self.offsets[slot, flat] = pos
            length = pos + n + _streams.CRC_BYTES
            pos = _streams.stride_for(length)
        return json.dumps({"length": length, "leaves": leaves}).encode(), length

    def write(self, stream: _dataobjects.StreamWriter | None, snap: Snapshot,
              shards: dict[int, list[tuple[_layout.Index, np.ndarray]]]) -> None:
        """Write these compressed chunks' entries (each encoded again unless kept, checked
        to have the size it had when sized), a few threads, one chunk each at a time."""
        def one(slot: int, flat: int, rec: LeafRecord, data: np.ndarray) -> None:
            with self._lock:
                if (slot, flat) in self.done:
                    raise CheckpointError(f"leaf '{rec.path}': chunk {flat} was staged twice for writing")
                self.done.add((slot, flat))
                enc = self.kept.pop((slot, flat), None)
            want = self.sizes.get((slot, flat))
            if want is None:
                raise CheckpointError(f"leaf '{rec.path}': chunk {flat} was never sized before its write")
            if not want:
                return  # all zero: stored nowhere
            if enc is None:
                enc = self._encode(rec, flat, data)
                ENCODED.add(0 if enc is None else len(enc))
            got = 0 if enc is None else len(enc)
            try:
                if got != want:
                    raise CheckpointError(f"leaf '{rec.path}': chunk {flat} encoded to {want} bytes, then to {got} "
                                          f"(its {rec.codec} encoding is not deterministic)")
                if stream is None:
                    raise CheckpointError(f"leaf '{rec.path}': chunk {flat} has no stream to go to")
                stream.write_entry(self.offsets[slot, flat], np.frombuffer(enc, np.uint8))
            finally:
                ENCODED.sub(got)

        _tasks.run_tasks([functools.partial(one, *job) for job in self._jobs(snap, shards)], WRITE_THREADS)

    def check_written(self) -> None:
        if len(self.sizes) != self.expected or self.done != set(self.sizes):
            raise CheckpointError(f"process {_distributed.process_index()} sized {len(self.sizes)} compressed "
                                  f"chunks of the {self.expected} it writes and wrote {len(self.done)}")

    def drop_kept(self) -> None:
        """The kept bytes not written (a failed save): dropped and uncounted."""
        with self._lock:
            kept, self.kept = self.kept, {}
        ENCODED.sub(sum(map(len, kept.values())))


def place_compressed(snap: Snapshot, tables: dict[int, bytes], partial: bool = False) -> Snapshot:
    """Once every process has written: the compressed leaves' runs (one per chunk) and
    sizes from the processes' tables (``_write_stream``'s), and each stream's length with
    its compressed entries. The snapshot as is when it has none.

    One directory for the job (process 0, every table): each chunk's one entry. A
    directory per host (``snap.group``; each group wrote a copy of each chunk it holds):
    this host's view (``_hoststreams``), each chunk at its own group's copy, else at its
    designated copy (the first group's, by lowest process, holding it); a stream of
    another host is declared up to the end of the last entry the view locates there. The
    tables needed: this group's, and those of the groups designated for the chunks it
    holds no copy of (every one will do). ``partial``: a leaf these tables do not cover
    is left unplaced (no runs) rather than refused."""
    if snap.streams is None or all(rec.codec_config is None for rec in snap.records):
        return snap
    streams = dict(snap.streams)
    mine = set(snap.group) if snap.group and snap.groups else None
    rank = {p: 0 if mine is not None and p in mine else 1 + min(g) for g in snap.groups for p in g}
    found: dict[int, dict[int, tuple[int, int, int, int]]] = {}  # slot -> flat -> (rank, process, offset, size)
    for p, data in sorted(tables.items()):
        if not data:
            continue
        table = json.loads(data)
        if table["length"] and (mine is None or p in mine):
            streams[p] = table["length"]
        r = rank.get(p, 0)
        for slot, rows in table["leaves"].items():
            got = found.setdefault(int(slot), {})
            for flat, offset, size in rows:
                if flat not in got or r < got[flat][0]:
                    got[flat] = (r, p, offset, size)
    records = list(snap.records)
    for slot, rec in enumerate(records):
        if rec.codec_config is None:
            continue
        n = math.prod(_layout.chunk_grid_shape(rec.shape, rec.chunk_shape))
        got = found.get(slot, {})
        if sorted(got) != list(range(n)):
            if partial:
                continue
            raise CheckpointError(f"leaf '{rec.path}': its writers encoded {len(got)} of its {n} chunks")
        runs = tuple((got[f][1], f, 1, got[f][2]) for f in range(n))
        records[slot] = dataclasses.replace(rec, runs=runs, sizes=tuple(got[f][3] for f in range(n)))
        if mine is not None:
            for _, p, offset, size in got.values():
                if p not in mine and size:
                    streams[p] = max(streams.get(p, 0), offset + size)
    return dataclasses.replace(snap, records=records, streams=streams)


class _Entry(NamedTuple):
    """One chunk to write as an entry of this process's stream."""

    offset: int  # in the stream
    rec: LeafRecord
    data: np.ndarray  # the snapshot's host buffer
    nbytes: int


def _write_entries(stream: _dataobjects.StreamWriter | None,
                   snap: Snapshot, shards: dict[int, list[tuple[_layout.Index, np.ndarray]]]) -> int:
    """Write these chunks (``Snapshot.file_shards``' form) as entries, on a few threads,
    in batches of consecutive entries (``ENTRY_BATCH_BYTES``); returns how many."""
    me = _distributed.process_index()
    entries = []
    for slot, chunks in shards.items():
        rec = snap.records[slot]
        if rec.codec_config is not None:  # compressed: _encode_mine's
            continue
        grid = _layout.chunk_grid_shape(rec.shape, rec.chunk_shape)
        stride = _streams.stride_for(rec.entry_bytes)
        for region, data in split_rows(rec, chunks):
            flat = _layout.chunk_flat_index(cell_of(region, rec.chunk_shape), grid)
            process, offset = _streams.locate(rec.runs, flat, stride)
            if process != me or stream is None:
                raise CheckpointError(f"leaf '{rec.path}': chunk {flat} is process {process}'s to write, "
                                      f"not process {me}'s")
            entries.append(_Entry(offset, rec, data, data.nbytes))
    batches = _tasks.batches(entries, ENTRY_BATCH_BYTES)
    _tasks.run_tasks([functools.partial(_write_batch, stream, b) for b in batches], WRITE_THREADS)
    return len(entries)


def split_rows(rec: LeafRecord, pieces: list[tuple[_layout.Index, np.ndarray]]) -> Iterator[
        tuple[_layout.Index, np.ndarray]]:
    """Each chunk of ``pieces`` (``Snapshot.file_shards``' form): a piece taller than a
    chunk is a shard of whole row-block chunks (``_ArrayLeaf.pieces``), cut here into
    them (views); any other piece is one chunk."""
    height = rec.chunk_shape[0] if rec.chunk_shape else 0
    for region, data in pieces:
        if not region or region[0][1] - region[0][0] <= height:
            yield region, data
            continue
        start, stop = region[0]
        for k, row in enumerate(range(start, stop, height)):
            yield ((row, min(row + height, stop)), *region[1:]), data[k * height:(k + 1) * height]


def _write_batch(stream: _dataobjects.StreamWriter, batch: list[_Entry]) -> None:
    stream.write_entries([(e.offset, entry_payload(e.rec, e.data)) for e in batch])


def entry_payload(rec: LeafRecord, data: np.ndarray) -> np.ndarray:
    """A chunk's entry payload: the full ``chunk_shape`` in the storage dtype, C order,
    little endian. The host buffer itself (a view) in the common case; a copy for an edge
    chunk (padded with zeros, as zarr does), a strided buffer or a big-endian host."""
    storage = _dtypes.DTYPES[rec.storage_dtype]
    payload = data.view(storage)
    if not payload.flags.c_contiguous:  # (np.ascontiguousarray would make a 0-d array 1-d)
        payload = payload.copy(order="C")
    if payload.shape != tuple(rec.chunk_shape):
        full = np.zeros(rec.chunk_shape, storage)
        full[tuple(slice(0, n) for n in payload.shape)] = payload
        payload = full
    if sys.byteorder != "little" and storage.itemsize > 1:
        payload = payload.byteswap()
    if rec.codec in _quantize.FORMS:  # stored lossy: the encoded chunk (little endian by its format)
        try:
            return _quantize.encode(payload.view(_dtypes.DTYPES[rec.dtype]), rec.codec)
        except ValueError as e:
            raise CheckpointError(f"leaf '{rec.path}': {e}") from None
    return payload


def _create_arrays(staging: Location, snap: Snapshot) -> None:
    """Every big leaf's array (its zarr.json), on the process that creates them, settled
    before any wave is written: each wave then opens them blind, as the others do."""
    if _distributed.process_index() != (snap.group[0] if snap.group else 0):
        return
    ctx = _kvstore.context(staging)
    openings = []
    for rec in snap.records:
        if rec.kind != "value" and rec.store == "file":
            spec = _zarr.array_spec(staging, rec.key, rec.shape, rec.chunk_shape, rec.storage_dtype)
            openings.append(_Write((), np.empty(0), rec.key, None, _zarr.open_array(spec, ctx, create=True)))
    _open_all(openings)


def _write_wave(staging: Location, snap: Snapshot, wave: Wave) -> None:
    part = dataclasses.replace(snap, file_shards=wave.shards, packed_buf=wave.packed, waves=None)
    execute(plan(staging, part, create=False), staging)


def plan(staging: Location, snap: Snapshot, create: bool = True) -> list[_Write]:
    """Open (create, on process 0) every array this process writes to; one ``_Write`` per
    chunk. Nothing is written yet. ``create=False``: the arrays exist (a later wave)."""
    me = _distributed.process_index()
    creator = snap.group[0] if snap.group else 0  # writes each array's zarr.json
    ctx = _kvstore.context(staging)
    direct = DIRECT_WRITES and staging.local is not None
    writes = []
    if snap.packed_buf is not None:
        mine = next(p for p in snap.packed if p.process == me)
        spec = _zarr.packed_spec(staging, me, mine.nbytes, mine.chunk_bytes)
        store = _zarr.open_array(spec, ctx, create=True)
        writes.append(_Write((), snap.packed_buf, f"packed/p{me}", None, store))
    for slot, shards in snap.file_shards.items():
        rec = snap.records[slot]
        if not shards and me != creator:
            continue
        spec = _zarr.array_spec(staging, rec.key, rec.shape, rec.chunk_shape, rec.storage_dtype)
        # One process (of each directory's group) writes each array's zarr.json; the
        # others open blind from the spec.
        store = _zarr.open_array(spec, ctx, create=create and me == creator)
        storage = _dtypes.DTYPES[rec.storage_dtype]
        little = storage.itemsize == 1 or sys.byteorder == "little"
        for index, data in shards:
            if not data.size:
                continue
            path = None
            if direct and little and data.flags.c_contiguous:
                path = _chunkfiles.chunk_file(staging, rec.key, cell_of(index, rec.chunk_shape))
            writes.append(_Write(index, data.view(storage), rec.key, path, store))
    return writes


def execute(writes: list[_Write], staging: Location) -> None:
    """Run the planned writes: tensorstore ones within the byte budget while the direct
    ones run on a few threads; then make the new files' directory entries durable."""
    direct = [w for w in writes if w.path is not None]
    dirs = sorted({os.path.dirname(w.path) for w in direct})
    # Every array's zarr.json exists before any chunk is written through tensorstore.
    stores = _open_all(writes)
    for d in dirs:
        os.makedirs(d, exist_ok=True)

    def start(w: _Write) -> Callable[[], Any]:
        def go() -> Any:
            return _zarr.write_region(stores[id(w.store)], w.index, w.data, w.key)
        return go

    _tasks.run_bounded(
        ((w.data.nbytes, start(w), _wait) for w in writes if w.path is None), WRITE_BUDGET_BYTES)
    _tasks.run_tasks([functools.partial(_chunkfiles.write_chunk_file, w.path, w.data, w.key) for w in direct],
                     WRITE_THREADS)
    for d in parents_up_to(set(dirs), staging.local):
        _kvstore.fsync_dir(d)


def _wait(future: Any) -> None:
    future.result()


def _open_all(writes: list[_Write]) -> dict[int, Any]:
    """Every array opening of ``writes``, settled; the first error once all have: an
    open still in flight would (re)create its directories after a failed save's
    clean-up (a staging directory made read-only, full, ...)."""
    stores: dict[int, Any] = {}
    first: BaseException | None = None
    for w in writes:
        if id(w.store) not in stores:
            try:
                stores[id(w.store)] = w.store.result()
            except Exception as e:  # noqa: BLE001 - raised once every open settled
                stores[id(w.store)] = None
                first = first or e
    if first is not None:
        raise first
    return stores


def parents_up_to(dirs: set[str], root: str | None) -> list[str]:
    """``dirs`` and every directory between them and ``root`` (exclusive), deepest first."""
    out: set[str] = set()
    for d in dirs:
        while root is not None and d.startswith(root) and d != root and d not in out:
            out.add(d)
            d = os.path.dirname(d)
    return sorted(out, key=len, reverse=True)
