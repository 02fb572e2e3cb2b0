"""A manager's committed steps, the start reading the newest step's manifest only (issue 34).

A manager starts from one listing of its directory and the newest step's manifest,
whatever the number of steps the directory holds: 10,000 retained steps cost the start
what one does. At the start the newest step is read, and the next older one after it
whenever it fails, down to one that validates, so ``latest_step()`` is a step that
restores. Every other listed step is *unread*: its manifest is read and validated the
first time something asks about it, and a step whose manifest is missing (an empty
``7/``, a deletion stopped halfway, an object store's attempt not committed) or fails
(the warning ``_commit.load_step`` logs) is then unlisted, as the eager discovery it
replaces skipped it. A store that fails to answer is not a failing step: the read
raises and the step stays unread (``_commit.load_step``).

What asks: ``step in steps`` reads that one step (a restore, ``info``, a delete, a
save's overwrite check: each process decides from the same bytes, so the processes of a
job agree); iteration and ``len`` read every unread step first (``all_steps()``,
retention, the views): a step is never counted, ranked or deleted unvalidated.
``tiers.Listing.validate`` reads them outside the manager's lock, ahead of those.
Callers hold the manager's lock, as for the plain dict this replaces.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, MutableMapping
from typing import Any

from .. import _commit, _tasks
from .._formats import orbaxrun as _orbaxrun
from .._manifest import Manifest
from .._storage.location import Location

READ_THREADS = 16  # manifests read at once on an object store (one at a time locally)


class Steps(MutableMapping):
    """Step -> validated manifest, the manifests of ``unread`` steps read on first use."""

    def __init__(self, directory: Location | None, unread: Iterable[int] = (),
                 read: Mapping[int, Manifest] | None = None):
        self._dir = directory
        self._read: dict[int, Manifest] = dict(read or {})
        self._unread = set(unread) - set(self._read)
        self.skipped: dict[int, str] = {}  # steps whose manifest failed when read, with why

    @property
    def directory(self) -> Location | None:
        return self._dir

    def _load(self, step: int) -> Manifest | None:
        # a store that fails raises (``_commit.load_step``): the step stays unread, asked again next time
        man = _commit.load_step(self._dir, step, self.skipped) if self._dir is not None else None
        self._unread.discard(step)
        if man is not None:
            self._read[step] = man
        return man

    def __contains__(self, step: object) -> bool:
        if step in self._read:
            return True
        return step in self._unread and self._load(step) is not None  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[int]:
        self.read_all()
        return iter(sorted(self._read))

    def __len__(self) -> int:
        self.read_all()
        return len(self._read)

    def __getitem__(self, step: int) -> Manifest:
        man = self._read.get(step)
        if man is None and step in self._unread:
            man = self._load(step)
        if man is None:
            raise KeyError(step)
        return man

    def __setitem__(self, step: int, man: Manifest) -> None:
        self._unread.discard(step)
        self._read[step] = man

    def __delitem__(self, step: int) -> None:
        if step not in self._read and step not in self._unread:
            raise KeyError(step)
        self._unread.discard(step)
        self._read.pop(step, None)

    def pop(self, step: int, *default: Any) -> Any:  # a deleted step's manifest is never read for it
        if step in self._unread:
            self._unread.discard(step)
            return default[0] if default else None
        return self._read.pop(step, *default)

    def clear(self) -> None:
        self._read.clear()
        self._unread.clear()

    def update(self, other: Any = (), /, **kw: Any) -> None:
        if isinstance(other, Steps):  # adopts its unread steps unread
            self._read.update(other._read)
            self._unread = (self._unread | other._unread) - self._read.keys()
            self.skipped.update(other.skipped)
            self._dir = other._dir if other._dir is not None else self._dir
            return
        super().update(other, **kw)

    def known(self) -> dict[int, Manifest]:
        """The steps read so far, with their manifests (nothing read here)."""
        return dict(self._read)

    def unread(self) -> list[int]:
        """The listed steps not read yet."""
        return sorted(self._unread) if self._dir is not None else []

    def read_all(self) -> None:
        """Read every unread step (with the caller's lock held throughout)."""
        found: tuple[dict[int, Manifest | None], dict[int, str]] = ({}, {})
        try:
            read(self._dir, self.unread(), found)
        finally:  # those read before a store failed are kept; the others stay unread
            self.adopt(found)

    def adopt(self, found: tuple[dict[int, Manifest | None], dict[int, str]]) -> None:
        """``read``'s answers for the steps still unread: listed when valid, else unlisted."""
        mans, skipped = found
        for step, man in mans.items():
            if step in self._unread:
                self._unread.discard(step)
                if man is not None:
                    self._read[step] = man
                elif step in skipped:
                    self.skipped[step] = skipped[step]

    def newest(self) -> int | None:
        """The newest step whose manifest validates (those newer that fail are unlisted);
        no other step read."""
        for step in sorted(self._read.keys() | self._unread, reverse=True):
            if self.get(step) is not None:
                return step
        return None


def read(directory: Location | None, steps: list[int],
         into: tuple[dict[int, Manifest | None], dict[int, str]] | None = None,
         ) -> tuple[dict[int, Manifest | None], dict[int, str]]:
    """The validated manifests of ``steps`` of manager ``directory`` (``None``: missing or
    failing, the reason in the second dict): one at a time locally, ``READ_THREADS`` at a
    time on an object store. A store that fails raises (no read starts after it, so the
    failure comes within one I/O bound whatever the number of steps); ``into`` then holds
    the steps read before."""
    mans, skipped = into if into is not None else ({}, {})
    if directory is None or not steps:
        return mans, skipped

    def one(step: int) -> None:
        mans[step] = _commit.load_step(directory, step, skipped)

    _tasks.run_tasks([lambda s=s: one(s) for s in steps], 1 if directory.local is not None else READ_THREADS)
    return mans, skipped


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
    if found.newest() is not None:
        return found
    return Steps(None, read=_orbaxrun.stand_ins(directory))
