"""orbax-checkpoint run directories (what ``orbax.checkpoint.CheckpointManager`` writes)
read as runs: their committed steps, each step's directory and the metrics orbax's
manager recorded (reading only; orbax is not imported).

What orbax 0.12.8 writes, and how it is read here:

* a step is a directory named ``<step>``, ``<prefix>_<step>`` (``step_prefix``), the
  number maybe zero-padded (``step_format_fixed_length``); one run uses one format, so
  names with several prefixes, or two names for one step (``7`` and ``0007``), are
  refused: which is the run is not ours to guess;
* a step is committed when its directory has its final name (orbax writes under
  ``<name>.orbax-checkpoint-tmp*`` and renames) and holds ``_CHECKPOINT_METADATA`` (one
  that is not a JSON object: the step is skipped with a warning, as a bad manifest is);
  on an object store (no rename) also orbax's ``commit_success.txt``. Temporary,
  hidden and symlinked entries are never steps (a link could lead out of the run);
* metrics (``mgr.save(step, args, metrics=...)``; orbax writes them only with a
  ``best_fn``) are the JSON object in ``<step>/metrics/metrics``. jaxckpt's metrics are
  a flat dict of numbers, strings, booleans and ``None``: metrics that are not (nested,
  malformed, bigger than ``MAX_METRICS_BYTES``) are left out with a warning, and the
  step is listed without them;
* the commit time is ``commit_timestamp_nsecs`` of ``_CHECKPOINT_METADATA`` (orbax's
  own fallback, the directory's mtime, on a local disk).

A directory holding any jaxckpt step is a jaxckpt run: orbax steps beside them are not
listed (as before), and a writer may open it. A directory holding committed orbax steps
and no jaxckpt step is an orbax run: read-only managers list and restore its steps, and
nothing of jaxckpt writes there (``refuse_writer``).
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any, NamedTuple

from .. import _commit, _untrusted
from .._errors import CheckpointError
from .._manifest import Manifest
from .._storage import kvstore as _kvstore
from .._storage import location as _location
from .._storage.location import Location
from . import orbax as _orbax

_log = logging.getLogger("jaxckpt")

TMP_MARK = ".orbax-checkpoint-tmp"  # orbax's temporary step directories
COMMIT_FILE = "commit_success.txt"  # orbax's commit marker where it cannot rename
METRICS_ITEM = "metrics"  # <step>/metrics/metrics, JsonCheckpointHandler(filename="metrics")
MAX_METRICS_BYTES = 1 << 20  # a step's metrics: a few numbers
MAX_METRICS = 1000  # metrics per step, as the manager's history keeps them
MAX_TEXT = 1000  # a metric's name or string value
_NAME = re.compile(r"(?:(.+)_)?([0-9]{1,40})")


class OrbaxStep(NamedTuple):
    """A committed orbax step: its number, its directory's name, when it was committed
    (seconds since the epoch, ``None`` if unknown) and the metrics recorded with it."""

    step: int
    name: str
    commit_time: float | None
    metrics: dict[str, Any] | None

    def info(self) -> dict[str, Any]:
        """What a manager's ``info(step)`` says of it (jaxckpt's own manifest fields)."""
        return {"format": "orbax", "step": self.step, "orbax_step_dir": self.name, "metrics": self.metrics,
                "commit_time": self.commit_time}


def parse_name(name: str) -> tuple[str, int] | None:
    """``(prefix, step)`` of a directory named like an orbax step (prefix ``""`` for a
    bare number); ``None`` for anything else, temporary and hidden names included."""
    if not name.isascii() or len(name) > 4096 or name.startswith(".") or TMP_MARK in name:
        return None
    m = _NAME.fullmatch(name)
    return None if m is None else (m.group(1) or "", int(m.group(2)))


def find_steps(directory: Any) -> dict[int, OrbaxStep]:
    """The committed orbax steps in ``directory`` (see the module docstring).

    Raises:
      CheckpointError: the step names follow several formats (prefixes), or two name
        one step.
    """
    loc = _location.resolve(directory)
    names: dict[int, str] = {}
    prefixes: dict[str, str] = {}
    for name in _kvstore.list_children(loc):
        parsed = parse_name(name)
        if parsed is None or not _committed(loc, name):
            continue
        prefix, step = parsed
        if step in names:
            raise CheckpointError(f"'{loc}' holds two orbax steps {step}: '{names[step]}' and '{name}'; "
                                  "jaxckpt reads a run whose step directories have one name format")
        names[step] = name
        prefixes.setdefault(prefix, name)
    if len(prefixes) > 1:
        shown = ", ".join(f"'{n}'" for n in sorted(prefixes.values())[:5])
        raise CheckpointError(f"'{loc}' holds orbax steps named with {len(prefixes)} prefixes ({shown}): "
                              "several runs in one directory; jaxckpt reads a run with one step name format")
    found = {s: _step(loc, s, names[s]) for s in sorted(names)}
    return {s: o for s, o in found.items() if o is not None}


def manifests(directory: Any) -> dict[int, Manifest]:
    """The committed steps of ``directory`` as a manager lists them: jaxckpt's (with
    their manifests), or in a directory holding none, orbax's (a stand-in manifest each:
    no leaves, ``info`` as ``OrbaxStep.info``; a restore reads the step itself)."""
    found = _commit.discover_steps(_location.resolve(directory))
    return found if found else stand_ins(directory)


def stand_ins(directory: Any) -> dict[int, Manifest]:
    """The committed steps of an orbax run directory, a stand-in manifest each (see ``manifests``)."""
    return {s: Manifest(format_version=0, structure={}, leaves=(), metadata={}, process_count=1, info=o.info())
            for s, o in find_steps(directory).items()}


def step_dir(man: Manifest | None) -> str | None:
    """The directory name of a step listed from an orbax run (``None``: a jaxckpt step)."""
    if man is None or man.info.get("format") != "orbax" or man.leaves:
        return None
    return man.info.get("orbax_step_dir")


def refuse_writer(directory: Location) -> None:
    """Raise ``CheckpointError`` when ``directory`` is an orbax run (committed orbax steps,
    no jaxckpt step): jaxckpt reads it but never writes or deletes there.

    Cheap where it matters: in a jaxckpt run the newest step's manifest decides (one read).
    """
    names = _kvstore.list_children(directory)
    numbered = sorted((s, n) for n in names if (s := _commit.step_of(n)) is not None)
    if any(_commit.has_manifest(directory.child(n)) for _, n in reversed(numbered)):
        return
    steps = [p[1] for n in names if (p := parse_name(n)) is not None and _committed(directory, n)]
    if steps:
        shown = ", ".join(map(str, sorted(steps)[:10])) + (", ..." if len(steps) > 10 else "")
        raise CheckpointError(
            f"'{directory}' is an orbax-checkpoint run directory (steps {shown}): jaxckpt reads it but never "
            "writes or deletes there. List and restore it with CheckpointManager(..., read_only=True); to "
            f"train on with jaxckpt, import it first (`jaxckpt import-orbax {directory} OUT`, or "
            f"jaxckpt.convert.from_orbax('{directory}', OUT)) and save on with CheckpointManager(OUT)")


# --- one step ------------------------------------------------------------------------


def _committed(loc: Location, name: str) -> bool:
    step = loc.child(name)
    if step.local is not None:
        if os.path.islink(step.local) or not os.path.isdir(step.local):
            return False
        if not os.path.isfile(os.path.join(step.local, _orbax.CHECKPOINT_METADATA)):
            return False
        return os.path.isfile(os.path.join(step.local, COMMIT_FILE)) or not _unfinished(step)
    return all(_kvstore.read_blob(step, f) is not None for f in (COMMIT_FILE, _orbax.CHECKPOINT_METADATA))


def _unfinished(step: Location) -> bool:
    """A step orbax is still writing in place (its ``COMMIT_FILE`` mode, made for file
    systems like GCSFuse that look local): ``_CHECKPOINT_METADATA`` comes first, with
    ``commit_timestamp_nsecs`` null, and the commit file last. (Where orbax renames a
    finished step into place, the metadata it renames carries its commit time.)"""
    try:
        ckpt = _orbax._read_json(step, _orbax.CHECKPOINT_METADATA, str(step))
    except CheckpointError:
        return False  # a bad metadata file: listed and skipped with its warning (``_step``)
    return isinstance(ckpt, dict) and "commit_timestamp_nsecs" in ckpt and ckpt["commit_timestamp_nsecs"] is None


def _step(loc: Location, step: int, name: str) -> OrbaxStep | None:
    """The step, or ``None`` (skipped, with a warning, as jaxckpt's discovery skips a
    step whose manifest is bad) when its ``_CHECKPOINT_METADATA`` is not a JSON object."""
    where = str(loc.child(name))
    try:
        ckpt = _orbax._read_json(loc.child(name), _orbax.CHECKPOINT_METADATA, where)
        if not isinstance(ckpt, dict):
            raise CheckpointError(f"{_orbax.CHECKPOINT_METADATA} is not a JSON object")
    except CheckpointError as e:
        _log.warning("Skipping orbax step %d in '%s': %s", step, loc, e)
        return None
    stamp = ckpt.get("commit_timestamp_nsecs")
    if isinstance(stamp, int) and not isinstance(stamp, bool) and 0 < stamp < 1 << 63:
        when: float | None = stamp / 1e9
    else:
        when = _mtime(loc.child(name))
    return OrbaxStep(step, name, when, _metrics(loc.child(name).child(METRICS_ITEM), step, loc))


def _mtime(loc: Location) -> float | None:
    try:
        return os.stat(loc.local).st_mtime if loc.local is not None else None
    except OSError:
        return None


def _metrics(loc: Location, step: int, run: Location) -> dict[str, Any] | None:
    """The metrics orbax recorded for ``step`` (``None``: none, or none jaxckpt can keep)."""

    def refuse(why: str, detail: Any) -> BaseException | None:
        if why in (_untrusted.ABSENT, _untrusted.CANNOT_OPEN):
            return None
        return ValueError(f"more than {MAX_METRICS_BYTES} bytes" if why == _untrusted.TOO_BIG else why)

    try:
        data = _untrusted.read_small(loc, METRICS_ITEM, MAX_METRICS_BYTES, refuse, _kvstore.read_blob)
        if data is None:
            return None
        doc = _untrusted.load_json(data, ValueError)
        problem = _metrics_problem(doc)
        if problem is not None:
            raise ValueError(problem)
    except (OSError, ValueError) as e:
        _log.warning("orbax step %d in '%s': its metrics (%s/%s) are left out: %s", step, run, METRICS_ITEM,
                     METRICS_ITEM, str(e)[:300])
        return None
    return doc


def _metrics_problem(doc: Any) -> str | None:
    if not isinstance(doc, dict):
        return "not a JSON object"
    if len(doc) > MAX_METRICS:
        return f"more than {MAX_METRICS} metrics"
    for key, v in doc.items():
        if len(key) > MAX_TEXT or not (v is None or isinstance(v, (int, float))
                                       or (isinstance(v, str) and len(v) <= MAX_TEXT)):
            return f"metric {key[:50]!r} is not a number, a short str or null"
    return None
