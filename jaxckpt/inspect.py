"""``jaxckpt.open``: look inside a checkpoint without the model code.

    >>> view = jaxckpt.open("/ckpts/100")
    >>> view.keys()[:3]
    ['opt/0/count', 'opt/0/mu/dense/kernel', 'params/dense/kernel']
    >>> k = view["params/dense/kernel"]      # lazy: nothing read yet
    >>> k.shape, k.dtype
    ((1024, 512), dtype('float32'))
    >>> k[:2, :4]                            # reads only the chunks this slice touches
    array([[...]], dtype=float32)

In a notebook the view renders as a table (``_repr_html_``).
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterator
from typing import Any

import numpy as np

from . import _commit, _dtypes, _layout, _location, _reader, _tree
from ._manifest import LeafRecord, Manifest


class LazyArray:
    """One saved array; indexing reads only the saved chunks the index touches."""

    def __init__(self, loc: _location.Location, man: Manifest, rec: LeafRecord):
        self._loc, self._man, self._rec = loc, man, rec

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
        reader = _reader.Reader(self._loc, self._man)
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

    def __init__(self, loc: _location.Location, man: Manifest, prefix: str = ""):
        self._loc, self._man, self._prefix = loc, man, prefix
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
            return rec.value if rec.kind == "value" else LazyArray(self._loc, self._man, rec)
        sub = full + "/"
        if any(p.startswith(sub) for p in self._by_path):
            return CheckpointView(self._loc, self._man, sub)
        raise KeyError(f"'{key}' is not a key path in checkpoint '{self._loc}'")

    def summary(self) -> list[dict[str, Any]]:
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

    def __repr__(self) -> str:
        return f"CheckpointView('{self._loc}', {len(self)} leaves, {_human(self.nbytes)})"

    def _repr_html_(self) -> str:
        head = (f"<b>jaxckpt</b> <code>{html.escape(str(self._loc))}</code>: {len(self)} leaves, "
                f"{_human(self.nbytes)}")
        created = self._man.info.get("created")
        if created:
            head += f", saved {html.escape(str(created))}"
        cells = "".join(
            "<tr>" + "".join(f"<td>{html.escape(str(row[c]))}</td>" for c in
                             ("path", "kind", "shape", "dtype")) +
            f"<td style='text-align:right'>{_human(row['bytes'])}</td><td>{html.escape(str(row['sharding']))}</td></tr>"
            for row in self.summary())
        return (f"<div>{head}<table><thead><tr><th>path</th><th>kind</th><th>shape</th><th>dtype</th>"
                f"<th>size</th><th>saved as</th></tr></thead><tbody>{cells}</tbody></table></div>")


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


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
        return CheckpointView(loc, _commit.read_manifest(loc))
