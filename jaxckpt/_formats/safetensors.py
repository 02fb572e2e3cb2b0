"""Safetensors files as a ``_formats.Source`` (reading), and the format's shared facts.

The format: 8 bytes little-endian header length N, N bytes of JSON header
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``,
offsets relative to the end of the header), then the tensors' bytes, C order, little
endian. A sharded export is a directory of ``model-0000k-of-0000N.safetensors`` files
and ``model.safetensors.index.json`` (``{"metadata": {"total_size"}, "weight_map":
{name: file}}``).

Names: a jaxckpt key path with ``/`` replaced by ``.`` (``params/dense/kernel`` →
``params.dense.kernel``), below the exported prefix, without nnx's ``value`` level and
renamed by the export's ``key_map`` (``convert.to_safetensors``).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import stat
import sys
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np

from .. import _dtypes, _layout, _storage, _tasks, _tree, _untrusted
from .._errors import CheckpointError, CorruptCheckpointError
from .._manifest import LeafRecord, Manifest
from .._storage import chunkfiles as _chunkfiles
from . import Source

# safetensors dtype names <-> jaxckpt (numpy / ml_dtypes) dtype names
DTYPE_TO_ST = {
    "bool": "BOOL", "uint8": "U8", "int8": "I8", "uint16": "U16", "int16": "I16", "uint32": "U32",
    "int32": "I32", "uint64": "U64", "int64": "I64", "float16": "F16", "bfloat16": "BF16",
    "float32": "F32", "float64": "F64", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
}
ST_TO_DTYPE = {v: k for k, v in DTYPE_TO_ST.items()}
INDEX_FILE = "model.safetensors.index.json"


def name_of(key_path: str) -> str:
    """The tensor name of a key path (``/`` becomes ``.``)."""
    return key_path.replace("/", ".")


# --- reading ------------------------------------------------------------------------
#
# Everything in a safetensors file is untrusted: the header is checked (size, JSON,
# dtypes, shapes, offsets inside the data section, no two tensors overlapping) before
# anything is allocated. Reads are positional (``os.preadv``) straight into the
# restored slices' 64-byte-aligned buffers: a C-order slice of a tensor is a set of
# contiguous runs, and only those runs are read (runs closer than ``MAX_GAP_BYTES``
# share one read, the gap going to a small scratch buffer).

MAX_HEADER_BYTES = 100 << 20
MAX_INDEX_BYTES = 100 << 20
READ_THREADS = 4
MAX_GAP_BYTES = 4096  # a gap this small costs less to read than another system call
_TASK_BYTES = 8 << 20  # reads batched per thread task (small ones would cost a lock each)
_IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX")) if "SC_IOV_MAX" in getattr(os, "sysconf_names", {}) else 1024
_MAX_RANK = 64
_MAX_NBYTES = 1 << 44  # 16 TiB per tensor, as for jaxckpt leaves
_MAX_MESSAGE = 500


class _Tensor(NamedTuple):
    """One tensor of one file: where its bytes are (``offset`` from the file's start)."""

    name: str
    dtype: str  # jaxckpt dtype name
    shape: tuple[int, ...]
    file: str
    offset: int
    nbytes: int


def open_source(loc: Any) -> Any:
    """The safetensors file or sharded directory at ``loc`` as a ``Source``, or ``None``.

    Claimed: a local ``*.safetensors`` file; a local directory holding ``INDEX_FILE``
    (a sharded export) or exactly one ``*.safetensors`` file. Anything else is left to
    the next format.

    Leaves are named by the tensor names with ``.`` as ``/`` (``params.dense.kernel`` is
    ``params/dense/kernel``, in nested dicts). When those paths cannot form a tree (two
    names become one path, a name is both a leaf and a prefix of another, an empty
    component), every tensor is a top-level key equal to its name instead.

    Raises:
      CorruptCheckpointError: a header or the index fails validation (naming the file
        and the tensor).
    """
    found = _find_files(loc)
    if found is None:
        return None
    files, weight_map = found
    tensors, metadata = _load_tensors(files, weight_map)
    man = _build_manifest(tensors, metadata, [os.path.basename(f) for f in files])
    by_key = {t.name: t for t in tensors}
    return Source(loc, man, lambda: _Reader(by_key), "safetensors")


def _find_files(loc: Any) -> tuple[list[str], dict[str, str] | None] | None:
    """The safetensors files at ``loc`` and the index's weight map (sharded), or ``None``."""
    path = getattr(loc, "local", None)
    if path is None:
        return None
    if os.path.isfile(path):
        return ([path], None) if path.endswith(".safetensors") else None
    if not os.path.isdir(path):
        return None
    index = os.path.join(path, INDEX_FILE)
    if os.path.lexists(index):
        weight_map = _read_index(index, path)
        return [os.path.join(path, f) for f in sorted(set(weight_map.values()))], weight_map
    names = [n for n in os.listdir(path)
             if n.endswith(".safetensors") and os.path.isfile(os.path.join(path, n))]
    return ([os.path.join(path, names[0])], None) if len(names) == 1 else None


def _bad(where: str) -> Callable[[str], CorruptCheckpointError]:
    def bad(msg: str) -> CorruptCheckpointError:
        if len(msg) > _MAX_MESSAGE:  # a hostile name or repr may be huge
            msg = msg[:_MAX_MESSAGE] + "…"
        return CorruptCheckpointError(f"Safetensors file '{where}': {msg}")

    return bad


@contextlib.contextmanager
def _open_regular(path: str, bad: Callable[[str], CorruptCheckpointError]) -> Iterator[tuple[Any, os.stat_result]]:
    """The open file and its stat, refused before any read when it is not a regular
    file (opened non-blocking: a FIFO must not hang us)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise bad(f"cannot be opened: {e}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise bad("is not a regular file")
        yield f, st


def _read_capped(path: str, limit: int, bad: Callable[[str], CorruptCheckpointError]) -> bytes:
    """A small metadata file's bytes (``_untrusted.read_file``); refused before reading
    when it is not a regular file (a FIFO would block) or larger than ``limit``."""

    def refuse(why: str, detail: Any) -> CorruptCheckpointError:
        if why == _untrusted.TOO_BIG:
            return bad(f"{detail} bytes is more than the {limit} it may have")
        return bad("is not a regular file" if why == _untrusted.NOT_REGULAR else f"cannot be opened: {detail}")

    data = _untrusted.read_file(path, limit, refuse)
    assert data is not None  # refuse raises for an absent file too
    return data


def _read_index(index: str, directory: str) -> dict[str, str]:
    """The index's weight map (tensor name -> file name), every file a plain name of an
    existing file in ``directory``."""
    bad = _bad(index)
    doc = _untrusted.load_json(_read_capped(index, MAX_INDEX_BYTES, bad), bad)
    if not isinstance(doc, dict) or not isinstance(doc.get("weight_map"), dict):
        raise bad("has no 'weight_map' object")
    if not isinstance(doc.get("metadata", {}), dict):
        raise bad("'metadata' is not an object")
    weight_map = doc["weight_map"]
    for name, file in weight_map.items():
        if not (isinstance(file, str) and file not in ("", ".", "..") and "/" not in file
                and "\\" not in file and "\0" not in file):
            raise bad(f"tensor '{name}': file {file!r} is not a plain file name in the directory")
        if not os.path.isfile(os.path.join(directory, file)):
            raise bad(f"tensor '{name}': file '{file}' does not exist")
    return weight_map


def _load_tensors(files: list[str], weight_map: dict[str, str] | None) -> tuple[list[_Tensor], dict[str, str]]:
    """Every tensor of ``files`` (as the index places them) and the files' metadata
    (their ``__metadata__`` merged in file order, the first file winning)."""
    tensors: list[_Tensor] = []
    metadata: dict[str, str] = {}
    seen: dict[str, str] = {}
    for file in files:
        found, meta = _read_header(file)
        bad = _bad(file)
        for k, v in meta.items():
            metadata.setdefault(k, v)
        for t in found:
            if t.name in seen:
                raise bad(f"tensor '{t.name}' is also in '{seen[t.name]}'")
            seen[t.name] = file
            if weight_map is not None and weight_map.get(t.name) != os.path.basename(file):
                raise bad(f"tensor '{t.name}' is not in {INDEX_FILE} for this file")
        tensors.extend(found)
    if weight_map is not None:
        lost = sorted(set(weight_map) - set(seen))
        if lost:
            raise _bad(os.path.dirname(files[0]))(
                f"{INDEX_FILE} names tensors its files lack: {', '.join(lost[:10])}")
    return tensors, metadata


def _read_header(path: str) -> tuple[list[_Tensor], dict[str, str]]:
    """The validated tensors and ``__metadata__`` of one file (only its header is read)."""
    bad = _bad(path)
    with _open_regular(path, bad) as (f, st):
        if st.st_size < 8:
            raise bad(f"{st.st_size} bytes is too short for a safetensors header")
        n = int.from_bytes(f.read(8), "little")
        if n > MAX_HEADER_BYTES or n > st.st_size - 8:
            raise bad(f"header length {n} is beyond the file ({st.st_size} bytes) or over "
                      f"{MAX_HEADER_BYTES} bytes")
        data = f.read(n)
    if len(data) != n:
        raise bad("the header ends early")
    return _parse_header(data, 8 + n, st.st_size - 8 - n, path)


def _parse_header(data: bytes, start: int, size: int, path: str) -> tuple[list[_Tensor], dict[str, str]]:
    """Tensors of a header whose data section is ``size`` bytes from ``start``."""
    bad = _bad(path)
    doc = _untrusted.load_json(data, bad)
    if not isinstance(doc, dict):
        raise bad("the header is not a JSON object")
    meta = doc.pop("__metadata__", None)
    meta = {} if meta is None else meta
    if not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise bad("__metadata__ is not an object of strings")
    tensors = [_parse_entry(name, entry, start, size, path, bad) for name, entry in doc.items()]
    last: _Tensor | None = None
    for t in sorted((t for t in tensors if t.nbytes), key=lambda t: t.offset):
        if last is not None and t.offset < last.offset + last.nbytes:
            raise bad(f"tensor '{t.name}' overlaps tensor '{last.name}'")
        last = t
    return tensors, meta


def _parse_entry(name: str, entry: Any, start: int, size: int, path: str,
                 bad: Callable[[str], CorruptCheckpointError]) -> _Tensor:
    if not isinstance(entry, dict):
        raise bad(f"tensor '{name}': entry is not an object")
    st_dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(st_dtype, str) or st_dtype not in ST_TO_DTYPE:
        raise bad(f"tensor '{name}': unknown dtype {st_dtype!r}")
    if not (isinstance(shape, list) and len(shape) <= _MAX_RANK
            and all(_is_int(d) and 0 <= d <= _MAX_NBYTES for d in shape)):
        raise bad(f"tensor '{name}': shape {shape!r} is not a list of non-negative ints")
    dtype = ST_TO_DTYPE[st_dtype]
    nbytes = math.prod(shape) * _dtypes.DTYPES[dtype].itemsize
    if nbytes > _MAX_NBYTES:
        raise bad(f"tensor '{name}': {nbytes} bytes is more than the {_MAX_NBYTES} a tensor may have")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
        raise bad(f"tensor '{name}': data_offsets {offsets!r} is not [begin, end]")
    begin, end = offsets
    if not 0 <= begin <= end <= size:
        raise bad(f"tensor '{name}': data_offsets [{begin}, {end}] lie outside the data section "
                  f"({size} bytes)")
    if end - begin != nbytes:
        raise bad(f"tensor '{name}': data_offsets [{begin}, {end}] span {end - begin} bytes, "
                  f"its shape and dtype {nbytes}")
    return _Tensor(name, dtype, tuple(shape), path, start + begin, nbytes)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _build_manifest(tensors: list[_Tensor], metadata: dict[str, str], files: list[str]) -> Manifest:
    paths, structure = _tree_of([t.name for t in tensors])
    order = {name: i for i, name in enumerate(paths)}
    recs: list[LeafRecord | None] = [None] * len(tensors)
    for t in tensors:
        recs[order[t.name]] = LeafRecord(
            path=paths[t.name], kind="array", dtype=t.dtype, shape=t.shape, sharding=None,
            store="safetensors", key=t.name, chunk_shape=t.shape, storage_dtype=t.dtype,
            nbytes=t.nbytes)
    info = {"format": "safetensors", "files": files, "bytes": sum(t.nbytes for t in tensors)}
    return Manifest(format_version=1, structure=structure, leaves=tuple(recs), metadata=metadata,
                    process_count=1, info=info)


def _tree_of(names: list[str]) -> tuple[dict[str, str], dict[str, Any]]:
    """Each name's key path (in leaf-index order) and the structure of nested dicts they
    form; flat top-level keys equal to the names when the paths do not form a tree."""
    parts = {n: n.replace(".", "/").split("/") for n in names}
    nested: dict[str, Any] = {}
    ok = all(all(parts[n]) and len(parts[n]) < _tree.MAX_DEPTH for n in names)
    for n in sorted(names) if ok else ():
        node = nested
        for p in parts[n][:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):  # a leaf is also a prefix
                ok = False
                break
        if not ok or parts[n][-1] in node:  # a prefix is also a leaf, or a duplicate path
            ok = False
            break
        node[parts[n][-1]] = n
    if not ok:
        nested = {n: n for n in names}
    paths: dict[str, str] = {}

    def describe(node: Any, trail: list[str]) -> dict[str, Any]:
        if isinstance(node, str):
            paths[node] = "/".join(_tree.encode_key(p) for p in trail)
            return {"leaf": len(paths) - 1}
        return {"dict": [[k, describe(node[k], [*trail, k])] for k in sorted(node)]}

    return paths, describe(nested, [])


class _Reader:
    """``_reader.Reader``'s interface over safetensors files: ``add`` the slices,
    ``run`` once (each file opened once), ``get`` each slice."""

    def __init__(self, tensors: dict[str, _Tensor]):
        self._tensors = tensors
        self._wanted: dict[tuple[str, _layout.Index], None] = {}
        self._out: dict[tuple[str, _layout.Index], np.ndarray] = {}

    def add(self, rec: LeafRecord, index: _layout.Index) -> None:
        if (rec.key, index) not in self._out:
            self._wanted[(rec.key, index)] = None

    def get(self, rec: LeafRecord, index: _layout.Index) -> np.ndarray:
        return self._out[(rec.key, index)]

    def run(self) -> None:
        reads: list[_Read] = []
        wanted, self._wanted = list(self._wanted), {}
        for key, index in wanted:
            t = self._tensors[key]
            dtype = _dtypes.DTYPES[t.dtype]
            if dtype.itemsize > 1 and sys.byteorder != "little":
                raise CheckpointError(f"Safetensors file '{t.file}': tensor '{t.name}': safetensors "
                                      "data is little endian; big-endian hosts are not supported")
            dest = _chunkfiles.aligned_empty(_layout.index_shape(index), dtype)
            reads.extend(_plan_reads(t, index, dest))
            self._out[(key, index)] = dest
        fds: dict[str, int] = {}
        try:
            for r in reads:
                if r.tensor.file not in fds:
                    fds[r.tensor.file] = _open_data(r.tensor)
            _tasks.run_tasks([functools.partial(_run_reads, batch, fds) for batch in _batches(reads)],
                             READ_THREADS)
        finally:
            for fd in fds.values():
                os.close(fd)
        for key, index in wanted:
            dest = self._out[(key, index)]
            if dest.dtype == np.bool_ and dest.size and dest.view(np.uint8).max() > 1:
                raise CorruptCheckpointError(f"Safetensors file '{self._tensors[key].file}': tensor "
                                             f"'{key}': a bool byte is neither 0 nor 1")


class _Read(NamedTuple):
    """One positional read: ``nbytes`` from ``offset`` into ``views`` (memoryviews of the
    destination, and ints: gaps of that many bytes, read into a scratch buffer)."""

    tensor: _Tensor
    offset: int
    nbytes: int
    views: list[Any]  # memoryview pieces of the destination, or int gap lengths


def _plan_reads(t: _Tensor, index: _layout.Index, dest: np.ndarray) -> list[_Read]:
    """The reads that fill ``dest`` with ``index`` of ``t``: its contiguous runs (the
    innermost dimensions the slice spans whole, times the extent of the next one), runs
    closer than ``MAX_GAP_BYTES`` sharing one read."""
    if dest.size == 0:
        return []
    itemsize = dest.dtype.itemsize
    shape = t.shape
    strides = [itemsize * math.prod(shape[j + 1:]) for j in range(len(shape))]
    k = len(shape)  # dims k.. are spanned whole
    while k > 0 and index[k - 1] == (0, shape[k - 1]):
        k -= 1
    run = itemsize * math.prod(b - a for a, b in index[max(k - 1, 0):]) if k else t.nbytes
    outer = max(k - 1, 0)
    offsets = np.zeros((), np.int64) + sum(a * s for (a, _), s in zip(index[outer:], strides[outer:]))
    for (a, b), s in zip(index[:outer], strides[:outer]):
        offsets = offsets[..., None] + np.arange(a, b, dtype=np.int64) * s
    flat = memoryview(dest.reshape(-1).view(np.uint8))
    gaps = (np.diff(offsets.reshape(-1)) - run).tolist()
    offsets = offsets.reshape(-1).tolist()
    reads: list[_Read] = []
    first = 0
    for i in range(len(offsets)):
        last = i + 1 == len(offsets)
        if last or gaps[i] > MAX_GAP_BYTES or i + 1 - first >= _IOV_MAX // 2:
            views: list[Any] = []
            for j in range(first, i + 1):
                views.append(flat[j * run:(j + 1) * run])
                if j < i and gaps[j]:
                    views.append(gaps[j])
            start = offsets[first]
            reads.append(_Read(t, t.offset + start, offsets[i] + run - start, views))
            first = i + 1
    return reads


def _batches(reads: list[_Read]) -> list[list[_Read]]:
    """``reads`` grouped into thread tasks of about ``_TASK_BYTES`` each."""
    out: list[list[_Read]] = []
    size = _TASK_BYTES
    for r in reads:
        if size >= _TASK_BYTES:
            out.append([])
            size = 0
        out[-1].append(r)
        size += r.nbytes
    return out


def _open_data(t: _Tensor) -> int:
    try:  # non-blocking: a FIFO swapped in for the file must not hang the restore
        return os.open(t.file, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise CorruptCheckpointError(f"Safetensors file '{t.file}': tensor '{t.name}': cannot be "
                                     f"opened: {e}") from None


def _run_reads(batch: list[_Read], fds: dict[str, int]) -> None:
    scratch = memoryview(bytearray(MAX_GAP_BYTES))
    done = 0
    try:
        for r in batch:
            views = [v if not isinstance(v, int) else scratch[:v] for v in r.views]
            try:
                got = _preadv_all(fds[r.tensor.file], views, r.offset)
            except OSError as e:
                raise CorruptCheckpointError(f"Safetensors file '{r.tensor.file}': tensor "
                                             f"'{r.tensor.name}': cannot be read: {e}") from None
            done += 1
            if got != r.nbytes:
                raise CorruptCheckpointError(
                    f"Safetensors file '{r.tensor.file}': tensor '{r.tensor.name}': the file ends early "
                    f"(read {got} of {r.nbytes} bytes at offset {r.offset})")
    finally:  # counted once per batch: a lock per small read would cost more than the read
        _storage.count(bytes_read=sum(r.nbytes for r in batch[:done]), reads=done)


def _preadv_all(fd: int, views: list[memoryview], offset: int) -> int:
    """Fill ``views`` from ``offset`` on; the bytes read (fewer only at the end of the file)."""
    done, i = 0, 0
    while i < len(views):
        n = os.preadv(fd, views[i:i + _IOV_MAX], offset + done)
        if n == 0:
            break
        done += n
        while i < len(views) and n >= len(views[i]):
            n -= len(views[i])
            i += 1
        if n:
            views[i] = views[i][n:]
    return done
