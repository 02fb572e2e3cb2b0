"""A manager's committed steps, each manifest read when it is first needed (issue 34).

A manager starts from one listing of its directory and the newest step's manifest,
whatever the number of steps the directory holds: 10,000 retained steps cost the start
what one does. The listing names the steps; a step's manifest is read and validated the
first time something needs it (a restore, ``info``, ``metrics``, ``history``, a
retention rule that ranks by metric or time), and kept. At the start the newest step is
read, and the next older one after it whenever it fails, down to one that validates, so
``latest_step()`` is a step that restores. A step whose manifest is missing (an empty
``7/``, an object store's attempt that never committed) or fails (the warning
``_commit.load_step`` logs) is unlisted when it is read, as the eager discovery it
replaces skipped it.

``Steps`` is a mapping from step to manifest: ``in``, ``len`` and iteration look at the
listing only; indexing, ``get``, ``items`` and ``values`` read what they need. Callers
hold the manager's lock, as for the plain dict it replaces.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, MutableMapping
from typing import Any

from .. import _commit, _tasks
from .._formats import orbaxrun as _orbaxrun
from .._manifest import MANIFEST, Manifest
from .._storage import kvstore as _kvstore
from .._storage.location import Location

CHECK_THREADS = 16


class Steps(MutableMapping):
    """Step -> manifest, the manifests of ``unread`` steps read on first use."""

    def __init__(self, directory: Location | None, unread: Iterable[int] = (),
                 read: Mapping[int, Manifest] | None = None):
        self._dir = directory
        self._read: dict[int, Manifest] = dict(read or {})
        self._unread = set(unread) - set(self._read)
        self._present: set[int] = set()  # unread steps whose manifest is known to be there
        self.skipped: dict[int, str] = {}  # steps whose manifest failed when read, with why

    @property
    def directory(self) -> Location | None:
        return self._dir

    def _load(self, step: int) -> Manifest | None:
        self._unread.discard(step)
        self._present.discard(step)
        man = _commit.load_step(self._dir, step, self.skipped) if self._dir is not None else None
        if man is not None:
            self._read[step] = man
        return man

    def __contains__(self, step: object) -> bool:
        return step in self._read or step in self._unread

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self._read.keys() | self._unread))

    def __len__(self) -> int:
        return len(self._read) + len(self._unread)

    def __getitem__(self, step: int) -> Manifest:
        man = self._read.get(step)
        if man is None and step in self._unread:
            man = self._load(step)
        if man is None:
            raise KeyError(step)
        return man

    def __setitem__(self, step: int, man: Manifest) -> None:
        self._unread.discard(step)
        self._present.discard(step)
        self._read[step] = man

    def __delitem__(self, step: int) -> None:
        if step not in self:
            raise KeyError(step)
        self._unread.discard(step)
        self._present.discard(step)
        self._read.pop(step, None)

    def pop(self, step: int, *default: Any) -> Any:  # a deleted step's manifest is never read for it
        if step in self._unread:
            self._unread.discard(step)
            self._present.discard(step)
            return default[0] if default else None
        return self._read.pop(step, *default)

    def clear(self) -> None:
        self._read.clear()
        self._unread.clear()
        self._present.clear()

    def update(self, other: Any = (), /, **kw: Any) -> None:
        if isinstance(other, Steps):  # adopts its unread steps unread
            self._read.update(other._read)
            self._unread = (self._unread | other._unread) - self._read.keys()
            self._present = (self._present | other._present) & self._unread
            self._dir = other._dir if other._dir is not None else self._dir
            return
        super().update(other, **kw)

    def items(self) -> list[tuple[int, Manifest]]:  # type: ignore[override] - a snapshot
        return [(s, m) for s in list(self) if (m := self.get(s)) is not None]

    def values(self) -> list[Manifest]:  # type: ignore[override]
        return [m for _, m in self.items()]

    def unconfirmed(self) -> list[int]:
        """The unread steps not yet known to have a manifest (``present`` checks them;
        ``tiers.Listing.confirm`` outside the manager's lock)."""
        return sorted(self._unread - self._present) if self._dir is not None else []

    def mark(self, there: Mapping[int, bool]) -> None:
        """``present``'s answers: a step without its manifest is unlisted."""
        for step, yes in there.items():
            if step in self._unread:
                (self._present.add if yes else self._unread.discard)(step)

    def newest(self) -> int | None:
        """The newest step whose manifest validates (those newer that fail are unlisted)."""
        for step in sorted(self, reverse=True):
            if self.get(step) is not None:
                return step
        return None


def present(directory: Location | None, steps: list[int]) -> dict[int, bool]:
    """Whether each step of manager ``directory`` has its manifest (a step an object
    store's delete stopped after removing its manifest, an attempt of another writer not
    committed yet, an empty ``7/`` have none): a stat each locally, a one-key listing
    each (``CHECK_THREADS`` at a time) on an object store; no manifest read."""
    there: dict[int, bool] = {}
    if directory is None or not steps:
        return there

    def check(step: int) -> None:
        there[step] = _kvstore.exists(directory.child(_commit.step_name(step)), MANIFEST)

    _tasks.run_tasks([lambda s=s: check(s) for s in steps], 1 if directory.local is not None else CHECK_THREADS)
    return there


def discover(directory: Location) -> Steps:
    """The committed steps of manager ``directory`` from one listing, the newest read."""
    steps, skipped = _commit.listed_steps(directory)
    found = Steps(directory, steps)
    found.skipped.update(skipped)
    found.newest()
    return found


def listed(directory: Location) -> Steps:
    """What a manager lists: jaxckpt's steps (``discover``), or in a directory holding
    none, an orbax run's (``_formats.orbaxrun``: stand-in manifests, all known)."""
    found = discover(directory)
    if len(found):
        return found
    return Steps(None, read=_orbaxrun.stand_ins(directory))
