"""Two tiers: every step commits to a fast local directory; every K-th one is also copied,
in the background, to a durable persistent directory (a bucket), with its own
manifest-last commit and its own retention.

The copy streams the committed local files leaf by leaf through the convert writer
(``_stream``): device memory is never snapshotted again, host memory stays near one
chunk, and a copy killed midway leaves no persistent step (its manifest is written last).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Any

from . import _commit, _retention, _sources, _stream, _tasks
from ._location import Location
from ._manifest import LeafRecord, Manifest

_log = logging.getLogger("jaxckpt")


def copy_step(src: Location, dest: Location) -> Manifest:
    """Copy the committed checkpoint at ``src`` to ``dest`` (same records and chunks,
    same metadata and info), manifest last. Returns the new manifest."""
    source = _sources.open_source(src)
    man = source.manifest

    def chunk_data(i: int, rec: LeafRecord) -> Any:
        saved = man.leaves[i]
        return functools.partial(_read_region, source, saved)

    info = {k: v for k, v in man.info.items() if k not in ("write_seconds", "format")}
    info["copied_from"] = str(src)
    return _stream.write_checkpoint(dest, man.structure, list(man.leaves), chunk_data,
                                    metadata=man.metadata, overwrite=True, info=info)


def _read_region(source: _sources.Source, rec: LeafRecord, index: Any) -> Any:
    reader = source.new_reader()
    reader.add(rec, index)
    reader.run()
    return reader.get(rec, index)


class PersistentTier:
    """The durable tier of a manager: its committed steps, a copy thread, retention."""

    def __init__(self, directory: Location, interval_steps: int, max_to_keep: int | None):
        self.dir, self.interval, self.max_to_keep = directory, interval_steps, max_to_keep
        self.steps: dict[int, Manifest] = dict(_commit.discover_steps(directory))
        self._lock = threading.Lock()
        self._worker = _tasks.Worker("jaxckpt-persist", self._run)
        self.errors: list[tuple[int, BaseException]] = []

    def wants(self, step: int) -> bool:
        return step % self.interval == 0

    def submit(self, step: int, local: Location, done: Callable[[], None]) -> None:
        """Copy committed local ``step`` in the background; ``done()`` runs after it."""
        self._worker.submit((step, local, done))

    def _run(self, item: tuple[int, Location, Callable[[], None]]) -> None:
        step, local, done = item
        try:
            self._copy(step, local)
        except Exception as e:  # noqa: BLE001 - raised by the manager's next wait
            _log.warning("jaxckpt: copying step %d to '%s' failed: %s", step, self.dir, e)
            with self._lock:
                self.errors.append((step, e))
        finally:
            done()

    def _copy(self, step: int, local: Location) -> None:
        man = copy_step(local, self.dir.child(_commit.step_name(step)))
        with self._lock:
            self.steps[step] = man
        self._apply_retention()

    def _apply_retention(self) -> None:
        if self.max_to_keep is None:
            return
        infos = [_retention.StepInfo(s, float(m.info.get("commit_time", 0.0)), m.info.get("metrics"))
                 for s, m in self.steps.items()]
        policy = _retention.RetentionPolicy.make(max_to_keep=self.max_to_keep)
        for s in _retention.steps_to_delete(infos, policy):
            with self._lock:
                self.steps.pop(s, None)
            _commit.delete_step(self.dir, s, _commit.new_token())

    def wait(self) -> list[tuple[int, BaseException]]:
        """Until every submitted copy ran; returns (and forgets) the failures."""
        self._worker.wait()
        with self._lock:
            errors, self.errors = self.errors, []
        return errors
