"""The first half of a save: flatten the tree, plan which process writes which chunk
(replicated chunks balanced over their holders), and take host buffers of everything
this process writes (``snapshot``). ``_writer`` writes them.

After ``snapshot`` returns the caller may donate, delete or overwrite what it passed:
shards are host views jax keeps alive for us (on CPU zero-copy; a jitted call does not
donate a buffer a view still holds), laid out as entries of their writers' streams
(format 3: ``_streams.plan``, recorded in the leaf's runs); numpy leaves are copied when
the save continues in the background. (With ``JAXCKPT_FORMAT=1``, small leaves are
copied into one packed buffer per process.) With a ``StagingBudget`` (the manager's
``max_staging_bytes``) a snapshot is staged in waves, within the budget: see ``snapshot``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import numpy as np

from . import _chunking, _codecs, _distributed, _dtypes, _hoststreams, _layout, _quantize, _streams, _tree
from ._errors import CheckpointError
from ._manifest import MAX_INLINE_BYTES, MAX_INT_DIGITS, STREAMS_VERSION, LeafRecord, PackedArray, int_fits
from ._waves import Planned, StagingBudget, Wave, Waves, staging_budget  # noqa: F401 (re-exported)
from ._waves import plan as _plan_waves

# Leaves smaller than this are packed into one byte array per process; bigger ones get
# a zarr3 array of their own with one file per shard.
SMALL_LEAF_BYTES = 1 << 20
PACK_CHUNK_BYTES = 4 << 20
# Format 3 is what a save writes (every array leaf's chunks entries of its writers' streams,
# ``_streams``; no packing); JAXCKPT_FORMAT=1, read per snapshot, the layout of formats 1 and 2.
# SEGMENT_BYTES: the data objects' size (settable for tests; >= ``_streams.MIN_SEGMENT_BYTES``).
FORMAT_ENV = "JAXCKPT_FORMAT"
LEGACY_FORMAT = "1"
SEGMENT_BYTES = _streams.SEGMENT_BYTES


def streams_wanted() -> bool:
    """Whether this save writes format 3: unless ``JAXCKPT_FORMAT=1`` (unset or ``3``: yes;
    any other value is refused, so a typo never picks a layout silently)."""
    value = os.environ.get(FORMAT_ENV, "").strip()
    if value in ("", str(STREAMS_VERSION)):
        return True
    if value == LEGACY_FORMAT:
        return False
    raise CheckpointError(f"{FORMAT_ENV}={value!r:.40}: set it to 3 (format 3, the default) or 1 (the layout "
                          "of formats 1 and 2, for readers older than format 3)")


@dataclass
class Snapshot:
    """What the writing half of a save needs once the caller's arrays may be gone."""

    structure: dict[str, Any]
    records: list[LeafRecord]
    file_shards: dict[int, list[tuple[_layout.Index, np.ndarray]]]  # leaf -> this process's shards
    packed: tuple[PackedArray, ...]  # every process's packed array
    packed_buf: np.ndarray | None  # this process's packed bytes
    nbytes_local: int  # host bytes this snapshot holds (in waves: at most at once)
    group: tuple[int, ...] = ()  # the processes sharing this process's directory; () = all
    groups: tuple[tuple[int, ...], ...] = ()  # with ``group``: every group of the job
    waves: Waves | None = None  # staged in waves: the writer takes them from here
    created_at: float = dataclasses.field(default_factory=time.perf_counter)
    # format 3: every writing process's stream length (``file_shards`` then holds this
    # process's entries, of every array leaf); ``None``: formats 1 and 2
    streams: dict[int, int] | None = None
    segment_bytes: int = 0
    # restores from quantized leaves the state has been through (the manager's count),
    # recorded in the manifest's info when some leaf is stored quantized
    lossy_resumes: int = 0
    # staged in waves: how many compressed chunks this process encodes (``Wave.sizing``)
    encodes: int = 0

    def stage_rest(self) -> None:
        """Staged in waves: stage the rest as the writer frees room; return once nothing
        reads the caller's arrays any more (see ``snapshot``). Never raises: a failure
        fails the save, in the writer. Without waves: nothing to do."""
        if self.waves is not None:
            self.waves.stage_rest()

    def close(self) -> None:
        """The save is over (written or failed): stop staging, free the staged waves."""
        if self.waves is not None:
            self.waves.close()

    def staged_at(self) -> float:
        """When (``time.perf_counter()``) the last of its bytes was staged."""
        return self.created_at if self.waves is None else self.waves.staged_at


def is_inline(x: Any) -> bool:
    """Stored in the manifest's JSON rather than as an array.

    numpy scalars are 0-d arrays (``np.float64`` subclasses ``float`` but must come
    back as itself), except ``np.str_``/``np.bytes_``: inline, with their type recorded.
    Python ``bytes`` (grain's data-loader state) come back as themselves.
    """
    if isinstance(x, np.generic):
        return isinstance(x, (np.str_, np.bytes_))
    return x is None or isinstance(x, (bool, int, float, str, bytes))


def is_prng(x: Any) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def cell_of(index: _layout.Index, chunk_shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(a // c for (a, _), c in zip(index, chunk_shape))


def snapshot(tree: Any, *, copy_host_arrays: bool, group: tuple[int, ...] = (),
             budget: StagingBudget | None = None, groups: tuple[tuple[int, ...], ...] = (),
             compression: Any = None, quantize: Any = None, lossy_resumes: int = 0) -> Snapshot:
    """Flatten ``tree`` and take host buffers of every shard this process must write.

    With ``copy_host_arrays`` numpy leaves are copied, so the caller may mutate them
    once this returns.

    ``group``: the processes that share this process's directory, when the job's
    processes do not all share one (a per-host local tier). Then each group writes a
    copy of every chunk its processes hold (balanced over them), so that every host's
    directory holds what its devices need; every array gets a file store of its own
    (chunk files are named by position, the same in every host's copy). In format 3
    ``groups`` (every group of the job) is needed too: a host's streams hold its group's
    copies, and its manifest locates the others' chunks in theirs (``_hoststreams``).

    ``budget``: stage in waves, holding at most ``budget.max_bytes`` of host copies at
    once (shared by every save given the same budget). Only bytes that need a copy
    count: shards on accelerators (copied device to host), numpy leaves when
    ``copy_host_arrays`` (or not C-contiguous); CPU jax shards are zero-copy views and
    count 0. Chunks stay whole: waves fill up to half the budget (one is written while
    the next is staged), and a chunk bigger than that forms a wave by itself (one
    bigger than the budget is staged only when nothing else is). The first wave (all
    the views, the packed small leaves, then chunks in tree order) is staged here; the
    caller then hands the snapshot to the writer (``_writer.write_data``, which takes
    the waves in turn and frees each once written) and calls ``stage_rest()``, which
    blocks until the last wave is staged. A writer in the caller's own thread stages
    the waves itself. Whoever runs the save calls ``close()`` when it is over.

    ``compression``: ``compression=`` as ``save`` takes it (``_codecs.parse``); the leaves
    it selects are encoded by the writer (format 3 only). In waves each
    compressed chunk is staged twice: to be sized (``_Sizing``), then to be written.
    ``quantize``: ``quantize=`` (``_quantize.parse``): the leaves it selects are stored
    lossy by the writer (format 3 only); it wins over ``compression``. With ``group``
    each group encodes its own copies; their places are known once written
    (``_writer.place_compressed``).
    """
    codecs = _Codecs(_codecs.parse(compression), _quantize.parse(quantize))
    codecs = None if codecs.lossless is None and codecs.lossy is None else codecs
    if codecs is not None and codecs.lossy is not None:
        codecs = codecs._replace(nnx_params=_nnx_params(tree))
    for what, given in (("compression", codecs and codecs.lossless), ("quantize", codecs and codecs.lossy)):
        if given is not None and not streams_wanted():
            raise CheckpointError(f"{what}= is not supported with {FORMAT_ENV}={LEGACY_FORMAT} ({what} needs format 3)")
    with _tree.gc_paused():
        if budget is None:
            snap = _snapshot(tree, copy_host_arrays, group, groups, codecs)
        else:
            snap = _snapshot_in_waves(tree, copy_host_arrays, group, budget, groups, codecs)
    snap.lossy_resumes = lossy_resumes  # (``Snapshot.lossy_resumes``)
    return snap


class _Codecs(NamedTuple):
    """A save's ``compression`` and ``quantize``, parsed: which codec each leaf gets."""

    lossless: Any  # _codecs.Compression | None
    lossy: Any  # _quantize.Quantize | None
    nnx_params: frozenset[str] = frozenset()  # with lossy: the paths of the tree's nnx.Param nodes

    def codec_for(self, path: str, dtype: Any, shape: tuple[int, ...]) -> tuple[str, Any]:
        """``(codec, lossless Codec or None)`` for an array leaf; a quantized one is checked."""
        form = self.lossy.form_for(path) if self.lossy is not None else None
        if form is not None:
            keys = path.split("/")
            param = any("/".join(keys[:k]) in self.nnx_params for k in range(1, len(keys) + 1))
            _quantize.check_leaf(path, dtype, shape, form, param)
            return form, None
        c = self.lossless.codec_for(path) if self.lossless is not None else None
        return (_streams.CODEC_RAW, None) if c is None else (c.name, c)


def _nnx_params(tree: Any) -> frozenset[str]:
    """The key paths of the flax ``nnx.Param`` nodes of ``tree`` (flattened, their arrays
    lie below them: ``lin/kernel/value``), which ``quantize=`` never selects. Without
    ``flax.nnx`` imported the tree holds none."""
    nnx = sys.modules.get("flax.nnx")
    param = getattr(nnx, "Param", None)
    if not isinstance(param, type):
        return frozenset()
    nodes = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None or isinstance(x, param))[0]
    return frozenset(_tree.keypath_to_str(p) for p, x in nodes if isinstance(x, param))


def _snapshot(tree: Any, copy_host_arrays: bool, group: tuple[int, ...],
              groups: tuple[tuple[int, ...], ...] = (), codecs: _Codecs | None = None) -> Snapshot:
    structure, records, arrays, packed, packed_buf, streams = _plan(tree, copy_host_arrays, group, groups, codecs)
    me = _distributed.process_index()
    file_shards: dict[int, list[tuple[_layout.Index, np.ndarray]]] = {}
    total = 0 if packed_buf is None else packed_buf.nbytes
    _start_transfers(arrays, me)
    for leaf in arrays:
        rec = LeafRecord(**leaf.fields)
        records[leaf.slot] = rec
        chunks, plan, _ = _chunking.mine(leaf.chunks, leaf.writers, me)
        if rec.store == "stream":  # format 3: whole shards where they are whole row blocks
            file_shards[leaf.slot] = pieces = leaf.run_plan(plan)
            total += sum(data.nbytes for _, data in pieces)
            continue
        hosts = leaf.hosts(chunks)
        if rec.store != "packed":  # "file" (map: many chunks)
            file_shards[leaf.slot] = list(zip(map(operator.attrgetter("region"), chunks), hosts))
            total += sum(map(operator.attrgetter("nbytes"), hosts))
        else:
            _copy_packed(rec, list(zip(chunks, hosts)), packed_buf)
    return Snapshot(structure, records, file_shards, packed, packed_buf, total, group, tuple(groups),
                    streams=streams, segment_bytes=SEGMENT_BYTES if streams is not None else 0)


def _plan(tree: Any, copy_host_arrays: bool | None, group: tuple[int, ...],
          groups: tuple[tuple[int, ...], ...] = (), codecs: _Codecs | None = None) -> tuple[
        dict[str, Any], list[LeafRecord | None], list[_ArrayLeaf], tuple[PackedArray, ...], np.ndarray | None,
        dict[int, int] | None]:
    """The tree's structure, its inline values' records (arrays' are ``None`` yet), its
    array leaves with their chunks and writers, and the packed small leaves' layout; in
    format 3 instead (no packing) every writing process's stream length."""
    format3 = streams_wanted()
    if format3 and group and group not in groups:
        raise CheckpointError(f"format 3 in directories of their own per host needs "
                              f"every host's group (groups=...), got {groups!r} for group {group!r}")
    flat, _ = _tree.flatten(tree)
    structure = _tree.describe(tree)
    me = _distributed.process_index()
    records: list[LeafRecord | None] = []
    arrays: list[_ArrayLeaf] = []
    for i, (path, leaf) in enumerate(flat):
        if is_inline(leaf):
            if isinstance(leaf, int) and not int_fits(leaf):  # the reader would refuse it
                raise CheckpointError(f"Leaf '{path}': an int of more than {MAX_INT_DIGITS} digits "
                                      "cannot be saved")
            if isinstance(leaf, bytes) and len(leaf) > MAX_INLINE_BYTES:  # so would it these
                raise CheckpointError(
                    f"Leaf '{path}': {len(leaf)} bytes is more than the {MAX_INLINE_BYTES} a bytes leaf "
                    "holds (it is stored in the manifest); save it as an array: np.frombuffer(b, np.uint8)")
            records.append(LeafRecord(path=path, kind="value", value=leaf))
            continue
        fields: dict[str, Any] = {"path": path, "kind": "array", "key": str(i)}
        _check_not_donated(path, leaf)
        if is_prng(leaf):
            fields.update(kind="prng_key", impl=str(jax.random.key_impl(leaf)), key_ndim=leaf.ndim)
            leaf = jax.random.key_data(leaf)
        if isinstance(leaf, np.generic):
            leaf, fields["scalar"] = np.asarray(leaf), True
        arrays.append(_plan_array(len(records), path, leaf, fields, copy_host_arrays, format3))
        if group:
            arrays[-1].fields["store"] = "file"
        records.append(None)
    _assign(arrays, group)
    if format3:
        return structure, records, arrays, (), None, _lay_out_streams(arrays, group, groups, codecs)
    packed, packed_buf = _lay_out_packed(arrays, me)
    return structure, records, arrays, packed, packed_buf, None


def _check_not_donated(path: str, leaf: Any) -> None:
    """Refuse an array whose buffer is gone, naming its leaf.

    A jitted step with ``donate_argnums`` deletes the arrays it was given; saving the
    state it was given afterwards would fail deep in jax with "Array has been deleted",
    naming no leaf. Checked before anything touches the array (a key's data included).
    """
    if isinstance(leaf, jax.Array) and leaf.is_deleted():
        raise CheckpointError(
            f"Leaf '{path}' was donated (its buffer is deleted): call save(...) before the step "
            "that donates the state (donate_argnums), or save the step's output")


_Chunk = _chunking.Chunk


@dataclass
class _ArrayLeaf:
    """One array leaf while a snapshot is planned: its record fields, chunks in C order,
    this process's copy of each shard it holds, and (once assigned) each chunk's writer."""

    slot: int
    fields: dict[str, Any]
    chunks: list[_Chunk]
    local: dict[_layout.Index, Any]
    writers: list[int] = dataclasses.field(default_factory=list)
    on_host: bool = False  # every shard is host memory (numpy, or CPU jax): nothing to copy

    def host(self, chunk: _Chunk) -> np.ndarray:
        data = self.local[chunk.shard]
        host = data if isinstance(data, np.ndarray) else np.asarray(data)
        if chunk.region == chunk.shard:
            return host
        return host[_layout.relative(chunk.region, chunk.shard)]  # a contiguous view: dim-0 split

    def hosts(self, chunks: list[_Chunk]) -> list[np.ndarray]:
        """``host`` of each of ``chunks`` (in C order); a shard cut into row blocks
        (format 3's fine chunks) is cut with one reshape, not a slice per chunk (the
        blocking part of an async save makes these views: hundreds per GiB)."""
        out: list[np.ndarray] = []
        i = 0
        while i < len(chunks):
            first = chunks[i]
            rows = self._row_blocks(first)
            if rows is None:
                out.append(self.host(first))
                i += 1
                continue
            j, shard = i, first.shard
            while j < len(chunks) and (chunks[j].shard is shard or chunks[j].shard == shard):
                j += 1
            start, height = first.shard[0][0], first.region[0][1] - first.region[0][0]
            if j - i == len(rows):  # every row block of the shard, in order
                out += rows
            else:
                out += [rows[(c.region[0][0] - start) // height] for c in chunks[i:j]]
            i = j
        return out

    def pieces(self, chunks: list[_Chunk]) -> list[tuple[_layout.Index, np.ndarray]]:
        """``(region, host buffer)`` of ``chunks`` (in C order) as format 3's writer takes
        them: a shard whose every row-block chunk is among them is one piece, the whole
        shard (the writer cuts it into its chunks, ``_writer.split_rows``, in the
        background part of a save); any other chunk is a piece of its own."""
        return self.run_plan(_chunking.piece_plan(chunks))

    def run_plan(self, plan: tuple[tuple[Any, Any], ...]) -> list[tuple[_layout.Index, np.ndarray]]:
        """The pieces a ``_chunking.piece_plan`` names, as host buffers of this leaf's shards."""
        out: list[tuple[_layout.Index, np.ndarray]] = []
        for shard, chunks in plan:
            if chunks is None:
                data = self.local[shard]
                out.append((shard, data if isinstance(data, np.ndarray) else np.asarray(data)))
            else:
                out += zip(map(operator.attrgetter("region"), chunks), self.hosts(chunks))
        return out

    def _row_blocks(self, chunk: _Chunk) -> list[np.ndarray] | None:
        """The shard of ``chunk`` as views of row blocks of ``chunk``'s height, when
        its chunks are exactly that (full in every other dimension, the height dividing
        the shard's); else None."""
        shard, region = chunk.shard, chunk.region
        if not region or region[1:] != shard[1:]:
            return None
        height, total = region[0][1] - region[0][0], shard[0][1] - shard[0][0]
        if height == 0 or total % height:
            return None
        data = self.local[shard]
        host = data if isinstance(data, np.ndarray) else np.asarray(data)
        return list(host.reshape((total // height, height) + host.shape[1:]))


def _plan_array(slot: int, path: str, leaf: Any, fields: dict[str, Any], copy_host_arrays: bool | None,
                fine: bool = False) -> _ArrayLeaf:
    """Shapes, chunks and the shards this process holds of one array leaf (no data moved;
    ``copy_host_arrays=None``: a numpy leaf as it is, staged chunk by chunk later)."""
    if isinstance(leaf, jax.Array):
        dtype = _dtypes.dtype_name(leaf.dtype)
        itemsize = _dtypes.DTYPES[dtype].itemsize
        shape, sharding = tuple(leaf.shape), leaf.sharding
        shards = _layout.shards_of(sharding, shape)
        chunk_shape = _layout.chunk_shape_for(sharding, shape, itemsize, fine)
        local = {}
        index_of, on_host = _layout.device_indices(sharding, shape)
        for s in leaf.addressable_shards:  # a few per process, however many shards in all
            local.setdefault(index_of[s.device], s.data)
        sharding_json = _layout.sharding_to_json(sharding)
    elif isinstance(leaf, np.ndarray):
        dtype = _dtypes.dtype_name(leaf.dtype)
        itemsize = _dtypes.DTYPES[dtype].itemsize
        shape = tuple(leaf.shape)
        # A host array is the same in every process: all of them hold it, and share its writes.
        everyone = tuple(range(_distributed.process_count()))
        full = tuple((0, d) for d in shape)
        shards = (_layout.Shard(full, everyone, ()),)
        chunk_shape = _layout.split_chunk_shape(shape, len(everyone), itemsize)
        if fine:  # format 3: finer, for reading
            chunk_shape = _layout.fine_chunk_shape(chunk_shape, shape, itemsize, len(everyone))
        if copy_host_arrays is None:
            data = np.asarray(leaf)
        else:
            data = np.array(leaf, order="C", copy=True) if copy_host_arrays else np.asarray(leaf, order="C")
        local = {full: data}
        sharding_json, on_host = None, True
    else:
        raise CheckpointError(
            f"Leaf '{path}' has type {type(leaf).__name__}, which cannot be saved: use "
            "jax/numpy arrays or int/float/bool/str/bytes/None"
        )
    nbytes = math.prod(shape) * itemsize
    fields.update(dtype=dtype, shape=shape, sharding=sharding_json, chunk_shape=chunk_shape,
                  storage_dtype=_dtypes.storage_dtype_name(dtype), nbytes=nbytes,
                  store="packed" if nbytes < SMALL_LEAF_BYTES else "file")
    chunks = _chunking.chunks_cached if isinstance(leaf, jax.Array) else _chunking.chunks
    return _ArrayLeaf(slot, fields, chunks(shape, chunk_shape, shards, itemsize), local, on_host=on_host)


def _assign(arrays: list[_ArrayLeaf], group: tuple[int, ...]) -> None:
    """Every chunk's writer, balanced over the whole tree (the same plan in every process).

    With a ``group``, each chunk that a process of the group holds gets a writer among
    those (``-1``: nobody in the group holds it, so the group writes no copy of it)."""
    if group:
        lists = [a.chunks for a in arrays]
        writers = _chunking.repeated(_LAST_GROUP_WRITERS, lists, (group,), functools.partial(_group_writers, arrays, group))
        for a, w in zip(arrays, writers):
            a.writers = w  # shared with the last save of the same leaves: never mutated
        return
    for a, writers in zip(arrays, _chunking.writers_of([a.chunks for a in arrays])):
        a.writers = writers  # shared: never mutated


def _group_writers(arrays: list[_ArrayLeaf], group: tuple[int, ...]) -> list[list[int]]:
    """Per leaf, each chunk's writer among ``group``'s processes holding it, balanced
    over the whole tree (``-1``: nobody in the group holds it). Leaves whose chunks have
    one holder each are counted once per kind of leaf (``_chunking.fixed_writers``), the rest
    balanced on top: what ``_layout.assign_writers`` gives for all of them at once."""
    members, load = set(group), {}
    out: list[list[int]] = [[] for _ in arrays]
    kinds: dict[int, list[int]] = {}
    flexible = []
    for i, a in enumerate(arrays):
        fixed = _chunking.fixed_writers(a.chunks)
        if fixed is None:
            flexible.append(i)
            continue
        if id(a.chunks) not in kinds:
            kinds[id(a.chunks)] = [p if p in members else -1 for p in fixed[0]]
        out[i] = kinds[id(a.chunks)]  # shared: never mutated
        for p in members:  # a few: not the hundreds of processes a leaf's chunks may have
            if p in fixed[1]:
                load[p] = load.get(p, 0) + fixed[1][p]
    # each distinct set of holders (a few) filtered once, not once per chunk
    within = {h: tuple(p for p in h if p in members) for h in {c.holders for i in flexible for c in arrays[i].chunks}}
    held = {i: [within[c.holders] for c in arrays[i].chunks] for i in flexible}
    picked = iter(_layout.assign_with_loads(
        [(c.nbytes, h) for i in flexible for c, h in zip(arrays[i].chunks, held[i]) if h], load))
    for i in flexible:
        out[i] = [next(picked) if h else -1 for h in held[i]]
    return out


def _lay_out_packed(arrays: list[_ArrayLeaf], me: int) -> tuple[tuple[PackedArray, ...], np.ndarray | None]:
    """Offsets of the small leaves' chunks in each writer's packed array (recorded in
    their fields), every process's packed array, and this process's zeroed buffer."""
    small = [a for a in arrays if a.fields["store"] == "packed"]
    offsets, sizes = _layout.pack_offsets([[(w, c.nbytes) for w, c in zip(a.writers, a.chunks)] for a in small])
    for a, offs in zip(small, offsets):
        a.fields["chunks"] = tuple(zip(a.writers, offs))
    # zarr stores an edge chunk at full size, so split evenly instead of in 4 MiB pieces
    packed = tuple(PackedArray(p, n, -(-n // -(-n // PACK_CHUNK_BYTES))) for p, n in sorted(sizes.items()))
    # zeros, not empty: alignment padding must not carry stale process memory to disk
    return packed, np.zeros(sizes[me], np.uint8) if sizes.get(me) else None


def _lay_out_streams(arrays: list[_ArrayLeaf], group: tuple[int, ...] = (),
                     groups: tuple[tuple[int, ...], ...] = (), codecs: _Codecs | None = None) -> dict[int, int]:
    """Format 3: every array leaf's chunks as entries of its writers' streams (recorded in
    its fields: store, codec, entry_bytes, runs), and every writing process's stream
    length. ``_streams.plan`` of the global tree: the same in every process. With a
    directory per host (``group``), the layout of this host's directory: other groups'
    writers are planned as their processes plan them where it needs them (``_hoststreams``).
    ``codecs``: a quantized leaf's entries hold its encoded chunks (a size fixed by the
    chunk shape); a compressed leaf is left out: its entries' sizes are known once its
    writers have encoded them (``_writer``), so process 0 places them then (and, with a
    directory per host, each other host's processes in their view)."""
    payloads = [math.prod(a.fields["chunk_shape"]) * _dtypes.DTYPES[a.fields["storage_dtype"]].itemsize
                for a in arrays]
    if codecs is not None and codecs.lossy is not None:  # before anything is written (issue 31)
        refusal = _quantize.unmatched(codecs.lossy, [a.fields["path"] for a in arrays])
        if refusal is not None:
            raise ValueError(refusal)
    chosen = [codecs.codec_for(a.fields["path"], _dtypes.DTYPES[a.fields["dtype"]], a.fields["shape"])
              if codecs is not None else (_streams.CODEC_RAW, None) for a in arrays]
    if any(name != _streams.CODEC_RAW for name, _ in chosen):
        planned = [i for i, (_, c) in enumerate(chosen) if c is None]
        sizes = [_quantize.encoded_nbytes(tuple(arrays[i].fields["chunk_shape"]), chosen[i][0])
                 if chosen[i][0] in _quantize.FORMS else payloads[i] for i in planned]
        if group:  # each host's view of the fixed-size entries (raw and quantized); no cache
            layout = _hoststreams.lay_out(
                sizes, [arrays[i].chunks for i in planned], groups, group, [arrays[i].writers for i in planned],
                lambda g: (lambda w: [w[i] for i in planned])(_group_writers(arrays, g)))
        else:
            layout = _plan_streams(sizes, [arrays[i].writers for i in planned])
        runs: list[Any] = [()] * len(arrays)
        for i, r, size in zip(planned, layout.runs, sizes):
            runs[i], payloads[i] = r, size
        for a, payload, (name, c), r in zip(arrays, payloads, chosen, runs):
            itemsize = _dtypes.DTYPES[a.fields["storage_dtype"]].itemsize
            a.fields.update(store="stream", key="", codec=name, entry_bytes=_streams.entry_bytes_for(payload),
                            runs=r, codec_config=None if c is None else c.config(itemsize))
        return layout.streams
    if group:
        lists = [a.chunks for a in arrays]
        layout = _chunking.repeated(_LAST_HOST_LAYOUT, lists, (tuple(payloads), group, groups), functools.partial(
            _hoststreams.lay_out, payloads, lists, groups, group, [a.writers for a in arrays],
            functools.partial(_group_writers, arrays)))
        layout = _streams.Layout(layout.runs, dict(layout.streams))
    else:
        layout = _plan_streams(payloads, [a.writers for a in arrays])
    for a, payload, runs in zip(arrays, payloads, layout.runs):
        a.fields.update(store="stream", key="", codec=_streams.CODEC_RAW,
                        entry_bytes=_streams.entry_bytes_for(payload), runs=runs)
    return layout.streams


# The last save's plans, for a repeated save of the same leaves (``_chunking.repeated``'s
# entries): a directory per host, its group's writer lists and its layout; else the layout.
_LAST_GROUP_WRITERS: list[Any] = [None, (), None]
_LAST_HOST_LAYOUT: list[Any] = [None, (), None]
_LAST_LAYOUT: list[Any] = [None, (), None]


def _plan_streams(payloads: list[int], writers: list[Any]) -> _streams.Layout:
    """``_streams.plan``, or the last save's layout when it was of the same leaves (the
    same writer lists). Each call gets a streams dict of its own."""
    layout = _chunking.repeated(_LAST_LAYOUT, writers, tuple(payloads),
                                lambda: _streams.plan(zip(payloads, writers)))
    return _streams.Layout(layout.runs, dict(layout.streams))


def _start_transfers(arrays: list[_ArrayLeaf], me: int) -> None:
    """Start every device-to-host copy this process needs before waiting on any.

    Where the device has pinned host memory (GPUs), each shard goes there in one batched
    ``device_put`` and the leaf's shard is replaced by the pinned copy, which
    ``np.asarray`` views without a copy: a DMA at the link's rate (4 GiB on an H200: 0.08 s
    against 2.5 s for ``copy_to_host_async`` into pageable memory, benchmarks/RESULTS.md),
    and the host copy belongs to the snapshot, not to the caller's array. Elsewhere (or if
    the put is refused) ``copy_to_host_async``, whose copy ``np.asarray`` waits for."""
    pending: list[tuple[_ArrayLeaf, Any, jax.Array, Any]] = []
    for a in arrays:
        if a.on_host:
            continue  # nothing to copy (views of host memory)
        for index in _chunking.mine(a.chunks, a.writers, me)[2]:
            data = a.local[index]
            if isinstance(data, jax.Array) and not _on_cpu(data):
                pinned = _pinned_sharding(next(iter(data.devices())))
                if pinned is None:
                    data.copy_to_host_async()
                else:
                    pending.append((a, index, data, pinned))
    if not pending:
        return
    try:
        copies = jax.device_put([d for _, _, d, _ in pending], [p for _, _, _, p in pending])
    except Exception:  # noqa: BLE001 - a backend that lists pinned memory but refuses the put
        for _, _, data, _ in pending:
            data.copy_to_host_async()
        return
    for (a, index, _, _), copy in zip(pending, copies):
        a.local[index] = copy


@functools.lru_cache(maxsize=None)
def _pinned_sharding(device: Any) -> Any:
    """A single-device sharding of ``device``'s pinned host memory, or None without one."""
    try:
        if "pinned_host" not in {m.kind for m in device.addressable_memories()}:
            return None
        return jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    except Exception:  # noqa: BLE001 - a backend without memory kinds
        return None


def _copy_packed(rec: LeafRecord, mine: list[tuple[_Chunk, np.ndarray]], packed_buf: np.ndarray | None) -> None:
    storage = _dtypes.DTYPES[rec.storage_dtype]
    grid = _layout.chunk_grid_shape(rec.shape, rec.chunk_shape)
    for chunk, host in mine:
        if not chunk.nbytes:
            continue
        cell = cell_of(chunk.region, rec.chunk_shape)
        _, offset = rec.chunks[_layout.chunk_flat_index(cell, grid)]
        view = packed_buf[offset:offset + host.nbytes].view(storage).reshape(host.shape)
        view[...] = host.view(storage)


def _snapshot_in_waves(tree: Any, copy_host_arrays: bool, group: tuple[int, ...],
                       budget: StagingBudget, groups: tuple[tuple[int, ...], ...] = (),
                       codecs: _Codecs | None = None) -> Snapshot:
    structure, records, arrays, packed, packed_buf, streams = _plan(tree, None, group, groups, codecs)
    me = _distributed.process_index()
    items: list[tuple[_ArrayLeaf, _Chunk]] = []
    sizing: list[_Sizing] = []  # compressed chunks, staged first to be sized (and again to be written)
    small = []
    for leaf in arrays:
        rec = records[leaf.slot] = LeafRecord(**leaf.fields)
        mine = [c for c, w in zip(leaf.chunks, leaf.writers) if w == me]
        if rec.store != "packed":  # "file", or format 3's "stream"
            items += [(leaf, c) for c in mine if c.nbytes]
            if rec.codec_config is not None:
                sizing += [_Sizing(leaf, c) for c in mine if c.nbytes]
        else:
            small.append((rec, leaf, mine))
    items = [*sizing, *items]

    def fill_packed() -> np.ndarray | None:
        _start_transfers([leaf for _, leaf, _ in small], me)
        for rec, leaf, mine in small:
            _copy_packed(rec, [(c, np.ascontiguousarray(leaf.host(c))) for c in mine], packed_buf)
        return packed_buf

    costs = [_cost(leaf, c, copy_host_arrays) for leaf, c in items]
    planned = _plan_waves(items, costs, 0 if packed_buf is None else packed_buf.nbytes, budget.max_bytes)
    stage = functools.partial(_stage_wave, copy=copy_host_arrays, fill_packed=fill_packed)
    waves = Waves(budget, planned, stage)
    waves.stage_first()
    most = min(sum(p.nbytes for p in planned), max(budget.max_bytes, max(p.nbytes for p in planned)))
    return Snapshot(structure, records, {}, packed, None, most, group, tuple(groups), waves, streams=streams,
                    segment_bytes=SEGMENT_BYTES if streams is not None else 0, encodes=len(sizing))


class _Sizing(NamedTuple):
    """A compressed chunk staged for its size only: ``_writer`` encodes it before the
    stream is opened (its length depends on every encoded size), then drops the bytes."""

    leaf: _ArrayLeaf
    chunk: _Chunk


def _on_cpu(data: jax.Array) -> bool:
    return next(iter(data.devices())).platform == "cpu"


def _cost(leaf: _ArrayLeaf, chunk: _Chunk, copy: bool) -> int:
    """The host bytes staging ``chunk`` takes: 0 for a view of memory the caller keeps."""
    data = leaf.local[chunk.shard]
    if isinstance(data, np.ndarray):
        return chunk.nbytes if copy or not leaf.host(chunk).flags.c_contiguous else 0
    return 0 if _on_cpu(data) else chunk.nbytes


def _stage_wave(planned: Planned, *, copy: bool, fill_packed: Callable[[], np.ndarray | None]) -> Wave:
    """Host buffers of one wave's chunks (and, in the first, the packed small leaves):
    every device-to-host copy started, then each waited for."""
    started = [_start_host(leaf, chunk, copy) for leaf, chunk in planned.items]
    shards: dict[int, list[tuple[_layout.Index, np.ndarray]]] = {}
    sizing: dict[int, list[tuple[_layout.Index, np.ndarray]]] = {}
    sizing_nbytes = 0
    for item, host in zip(planned.items, started):
        leaf, chunk = item
        into = sizing if isinstance(item, _Sizing) else shards
        into.setdefault(leaf.slot, []).append((chunk.region, np.asarray(host)))
        if isinstance(item, _Sizing):
            sizing_nbytes += _cost(leaf, chunk, copy)
    return Wave(shards, fill_packed() if planned.first else None, planned.nbytes, sizing, sizing_nbytes)


def _start_host(leaf: _ArrayLeaf, chunk: _Chunk, copy: bool) -> Any:
    """Start staging ``chunk``: a numpy array (a copy, or a view when it costs nothing) or
    a device array whose host copy is under way (``np.asarray`` waits for it).

    A device shard is staged through a fresh ``jax.Array`` over the same buffer (or a
    slice of it): ``np.asarray`` caches the host copy on the array it is given, and on
    the caller's own array that copy would live as long as the caller's array does.
    """
    data = leaf.local[chunk.shard]
    if isinstance(data, np.ndarray):
        view = leaf.host(chunk)
        return np.array(view, order="C", copy=True) if copy or not view.flags.c_contiguous else view
    if _on_cpu(data):
        return leaf.host(chunk)
    if chunk.region == chunk.shard:
        own = jax.make_array_from_single_device_arrays(data.shape, data.sharding, [data])
    else:
        own = data[_layout.relative(chunk.region, chunk.shard)]
    own.copy_to_host_async()
    return own
