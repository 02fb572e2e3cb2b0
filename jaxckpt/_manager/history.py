"""The run history of a manager directory: one record per committed step, kept after
retention deleted the step.

The writing manager (process 0) adds one record right after each commit:

* local file system: one JSON line appended to ``<directory>/history.jsonl``
  (``O_APPEND``, then ``fsync``);
* object stores (no append): one small blob per step, ``<directory>/.history/<step>.json``.
  A read-modify-write of one log would need the writer lease held around every
  append and would rewrite the whole log per save; a blob per step is written once,
  never conflicts, and costs one small GET per step to read back (done in parallel).

Neither name can be mistaken for a step by discovery (it only counts decimal names).
Reading is defensive (the log is untrusted input): a line that is not a valid record is
skipped and logged, a line is at most ``MAX_LINE_BYTES``, and only the last
``MAX_LOG_BYTES`` of the log (the newest records) are read. The history merges the log
with the manifests of the steps still present, so steps committed before the log
existed are listed too.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import math
import os
import stat
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from .. import _commit
from .._storage import kvstore as _kvstore
from .._storage import location as _location
from .._storage.location import Location

HISTORY_FILE = "history.jsonl"
HISTORY_DIR = ".history"  # object stores: one blob per step
MAX_LOG_BYTES = 32 << 20
MAX_LINE_BYTES = 64 << 10
MAX_BLOBS = 100_000  # object stores: the newest this many step records are read
_MAX_METRICS = 1000
_MAX_TEXT = 1000
_FIELDS = ("commit_time", "created", "metrics", "bytes", "blocking_seconds", "total_seconds", "write_seconds",
           "started")
_SECONDS = ("commit_time", "blocking_seconds", "total_seconds", "write_seconds", "started")
_log = logging.getLogger("jaxckpt")


class HistoryRecord(NamedTuple):
    """One committed step of a run.

    Attributes:
      step: the step number.
      commit_time: seconds since the epoch on the writing manager's clock.
      created: the manifest's creation time, ISO 8601 (UTC).
      metrics: the metrics saved with the step (``None`` if none).
      bytes: array bytes of the checkpoint.
      blocking_seconds: how long ``save`` blocked the training loop.
      total_seconds: from ``save`` to the commit (the durability window).
      write_seconds: how long the data writes took.
      exists: the step is still committed (``False``: deleted since, e.g. by retention).
      started: when the manager that saved it was made (its clock): one value per start
        of the run, so the run's restarts (``policies.goodput`` counts them).

    Example:
      >>> rec = mgr.history()[-1]
      >>> rec.step, rec.metrics, rec.total_seconds, rec.exists
      (1000, {'loss': 0.29}, 4.2, True)
    """

    step: int
    commit_time: float | None = None
    created: str | None = None
    metrics: Mapping[str, Any] | None = None
    bytes: int | None = None
    blocking_seconds: float | None = None
    total_seconds: float | None = None
    write_seconds: float | None = None
    exists: bool = False
    started: float | None = None


class History(Sequence):
    """The records of a run, ascending by step: a read-only sequence of ``HistoryRecord``.

    Example:
      >>> hist = jaxckpt.history("/ckpts")
      >>> [(r.step, r.metrics["loss"], r.exists) for r in hist][-2:]
      [(900, 0.31, True), (1000, 0.29, True)]
      >>> hist.to_pandas().set_index("step")["loss"].plot()
    """

    def __init__(self, records: Iterable[HistoryRecord], directory: str = ""):
        self._records = tuple(sorted(records, key=lambda r: r.step))
        self.directory = directory

    def __getitem__(self, i: Any) -> Any:
        return self._records[i]

    def __len__(self) -> int:
        return len(self._records)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, History) and self._records == other._records

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        kept = sum(r.exists for r in self._records)
        return f"History({self.directory!r}, {len(self)} records, {kept} still committed)"

    @property
    def steps(self) -> list[int]:
        """Every recorded step, ascending."""
        return [r.step for r in self._records]

    def metric_names(self) -> list[str]:
        """Names of the metrics any record has, in first-seen order."""
        return list(dict.fromkeys(k for r in self._records for k in (r.metrics or {})))

    def to_json(self) -> str:
        """The records as a JSON list of objects (one per step).

        Example:
          >>> json.loads(jaxckpt.history("/ckpts").to_json())[0]["step"]
          0
        """
        return json.dumps([r._asdict() for r in self._records])

    def to_pandas(self) -> Any:
        """A ``pandas.DataFrame``: one row per step, one column per field and per metric
        (``metric/<name>``).

        Raises:
          ImportError: pandas is not installed.

        Example:
          >>> df = mgr.history().to_pandas()
          >>> df[["step", "metric/loss", "total_seconds"]].tail()
        """
        try:
            import pandas as pd
        except ImportError as e:
            raise ImportError("History.to_pandas() needs pandas: pip install pandas") from e
        names = self.metric_names()
        rows = []
        for r in self._records:
            row = {k: v for k, v in r._asdict().items() if k != "metrics"}
            row.update({f"metric/{n}": (r.metrics or {}).get(n) for n in names})
            rows.append(row)
        columns = [*(f for f in HistoryRecord._fields if f != "metrics"), *(f"metric/{n}" for n in names)]
        return pd.DataFrame(rows, columns=columns)


def history(directory: Any) -> History:
    """The run history of a manager directory (no manager, nothing written).

    One record per committed step, including steps retention has since deleted; each
    says whether the step still exists.

    Args:
      directory: the manager's directory: path, URL or kvstore spec.

    Example:
      >>> hist = jaxckpt.history("/ckpts")
      >>> [r.step for r in hist if not r.exists]  # deleted by retention
      [0, 100, 200]
    """
    loc = _location.resolve(directory)
    return load(loc, {s: m.info for s, m in _commit.discover_steps(loc).items()})


def load(directory: Location, committed: Mapping[int, Mapping[str, Any]]) -> History:
    """The log of ``directory`` merged with the manifest infos of its committed steps."""
    return History(merge(read_log(directory), committed), str(directory))


def merge(logged: Mapping[int, Mapping[str, Any]],
          committed: Mapping[int, Mapping[str, Any]]) -> list[HistoryRecord]:
    """Pure: one record per step of either; a committed step's manifest wins over the log."""
    out = []
    for step in sorted(set(logged) | set(committed)):
        if step in committed:
            fields = clean_fields(committed[step], strict=False)
            assert isinstance(fields, dict)
            out.append(HistoryRecord(step=step, exists=True, **fields))
        else:
            out.append(HistoryRecord(step=step, exists=False, **logged[step]))
    return out


# --- writing -------------------------------------------------------------------------


def entry(step: int, info: Mapping[str, Any]) -> dict[str, Any]:
    """The log record of a committed step, from its manifest info."""
    return {"step": step, **{k: info.get(k) for k in _FIELDS}}


def append(directory: Location, step: int, info: Mapping[str, Any]) -> None:
    """Record a committed step (the writing manager, process 0, right after the commit)."""
    line = json.dumps(entry(step, info), separators=(",", ":"), allow_nan=True).encode() + b"\n"
    if directory.local is None:
        _kvstore.write_blob(directory.child(HISTORY_DIR), f"{_commit.step_name(step)}.json", line)
        return
    _append_line(os.path.join(directory.local, HISTORY_FILE), line)


def record(directory: Location, step: int, info: Mapping[str, Any]) -> None:
    """``append``, where a failure is logged instead: the step is committed; the log is
    a convenience."""
    try:
        append(directory, step, info)
    except Exception as e:  # noqa: BLE001 - the step is committed; the log is a convenience
        _log.warning("jaxckpt: recording step %d in the history of '%s' failed: %s", step, directory, e)


def _append_line(path: str, line: bytes) -> None:
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | getattr(os, "O_NONBLOCK", 0), 0o644)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"'{path}' is not a regular file")
        if st.st_size and os.pread(fd, 1, st.st_size - 1) != b"\n":
            line = b"\n" + line  # a torn last line (a crash mid-append) stays one bad line
        view = memoryview(line)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    if not st.st_size:
        _kvstore.fsync_dir(os.path.dirname(path))  # the file is new: make its name durable


# --- reading -------------------------------------------------------------------------


def read_log(directory: Location) -> dict[int, dict[str, Any]]:
    """The logged records by step (the last record of a step wins); bad ones skipped."""
    if directory.local is None:
        lines = _read_blobs(directory.child(HISTORY_DIR))
    else:
        lines = _read_lines(os.path.join(directory.local, HISTORY_FILE))
    out: dict[int, dict[str, Any]] = {}
    bad = []
    for where, raw in lines:
        rec = parse_line(raw)
        if isinstance(rec, str):
            bad.append(f"{where}: {rec}")
            continue
        step = rec.pop("step")
        out[step] = rec
    if bad:
        _log.warning("jaxckpt: skipped %d bad record(s) in the history of '%s': %s", len(bad), directory,
                     "; ".join(bad[:5]) + (" ..." if len(bad) > 5 else ""))
    return out


def _read_lines(path: str) -> list[tuple[str, bytes]]:
    """The lines of the local log, from its last ``MAX_LOG_BYTES`` (never blocking on a FIFO)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except (FileNotFoundError, NotADirectoryError):
        return []
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            _log.warning("jaxckpt: ignoring history '%s': not a regular file", path)
            return []
        start = max(0, st.st_size - MAX_LOG_BYTES)
        f.seek(start)
        data = f.read(MAX_LOG_BYTES)
    lines = data.split(b"\n")
    if start:
        _log.warning("jaxckpt: history '%s' is %d bytes; reading its last %d (the newest records)",
                     path, st.st_size, MAX_LOG_BYTES)
        return [("a line", line) for line in lines[1:] if line.strip()]  # the first one is cut
    return [(f"line {i}", line) for i, line in enumerate(lines, 1) if line.strip()]


def _read_blobs(root: Location) -> list[tuple[str, bytes]]:
    """Object stores: the per-step blobs, the newest ``MAX_BLOBS`` by step, read in parallel."""
    named = {}
    for name in _kvstore.list_children(root):
        stem = name[:-5] if name.endswith(".json") else ""
        step = _commit.parse_step_name(stem) if stem.isascii() and len(stem) <= 40 else None
        if step is not None:
            named[step] = name
    names = [named[s] for s in sorted(named)[-MAX_BLOBS:]]
    with concurrent.futures.ThreadPoolExecutor(16, thread_name_prefix="jaxckpt-history") as pool:
        blobs = list(pool.map(lambda n: _kvstore.read_blob(root, n), names))
    return [(n, b) for n, b in zip(names, blobs) if b is not None]


def parse_line(raw: bytes) -> dict[str, Any] | str:
    """One logged record, checked; or why it is not one."""
    if len(raw) > MAX_LINE_BYTES:
        return f"{len(raw)} bytes is more than the {MAX_LINE_BYTES} a record may have"
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as e:
        return f"not JSON ({type(e).__name__})"
    if not isinstance(doc, dict):
        return "not a JSON object"
    step = doc.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 10**40:
        return f"invalid step {str(step)[:50]!r}"
    fields = clean_fields(doc, strict=True)
    if isinstance(fields, str):
        return f"step {step}: {fields}"
    return {"step": step, **fields}


def clean_fields(doc: Mapping[str, Any], strict: bool) -> dict[str, Any] | str:
    """The record fields of ``doc`` with their types checked. A bad field makes the
    record bad (``strict``: the reason is returned) or is dropped (``None``)."""
    out: dict[str, Any] = {}
    for name in _FIELDS:
        value = doc.get(name)
        problem = None if value is None else _field_problem(name, value)
        if problem is not None:
            if strict:
                return f"{name}: {problem}"
            value = None
        out[name] = value
    if out["metrics"] is not None:
        out["metrics"] = dict(out["metrics"])
    if out["bytes"] is not None:
        out["bytes"] = int(out["bytes"])
    for name in _SECONDS:
        if out[name] is not None:
            out[name] = float(out[name])
    return out


def _field_problem(name: str, value: Any) -> str | None:
    if name in _SECONDS:
        ok = _is_number(value) and math.isfinite(value)
        return None if ok else "not a finite number"
    if name == "bytes":
        return None if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else "not a count"
    if name == "created":
        return None if isinstance(value, str) and len(value) <= 64 else "not a time stamp"
    if not isinstance(value, dict) or len(value) > _MAX_METRICS:
        return f"not a dict of at most {_MAX_METRICS} metrics"
    for key, v in value.items():
        if len(key) > _MAX_TEXT or not (v is None or _is_number(v) or isinstance(v, bool)
                                        or (isinstance(v, str) and len(v) <= _MAX_TEXT)):
            return f"metric {key[:50]!r} is not a number, a short str or null"
    return None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
