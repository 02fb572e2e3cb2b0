"""``save`` and ``metadata``: blocking functions (``restore`` is in ``_restore``).

Save runs in two halves so the manager can split them across threads: ``snapshot``
(host buffers of everything this process writes; see ``_snapshot``) and
``save_snapshot`` (write, agree, manifest last, commit).

Neither keeps state between calls that changes what is written or read, but the
process keeps some: caches that make the next call cheaper (tensorstore contexts and
kvstore handles per location in ``_storage.kvstore``, chunk and writer lists per kind of
leaf in ``_snapshot``); the I/O statistics and fault points of ``_storage``; in a
multi-process job, ``_distributed``'s collective sequence number (every process takes
it in the same order) and heartbeat thread; and switches read when used, module flags
(``_writer.DIRECT_WRITES``, ``_commit.RENAME_EXCHANGE``) and environment variables
(``JAXCKPT_STALL_S``, ``JAXCKPT_IO_TIMEOUT_S``), which choose how bytes are written and
how long a wait may last, never which bytes. One does choose the bytes:
``JAXCKPT_FORMAT=1``, read by each snapshot, writes the layout of formats 1 and 2
instead of format 3's streams (``_snapshot``, ``_writer``); every process of a job must
set it alike.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import logging
import os
import re
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from . import _commit, _distributed, _dtypes, _formats, _layout, _manifest, _streams, _tree
from ._errors import CheckpointError
from ._manifest import LeafRecord, Manifest
from ._restore import key_dtype
from ._snapshot import FORMAT_ENV, Snapshot, snapshot
from ._storage import dataobjects as _dataobjects
from ._storage import location as _location
from ._storage import uploads as _uploads
from ._storage.location import Location
from ._writer import STREAM_DIR, place_compressed, write_data

_log = logging.getLogger("jaxckpt")


def build_manifest(snap: Snapshot, metadata: dict[str, Any] | None,
                   extra_info: dict[str, Any] | None = None, data: str = "") -> Manifest:
    """The manifest of a save; ``data`` is its data prefix (``_commit.data_key``). A
    snapshot laid out in streams (format 3, the default) is format version 3: its
    records carry their runs, the manifest every process's stream length. With
    ``JAXCKPT_FORMAT=1``, a checkpoint with a data prefix is version 2, one without
    (local disks) version 1."""
    from importlib.metadata import version as dist_version  # ~10 ms to import: only when saving

    from ._version import __version__

    info = {
        "library_version": __version__,
        "jax_version": jax.__version__,
        "tensorstore_version": dist_version("tensorstore"),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "created_unix": time.time(),
        "bytes": sum(r.nbytes for r in snap.records),
    }
    info.update(extra_info or {})
    if snap.streams is not None:
        return Manifest(format_version=_manifest.STREAMS_VERSION, structure=snap.structure, leaves=tuple(snap.records),
                        metadata=metadata or {}, process_count=_distributed.process_count(), info=info,
                        data=data, segment_bytes=snap.segment_bytes, streams=dict(snap.streams))
    return Manifest(
        format_version=_manifest.DATA_PREFIX_VERSION if data else _manifest.FORMAT_VERSION,
        structure=snap.structure,
        leaves=tuple(snap.records),
        metadata=metadata or {},
        process_count=_distributed.process_count(),
        info=info,
        packed=snap.packed,
        data=data,
    )


def _check_metadata(metadata: Any, name: str = "metadata") -> dict[str, Any]:
    """A JSON copy of the user's dict; the error names the offending key path.

    Checked up front because json.dumps names no key, silently turns int keys into
    strings, and writes ints the manifest reader refuses (over 40 digits).
    """
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise CheckpointError(f"{name} must be a dict, got {type(metadata).__name__}")
    reason = _manifest.unsaveable(metadata, name)
    if reason is not None:
        raise CheckpointError(reason)
    try:
        return json.loads(json.dumps(metadata))
    except (TypeError, ValueError) as e:  # not expected after the walk above
        raise CheckpointError(f"{name} must be JSON-serialisable: {e}") from None


def save_snapshot(path: Any, snap: Snapshot, *, metadata: Any = None, overwrite: bool = False,
                  info: Callable[[], dict[str, Any]] | None = None, timeout_s: float | None = None,
                  op_id: int | None = None, check: Callable[[], None] | None = None, dedup: Any = None) -> Manifest:
    """The writing half of ``save``: stage, write every shard, manifest last, commit.

    In a multi-process job every process calls this with its own snapshot. Process 0
    decides the outcome and every process learns that one outcome:

    1. process 0 prepares the staging location and broadcasts its token (or its error);
    2. every process writes its shards and posts whether that worked;
    3. process 0 waits for all of them (a slow writer is waited for as long as it is
       alive; see ``_distributed``), commits, and broadcasts the manifest bytes, or the
       error. The others take the manifest from that message, never by re-reading the
       file process 0 just renamed (on NFS a cached negative lookup fails that read).

    ``info`` is called on process 0 just before the commit; what it returns is added to
    the manifest's info (the manager's timings). ``check`` is called by every other
    process once its part is written, before it says so: what it raises fails the save
    in every process (a manager whose per-host writer lease was lost on that host).
    ``op_id`` is the collective sequence
    number (taken in program order by the caller). ``metadata`` must already have
    passed ``_check_metadata``. Returns the committed manifest.

    A snapshot staged in waves (see ``_snapshot.snapshot``) is written wave by wave in
    step 2; the agreement and the commit are the same. It is closed on return, written or
    not (a failed save frees its waves and stops the caller staging more).

    ``dedup`` (a manager's ``_manager.dedup.Dedup``, one process): the runs whose bytes a
    retained step holds refer to them (``dedup.apply``, on this thread), the rest is
    written to the manager directory's pool (``dedup.location``) and the manifest is
    format 4 (``dedup.finish``); a failed save's pool entry goes (``dedup.abort``).
    """
    try:
        final = _location.resolve(path)
        if snap.streams is not None:  # smaller data objects where each goes up whole
            snap.segment_bytes = _uploads.segment_bytes_for(final, snap.segment_bytes)
        op_id = _distributed.next_id() if op_id is None else op_id
        with _distributed.Operation(f"save{op_id}", str(final), timeout_s) as op:
            if _distributed.process_index() == 0:
                return _save_as_coordinator(op, final, snap, metadata, overwrite, info, dedup)
            return _save_as_follower(op, final, snap, check, dedup)
    finally:
        snap.close()


def _save_as_coordinator(op: _distributed.Operation, final: Location, snap: Snapshot, metadata: Any,
                         overwrite: bool, info: Callable[[], dict[str, Any]] | None, dedup: Any = None) -> Manifest:
    def stage() -> tuple[str, Location]:
        token = _commit.new_token(final)
        return token, _prepare_host_copy(final, token) if _per_host(snap) else _commit.prepare(final, token, overwrite)

    def work(token: str) -> tuple[bytes, Manifest]:
        t0 = time.perf_counter()
        data = _commit.data_location(final, token) if dedup is None else dedup.location(final, token)
        mine = snap if dedup is None else dedup.apply(snap, token)
        own = write_data(data, mine)
        write_seconds = time.perf_counter() - t0
        tables = op.wait_for("written", list(range(1, _distributed.process_count())))
        if _per_host(snap) and own:
            op.post("written", own)  # the other hosts' views locate some chunks in its entries
        done = place_compressed(mine, {**tables, 0: own}) if dedup is None else dedup.merge(mine, tables)
        _check_streams(data, done)
        extra = {"write_seconds": round(write_seconds, 6), **(info() if info is not None else {})}
        if done.lossy_resumes or any(rec.codec in _streams.LOSSY for rec in done.records):
            extra["lossy_resumes"] = done.lossy_resumes
        manifest = build_manifest(done, metadata, extra, _commit.data_key(final, token) if dedup is None else "")
        if dedup is not None:
            manifest = dedup.finish(manifest, token)
        return manifest.to_bytes(), manifest

    abort = functools.partial(_commit.abort if dedup is None else dedup.abort, final)
    return op.lead_commit(f"save of '{final}'", stage, work, functools.partial(_commit.commit, final), abort)


def _check_streams(data: Location, snap: Snapshot) -> None:
    """Before the manifest: in format 3 every process's data objects are there, at the
    sizes its layout gives; in the others no process wrote any. A process of the job
    whose ``JAXCKPT_FORMAT`` differs from process 0's wrote its chunks where process 0's
    manifest would not look: the save fails rather than commit without them. On an
    object store one listing of the attempt's ``data/`` (a request per 1,000 objects;
    GCS lists no sizes, so there only their presence is checked)."""
    if snap.streams is None:
        if data.local is not None:
            wrote = os.path.lexists(os.path.join(data.local, STREAM_DIR))
        else:
            wrote = bool(_dataobjects.stored_sizes(data.child(STREAM_DIR)))
        if wrote:
            raise CheckpointError(f"a process of the job wrote format 3's data objects, process 0 did not "
                                  f"({FORMAT_ENV}=1): set {FORMAT_ENV} alike in every process of the job")
        return
    stored = _dataobjects.stored_sizes(data.child(STREAM_DIR))
    expected: set[str] = set()
    for p, length in snap.streams.items():
        if _per_host(snap) and p not in snap.group:
            continue  # per-host directories: other hosts' processes' objects are on their disks
        for n, size in enumerate(_dataobjects.segment_sizes(length, snap.segment_bytes)):
            name = _dataobjects.segment_name(p, n)
            expected.add(name)
            got = "is missing" if name not in stored else f"has {stored[name]} bytes"
            if got != f"has {size} bytes" and not (name in stored and stored[name] is None):
                raise CheckpointError(f"process {p}'s data object {STREAM_DIR}/{name} {got}, its layout {size}: "
                                      f"was {FORMAT_ENV} set alike in every process of the job?")
    # A process that cut its stream finer (its store took no upload in parts: the s3 or gcs
    # extra missing there, ``uploads.segment_bytes_for``) wrote objects process 0's layout
    # has no place for; where sizes are listed its first object's size gives it away
    # above, where they are not (GCS) these do.
    extra = sorted(n for n in stored if _SEGMENT.fullmatch(n) and n not in expected
                   and not (_per_host(snap) and int(n[1:].split(".")[0]) not in snap.group))
    if extra:
        raise CheckpointError(f"data object {STREAM_DIR}/{extra[0]} is not in process 0's layout (data objects of "
                              f"{snap.segment_bytes} bytes): install jaxckpt's extras (s3, gcs) alike in every "
                              "process of the job")


_SEGMENT = re.compile(r"p[0-9]+\.[0-9]+")


def _save_as_follower(op: _distributed.Operation, final: Location, snap: Snapshot,
                      check: Callable[[], None] | None = None, dedup: Any = None) -> Manifest:
    # per-host directories: the first process of each group commits its host's copy
    leader = _per_host(snap) and snap.group[0] == _distributed.process_index()
    attempt: dict[str, Any] = {}  # the token, and this host's staging directory once made

    def work(token: str) -> bytes:
        attempt["token"] = token
        if _per_host(snap):
            attempt["staging"] = _prepare_host_copy(final, token)
        if dedup is None:
            table = write_data(_commit.data_location(final, token), snap)
        else:  # this process's part in the pool; what it decided goes to process 0
            write_data(dedup.location(final, token), dedup.apply(snap, token))
            table = dedup.table()
        if check is not None:
            check()
        return table

    def undo() -> None:
        if leader and "staging" in attempt:
            _commit.abort(final, attempt["staging"], attempt["token"])

    data = op.follow_commit(str(final), "written", work, undo)
    if _per_host(snap) and snap.streams is not None and 0 not in snap.group:
        data = _host_manifest(data, _host_view(op, snap), str(final))
    if leader:
        _commit_host_copy(final, attempt["staging"], data, attempt["token"])
    return _manifest.parse(data, str(final))


def _per_host(snap: Snapshot) -> bool:
    """Whether the processes of this save write to directories of their own (one per
    group of processes sharing a host's disk) rather than all to one."""
    return bool(snap.group) and len(snap.group) < _distributed.process_count()


def _host_view(op: _distributed.Operation, snap: Snapshot) -> Snapshot:
    """This host's snapshot with its compressed leaves placed (``place_compressed``), once
    process 0 committed (every process's table is posted then): from its group's tables,
    and from every other process's when a chunk it holds no copy of is compressed."""
    if all(rec.codec_config is None for rec in snap.records):
        return snap
    group = sorted(snap.group)
    tables = op.wait_for("written", group)
    missing = any(not rec.runs for rec in place_compressed(snap, tables, partial=True).records
                  if rec.codec_config is not None)
    if missing:
        others = [p for p in range(_distributed.process_count()) if p not in snap.group]
        tables.update(op.wait_for("written", others))
    return place_compressed(snap, tables)


def _host_manifest(data: bytes, snap: Snapshot, where: str) -> bytes:
    """Format 3, per-host directories: process 0's manifest as this host's copy has it.
    Process 0's locates every chunk at the copy its host or the first other host holding
    it wrote (``_hoststreams``); this host's locates the chunks it holds in its own
    streams, as its snapshot planned them (compressed ones: ``_host_view``). Everything
    else is process 0's."""
    man = _manifest.parse(data, where)
    leaves = tuple(dataclasses.replace(rec, runs=mine.runs, sizes=mine.sizes) if rec.store == "stream" else rec
                   for rec, mine in zip(man.leaves, snap.records))
    return dataclasses.replace(man, leaves=leaves, streams=dict(snap.streams)).to_bytes()


def _prepare_host_copy(final: Location, token: str) -> Location:
    """This host's staging directory for attempt ``token`` (per-host directories; every
    process of the group calls it). A committed copy of the step already there (left by
    a job whose other hosts lost theirs) is replaced at the commit."""
    if final.local is None:
        raise CheckpointError(f"'{final}': directories of their own per host must be local directories")
    if os.path.lexists(final.local) and not _commit.has_manifest(final):
        raise CheckpointError(f"'{final}' exists and is not a jaxckpt checkpoint (no manifest.json); "
                              "refusing to overwrite it")
    return _commit.make_staging(final, token)


def _commit_host_copy(final: Location, staging: Location, data: bytes, token: str) -> None:
    """Commit this host's copy of a step process 0 committed. The job's step stands
    either way: a host whose copy failed is found by the restore's agreement, which
    then reads the persistent tier."""
    try:
        _commit.commit(final, staging, data, token)
    except Exception as e:  # noqa: BLE001 - logged: the step is committed on process 0's host
        _log.warning("jaxckpt: committing this host's copy '%s' failed (restores of it fall back "
                     "to the persistent tier): %s", final, e)
        _commit.abort(final, staging, token)


def save(path: Any, tree: Any, *, metadata: dict[str, Any] | None = None,
         overwrite: bool = False, timeout_s: float | None = None, compression: Any = None,
         quantize: Any = None) -> None:
    """Save ``tree`` to ``path``, blocking until it is committed.

    Each distinct shard is written once, by one of the processes holding it; the
    chunks of replicated data are spread over the processes that hold them, balanced
    by bytes. The checkpoint becomes visible atomically: ``manifest.json`` is written
    last.

    Args:
      path: a local directory, an ``s3://``/``gs://``/``memory://`` URL, or a
        tensorstore kvstore spec dict.
      tree: any PyTree of ``jax.Array``, ``numpy.ndarray``, typed PRNG keys and
        ``int/float/bool/str/bytes/None``.
      metadata: a JSON-serialisable dict stored in the manifest.
      overwrite: replace an existing checkpoint at ``path`` (otherwise it raises).
      timeout_s: multi-process only: how long a process waits for a peer that has
        not started this save before it fails in all of them (default 30 s). A peer
        that is still writing is waited for as long as it makes progress; one that
        stops heartbeating fails the save within ``_distributed.STALE_S`` (10 s), one
        alive without progress within the stall bound (``JAXCKPT_STALL_S``, 600 s).
      compression: lossless compression of array leaves (default none): a codec,
        ``"zstd"`` or ``"blosc"`` (lz4 with byte shuffle), or ``(codec, level)``
        (zstd 1-22, default 3; blosc 0-9, default 5), for every array leaf; or a dict
        from key-path patterns (``fnmatch`` on the leaf paths ``metadata()`` lists, e.g.
        ``{"opt_state/*": "zstd"}``) to codecs, the first match winning, other leaves
        raw. Chunks whose bytes are all zero are stored as nothing. Each chunk keeps its
        crc32c (of the stored bytes). Not with ``JAXCKPT_FORMAT=1``. See
        ``docs/compression.md``.
      quantize: lossy, opt-in storage of optimizer moments (default none): a dict from
        key-path patterns to ``"int8"`` (per-block scales; for Adam's first moment) or
        ``"int4"`` (log-spaced, never 0 for a positive value; for the second moment),
        or a ``jaxckpt.Quantize``. Only float32/bfloat16/float16 leaves, never params
        (a ``params`` key at any depth outside an optimizer state, or an ``nnx.Param``),
        and every pattern must match an array leaf (else ``ValueError`` naming the nearest
        key paths, before anything is written); they come back in their dtype, not bit
        for bit. It wins over ``compression`` for the leaves it selects.

    Example:
      >>> jaxckpt.save("/tmp/ckpt", {"params": params, "step": 100})
    """
    _tree.refuse_tracers(tree, f"Saving '{path}'")  # (under jax.jit: before anything starts)
    metadata = _check_metadata(metadata)
    snap = snapshot(tree, copy_host_arrays=False, compression=compression, quantize=quantize)
    save_snapshot(path, snap, metadata=metadata, overwrite=overwrite, timeout_s=timeout_s)


# --- metadata -----------------------------------------------------------------------


class LeafInfo(NamedTuple):
    """Shape, dtype and saved sharding of one array leaf (no data is read)."""

    shape: tuple[int, ...]
    dtype: Any  # numpy dtype, or a jax PRNG key dtype
    sharding: _layout.SavedSharding | None
    path: str = ""
    nbytes: int = 0
    codec: str = "raw"  # how its chunks are stored: "raw", a lossless codec ("zstd", "blosc") or "int8"/"int4"
    stored_bytes: int | None = None  # not raw: what its entries take (checksums included)


class CheckpointInfo(NamedTuple):
    """What ``metadata(path)`` returns."""

    tree: Any  # nested dicts/lists of LeafInfo and inline Python values
    metadata: dict[str, Any]
    format_version: int
    info: dict[str, Any]  # versions, creation time, byte count, save stats
    path: str = ""


def _leaf_info(rec: LeafRecord) -> Any:
    if rec.kind == "value":
        return rec.value
    if rec.kind == "prng_key":
        dtype = key_dtype(rec.impl)
        shape = rec.shape[: rec.key_ndim]
    else:
        dtype, shape = _dtypes.DTYPES[rec.dtype], rec.shape
    codec = rec.codec or "raw"
    return LeafInfo(shape, dtype, _layout.sharding_from_json(rec.sharding), rec.path, rec.nbytes,
                    codec, None if codec == "raw" else rec.stored_nbytes)


def metadata(path: Any) -> CheckpointInfo:
    """Describe a checkpoint without reading array data.

    Example:
      >>> info = jaxckpt.metadata("/tmp/ckpt")
      >>> info.tree["params"]["w"].shape
      (1024, 1024)
    """
    with _tree.gc_paused():
        source = _formats.open_source(path)
        man = source.manifest
        tree = _tree.build(man.structure, lambda i: _leaf_info(man.leaves[i]))
    return CheckpointInfo(tree, man.metadata, man.format_version, man.info, str(source.loc))

