"""Peer copies' file streams, and the collective transport a repair moves them with.

``Files``: the files of a part back to back as one stream of bytes, read into rows or
written from them (each file fsynced). ``move``: each sender's files to its receiver over
JAX's collectives, a jitted ``ppermute`` per wave of at most ``BLOCK_BYTES`` per process,
one device per process: what ``peerrepair`` uses on the loop's own thread (at a restore,
where no collective of the user's runs beside it). A save's copies move in the
background over ``peerlink`` instead.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any

import jax
import numpy as np

from .. import _distributed, _storage
from .._errors import CheckpointError

BLOCK_BYTES = 64 << 20  # bytes each sender moves per collective (its row)


def waves(sizes: dict[int, int], block: int = BLOCK_BYTES) -> tuple[int, int]:
    """(number of waves, row width) for senders moving ``sizes`` bytes each."""
    most = max(sizes.values(), default=0)
    if most == 0:
        return 0, 0
    count = -(-most // block)
    width = -(-most // count)  # even waves: 128 MiB and a manifest's few KiB are two, not three
    width = -(-width // 4096) * 4096  # few distinct shapes to compile
    return -(-most // width), width


def _one_device_per_process() -> list[Any]:
    first: dict[int, Any] = {}
    for d in sorted(jax.devices(), key=lambda d: d.id):
        first.setdefault(d.process_index, d)
    return [first[p] for p in sorted(first)]


@functools.lru_cache(maxsize=16)
def _permute(pairs: tuple[tuple[int, int], ...], width: int) -> Any:
    devices = _one_device_per_process()
    mesh = jax.sharding.Mesh(np.array(devices), ("p",))
    spec = jax.sharding.PartitionSpec("p")
    fn = jax.shard_map(lambda x: jax.lax.ppermute(x, "p", list(pairs)), mesh=mesh, in_specs=spec, out_specs=spec)
    return jax.jit(fn), jax.sharding.NamedSharding(mesh, spec), devices


def permute(row: np.ndarray, pairs: tuple[tuple[int, int], ...]) -> np.ndarray:
    """Each sender's ``row`` (uint8, the same width everywhere) at its receiver (zeros
    where a process receives nothing): one collective over one device per process."""
    fn, sharding, devices = _permute(pairs, row.shape[0])
    local = jax.device_put(row.reshape(1, -1), devices[_distributed.process_index()])
    arr = jax.make_array_from_single_device_arrays((len(devices), row.shape[0]), sharding, [local])
    return np.asarray(fn(arr).addressable_data(0)).reshape(-1)


def move(pairs: list[tuple[int, int]], files: dict[int, list[tuple[str, int]]], read_root: str | None,
         write_root: str | None, spent: dict[str, float] | None = None) -> BaseException | None:
    """Send each sender's ``files`` (read under ``read_root``) to its receiver (written
    under ``write_root``, each fsynced). Every process calls it with the same ``pairs``
    and ``files`` (senders and receivers each unique). A read or write that fails stops
    this process's I/O but not its part in the waves; its error is returned. ``spent``
    adds up the seconds reading, in the collectives and writing."""
    spent = {} if spent is None else spent
    me = _distributed.process_index()
    count, width = waves({s: sum(n for _, n in files.get(s, [])) for s, _ in pairs})
    sender = next((s for s, r in pairs if s == me), None)
    source = next((s for s, r in pairs if r == me), None)
    error: BaseException | None = None
    stream = Files(read_root, files[me]) if sender is not None else None
    sink = Files(write_root, files[source]) if source is not None else None
    row = np.zeros(width, np.uint8)  # one buffer for every wave: fresh memory is slow to touch
    for _ in range(count):
        t0 = time.perf_counter()
        if stream is not None and error is None:
            try:
                stream.read_into(row)
            except Exception as e:  # noqa: BLE001 - reported after the waves
                error = e
                row[:] = 0
        t1 = time.perf_counter()
        got = permute(row, tuple(pairs))
        t2 = time.perf_counter()
        if sink is not None and error is None:
            try:
                _storage.fault("peer", write_root)
                sink.write_from(got)
            except Exception as e:  # noqa: BLE001 - reported after the waves
                error = e
        for key, dt in (("read", t1 - t0), ("collective", t2 - t1), ("write", time.perf_counter() - t2)):
            spent[key] = spent.get(key, 0.0) + dt
    for files_ in (stream, sink):
        try:
            if files_ is not None:
                files_.close(check=files_ is sink and error is None)
        except Exception as e:  # noqa: BLE001
            error = error or e
    return error


class Files:
    """Files under ``root`` back to back as one stream of bytes: read into each wave's
    row (the rest of it zeros), or written from each wave's row (each file fsynced)."""

    def __init__(self, root: str, files: list[tuple[str, int]]):
        self.root, self.files, self.i, self.done, self.f = root, list(files), 0, 0, None

    def _open(self, mode: str) -> Any:
        if self.f is None:
            path = os.path.join(self.root, self.files[self.i][0])
            if mode == "wb":
                os.makedirs(os.path.dirname(path), exist_ok=True)
            self.f = open(path, mode)  # noqa: SIM115 - closed when its last byte passed
        return self.f

    def _next_file(self, fsync: bool) -> None:
        if self.f is not None:
            if fsync:
                self.f.flush()
                os.fsync(self.f.fileno())
            self.f.close()
        self.f, self.i, self.done = None, self.i + 1, 0

    def read_into(self, row: np.ndarray) -> None:
        view, at = memoryview(row), 0
        while at < len(view) and self.i < len(self.files):
            size = self.files[self.i][1]
            if self.done == size:
                self._next_file(False)
                continue
            n = self._open("rb").readinto(view[at:at + min(len(view) - at, size - self.done)])
            if not n:
                raise CheckpointError(f"'{self.files[self.i][0]}' in '{self.root}' is shorter than its {size} bytes")
            at, self.done = at + n, self.done + n
        row[at:] = 0

    def write_from(self, row: np.ndarray) -> None:
        view, at = memoryview(row), 0
        while self.i < len(self.files):
            size = self.files[self.i][1]
            take = min(size - self.done, len(view) - at)
            if take:
                self._open("wb").write(view[at:at + take])
                at, self.done = at + take, self.done + take
            if self.done < size:
                return  # this row is used up; the file goes on in the next
            self._open("wb")  # an empty file is created too
            self._next_file(True)

    def close(self, check: bool) -> None:
        if self.f is not None:
            self.f.close()
            self.f = None
        if check and self.i < len(self.files):
            self.write_from(np.zeros(0, np.uint8))  # empty files at the end
            if self.i < len(self.files):
                raise CheckpointError(f"short copy into '{self.root}': {len(self.files) - self.i} file(s) incomplete")
