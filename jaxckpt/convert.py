"""Interop: import an orbax checkpoint, export to safetensors, re-layout offline.

Every function here reads its input as a ``_formats.Source`` (a jaxckpt checkpoint, an
orbax step, safetensors files), one leaf at a time through the source's reader, and
writes one leaf at a time (``_stream`` for jaxckpt checkpoints), so host memory stays
near the largest leaf whatever the checkpoint's size. They run in one process, outside
the training job; no device of the target mesh is needed.

Example:
  >>> from jaxckpt import convert
  >>> convert.from_orbax("/ckpt/orbax/1000", "/ckpt/jaxckpt/1000")
  ImportResult(path='/ckpt/jaxckpt/1000', leaves=212, arrays=210, total_size=1073741824)
  >>> convert.to_safetensors("/ckpt/jaxckpt/1000", "/export/model", select="params",
  ...                        dtype="bfloat16")
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from . import _dtypes, _formats, _layout, _restore, _tasks, _tree
from ._errors import CheckpointError, CheckpointNotFoundError, TreeMismatchError
from ._formats import safetensors as _safetensors
from ._formats import stream as _stream
from ._manager import orbaximport as _orbaximport
from ._manager.orbaximport import RunImportResult
from ._manifest import LeafRecord, Manifest
from ._storage import location as _location

__all__ = ["ExportResult", "ImportResult", "RunImportResult", "from_orbax", "relayout", "to_safetensors"]

Progress = Callable[[int, int], None]
# Hugging Face's default max_shard_size ("5GB", decimal).
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
_CAST_BLOCK_BYTES = 16 << 20  # elements cast and written at a time by to_safetensors
SMALL_BATCH_BYTES = 64 << 20  # small leaves read together (see _SmallLeaves)


# --- import ---------------------------------------------------------------------------


class ImportResult(NamedTuple):
    """What ``from_orbax`` wrote (as ``ExportResult`` tells what ``to_safetensors`` did).

    Attributes:
      path: the jaxckpt checkpoint written (``dest`` as a path or URL).
      leaves: how many leaves it holds: arrays, PRNG keys and inline values.
      arrays: how many of them hold array data (PRNG keys included).
      total_size: bytes of array data (uncompressed, as ``metadata`` counts them).
    """

    path: str
    leaves: int
    arrays: int
    total_size: int


def from_orbax(src: Any, dest: Any, *, overwrite: bool = False, progress: Progress | None = None,
               ) -> ImportResult | RunImportResult:
    """Convert the orbax-checkpoint checkpoint at ``src`` into a jaxckpt checkpoint at ``dest``.

    The tree structure, values, dtypes and recorded shardings are kept; each array's
    chunks follow its recorded sharding's shard shape (the whole array when none was
    recorded), so a restore onto the same mesh reads each chunk once. Leaves are read
    and written one at a time. An orbax run directory becomes a manager directory (each
    committed step as ``dest/<step>``, with its metrics; a rerun skips steps imported).

    Memory: tensorstore decodes orbax's compressed chunks on its own threads, and
    glibc's malloc keeps what those threads free in per-thread arenas, so the import
    would peak near 2.5× the largest leaf. This function therefore sets
    ``mallopt(M_MMAP_THRESHOLD, 1 MiB)`` for the process first (big buffers then go back
    to the system when freed; it peaks near 1×). Set ``JAXCKPT_KEEP_MALLOC=1`` to leave
    malloc alone.

    Args:
      src: an orbax step directory (or item directory), or run directory, or URL.
      dest: where the jaxckpt checkpoint goes (committed atomically, manifest last).
      overwrite: replace a checkpoint already at ``dest`` (a run: the steps both have).
      progress: called with ``(bytes done, bytes total)`` after each leaf.

    Returns:
      An ``ImportResult`` (the checkpoint written, its leaf and array counts, its bytes), or
      from a run directory a ``RunImportResult`` (also the steps imported and skipped).

    Raises:
      CheckpointError: ``src`` is a checkpoint of another format (jaxckpt, safetensors).
      CheckpointNotFoundError: nothing at ``src`` is a checkpoint.

    Example:
      >>> convert.from_orbax("/runs/a/checkpoints/1000", "/runs/a/jaxckpt/1000")
      ImportResult(path='/runs/a/jaxckpt/1000', leaves=212, arrays=210, total_size=1073741824)
    """
    try:
        source = _formats.open_source(src)
    except CheckpointNotFoundError:  # or an orbax run directory
        if (run := _orbaximport.import_run(src, dest, import_source, overwrite, progress)) is None:
            raise
        return run
    if source.format != "orbax":
        raise CheckpointError(
            f"'{source.loc}' is a {source.format} checkpoint, not an orbax-checkpoint one; from_orbax "
            "imports orbax checkpoints (relayout rewrites a jaxckpt checkpoint)")
    _stream.limit_malloc_retention()  # not with JAXCKPT_KEEP_MALLOC set
    return import_source(source, dest, overwrite=overwrite, progress=progress)


def import_source(source: _formats.Source, dest: Any, *, overwrite: bool = False,
                  progress: Progress | None = None, info: dict[str, Any] | None = None) -> ImportResult:
    """Write any ``Source`` as a jaxckpt checkpoint (what ``from_orbax`` runs); chunks
    follow each leaf's recorded sharding; ``info`` joins its manifest's info."""
    man = source.manifest
    leaves = [_retarget(rec, rec.sharding, None) for rec in man.leaves]
    written = _copy(source, dest, man.structure, list(range(len(leaves))), leaves, overwrite, progress, info)
    arrays = [r for r in written.leaves if r.kind != "value"]
    return ImportResult(str(_location.resolve(dest)), len(written.leaves), len(arrays),
                        sum(r.nbytes for r in arrays))


def _copy(source: _formats.Source, dest: Any, structure: dict[str, Any], indices: list[int],
          leaves: list[LeafRecord], overwrite: bool, progress: Progress | None, extra: Any = None) -> Manifest:
    """Write source leaves ``indices`` as ``leaves`` (their new records, same order);
    returns the manifest committed.

    A big leaf whose new chunks are unions of whole saved chunks is read chunk by chunk
    as the writer asks (each saved chunk read once, a few in flight); any other leaf is
    read whole once and written from views of that buffer (one leaf in memory)."""
    saved = [source.manifest.leaves[i] for i in indices]
    small = _SmallLeaves(source, saved)

    def chunk_data(i: int, rec: LeafRecord) -> _stream.ChunkData:
        if rec.nbytes >= _stream.SMALL_LEAF_BYTES and _aligned(saved[i], rec):  # big, in any format
            return functools.partial(_read_region, source, saved[i])
        return small.leaf(saved[i])  # the writer writes views of it, casting

    info = {"converted_from": {"path": str(source.loc), "format": source.format}, **(extra or {})}
    return _stream.write_checkpoint(dest, structure, leaves, chunk_data, metadata=source.manifest.metadata,
                             overwrite=overwrite, info=info, progress=progress)


def _aligned(saved: LeafRecord, rec: LeafRecord) -> bool:
    """Whether every chunk of ``rec`` covers whole saved chunks of ``saved``."""
    return len(saved.chunk_shape) == len(rec.shape) and all(
        c % s == 0 or c >= n for c, s, n in zip(rec.chunk_shape, saved.chunk_shape, rec.shape))


def _read_region(source: _formats.Source, rec: LeafRecord, index: _layout.Index) -> np.ndarray:
    reader = source.new_reader()
    reader.add(rec, index)
    reader.run()
    return reader.get(rec, index)


def _read_leaf(source: _formats.Source, rec: LeafRecord) -> np.ndarray:
    """The whole of one saved leaf, as a host array of its saved dtype."""
    return _read_region(source, rec, tuple((0, d) for d in rec.shape))


class _SmallLeaves:
    """Whole leaves, as ``_read_leaf`` gives them, for leaves asked for in (about) the
    order of ``recs``. The small leaves of a jaxckpt checkpoint are packed many to a
    stored chunk, which is read (and checksummed) whole: read one at a time, each chunk
    would be read once per leaf in it. They are read in batches of consecutive small
    leaves (up to ``SMALL_BATCH_BYTES`` of them) with one reader, each chunk once."""

    def __init__(self, source: _formats.Source, recs: list[LeafRecord]):
        self.source = source
        self.batch_of: dict[str, list[LeafRecord]] = {}
        self.ready: dict[str, np.ndarray] = {}
        if source.format != "jaxckpt":
            return
        small = [r for r in recs if r.kind != "value" and (r.store == "packed" or _small_entries(r))]
        for batch in _tasks.batches(small, SMALL_BATCH_BYTES):
            for rec in batch:
                self.batch_of[rec.path] = batch

    def leaf(self, rec: LeafRecord) -> np.ndarray:
        if rec.path in self.ready:
            return self.ready.pop(rec.path)
        batch = self.batch_of.get(rec.path)
        if batch is None:
            return _read_leaf(self.source, rec)
        reader = self.source.new_reader()
        whole = {r.path: tuple((0, d) for d in r.shape) for r in batch}
        for r in batch:
            reader.add(r, whole[r.path])
        reader.run()
        for r in batch:
            self.batch_of.pop(r.path, None)
            self.ready[r.path] = reader.get(r, whole[r.path])
        return self.ready.pop(rec.path)


def _small_entries(rec: LeafRecord) -> bool:
    """A small leaf of a format-3 checkpoint: entries of its own, but read with its
    neighbours all the same (one reader for many small leaves, not one each)."""
    return rec.store == "stream" and rec.nbytes < _stream.SMALL_LEAF_BYTES


def _retarget(rec: LeafRecord, sharding: dict[str, Any] | None, dtype: str | None,
              shard_shape: Sequence[int] | None = None) -> LeafRecord:
    """The record template of ``rec`` written with ``sharding`` (JSON), floats cast to
    ``dtype``; chunks are ``shard_shape``, or the shard shape ``sharding`` implies."""
    if rec.kind == "value":
        return LeafRecord(path=rec.path, kind="value", value=rec.value)
    out_dtype = _cast_to(rec.dtype, dtype)
    if shard_shape is None:
        shard_shape = _shard_shape_of(rec, sharding)
    chunk_shape = _layout.split_chunk_shape(shard_shape, 1, _dtypes.DTYPES[out_dtype].itemsize)
    return LeafRecord(path=rec.path, kind=rec.kind, dtype=out_dtype, shape=rec.shape, scalar=rec.scalar,
                      impl=rec.impl, key_ndim=rec.key_ndim, sharding=sharding, chunk_shape=chunk_shape)


def _shard_shape_of(rec: LeafRecord, sharding: dict[str, Any] | None) -> tuple[int, ...]:
    """The shard shape a recorded named sharding gives ``rec`` (its spec covers the
    leading dimensions: a PRNG key's key-data dimension stays whole); the whole leaf
    for any other sharding. An uneven split rounds up (the last chunk is shorter)."""
    saved = _layout.sharding_from_json(sharding)
    if saved is None or saved.type != "named":
        return tuple(rec.shape)
    sizes = saved.mesh_shape
    out = []
    for d, n in enumerate(rec.shape):
        entry = saved.spec[d] if d < len(saved.spec) else None
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        out.append(-(-n // math.prod(sizes.get(a, 1) for a in axes)))
    return tuple(out)


def _cast_to(saved: str, dtype: str | None) -> str:
    """The dtype a leaf of dtype ``saved`` is written as: ``dtype`` for floating leaves,
    unchanged for everything else (ints, bools, PRNG key data)."""
    return dtype if dtype is not None and _is_float(saved) else saved


def _is_float(name: str) -> bool:
    return name.startswith(("float", "bfloat"))


def _dtype_arg(dtype: Any) -> str | None:
    if dtype is None:
        return None
    try:
        name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    except TypeError:
        name = str(dtype)
    if name not in _dtypes.DTYPES or not _is_float(name):
        raise CheckpointError(f"dtype must be a floating dtype (e.g. 'bfloat16', 'float32'), got {dtype!r}")
    return name


# --- selection ------------------------------------------------------------------------


def _prefixes(select: Any) -> list[str] | None:
    if select is None:
        return None
    items = [select] if isinstance(select, str) else list(select)
    if not all(isinstance(s, str) for s in items) or not items:
        raise CheckpointError(f"select must be a key path prefix or a list of them, got {select!r}")
    return [s.strip("/") for s in items]


def _under(path: str, prefix: str) -> bool:
    return prefix == "" or path == prefix or path.startswith(prefix + "/")


def _select(source: _formats.Source, select: Any) -> tuple[list[int], dict[int, str]]:
    """Indices of the leaves under any prefix in ``select`` (all without one), and for
    each the longest prefix it is under. A prefix that selects nothing raises."""
    prefixes = _prefixes(select)
    leaves = source.manifest.leaves
    if prefixes is None:
        return list(range(len(leaves))), dict.fromkeys(range(len(leaves)), "")
    chosen: dict[int, str] = {}
    for i, rec in enumerate(leaves):
        under = [p for p in prefixes if _under(rec.path, p)]
        if under:
            chosen[i] = max(under, key=len)
    empty = [p for p in prefixes if not any(_under(r.path, p) for r in leaves)]
    if empty:
        near = {p: _tree.keys_near([r.path for r in leaves], p) for p in empty}  # what there is instead
        raise CheckpointError(f"Checkpoint '{source.loc}': select: no leaf under "
                              + "; ".join(f"'{p}' ({keys})" for p, keys in near.items()))
    return sorted(chosen), chosen


def _prune(node: dict[str, Any], keep: dict[int, int]) -> dict[str, Any] | None:
    """The structure with only the leaves in ``keep`` (renumbered), ``None`` when nothing
    is left. A list or tuple that loses items becomes a dict with int keys, so every
    kept leaf keeps its key path."""
    if "leaf" in node:
        return {"leaf": keep[node["leaf"]]} if node["leaf"] in keep else None
    kind = next(k for k in ("dict", "items", "list", "tuple") if k in node)
    pairs = node[kind] if kind in ("dict", "items") else list(enumerate(node[kind]))
    kept = [[k, sub] for k, c in pairs if (sub := _prune(c, keep)) is not None]
    if not kept:
        return None
    if kind in ("dict", "items"):
        return {**node, kind: kept}
    if len(kept) == len(pairs):
        return {kind: [c for _, c in kept]}
    return {"dict": kept}


# --- relayout -------------------------------------------------------------------------


def relayout(src: Any, dest: Any, *, shardings: Any = None, dtype: Any = None, select: Any = None,
             overwrite: bool = False, progress: Progress | None = None) -> None:
    """Rewrite a checkpoint so its chunks follow another layout, optionally casting and
    selecting, one leaf at a time.

    Each array's chunks become the shard shape of its new sharding, so a restore onto
    that layout reads every chunk once and no more than it needs. The shardings may
    live on a ``jax.sharding.AbstractMesh``: no device of the target mesh is needed.

    Args:
      src: the checkpoint to read (any format ``restore`` reads).
      dest: where the new checkpoint goes (may be ``src`` itself on a local disk: the
        old one is replaced at the commit, after everything was read).
      shardings: one ``jax.sharding.Sharding`` for every array (arrays with fewer
        dimensions than its spec are replicated on its mesh), or a PyTree of them
        (``None`` entries keep a leaf's recorded layout) with the key paths of the
        selected leaves (others are ignored); ``None`` keeps every recorded layout.
        The recorded sharding becomes the new one.
      dtype: cast floating-point arrays to this dtype (``"bfloat16"``); integer, bool
        and PRNG key arrays are never cast.
      select: a key path prefix or a list of them: only those leaves are written (key
        paths stay the same; a list that loses items comes back as a dict of int keys).
      overwrite: replace a checkpoint already at ``dest``.
      progress: called with ``(bytes done, bytes total)`` after each leaf.

    Example:
      >>> mesh = jax.sharding.AbstractMesh((2, 2), ("a", "b"))
      >>> convert.relayout("/ckpt/1000", "/ckpt/1000-2x2",
      ...                  shardings=NamedSharding(mesh, P(None, "b")))
    """
    source = _formats.open_source(src)
    final = _location.resolve(dest)
    if final.local is None and final == source.loc:
        raise CheckpointError(f"relayout of '{final}' onto itself works on a local disk only "
                              "(an object store has no rename: the source would be deleted first)")
    dtype = _dtype_arg(dtype)
    indices, _ = _select(source, select)
    man = source.manifest
    layouts = _layout_map(shardings, [man.leaves[i] for i in indices], source)
    leaves = []
    for i in indices:
        rec = man.leaves[i]
        target = layouts.get(rec.path)
        if target is None:
            leaves.append(_retarget(rec, rec.sharding, dtype))
        else:
            leaves.append(_retarget(rec, _sharding_json(target), dtype, _target_shard_shape(rec, target, source)))
    structure = man.structure if select is None else _prune(man.structure, {i: n for n, i in enumerate(indices)})
    _copy(source, final, structure, indices, leaves, overwrite, progress)


def _layout_map(shardings: Any, recs: list[LeafRecord], source: _formats.Source) -> dict[str, Any]:
    """Key path -> its new sharding (``None``: keep the recorded one)."""
    arrays = [r for r in recs if r.kind != "value"]
    if shardings is None:
        return {}
    if isinstance(shardings, jax.sharding.Sharding):
        return {r.path: _fit(shardings, r) for r in arrays}
    given = dict(_tree.flatten(shardings)[0])
    known = {r.path for r in source.manifest.leaves}
    unknown = sorted(set(given) - known)
    missing = sorted(r.path for r in recs if r.path not in given)
    if unknown or missing:
        parts = ([f"not in the checkpoint: {', '.join(unknown)}"] if unknown else []) + (
            [f"no entry for: {', '.join(missing)}"] if missing else [])
        raise TreeMismatchError(f"Checkpoint '{source.loc}': shardings and checkpoint differ; " + "; ".join(parts),
                                unknown + missing)
    bad = [r.path for r in recs if given[r.path] is not None
           and (r.kind == "value" or not isinstance(given[r.path], jax.sharding.Sharding))]
    if bad:
        raise TreeMismatchError(f"Checkpoint '{source.loc}': shardings entries must be a jax.sharding.Sharding "
                                "for arrays and None for inline values: " + ", ".join(bad), bad)
    return {r.path: given[r.path] for r in arrays}


def _fit(sharding: jax.sharding.Sharding, rec: LeafRecord) -> jax.sharding.Sharding:
    """One sharding for every array: an array of fewer dimensions than its spec has
    entries (a bias under a 2-D spec, a scalar) is replicated on the same mesh."""
    ndim = rec.key_ndim if rec.kind == "prng_key" else len(rec.shape)
    if isinstance(sharding, jax.sharding.NamedSharding) and len(sharding.spec) > ndim:
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    return sharding


def _sharding_json(sharding: jax.sharding.Sharding) -> dict[str, Any] | None:
    """How the manifest records ``sharding``; a ``NamedSharding`` on an ``AbstractMesh``
    (no devices) records its axis names and sizes like one on a concrete mesh."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        mesh = sharding.mesh
        return {"type": "named", "axis_names": [str(a) for a in mesh.axis_names],
                "axis_sizes": [int(s) for s in mesh.axis_sizes],
                "spec": [list(e) if isinstance(e, tuple) else e if e is None or isinstance(e, str) else str(e)
                         for e in sharding.spec]}
    return _layout.sharding_to_json(sharding)


def _target_shard_shape(rec: LeafRecord, sharding: jax.sharding.Sharding, source: _formats.Source) -> tuple[int, ...]:
    """``sharding.shard_shape`` of the leaf (of a PRNG key's key shape, its key-data
    dimension whole); an uneven split rounds up."""
    key_ndim = rec.key_ndim if rec.kind == "prng_key" else len(rec.shape)
    shape = tuple(rec.shape[:key_ndim])
    if isinstance(sharding, jax.sharding.NamedSharding) and len(sharding.spec) > len(shape):
        raise CheckpointError(f"Checkpoint '{source.loc}': leaf '{rec.path}': sharding {sharding.spec} has more "
                              f"entries than the array's {len(shape)} dimensions")
    try:
        shard = tuple(sharding.shard_shape(shape))
    except ValueError:  # not evenly divisible: chunks as jax would split it, the last shorter
        if not isinstance(sharding, jax.sharding.NamedSharding):
            raise
        shard = _shard_shape_of(LeafRecord(path=rec.path, kind="array", shape=shape), _sharding_json(sharding))
    return shard + tuple(rec.shape[key_ndim:])


# --- safetensors ----------------------------------------------------------------------


class ExportResult(NamedTuple):
    """What ``to_safetensors`` wrote.

    Attributes:
      files: the files written (the ``.safetensors`` files, then the index if any).
      tensors: how many tensors they hold.
      total_size: bytes of tensor data (the index's ``metadata.total_size``).
      skipped: key paths of the selected leaves that are not tensors (PRNG keys, inline
        values), left out.
    """

    files: tuple[str, ...]
    tensors: int
    total_size: int
    skipped: tuple[str, ...]


class _Tensor(NamedTuple):
    rec: LeafRecord
    name: str
    dtype: str  # the dtype written
    nbytes: int


def to_safetensors(path: Any, out: str | os.PathLike, *, select: Any = None, dtype: Any = None,
                   max_shard_bytes: int | None = None, key_map: Any = None, keep_value: bool = False,
                   overwrite: bool = False, progress: Progress | None = None) -> ExportResult:
    """Export a checkpoint's arrays as safetensors (for inference, Hugging Face, PyTorch).

    The tensors are consolidated from the saved shards and streamed one at a time: the
    header is computed from the shapes, then each tensor is read whole and written, so
    host memory stays near the largest tensor.

    Names are the key paths below the selected prefix with ``.`` separators
    (``params/dense/kernel`` with ``select="params"`` → ``dense.kernel``). nnx's
    ``value`` level goes: a leaf named ``value`` that is the only leaf of its parent
    (``kernel/value`` of an ``nnx.Param``) is named by its parent (``kernel``), as
    Hugging Face consumers expect. ``key_map`` then renames. PRNG keys and inline values
    are not tensors and are skipped (their key paths are in ``ExportResult.skipped``);
    export key data with ``jax.random.key_data`` before saving if a consumer needs it.

    Args:
      path: the checkpoint (any format ``restore`` reads).
      out: a file ending in ``.safetensors`` (one file), or a directory: there
        ``model-0000k-of-0000N.safetensors`` shards, filled greedily in key path order up
        to ``max_shard_bytes`` of tensor data each (a bigger tensor gets a shard of its
        own), plus ``model.safetensors.index.json``; other files there (``config.json``)
        are left alone. Missing parent directories are created.
      select: a key path prefix or a list of them (``"params"``); default: every leaf.
      dtype: cast floating-point arrays to this dtype (``"bfloat16"``); integer and bool
        arrays are written as they are.
      max_shard_bytes: directory output only; default 5 GB (10^9 bytes), like Hugging Face.
      key_map: renames, as ``restore``'s ``key_map`` (the same forms): a dict of name
        prefixes (``{"layers": "model.layers"}``; the longest matching prefix wins; a
        value of ``None`` leaves those tensors out, listed in ``skipped``) or a callable
        from a tensor name to its new name (or ``None``). Names match as the tensors
        would be named without it; ``.`` and ``/`` separate alike. A dict entry that
        renames nothing raises (a typo would otherwise pass unseen).
      keep_value: keep nnx's ``value`` level in the names (``kernel.value``).
      overwrite: replace an existing export at ``out``: the file, or a directory's
        ``*.safetensors`` files and index (each file replaced by a rename, the index
        last; stale shards of the old export removed after). Without it an existing
        ``out`` file, or a directory already holding ``*.safetensors`` files or an
        index, raises.
      progress: called with ``(bytes done, bytes total)`` after each tensor.

    Returns:
      An ``ExportResult``: the files written, tensor count, total size, skipped paths.

    Raises:
      CheckpointError: two leaves would get one name (both named), ``out`` exists
        without ``overwrite``, a dtype has no safetensors equivalent.

    Example:
      >>> convert.to_safetensors("/ckpt/1000", "/export/model", select="params", dtype="bfloat16",
      ...                        key_map={"": "model"})  # model.layers.0.kernel
    """
    return _export(path, os.fspath(out), select, dtype, max_shard_bytes, _Names(key_map, keep_value), overwrite,
                   progress)


def _export(path: Any, out: str, select: Any, dtype: Any, max_shard_bytes: int | None, names: Any,
            overwrite: bool, progress: Progress | None) -> ExportResult:
    source = _formats.open_source(path)
    single = out.endswith(".safetensors")
    _check_shard_bytes(out, single, max_shard_bytes)
    tensors, skipped = _plan_tensors(source, select, _dtype_arg(dtype), names)
    shards = [tensors] if single else _shard(tensors, max_shard_bytes or DEFAULT_MAX_SHARD_BYTES)
    old = _existing_export(out, single)
    if old and not overwrite:
        raise CheckpointError(f"'{out}' already exists" + ("" if single else f" and holds an export ({old[0]})")
                              + "; pass overwrite=True (jaxckpt export --overwrite) to replace it")
    # the parent of a file, or the directory itself: the temporary files are written there
    os.makedirs(os.path.dirname(os.path.abspath(out)) if single else out, exist_ok=True)
    files = [out] if single else [os.path.join(out, f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors")
                                  for k in range(len(shards))]
    index = None if single else os.path.join(out, _safetensors.INDEX_FILE)
    _write_files(source, list(zip(files, shards)), index, progress)
    _remove_stale(old, files + ([index] if index else []))
    total = sum(t.nbytes for t in tensors)
    return ExportResult(tuple(files) + ((index,) if index else ()), len(tensors), total, tuple(skipped))


def _check_shard_bytes(out: str, single: bool, max_shard_bytes: int | None) -> None:
    if single and max_shard_bytes is not None:
        raise CheckpointError(f"max_shard_bytes shards a directory export; '{out}' is one .safetensors file")
    if max_shard_bytes is not None and max_shard_bytes < 1:
        raise CheckpointError(f"max_shard_bytes must be positive, got {max_shard_bytes}")


class _Names:
    """Tensor names: the key path below the selected prefix, nnx's ``value`` level
    dropped (unless ``keep_value``), renamed by ``key_map``, ``.``-separated."""

    def __init__(self, key_map: Any, keep_value: bool):
        if not (key_map is None or callable(key_map) or isinstance(key_map, dict)):
            raise CheckpointError(f"key_map must be a dict of name prefixes or a callable, got {key_map!r}")
        if isinstance(key_map, dict):
            bad = [k for k, v in key_map.items() if not isinstance(k, str) or not (v is None or isinstance(v, str))]
            if bad:
                raise CheckpointError(f"key_map entries must map a name prefix to a name or None: {bad[0]!r}")
            # matched as ``/`` paths: a prefix matches whole components whichever separator it was written with
            key_map = {_slashed(k): None if v is None else _slashed(v) for k, v in key_map.items()}
        self.key_map, self.keep_value = key_map, keep_value
        self.used: set[str] = set()

    def name(self, rec: LeafRecord, prefix: str, single: set[str]) -> str | None:
        """The tensor name of ``rec`` under ``prefix`` (``None``: ``key_map`` leaves it out);
        ``single`` holds the paths of the subtrees that hold one leaf."""
        path = rec.path
        parent = path.rpartition("/")[0]
        if not self.keep_value and path.endswith("/value") and parent in single:
            path = parent  # nnx's Variable over its one value
        below = path[len(prefix):].lstrip("/") if prefix and _under(path, prefix) else "" if prefix else path
        name = _safetensors.name_of(below or path.rsplit("/", 1)[-1])
        if self.key_map is None:
            return name
        if callable(self.key_map):
            new = self.key_map(name)
            if not (new is None or isinstance(new, str)):
                raise CheckpointError(f"key_map({name!r}) returned {new!r}, not a name or None")
        else:
            slashed = _slashed(name)
            self.used.update(k for k in self.key_map if k == "" or slashed == k or slashed.startswith(k + "/"))
            new = _restore.map_key(self.key_map, slashed)  # restore's reading of key_map, exactly
        if new is not None and not _safetensors.name_of(new).strip("."):
            raise CheckpointError(f"key_map renames '{name}' (leaf '{rec.path}') to an empty name")
        return None if new is None else _safetensors.name_of(new)

    def check_used(self, loc: Any) -> None:
        if isinstance(self.key_map, dict):
            unused = [k for k in self.key_map if k not in self.used]
            if unused:
                raise CheckpointError(f"Checkpoint '{loc}': key_map: no tensor name starts with "
                                      + ", ".join(f"'{_safetensors.name_of(k)}'" for k in unused)
                                      + " (names are matched before renaming, without nnx's value level"
                                      " unless keep_value)")


def _slashed(name: str) -> str:
    return name.replace(".", "/").strip("/")


def _single_leaf_subtrees(paths: list[str]) -> set[str]:
    """The key paths of the subtrees that hold exactly one leaf."""
    counts: dict[str, int] = {}
    for p in paths:
        parts = p.split("/")
        for k in range(1, len(parts)):
            sub = "/".join(parts[:k])
            counts[sub] = counts.get(sub, 0) + 1
    return {p for p, n in counts.items() if n == 1}


def _plan_tensors(source: _formats.Source, select: Any, dtype: str | None,
                  names_of: _Names) -> tuple[list[_Tensor], list[str]]:
    """The selected array leaves as named tensors (names checked unique, dtypes
    checked writable) and the key paths skipped."""
    indices, prefix_of = _select(source, select)
    single = _single_leaf_subtrees([r.path for r in source.manifest.leaves])
    tensors, skipped, names = [], [], {}
    for i in indices:
        rec = source.manifest.leaves[i]
        name = names_of.name(rec, prefix_of[i], single) if rec.kind == "array" else None
        if name is None:
            skipped.append(rec.path)
            continue
        out_dtype = _cast_to(rec.dtype, dtype)
        if out_dtype not in _safetensors.DTYPE_TO_ST:
            raise CheckpointError(f"Checkpoint '{source.loc}': leaf '{rec.path}': dtype {out_dtype} has no "
                                  "safetensors equivalent" + (" (pass dtype= to cast floats)" if _is_float(out_dtype) else ""))
        if name in names:
            raise CheckpointError(f"Checkpoint '{source.loc}': leaves '{names[name]}' and '{rec.path}' would both be "
                                  f"tensor '{name}'; select them separately or rename one (key_map=, --rename)")
        names[name] = rec.path
        nbytes = math.prod(rec.shape) * _dtypes.DTYPES[out_dtype].itemsize
        tensors.append(_Tensor(rec, name, out_dtype, nbytes))
    names_of.check_used(source.loc)
    return tensors, skipped


def _existing_export(out: str, single: bool) -> list[str]:
    """What an export to ``out`` would replace: the file, or a directory's
    ``*.safetensors`` files and index (sorted; other files are not the export's)."""
    if single:
        return [out] if os.path.lexists(out) else []
    if not os.path.isdir(out):
        if os.path.lexists(out):
            raise CheckpointError(f"'{out}' exists and is not a directory; a directory export (OUT not ending "
                                  "in .safetensors) writes its shards and index into a directory")
        return []
    return sorted(os.path.join(out, n) for n in os.listdir(out)
                  if n.endswith(".safetensors") or n == _safetensors.INDEX_FILE)


def _remove_stale(old: list[str], written: list[str]) -> None:
    """Remove the files of the replaced export that the new one did not replace (a
    stale shard would be read by a consumer that lists ``*.safetensors``)."""
    for f in old:
        if f not in written and os.path.lexists(f):
            os.unlink(f)


def _shard(tensors: list[_Tensor], limit: int) -> list[list[_Tensor]]:
    """Greedy, in order: a new shard when the next tensor would take this one past
    ``limit`` (one empty shard for no tensors)."""
    return _tasks.batches(tensors, limit) or [[]]


def _header(tensors: list[_Tensor]) -> bytes:
    """The safetensors header: 8-byte length, then JSON padded with spaces to 8 bytes."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    at = 0
    for t in tensors:
        header[t.name] = {"dtype": _safetensors.DTYPE_TO_ST[t.dtype], "shape": list(t.rec.shape),
                          "data_offsets": [at, at + t.nbytes]}
        at += t.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def _write_files(source: _formats.Source, files: list[tuple[str, list[_Tensor]]], index: str | None,
                 progress: Progress | None) -> None:
    """Write every file under a temporary name, then rename them all, the index last
    (each rename replaces a file atomically); a failure leaves no partial file."""
    final = [f for f, _ in files] + ([index] if index else [])
    token = os.urandom(6).hex()
    temps = {f: os.path.join(os.path.dirname(f) or ".", f".{os.path.basename(f)}.jaxckpt-tmp-{token}") for f in final}
    total = sum(t.nbytes for _, ts in files for t in ts)
    done = [0, total]
    try:
        for f, tensors in files:
            _write_file(source, temps[f], tensors, progress, done)
        if index:
            weight_map = {t.name: os.path.basename(f) for f, ts in files for t in ts}
            doc = {"metadata": {"total_size": total}, "weight_map": weight_map}
            with open(temps[index], "w") as fh:
                json.dump(doc, fh, indent=2)
        for f in final:
            os.replace(temps[f], f)
    finally:
        for tmp in temps.values():
            if os.path.lexists(tmp):
                os.unlink(tmp)


def _write_file(source: _formats.Source, tmp: str, tensors: list[_Tensor], progress: Progress | None,
                done: list[int]) -> None:
    with open(tmp, "wb") as fh:
        fh.write(_header(tensors))
        small = _SmallLeaves(source, [t.rec for t in tensors])
        for t in tensors:
            _write_tensor(fh, small.leaf(t.rec), _dtypes.DTYPES[t.dtype])  # one big tensor in memory
            done[0] += t.nbytes
            if progress is not None:
                progress(*done)
        fh.flush()
        os.fsync(fh.fileno())


def _write_tensor(fh: Any, data: np.ndarray, target: np.dtype) -> None:
    """``data`` as ``target``, little endian, C order, cast a block at a time (no view of
    it outlives this call, so the leaf's buffer goes before the next one is read)."""
    for block in _stream.cast_blocks(data, target, _CAST_BLOCK_BYTES):
        if sys.byteorder == "big" and target.itemsize > 1:
            block = block.byteswap()
        fh.write(memoryview(block.reshape(-1).view(np.uint8)))
