"""``jaxckpt.open``: look inside a checkpoint without the model code.

    >>> view = jaxckpt.open("/ckpts/100")
    >>> view.keys()[:3]
    ['opt/0/count', 'opt/0/mu/dense/kernel', 'params/dense/kernel']
    >>> k = view["params/dense/kernel"]      # lazy: nothing read yet
    >>> k.shape, k.dtype
    ((1024, 512), dtype('float32'))
    >>> k[:2, :4]                            # reads only the chunks this slice touches
    array([[...]], dtype=float32)
    >>> view["params"]["dense"]["kernel"]    # nested access, as in metadata().tree
    LazyArray('params/dense/kernel', shape=(1024, 512), dtype=float32)
    >>> view["opt"][0]                       # an int is a sequence index (or int dict key)
    CheckpointView('/ckpts/100/opt/0', ...)
    >>> view["rng"].dtype, view["rng"].shape # a typed PRNG key is a key, as `jaxckpt show` says
    (key<fry>, ())

In a notebook the view renders as a collapsible tree (``_repr_html_``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from . import _diff, _dtypes, _formats, _html, _layout, _reader, _restore, _tree
from ._diff import LeafStats
from ._manifest import LeafRecord, Manifest
from ._storage import location as _location


class LazyArray:
    """One saved array; indexing reads only the saved chunks the index touches.

    A typed PRNG key leaf is described as the key array it was (``shape`` and ``dtype``
    ``key<impl>``, as ``metadata`` and ``jaxckpt show`` report it): indexing it returns
    typed keys (a ``jax.Array``); ``key_data`` is the stored ``uint32`` data as a
    ``LazyArray`` of numpy slices.
    """

    def __init__(self, loc: _location.Location, man: Manifest, rec: LeafRecord,
                 new_reader: Callable[[], Any] | None = None, *, key_data: bool = False):
        self._loc, self._man, self._rec = loc, man, rec
        self._new_reader = new_reader or (lambda: _reader.Reader(loc, man))
        self._is_key = rec.kind == "prng_key" and not key_data

    @property
    def path(self) -> str:
        """The leaf's key path in the checkpoint (``params/dense/kernel``)."""
        return self._rec.path

    @property
    def shape(self) -> tuple[int, ...]:
        """The array's shape; for a typed PRNG key, the key array's (its data has more)."""
        return self._rec.shape[: self._rec.key_ndim] if self._is_key else self._rec.shape

    @property
    def dtype(self) -> Any:
        """A numpy dtype; for a typed PRNG key, jax's key dtype (``key<fry>``)."""
        return _restore.key_dtype(self._rec.impl) if self._is_key else _dtypes.DTYPES[self._rec.dtype]

    @property
    def ndim(self) -> int:
        """The number of dimensions."""
        return len(self.shape)

    @property
    def size(self) -> int:
        """The number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """The leaf's logical size in bytes (elements times item size)."""
        return self._rec.nbytes

    @property
    def codec(self) -> str:
        """How its chunks are stored: ``"raw"``, or a lossless codec (``"zstd"``, ``"blosc"``)."""
        return self._rec.codec or "raw"

    @property
    def stored_nbytes(self) -> int:
        """The bytes its data takes in the checkpoint (format 3: its entries, checksums
        included; compressed, or nothing for all-zero chunks); ``nbytes`` in older formats."""
        return self._rec.stored_nbytes

    @property
    def sharding(self) -> _layout.SavedSharding | None:
        """How it was sharded when saved."""
        return _layout.sharding_from_json(self._rec.sharding)

    @property
    def prng_impl(self) -> str | None:
        """For a typed PRNG key: its implementation (``threefry2x32``)."""
        return self._rec.impl

    @property
    def key_data(self) -> LazyArray:
        """For a typed PRNG key: its stored data (``uint32``, the key shape and the
        implementation's own dimensions), read as numpy slices like any array."""
        if self._rec.kind != "prng_key":
            raise TypeError(f"'{self.path}' is not a typed PRNG key (its dtype is {self.dtype})")
        return LazyArray(self._loc, self._man, self._rec, self._new_reader, key_data=True)

    def __getitem__(self, index: Any) -> Any:
        """A numpy array; for a typed PRNG key, typed keys (a ``jax.Array``)."""
        box, rest = _bounding_box(index, self.shape)
        box += tuple((0, d) for d in self._rec.shape[len(box):])  # a key's data dimensions, whole
        reader = self._new_reader()
        reader.add(self._rec, box)
        reader.run()
        out = reader.get(self._rec, box)
        axis = 0
        for r in rest:  # pick within the box, one dimension at a time
            if isinstance(r, int):
                out = np.take(out, r, axis=axis)
            else:
                out = out[(slice(None),) * axis + (r,)]
                axis += 1
        return jax.random.wrap_key_data(out, impl=self._rec.impl) if self._is_key else out

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        if self._is_key:  # as jax refuses np.asarray of typed keys
            raise TypeError(f"'{self.path}' is a typed PRNG key ({self.dtype}): it has no numpy form; "
                            f"index it for typed keys, or read its uint32 data with .key_data[...]")
        out = self[...]
        return out if dtype is None else out.astype(dtype)

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d array")
        return self.shape[0]

    def __repr__(self) -> str:
        data = ".key_data" if self._rec.kind == "prng_key" and not self._is_key else ""
        return f"LazyArray('{self.path}'{data}, shape={self.shape}, dtype={self.dtype.name})"


def _bounding_box(index: Any, shape: tuple[int, ...]) -> tuple[_layout.Index, list[Any]]:
    """The smallest box covering ``index`` and, per dimension, what to pick inside it:
    an int (drops the dimension), ``slice(None)`` or an array of positions."""
    if not isinstance(index, tuple):
        index = (index,)
    if any(i is Ellipsis for i in index):
        at = index.index(Ellipsis)
        fill = len(shape) - (len(index) - 1)
        index = index[:at] + (slice(None),) * fill + index[at + 1:]
    if len(index) > len(shape):
        raise IndexError(f"too many indices for an array of {len(shape)} dimensions")
    index = index + (slice(None),) * (len(shape) - len(index))
    box, rest = [], []
    for i, dim in zip(index, shape):
        if isinstance(i, (int, np.integer)) and not isinstance(i, bool):
            j = int(i) + dim if i < 0 else int(i)
            if not 0 <= j < dim:
                raise IndexError(f"index {i} is out of bounds for a dimension of size {dim}")
            box.append((j, j + 1))
            rest.append(0)
        elif isinstance(i, slice):
            start, stop, step = i.indices(dim)
            picked = range(start, stop, step)
            if len(picked) == 0:
                box.append((0, 0))
                rest.append(slice(None))
            elif step == 1:
                box.append((start, stop))
                rest.append(slice(None))
            else:
                lo = min(picked[0], picked[-1])
                box.append((lo, max(picked[0], picked[-1]) + 1))
                rest.append(np.asarray(picked) - lo)
        else:
            raise IndexError(f"only integers, slices and ... are supported, got {i!r}")
    return tuple(box), rest


class CheckpointView:
    """A read-only, lazy view of a checkpoint (see ``jaxckpt.open``)."""

    def __init__(self, loc: _location.Location, man: Manifest, prefix: str = "",
                 new_reader: Callable[[], Any] | None = None, format: str = "jaxckpt"):  # noqa: A002
        self._loc, self._man, self._prefix = loc, man, prefix
        self._new_reader, self.format = new_reader, format
        self._by_path = {r.path: r for r in man.leaves if r.path.startswith(prefix)}

    @property
    def path(self) -> str:
        """The checkpoint's location (path or URL)."""
        return str(self._loc)

    @property
    def metadata(self) -> dict[str, Any]:
        """The user metadata saved with the checkpoint."""
        return self._man.metadata

    @property
    def info(self) -> dict[str, Any]:
        """Versions, creation time, bytes, save statistics (and step metrics)."""
        return dict(self._man.info)

    @property
    def nbytes(self) -> int:
        """The logical size in bytes of the leaves under this view."""
        return sum(r.nbytes for r in self._by_path.values())

    def keys(self) -> list[str]:
        """Key paths of every leaf (under this view's prefix), sorted."""
        return sorted(p[len(self._prefix):] for p in self._by_path)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self._by_path)

    def __contains__(self, key: Any) -> bool:
        """Whether ``key`` (as ``__getitem__`` takes it) is a leaf or a subtree here."""
        return self._find(key) is not None

    def _find(self, key: Any) -> str | None:
        """The key path (with this view's prefix) ``key`` names, a leaf's or a subtree's.
        A str is a flat key path first; failing that, one raw key (``metadata().tree``'s
        ``"a/b"``, saved as ``a%2Fb``)."""
        tries = [_key_path(key)]
        if isinstance(key, str) and _tree.encode_key(key) != key:
            tries.append(_tree.encode_key(key))
        for path in tries:
            full = self._prefix + path
            if full in self._by_path or any(p.startswith(full + "/") for p in self._by_path):
                return full
        return None

    def __getitem__(self, key: str | int | tuple[str | int, ...]) -> Any:
        """A leaf (``LazyArray`` or its inline value) or, for a prefix, a sub-view.

        ``key`` is a key path relative to this view, flat (``"params/dense/kernel"``,
        as ``keys()`` lists it) or one level at a time as ``metadata().tree`` nests it:
        ``view["params"]["dense"]["kernel"]``, ``view["opt"][0]`` (an int: a sequence
        index or an int dict key). A tuple names one level per entry, raw (a key
        holding ``/`` needs no escaping): ``view["params", "a/b"]``. A str that is no key
        path here is tried as one raw key (``view["params"]["a/b"]``).
        """
        full = self._find(key)
        rec = None if full is None else self._by_path.get(full)
        if rec is not None:
            return rec.value if rec.kind == "value" else LazyArray(self._loc, self._man, rec, self._new_reader)
        if full is not None:
            return CheckpointView(self._loc, self._man, full + "/", self._new_reader, self.format)
        raise KeyError(f"'{key}' is not a key path in checkpoint '{self._loc}'")

    def rows(self) -> list[dict[str, Any]]:
        """One row per leaf: path, kind, shape, dtype, bytes, saved sharding."""
        rows = []
        for path in self.keys():
            rec = self._by_path[self._prefix + path]
            if rec.kind == "value":
                rows.append({"path": path, "kind": "value", "shape": "", "dtype": type(rec.value).__name__,
                             "bytes": 0, "sharding": repr(rec.value)[:60]})
                continue
            sharding = _layout.sharding_from_json(rec.sharding)
            where = "host" if sharding is None else (
                f"{sharding.spec} on {sharding.mesh_shape}" if sharding.type == "named" else sharding.type)
            if rec.kind == "prng_key":  # the key array, as ``LazyArray`` and ``jaxckpt show`` describe it
                kind, shape, dtype = f"key<{rec.impl}>", rec.shape[: rec.key_ndim], str(_restore.key_dtype(rec.impl))
            else:
                kind, shape, dtype = rec.kind, rec.shape, rec.dtype
            rows.append({"path": path, "kind": kind, "shape": shape, "dtype": dtype, "bytes": rec.nbytes,
                         "sharding": where})
        return rows

    def summary(self) -> dict[str, Any]:
        """Totals: leaf count, array count, bytes, and bytes per dtype and per top-level
        subtree (under this view's prefix). PRNG keys count as ``key<impl>``.

        Example:
          >>> jaxckpt.open("/ckpts/100").summary()
          {'leaves': 3, 'arrays': 2, 'bytes': 4194312, 'by_dtype': {'float32': 4194304,
           'key<threefry2x32>': 8}, 'by_subtree': {'params': 4194304, 'rng': 8, 'step': 0}}
        """
        by_dtype: dict[str, int] = {}
        by_subtree: dict[str, int] = {}
        arrays = 0
        for path in self.keys():
            rec = self._by_path[self._prefix + path]
            top = path.split("/", 1)[0]
            by_subtree[top] = by_subtree.get(top, 0) + rec.nbytes
            if rec.kind != "value":
                arrays += 1
                dtype = rec.dtype if rec.kind == "array" else f"key<{rec.impl}>"
                by_dtype[dtype] = by_dtype.get(dtype, 0) + rec.nbytes
        return {"leaves": len(self), "arrays": arrays, "bytes": self.nbytes,
                "by_dtype": dict(sorted(by_dtype.items())), "by_subtree": dict(sorted(by_subtree.items()))}

    def stats(self, key: str | None = None, *,
              progress: Callable[[int, int], None] | None = None) -> LeafStats | dict[str, LeafStats]:
        """Statistics of a leaf, or of every leaf under a prefix (``None``: all).

        Streams the saved chunks (memory stays near ``_verify.SCAN_BUDGET_BYTES``) and
        combines per-chunk statistics in float64 (Chan et al.'s update): ``count``,
        ``nan``, ``inf``, and ``min``/``max``/``mean``/``std`` over the finite
        elements. PRNG keys, inline values and complex arrays come back with
        ``numeric=False``.

        Args:
          key: a leaf's key path or a prefix, relative to this view; ``None`` for all.
          progress: optional ``callable(bytes_done, bytes_total)``.

        Returns:
          A ``LeafStats`` for a leaf; for a prefix, a dict from key path (relative to
          this view, like ``keys()``) to ``LeafStats``.

        Raises:
          KeyError: ``key`` is neither a leaf nor a prefix.
          CorruptCheckpointError: a chunk fails its checksum.

        Example:
          >>> s = jaxckpt.open("/ckpts/100").stats("params/dense/kernel")
          >>> s.mean, s.std, s.nan
          (0.0012, 0.0441, 0)
        """
        full = self._prefix + key.strip("/") if key and key.strip("/") else None
        rec = self._by_path.get(full) if full is not None else None
        if rec is not None:
            return _diff.leaf_stats(self._reader_factory(), [rec], progress)[rec.path]
        prefix = self._prefix if full is None else full + "/"
        recs = [self._by_path[p] for p in sorted(self._by_path) if p.startswith(prefix)]
        if not recs:
            raise KeyError(f"'{key}' is not a key path in checkpoint '{self._loc}'")
        out = _diff.leaf_stats(self._reader_factory(), recs, progress)
        return {r.path[len(self._prefix):]: out[r.path] for r in recs}

    def _reader_factory(self) -> Callable[[], Any]:
        return self._new_reader or (lambda: _reader.Reader(self._loc, self._man))

    def __repr__(self) -> str:
        n = len(self)
        return (f"CheckpointView('{self._loc}', {n} {'leaf' if n == 1 else 'leaves'}, "
                f"{_html.human_bytes(self.nbytes)})")

    def _repr_html_(self) -> str:
        return _html.render_view(self)


def _key_path(key: Any) -> str:
    """``__getitem__``'s key as a key path: a str is one already; an int is one level
    (a sequence index or int dict key, written as a decimal); a tuple one level each."""
    if isinstance(key, str):
        return key.strip("/")
    if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
        return str(int(key))
    if isinstance(key, tuple) and key:
        return "/".join(_tree.encode_key(k) if isinstance(k, str) else _key_path(k) for k in key)
    raise TypeError(f"a checkpoint view is indexed by a key path (str), an int or a tuple of them, "
                    f"got {type(key).__name__}")


def open(path: Any) -> CheckpointView:  # noqa: A001 - the public name is jaxckpt.open
    """Open a checkpoint for exploration; nothing but the manifest is read.

    Args:
      path: a checkpoint (local path, URL or kvstore spec).

    Returns:
      A ``CheckpointView``: ``keys()``, ``view["a/b"]`` (a ``LazyArray`` whose
      ``[index]`` reads a numpy slice, or an inline value, or a sub-view for a
      prefix), ``metadata``, ``info``, ``summary()`` and an HTML table in notebooks.

    Example:
      >>> view = jaxckpt.open("/ckpts/100")
      >>> view["params/dense/kernel"][0, :8]
    """
    loc = _location.resolve(path)
    with _tree.gc_paused():
        source = _formats.open_source(loc)
        return CheckpointView(source.loc, source.manifest, "", source.new_reader, source.format)
