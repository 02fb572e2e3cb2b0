"""``diff`` (two checkpoints compared region by region) and per-leaf statistics
(``CheckpointView.stats``), streamed over the saved chunks with bounded memory.

Both plan their regions first (each a union of whole saved chunks of every checkpoint
read, where that fits the budget), read them through the source's reader a batch
within ``_verify.SCAN_BUDGET_BYTES`` at a time, and fold each region into a small
result, so host memory stays near that budget whatever the checkpoints' size. The
budget, the progress meter and the JSON form of a report are ``_verify``'s, shared.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np

from . import _dtypes, _formats, _layout, _verify
from ._manifest import LeafRecord
from ._verify import Meter, Progress, json_value, leaf_count

# Leaves up to this size (all checkpoints compared together) are one region: small
# leaves are read whole, and packed ones together.
WHOLE_LEAF_BYTES = 4 << 20
# Elements folded at a time: bounds the float64 temporaries of stats and diff.
FOLD_BLOCK = 1 << 20


# --- results ------------------------------------------------------------------------


@dataclasses.dataclass
class DiffReport:
    """What ``diff`` found between checkpoints ``a`` and ``b``.

    Attributes:
      a, b: the two checkpoints.
      added: key paths only in ``b``; ``removed``: only in ``a`` (both sorted).
      changed: one dict per difference of a common leaf that is not its values:
        ``{"leaf", "field", "a", "b"}`` with ``field`` one of ``kind``, ``dtype``,
        ``shape``, ``impl`` (PRNG key implementation) or ``value`` (inline values).
      arrays: per common array leaf of equal shape, ``{"elements", "differ",
        "max_abs", "max_rel"}``: how many elements differ, the largest ``|a - b|`` and
        the largest ``|a - b| / max(|a|, |b|)``. NaN equals NaN; a NaN or infinity
        against anything else it does not equal is an infinite difference.
      seconds: wall time.
      keys: per common PRNG key leaf of equal shape, ``{"keys", "differ"}``: how many
        keys it holds and how many of them differ (a key differs when any word of its
        data does; keys are compared as keys, never as numbers).
      leaves: key paths in either checkpoint.
    """

    a: str
    b: str
    added: list[str]
    removed: list[str]
    changed: list[dict[str, Any]]
    arrays: dict[str, dict[str, Any]]
    seconds: float
    keys: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    leaves: int = 0

    @property
    def identical(self) -> bool:
        """Same keys, kinds, shapes, dtypes, inline values, array values and PRNG keys."""
        return (not (self.added or self.removed or self.changed)
                and all(d["differ"] == 0 for d in [*self.arrays.values(), *self.keys.values()]))

    def differences(self) -> dict[str, str]:
        """Each leaf that differs, by key path, with the first of: ``added``,
        ``removed``, ``kind``, ``shape``, ``dtype``, ``key impl``, ``value`` (inline
        value or array elements) or ``key`` (PRNG key data)."""
        out = dict.fromkeys(self.added, "added") | dict.fromkeys(self.removed, "removed")
        for field in ("kind", "shape", "dtype", "impl", "value"):
            for c in self.changed:
                if c["field"] == field:
                    out.setdefault(c["leaf"], "key impl" if field == "impl" else field)
        for path, d in self.arrays.items():
            if d["differ"]:
                out.setdefault(path, "value")
        for path, d in self.keys.items():
            if d["differ"]:
                out.setdefault(path, "key")
        return dict(sorted(out.items()))

    def summary(self) -> str:
        """The report as the ``jaxckpt diff`` command prints it: one line per
        difference (``+`` added, ``-`` removed, ``~`` kind/dtype/shape/inline value,
        ``≠`` array values or keys), then the counts.

        Example:
          >>> print(jaxckpt.diff("/ckpts/100", "/ckpts/200").summary())
          ≠ params/w: 1 of 131072 elements differ, max |a-b| 0.5, max rel 0.000647
          ≠ rng: the key differs
          2 of 5 leaves differ: 1 value, 1 key; 3 equal
        """
        lines = [f"+ {k}" for k in self.added] + [f"- {k}" for k in self.removed]
        lines += [f"~ {c['leaf']}: {c['field']} {c['a']} -> {c['b']}" for c in self.changed]
        for path, d in sorted(self.arrays.items()):
            if d["differ"]:
                lines.append(f"≠ {path}: {d['differ']} of {d['elements']} elements differ, "
                             f"max |a-b| {_readable(d['max_abs'])}, max rel {_readable(d['max_rel'])}")
        for path, d in sorted(self.keys.items()):
            if d["differ"]:
                lines.append(f"≠ {path}: the key differs" if d["keys"] == 1 else
                             f"≠ {path}: {d['differ']} of {d['keys']} keys differ")
        return "\n".join([*lines, self._counts()])

    def _counts(self) -> str:
        kinds = collections.Counter(self.differences().values())
        if not kinds:
            return f"identical ({leaf_count(self.leaves)})"
        n = sum(kinds.values())
        order = ("value", "key", "shape", "dtype", "kind", "key impl", "added", "removed")
        parts = [f"{kinds[k]} {_plural(k, kinds[k])}" for k in order if kinds[k]]
        return (f"{n} of {leaf_count(self.leaves)} differ{'s' if n == 1 else ''}: {', '.join(parts)}; "
                f"{self.leaves - n} equal")

    def to_json(self) -> dict[str, Any]:
        """The report as a JSON-able dict (infinite differences as ``"inf"``)."""
        return json_value({**dataclasses.asdict(self), "identical": self.identical})


def _plural(word: str, n: int) -> str:
    return word if n == 1 or word in ("added", "removed") else word + "s"


def _readable(x: float) -> str:
    """A difference for people: three significant digits (``3.1e-08``, ``0.5``, ``inf``)."""
    return f"{x:.3g}"


@dataclasses.dataclass(frozen=True)
class LeafStats:
    """Statistics of one leaf (see ``CheckpointView.stats``).

    ``min``, ``max``, ``mean`` and ``std`` (population, ``ddof=0``) are over the
    finite elements (``None`` when there are none); ``nan`` and ``inf`` count the
    others. ``min``/``max`` keep the leaf's kind (``bool``, ``int`` or ``float``).
    ``numeric`` is ``False`` for PRNG keys, inline values and complex arrays, whose
    other fields then stay empty. An inline value (a step counter, a string, a float;
    ``kind`` ``"value"``) is in ``value``.
    """

    path: str
    kind: str
    dtype: str | None
    shape: tuple[int, ...] | None
    numeric: bool
    count: int = 0
    nan: int = 0
    inf: int = 0
    min: bool | int | float | None = None
    max: bool | int | float | None = None
    mean: float | None = None
    std: float | None = None
    value: Any = None

    def to_json(self) -> dict[str, Any]:
        """The statistics as a JSON-able dict (``value`` only for an inline value)."""
        out = dataclasses.asdict(self)
        if self.kind != "value":
            del out["value"]
        return json_value(out)


# --- streaming regions through the reader (stats, diff) -------------------------------


class _Unit(NamedTuple):
    """One region of a leaf, read from each scanned checkpoint (``recs`` in order)."""

    recs: tuple[LeafRecord, ...]
    region: _layout.Index
    nbytes: int  # over all checkpoints


def _itemsize(rec: LeafRecord) -> int:
    return _dtypes.DTYPES[rec.dtype].itemsize


def _units(recs: tuple[LeafRecord, ...]) -> list[_Unit]:
    """Regions covering ``recs[0]``'s shape, each a union of whole saved chunks of every
    record (the least common multiple of their chunk shapes) when that fits the budget,
    else one saved chunk of ``recs[0]``; a small leaf is one region."""
    shape = recs[0].shape
    per_element = sum(_itemsize(r) for r in recs)
    size = math.prod(shape)
    if size == 0:
        return []
    if size * per_element <= WHOLE_LEAF_BYTES:
        return [_Unit(recs, tuple((0, d) for d in shape), size * per_element)]
    chunks = [_scan_chunk_shape(r, per_element) for r in recs]
    step = tuple(functools.reduce(math.lcm, dims) for dims in zip(*chunks))
    limit = max(_verify.SCAN_BUDGET_BYTES, math.prod(chunks[0]) * per_element)
    if math.prod(min(s, d) for s, d in zip(step, shape)) * per_element > limit:
        step = chunks[0]
    out = []
    for cell in _layout.chunk_cells(shape, step):
        region = _layout.chunk_region(cell, step, shape)
        out.append(_Unit(recs, region, _layout.index_size(region) * per_element))
    return out


def _scan_chunk_shape(rec: LeafRecord, per_element: int) -> tuple[int, ...]:
    """The saved chunk shape; for a foreign format (one array per leaf, no chunk grid of
    ours) row blocks of at most half the budget, so memory stays bounded there too."""
    if rec.store in ("file", "packed", "stream"):
        return tuple(rec.chunk_shape)
    shape = tuple(max(1, d) for d in rec.shape)
    if not shape:
        return ()
    row = math.prod(shape[1:]) * per_element
    return (max(1, min(shape[0], _verify.SCAN_BUDGET_BYTES // 2 // max(1, row))), *shape[1:])


def _plan_units(pairs: list[tuple[LeafRecord, ...]]) -> list[_Unit]:
    """Every region to read; packed leaves first in packed order, so that a batch reads
    neighbouring bytes of the packed arrays."""
    def order(recs: tuple[LeafRecord, ...]) -> tuple:
        first = recs[0]
        return (0, *first.chunks[0]) if first.store == "packed" and first.chunks else (1, 0, 0)

    return [u for recs in sorted(pairs, key=order) for u in _units(recs)]


def _batches(units: list[_Unit], budget: int) -> Iterator[list[_Unit]]:
    batch: list[_Unit] = []
    size = 0
    for unit in units:
        if batch and size + unit.nbytes > budget:
            yield batch
            batch, size = [], 0
        batch.append(unit)
        size += unit.nbytes
    if batch:
        yield batch


def _stream(sides: Sequence[Callable[[], Any]], units: list[_Unit],
            fold: Callable[..., None], progress: Progress | None) -> None:
    """Read ``units`` a batch (within the budget) at a time, from every checkpoint in
    ``sides``, and ``fold(unit, array_per_side...)`` each. Raises on a bad chunk."""
    meter = Meter(sum(u.nbytes for u in units), progress)
    for batch in _batches(units, _verify.SCAN_BUDGET_BYTES):
        readers = [new_reader() for new_reader in sides]
        for unit in batch:
            for reader, rec in zip(readers, unit.recs):
                reader.add(rec, unit.region)
        for reader in readers:
            reader.run()
        for unit in batch:
            fold(unit, *(reader.get(rec, unit.region) for reader, rec in zip(readers, unit.recs)))
        meter.add(sum(u.nbytes for u in batch))


def _kind(dtype: str) -> str:
    """``bool``, ``int``, ``float`` or ``complex`` for a dtype name (ml_dtypes too)."""
    if dtype == "bool":
        return "bool"
    if dtype.startswith("complex"):
        return "complex"
    return "int" if dtype.startswith(("int", "uint")) else "float"


def _plain(x: np.ndarray) -> np.ndarray:
    """``x`` in a numpy-native dtype numpy's reductions handle (ml_dtypes widened)."""
    if x.dtype.kind != "V":
        return x
    if _kind(x.dtype.name) == "int":
        return x.astype(np.uint8 if x.dtype.name.startswith("u") else np.int8)
    return x.astype(np.float32)


def _blocks(x: np.ndarray) -> Iterator[slice]:
    for start in range(0, x.size, FOLD_BLOCK):
        yield slice(start, start + FOLD_BLOCK)


# --- stats --------------------------------------------------------------------------


@dataclasses.dataclass
class _Moments:
    """Running statistics, combined with Chan et al.'s pairwise update (float64)."""

    count: int = 0  # elements
    nan: int = 0
    inf: int = 0
    n: int = 0  # finite elements
    mean: float = 0.0
    m2: float = 0.0  # sum of squared deviations from the mean
    lo: Any = None
    hi: Any = None

    def merge(self, o: _Moments) -> None:
        self.count, self.nan, self.inf = self.count + o.count, self.nan + o.nan, self.inf + o.inf
        if not o.n:
            return
        if not self.n:
            self.n, self.mean, self.m2, self.lo, self.hi = o.n, o.mean, o.m2, o.lo, o.hi
            return
        n = self.n + o.n
        delta = o.mean - self.mean
        self.mean += delta * o.n / n
        self.m2 += o.m2 + delta * delta * self.n * o.n / n
        self.n, self.lo, self.hi = n, min(self.lo, o.lo), max(self.hi, o.hi)


def _block_moments(x: np.ndarray) -> _Moments:
    """Statistics of one flat block of a real array."""
    x = _plain(x)
    m = _Moments(count=x.size)
    if x.dtype.kind == "f":
        finite = np.isfinite(x)
        m.nan = int(np.count_nonzero(np.isnan(x)))
        m.inf = x.size - m.nan - int(np.count_nonzero(finite))
        if m.nan or m.inf:
            x = x[finite]
    if x.size:
        f = x.astype(np.float64)
        m.n, m.mean = f.size, float(f.mean())
        m.m2 = float(np.square(f - m.mean).sum())
        m.lo, m.hi = x.min().item(), x.max().item()
    return m


def _numeric(rec: LeafRecord) -> bool:
    return rec.kind == "array" and _kind(rec.dtype) != "complex"


def leaf_stats(new_reader: Callable[[], Any], records: Sequence[LeafRecord],
               progress: Progress | None = None) -> dict[str, LeafStats]:
    """Statistics of ``records`` (by key path), all streamed in one pass."""
    acc = {r.path: _Moments() for r in records if _numeric(r)}

    def fold(unit: _Unit, data: np.ndarray) -> None:
        flat = data.reshape(-1)
        for block in _blocks(flat):
            acc[unit.recs[0].path].merge(_block_moments(flat[block]))

    _stream((new_reader,), _plan_units([(r,) for r in records if r.path in acc]), fold, progress)
    out = {}
    for rec in records:
        if rec.kind == "value":
            out[rec.path] = LeafStats(rec.path, "value", None, None, False, value=rec.value)
            continue
        m = acc.get(rec.path)
        if m is None:
            out[rec.path] = LeafStats(rec.path, rec.kind, rec.dtype, rec.shape, False, math.prod(rec.shape))
            continue
        mean, std = (m.mean, math.sqrt(m.m2 / m.n)) if m.n else (None, None)
        out[rec.path] = LeafStats(rec.path, rec.kind, rec.dtype, rec.shape, True, math.prod(rec.shape),
                                  m.nan, m.inf, m.lo, m.hi, mean, std)
    return out


# --- diff ---------------------------------------------------------------------------


def diff(a: Any, b: Any, *, progress: Progress | None = None) -> DiffReport:
    """Compare two checkpoints: keys, kinds, shapes, dtypes, inline values and values.

    Array values are compared element by element, streamed region by region (each
    region a union of whole saved chunks of both checkpoints where that fits the
    budget), so the two may have different shardings and chunk layouts and memory stays
    near ``SCAN_BUDGET_BYTES``. Arrays of equal shape are compared even when their
    dtypes differ (in float64, or complex128). NaN equals NaN; NaN or an infinity
    against a different value is an infinite absolute and relative difference;
    ``-0.0`` equals ``0.0``. The relative difference is ``|a - b| / max(|a|, |b|)``
    (0 where both are 0). User metadata is not compared.

    Args:
      a: the first checkpoint (local path, URL or kvstore spec).
      b: the second.
      progress: optional ``callable(bytes_done, bytes_total)`` over the bytes of both.

    Returns:
      A ``DiffReport`` (``identical``, ``added``, ``removed``, ``changed``, ``arrays``).

    Raises:
      CheckpointNotFoundError: either path holds no checkpoint.
      CorruptCheckpointError: a manifest or a chunk read fails (``verify`` says more).

    Example:
      >>> report = jaxckpt.diff("/ckpts/100", "/ckpts/200")
      >>> report.identical, report.arrays["params/w"]["max_abs"]
      (False, 0.0125)
    """
    start = time.perf_counter()
    src_a, src_b = _formats.open_source(a), _formats.open_source(b)
    (loc_a, man_a), (loc_b, man_b) = (src_a.loc, src_a.manifest), (src_b.loc, src_b.manifest)
    recs_a = {r.path: r for r in man_a.leaves}
    recs_b = {r.path: r for r in man_b.leaves}
    changed, pairs = _compare_records(recs_a, recs_b)
    acc = {ra.path: [0, 0.0, 0.0] for ra, _ in pairs}  # elements (or keys) differing, max abs, max rel

    def fold(unit: _Unit, x: np.ndarray, y: np.ndarray) -> None:
        rec, into = unit.recs[0], acc[unit.recs[0].path]
        if rec.kind == "prng_key":
            into[0] += _keys_differing(x, y, rec.key_ndim)
            return
        x, y = x.reshape(-1), y.reshape(-1)
        for block in _blocks(x):
            n, max_abs, max_rel = _diff_block(x[block], y[block])
            into[0] += n
            into[1], into[2] = max(into[1], max_abs), max(into[2], max_rel)

    _stream((src_a.new_reader, src_b.new_reader), _plan_units(pairs), fold, progress)
    arrays = {ra.path: {"elements": math.prod(ra.shape), "differ": acc[ra.path][0],
                        "max_abs": acc[ra.path][1], "max_rel": acc[ra.path][2]}
              for ra, _ in pairs if ra.kind != "prng_key"}
    keys = {ra.path: {"keys": math.prod(ra.shape[:ra.key_ndim]), "differ": acc[ra.path][0]}
            for ra, _ in pairs if ra.kind == "prng_key"}
    return DiffReport(str(loc_a), str(loc_b), sorted(recs_b.keys() - recs_a.keys()),
                      sorted(recs_a.keys() - recs_b.keys()), changed, arrays, time.perf_counter() - start,
                      keys, len(recs_a.keys() | recs_b.keys()))


def _keys_differing(x: np.ndarray, y: np.ndarray, key_ndim: int) -> int:
    """Keys that differ in a region of two PRNG keys' data. A key's words (the trailing
    dimensions) are never split across regions: a key leaf's chunks split a dimension
    longer than one only into pieces of at least ``_layout.MIN_PIECE_BYTES``, and a small
    leaf is one region."""
    return int(np.count_nonzero((x != y).reshape(*x.shape[:key_ndim], -1).any(axis=-1)))


def _same_value(x: Any, y: Any) -> bool:
    if type(x) is not type(y):
        return False
    return bool(x == y) or (isinstance(x, float) and x != x and y != y)


def _compare_records(recs_a: dict[str, LeafRecord], recs_b: dict[str, LeafRecord]):
    """What differs besides array values, and the pairs of array leaves to compare."""
    changed: list[dict[str, Any]] = []
    pairs: list[tuple[LeafRecord, LeafRecord]] = []
    for path in sorted(recs_a.keys() & recs_b.keys()):
        ra, rb = recs_a[path], recs_b[path]
        fields = ("kind",) if ra.kind != rb.kind else ("value",) if ra.kind == "value" else (
            "dtype", "shape", "impl")
        for field in fields:
            va, vb = getattr(ra, field), getattr(rb, field)
            if not _same_value(va, vb):
                changed.append({"leaf": path, "field": field, "a": va, "b": vb})
        if ra.kind == rb.kind != "value" and ra.shape == rb.shape:
            pairs.append((ra, rb))
    return changed, pairs


def _diff_block(x: np.ndarray, y: np.ndarray) -> tuple[int, float, float]:
    """Elements that differ, max absolute and max relative difference of two blocks."""
    x, y = _plain(x), _plain(y)
    same = x == y
    if x.dtype.kind in "fc" and y.dtype.kind in "fc":
        same |= np.isnan(x) & np.isnan(y)
    differ = ~same
    n = int(np.count_nonzero(differ))
    if not n:
        return 0, 0.0, 0.0
    wide = np.result_type(x.dtype, y.dtype, np.float64)
    xd, yd = x[differ].astype(wide), y[differ].astype(wide)
    finite = np.isfinite(xd) & np.isfinite(yd)
    with np.errstate(all="ignore"):
        d = np.where(finite, np.abs(xd - yd), np.inf)
        rel = np.where(finite, d / np.maximum(np.abs(xd), np.abs(yd)), np.inf)
    return n, float(d.max()), float(rel.max())
