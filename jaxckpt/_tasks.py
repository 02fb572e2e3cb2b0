"""Running I/O concurrently, bounded: callables on a few plain threads
(``run_tasks``) and tensorstore futures within a byte budget (``run_bounded``).
The writer and the reader both use them.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any


def batches(items: Iterable[Any], limit: int) -> list[list[Any]]:
    """``items`` in order, in consecutive groups of at most ``limit`` bytes (by their
    ``nbytes``; an item bigger than ``limit`` goes alone); none for no items."""
    out: list[list[Any]] = []
    size = 0
    for item in items:
        if not out or size + item.nbytes > limit:
            out.append([])
            size = 0
        out[-1].append(item)
        size += item.nbytes
    return out


def run_tasks(tasks: Sequence[Any], n_threads: int) -> None:
    """Run callables on up to ``n_threads`` threads, in order; once all stopped, raise the
    error of the first task (in ``tasks``' order) that failed. No task starts after a
    failure, and tasks start in order, so every task before a failed one has run: which
    error is raised does not depend on the threads' timing (a restore of two damaged
    leaves names the same one every time).

    Plain threads, not ``concurrent.futures``: that refuses new work once the
    interpreter starts exiting, and a pending async save must still finish then.
    """
    if not tasks:
        return
    todo = iter(enumerate(tasks))
    lock = threading.Lock()
    errors: list[tuple[int, BaseException]] = []

    def worker() -> None:
        while True:
            with lock:
                i, task = (None, None) if errors else next(todo, (None, None))
            if task is None:
                return
            try:
                task()
            except BaseException as e:  # noqa: BLE001 - re-raised below
                with lock:
                    errors.append((i, e))

    threads = [threading.Thread(target=worker, name="jaxckpt-io", daemon=True)
               for _ in range(min(n_threads, len(tasks)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise min(errors, key=lambda ie: ie[0])[1]


def run_bounded(jobs: Iterable[tuple[int, Callable[[], Any], Callable[[Any], None]]], budget: int) -> None:
    """Start ``jobs`` — ``(nbytes, start, finish)`` — keeping at most ``budget`` bytes in
    flight: ``start()`` returns a future, ``finish(future)`` waits for it and raises on
    failure. A job bigger than the budget runs alone.

    After a failure every started future settles before the first error is raised, so
    nothing lands after the caller has cleaned up.
    """
    in_flight: collections.deque = collections.deque()
    used = 0
    try:
        for nbytes, start, finish in jobs:
            while in_flight and used + nbytes > budget:
                n, future, done = in_flight.popleft()
                used -= n
                done(future)
            in_flight.append((nbytes, start(), finish))
            used += nbytes
        while in_flight:
            _, future, done = in_flight.popleft()
            done(future)
    finally:
        for _, future, _ in in_flight:
            try:
                future.result()
            except Exception:  # noqa: BLE001, S110 - the first error is the one reported
                pass


class Worker:
    """A background thread that runs ``fn(item)`` for each submitted item, in order,
    started on demand and gone when idle. ``wait()`` returns once every item ran.

    The manager's retention deletes and its persistent-tier copies each have one, so a
    slow delete or copy never holds up a save."""

    def __init__(self, name: str, fn: Callable[[Any], None]):
        self._name, self._fn = name, fn
        self._cond = threading.Condition()
        self._queue: collections.deque = collections.deque()
        self._thread: threading.Thread | None = None

    def submit(self, item: Any) -> None:
        with self._cond:
            self._queue.append(item)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._queue:
                    self._thread = None
                    self._cond.notify_all()
                    return
                item = self._queue.popleft()
            self._fn(item)  # fn handles its own errors

    def wait(self) -> None:
        with self._cond:
            while self._thread is not None:
                self._cond.wait()
