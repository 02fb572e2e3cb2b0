"""Staging a save's host buffers in waves within a byte budget (a manager's
``max_staging_bytes``): the budget shared by every save given it, the waves of one
snapshot, and the hand-over between the caller that stages them and the writer that
writes and frees them. ``_snapshot`` plans the waves and stages each one.

A restore within a budget too (``restore(..., max_staging_bytes=)``, issue 34): which
leaves go together (``restore_waves``) and the thread that reads the next wave while the
one before it is placed (``ReadAhead``); ``_restore`` runs them."""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from . import _layout
from ._errors import CheckpointError


def check_budget(max_bytes: Any) -> Any:
    """``max_bytes`` when it is a positive int (``None`` passes), else ``ValueError``."""
    if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1):
        raise ValueError(f"max_staging_bytes must be a positive int, got {max_bytes!r}")
    return max_bytes


class StagingBudget:
    """The most host bytes that staged-but-not-yet-written waves may hold at once, shared
    by every save given it (a manager's ``max_staging_bytes``). ``in_flight`` and
    ``peak``: those bytes now, and the most so far (what tests and benchmarks read)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = check_budget(max_bytes)
        self.in_flight = 0
        self.peak = 0
        self.cond = threading.Condition()

    def fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more may be staged now (always, when nothing is)."""
        return not self.in_flight or self.in_flight + nbytes <= self.max_bytes

    def take(self, nbytes: int) -> None:
        self.in_flight += nbytes
        self.peak = max(self.peak, self.in_flight)

    def give(self, nbytes: int) -> None:
        self.in_flight -= nbytes
        self.cond.notify_all()


def staging_budget(max_bytes: int | None) -> StagingBudget | None:
    """A ``StagingBudget`` of ``max_bytes``; ``None`` for ``None`` (no budget)."""
    return None if max_bytes is None else StagingBudget(max_bytes)


@dataclass
class Wave:
    """The host buffers of one staged wave, which the writer writes and then frees."""

    shards: dict[int, list[tuple[_layout.Index, np.ndarray]]]  # as Snapshot.file_shards
    packed: np.ndarray | None  # the first wave: the packed small leaves
    nbytes: int  # what it counts against the budget
    # format 3's compressed chunks staged to be encoded for their sizes only (the stream's
    # length needs them before any entry is written); they are staged again, in ``shards``
    sizing: dict[int, list[tuple[_layout.Index, np.ndarray]]] = dataclasses.field(default_factory=dict)
    sizing_nbytes: int = 0  # what ``sizing`` counts of ``nbytes`` (given back once sized: ``sized``)


class Planned(NamedTuple):
    items: list[tuple[Any, Any]]  # (a snapshot's array leaf, one of its chunks)
    nbytes: int
    first: bool


class Waves:
    """The waves of one snapshot: planned, then staged (by the caller's ``stage_rest``, or
    by the writer when it has nothing to write and a wave fits), then taken by the
    writer and given back once written. Every step holds the budget's lock."""

    def __init__(self, budget: StagingBudget, planned: list[Planned], stage: Callable[[Planned], Wave]):
        self._budget, self._cond, self._stage = budget, budget.cond, stage
        self._todo = collections.deque(planned)  # not yet claimed for staging
        self._ready: collections.deque[Wave] = collections.deque()  # staged, not yet taken
        self._staging = 0  # claimed, being staged
        self._closed = False
        self._error: BaseException | None = None
        self.staged_at = time.perf_counter()

    def _next(self, writer: bool) -> tuple[Wave | None, Planned | None]:
        """Wait for a staged wave (the writer only), a wave to stage that fits the budget
        (claimed and counted), or the end (``(None, None)``). Holds the lock."""
        while True:
            if self._closed:
                if writer:
                    raise self._stopped()
                return None, None
            if writer and self._ready:
                return self._ready.popleft(), None
            if self._todo and self._budget.fits(self._todo[0].nbytes):
                planned = self._todo.popleft()
                self._staging += 1
                self._budget.take(planned.nbytes)
                return None, planned
            if not self._todo and not (writer and self._staging):
                return None, None
            self._cond.wait()

    def _stopped(self) -> CheckpointError:
        error = CheckpointError(f"Staging this save's host buffers failed: {self._error}"
                                if self._error is not None else "This save was stopped")
        error.__cause__ = self._error
        return error

    def _stage_claimed(self, planned: Planned, enqueue: bool) -> Wave | None:
        """Stage a claimed wave; queue it for the writer, or return it (``None``: closed)."""
        try:
            wave = self._stage(planned)
        except BaseException:
            with self._cond:
                self._staging -= 1
                self._budget.give(planned.nbytes)
            raise
        with self._cond:
            self._staging -= 1
            self._cond.notify_all()
            if self._closed:
                self._budget.give(planned.nbytes)
                return None
            self.staged_at = time.perf_counter()
            if enqueue:
                self._ready.append(wave)
            return wave

    def stage_first(self) -> None:
        with self._cond:
            _, planned = self._next(writer=False)
        try:
            self._stage_claimed(planned, enqueue=True)
        except BaseException as e:
            self.close(e)
            raise

    def stage_rest(self) -> None:
        try:
            while True:
                with self._cond:
                    _, planned = self._next(writer=False)
                if planned is None:
                    break
                self._stage_claimed(planned, enqueue=True)
        except BaseException as e:  # noqa: BLE001 - the writer raises it (the save fails)
            self.close(e)
            if not isinstance(e, Exception):
                raise
        with self._cond:  # waves the writer is staging itself still read the caller's arrays
            while self._staging:
                self._cond.wait()

    def take(self) -> Wave | None:
        """The next wave to write (staged here if none is ready); ``None``: all written."""
        with self._cond:
            wave, planned = self._next(writer=True)
        if planned is None:
            return wave
        wave = self._stage_claimed(planned, enqueue=False)
        if wave is None:
            with self._cond:
                raise self._stopped()
        return wave

    def done(self, wave: Wave) -> None:
        """``wave`` is written (or failed): free its buffers and its share of the budget."""
        with self._cond:
            self._free(wave)

    def sized(self, wave: Wave) -> None:
        """``wave``'s compressed chunks are sized: free them and their share of the budget
        (a wave the writer holds until every chunk is sized then holds only what it writes,
        so the chunks still to size can be staged beside it)."""
        with self._cond:
            wave.sizing = {}
            self._budget.give(wave.sizing_nbytes)
            wave.nbytes -= wave.sizing_nbytes
            wave.sizing_nbytes = 0
            self._cond.notify_all()

    def _free(self, wave: Wave) -> None:
        wave.shards, wave.packed, wave.sizing = {}, None, {}
        self._budget.give(wave.nbytes)

    def close(self, error: BaseException | None = None) -> None:
        """Stop: nothing more is staged, the staged waves not taken are freed."""
        with self._cond:
            if self._closed:
                return
            self._closed, self._error = True, error
            while self._ready:
                self._free(self._ready.popleft())
            self._todo.clear()
            self._cond.notify_all()


def plan(items: list[Any], costs: list[int], first_bytes: int, budget: int) -> list[Planned]:
    """The waves of a snapshot's ``items`` (``(leaf, chunk)``), staging each costing
    ``costs`` bytes. The first: every zero-cost item and the packed leaves
    (``first_bytes``); then the others in order, a new wave whenever one would pass half
    the budget."""
    cap = max(1, budget // 2)
    waves: list[tuple[list[Any], list[int]]] = [
        ([it for it, c in zip(items, costs) if not c], [first_bytes])]
    for it, c in zip(items, costs):
        if not c:
            continue
        if sum(waves[-1][1]) and sum(waves[-1][1]) + c > cap:
            waves.append(([], []))
        waves[-1][0].append(it)
        waves[-1][1].append(c)
    return [Planned(its, sum(cs), i == 0) for i, (its, cs) in enumerate(waves)]


# --- a restore in waves -----------------------------------------------------------

def restore_waves(sizes: Sequence[int], max_bytes: int | None) -> list[list[int]]:
    """Indices ``0..len(sizes)-1`` in consecutive waves of at most ``max_bytes // 2`` bytes
    each (two waves are in host memory at once: one placed, the next read); an item bigger
    than that goes alone. One wave without a budget."""
    if max_bytes is None:
        return [list(range(len(sizes)))]
    limit = max(1, max_bytes // 2)
    out: list[list[int]] = [[]]
    total = 0
    for i, n in enumerate(sizes):
        if out[-1] and total + n > limit:
            out.append([])
            total = 0
        out[-1].append(i)
        total += n
    return out


class ReadAhead:
    """``fn(arg)`` on a thread of its own (a plain thread, as ``_tasks`` explains: a restore
    at the interpreter's exit still runs); ``result()`` waits for it and gives its value or
    raises its error. What it waits on is bounded by the reads' own storage timeouts."""

    def __init__(self, fn: Callable[[Any], Any], arg: Any):
        self._value: Any = None
        self._error: BaseException | None = None

        def run() -> None:
            try:
                self._value = fn(arg)
            except BaseException as e:  # noqa: BLE001 - raised in the caller, by result()
                self._error = e

        self._thread = threading.Thread(target=run, name="jaxckpt-restore-ahead", daemon=True)
        self._thread.start()

    def join(self) -> None:
        self._thread.join()

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        value, self._value = self._value, None
        return value
