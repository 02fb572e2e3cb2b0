"""``jaxckpt.open``: look inside a checkpoint without the model code.

    >>> view = jaxckpt.open("/ckpts/100")
    >>> view.keys()[:3]
    ['opt/0/count', 'opt/0/mu/dense/kernel', 'params/dense/kernel']
    >>> k = view["params/dense/kernel"]      # lazy: nothing read yet
    >>> k.shape, k.dtype
    ((1024, 512), dtype('float32'))
    >>> k[:2, :4]                            # reads only the chunks this slice touches
    array([[...]], dtype=float32)

In a notebook the view renders as a collapsible tree (``_repr_html_``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from . import _dtypes, _html, _layout, _location, _reader, _scan, _sources, _tree
from ._manifest import LeafRecord, Manifest
from ._scan import LeafStats


class LazyArray:
    """One saved array; indexing reads only the saved chunks the index touches."""

    def __init__(self, loc: _location.Location, man: Manifest, rec: LeafRecord,
                 new_reader: Callable[[], Any] | None = None):
        self._loc, self._man, self._rec = loc, man, rec
        self._new_reader = new_reader or (lambda: _reader.Reader(loc, man))

    @property
    def path(self) -> str:
        return self._rec.path

    @property
    def shape(self) -> tuple[int, ...]:
        return self._rec.shape

    @property
    def dtype(self) -> np.dtype:
        return _dtypes.DTYPES[self._rec.dtype]

    @property
    def ndim(self) -> int:
        return len(self._rec.shape)

    @property
    def size(self) -> int:
        return math.prod(self._rec.shape)

    @property
    def nbytes(self) -> int:
        return self._rec.nbytes

    @property
    def sharding(self) -> _layout.SavedSharding | None:
        """How it was sharded when saved."""
        return _layout.sharding_from_json(self._rec.sharding)

    @property
    def prng_impl(self) -> str | None:
        """For a typed PRNG key: its implementation (the data is the key data)."""
        return self._rec.impl

    def __getitem__(self, index: Any) -> np.ndarray:
        box, rest = _bounding_box(index, self.shape)
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
        return out

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self[...]
        return out if dtype is None else out.astype(dtype)

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d array")
        return self.shape[0]

    def __repr__(self) -> str:
        return f"LazyArray('{self.path}', shape={self.shape}, dtype={self.dtype.name})"


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
        return sum(r.nbytes for r in self._by_path.values())

    def keys(self) -> list[str]:
        """Key paths of every leaf (under this view's prefix), sorted."""
        return sorted(p[len(self._prefix):] for p in self._by_path)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self._by_path)

    def __contains__(self, key: str) -> bool:
        return self._prefix + key in self._by_path

    def __getitem__(self, key: str) -> Any:
        """A leaf (``LazyArray`` or its inline value) or, for a prefix, a sub-view."""
        full = self._prefix + key.strip("/")
        rec = self._by_path.get(full)
        if rec is not None:
            return rec.value if rec.kind == "value" else LazyArray(self._loc, self._man, rec, self._new_reader)
        sub = full + "/"
        if any(p.startswith(sub) for p in self._by_path):
            return CheckpointView(self._loc, self._man, sub, self._new_reader, self.format)
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
            rows.append({"path": path, "kind": rec.kind if rec.kind != "prng_key" else f"key<{rec.impl}>",
                         "shape": rec.shape, "dtype": rec.dtype, "bytes": rec.nbytes, "sharding": where})
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

        Streams the saved chunks (memory stays near ``_scan.SCAN_BUDGET_BYTES``) and
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
            return _scan.leaf_stats(self._reader_factory(), [rec], progress)[rec.path]
        prefix = self._prefix if full is None else full + "/"
        recs = [self._by_path[p] for p in sorted(self._by_path) if p.startswith(prefix)]
        if not recs:
            raise KeyError(f"'{key}' is not a key path in checkpoint '{self._loc}'")
        out = _scan.leaf_stats(self._reader_factory(), recs, progress)
        return {r.path[len(self._prefix):]: out[r.path] for r in recs}

    def _reader_factory(self) -> Callable[[], Any]:
        return self._new_reader or (lambda: _reader.Reader(self._loc, self._man))

    def __repr__(self) -> str:
        return f"CheckpointView('{self._loc}', {len(self)} leaves, {_html.human_bytes(self.nbytes)})"

    def _repr_html_(self) -> str:
        return _html.render_view(self)


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
        source = _sources.open_source(loc)
        return CheckpointView(source.loc, source.manifest, "", source.new_reader, source.format)
