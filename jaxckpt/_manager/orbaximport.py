"""Importing an orbax-checkpoint run directory into a jaxckpt manager directory: every
committed orbax step becomes the jaxckpt step of the same number, with the metrics and
the commit time orbax recorded, so a ``CheckpointManager`` of the new directory lists,
restores and keeps training in it (``convert.from_orbax`` on a run directory).

The import is a writer of the destination like a manager: it holds the directory's
writer lease (a training run writing there is refused, naming it) and cleans what a
killed import or writer left. Each step is committed on its own, manifest last, so an
import stopped anywhere leaves whole steps only; run again, it skips the steps it
already imported (a manifest that records the same orbax step as its source) and imports
the rest. A step of the destination that came from elsewhere is refused before anything
is written, unless ``overwrite``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple

from .. import _commit, _formats
from .._errors import CheckpointError
from .._formats import orbaxrun as _orbaxrun
from .._formats import stream as _stream
from .._manifest import Manifest
from .._storage import location as _location
from .._storage.location import Location
from . import cleanup as _cleanup

Progress = Callable[[int, int], None]


class RunImportResult(NamedTuple):
    """What ``convert.from_orbax`` did with an orbax run directory.

    Attributes:
      path: the jaxckpt manager directory (``dest`` as a path or URL).
      leaves, arrays, total_size: as ``ImportResult``'s, summed over the steps imported now.
      steps: the steps imported now, ascending.
      skipped: the steps an earlier import of the same run had written already.

    Example:
      >>> convert.from_orbax("/runs/a/orbax", "/runs/a/jaxckpt")
      RunImportResult(path='/runs/a/jaxckpt', leaves=636, arrays=630, total_size=3221225472,
                      steps=(0, 500, 1000), skipped=())
    """

    path: str
    leaves: int
    arrays: int
    total_size: int
    steps: tuple[int, ...]
    skipped: tuple[int, ...]


class _Holder:
    """The lease's owner while an import runs (a lease outlives no owner)."""


def import_run(src: Any, dest: Any, import_step: Callable[..., Any], overwrite: bool = False,
               progress: Progress | None = None) -> RunImportResult | None:
    """Import every committed step of the orbax run directory ``src`` into the manager
    directory ``dest``; ``None`` when ``src`` holds no orbax step.

    ``import_step(source, where, overwrite=, progress=, info=)`` writes one orbax step's
    ``Source`` as the jaxckpt checkpoint ``where`` with ``info`` in its manifest
    (``convert.import_source``) and returns its counts (``leaves``, ``arrays``,
    ``total_size``). Sets malloc's mmap threshold first, as a one-step import does.
    """
    src = _location.resolve(src)
    steps = _orbaxrun.find_steps(src)
    if not steps:
        return None
    _stream.limit_malloc_retention()  # not with JAXCKPT_KEEP_MALLOC set
    dest = _location.resolve(dest)
    holder = _Holder()
    lease = _cleanup.take_directory(dest, holder)  # refuses a directory a live writer holds
    try:
        done = _commit.discover_steps(dest)
        todo, skipped = _plan(src, steps, done, dest, overwrite)
        results = []
        meter = _Meter(len(todo), progress)
        for s in todo:
            source = _formats.open_source(src.child(steps[s].name))
            if source.format != "orbax":
                raise CheckpointError(f"'{source.loc}' is a {source.format} checkpoint in an orbax run directory")
            info = {k: v for k, v in steps[s].info().items() if k in ("step", "metrics", "commit_time")
                    and v is not None}
            results.append(import_step(source, dest.child(_commit.step_name(s)), overwrite=s in done,
                                       progress=meter.step(int(source.manifest.info.get("bytes", 0))), info=info))
            meter.finish()
    finally:
        lease.release()
    return RunImportResult(str(dest), sum(r.leaves for r in results), sum(r.arrays for r in results),
                     sum(r.total_size for r in results), tuple(todo), tuple(skipped))


def _plan(src: Location, steps: dict[int, _orbaxrun.OrbaxStep], done: dict[int, Manifest], dest: Location,
          overwrite: bool) -> tuple[list[int], list[int]]:
    """The steps to import and those imported already; a step of ``dest`` from elsewhere
    raises (without ``overwrite``) before anything is written."""
    todo, skipped = [], []
    for s, o in sorted(steps.items()):
        man = done.get(s)
        origin = (man.info.get("converted_from") or {}) if man is not None else {}
        if man is None or overwrite:
            todo.append(s)
        elif isinstance(origin, dict) and origin.get("path") == str(src.child(o.name)):
            then = man.info.get("commit_time")
            if isinstance(then, (int, float)) and o.commit_time is not None and abs(then - o.commit_time) > 1e-3:
                raise CheckpointError(
                    f"Step {s} of '{dest}' was imported from '{origin['path']}' as orbax committed it at "
                    f"{_when(then)}, but orbax's step {s} there now was committed at {_when(o.commit_time)} "
                    "(saved again since): nothing was imported. Pass overwrite=True (--overwrite) to import "
                    "the steps orbax saved again, or import into a new directory")
            skipped.append(s)
        else:
            what = f"imported from '{origin.get('path')}'" if isinstance(origin, dict) and origin.get("path") \
                else "saved by jaxckpt"
            raise CheckpointError(
                f"Step {s} of '{dest}' is already committed ({what}), and is not orbax's step {s} of '{src}': "
                "nothing was imported. Import into a new directory, or pass overwrite=True (--overwrite) to "
                "replace the steps both have")
    return todo, skipped


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d} UTC"


class _Meter:
    """``progress(done, total)`` over a whole run: the bytes of the steps opened so far,
    the steps still to open counted as big as the last one opened (steps of a run are
    usually alike); exact once the last step is open."""

    def __init__(self, steps: int, progress: Progress | None):
        self.left, self.progress, self.base, self.current = steps, progress, 0, 0

    def step(self, nbytes: int) -> Progress | None:
        self.left -= 1
        self.current = nbytes
        if self.progress is None:
            return None
        base, guess, progress = self.base, self.left * nbytes, self.progress
        return lambda done, total: progress(base + done, base + total + guess)

    def finish(self) -> None:
        self.base += self.current
