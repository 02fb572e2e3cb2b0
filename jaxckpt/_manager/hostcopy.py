"""Per-host directories: a host that lacks a committed step gets it from a host that
holds all of it, over JAX's own collectives.

With a local directory per host, each host keeps the files its devices hold. When the
state is replicated (or a host's devices hold everything), one host's copy is complete;
a replaced node, or a disk mounted late, has an empty directory. Such a step is left out
of the listing (``CheckpointManager`` never deletes it at start), and a restore of it
first gives every host that lacks it a copy of a complete one:

1. every process posts what it knows of the step: the first process of each group
   (the processes sharing a directory) its directory's file listing, and every holder
   its manifest's bytes;
2. every process computes the same plan from those posts alone: the source is the
   lowest process whose directory holds every file its own manifest implies (none: the
   step cannot be had from the hosts; the caller falls back or says which host lacks
   it). Its own: in format 3 each host's manifest locates chunks in that host's data
   objects (``_hoststreams``), so a copy takes the source's manifest with its files;
3. the source's files go to every process in fixed-size blocks
   (``multihost_utils.broadcast_one_to_all``: one all-reduce per block, one compiled
   shape); the first process of each group that lacks the step writes them into a
   staging attempt of its directory and commits the manifest last, as a save does;
4. every process posts whether its commit worked; any failure fails the repair in all.

Host memory stays near one block (a data object of a GiB goes block by block); nothing
goes through the persistent tier.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import numpy as np

from .. import _commit, _distributed, _manifest, _verify
from .._errors import CheckpointError
from .._storage import kvstore as _kvstore
from .._storage.location import Location

_log = logging.getLogger("jaxckpt")

BLOCK_BYTES = 16 << 20  # bytes per collective (the largest transient buffer)


def plan_source(listings: dict[int, dict[str, int]], expected: dict[str, Any]) -> int | None:
    """The lowest process whose directory listing holds every expected file (with the
    expected size where one is known), or ``None``."""
    for p in sorted(listings):
        files = listings[p]
        if all(path in files and (size is None or files[path] == size) for path, (size, _) in expected.items()):
            return p
    return None


def pick_source(listings: dict[int, dict[str, int]], mans: dict[int, bytes],
                where: str) -> tuple[int | None, _manifest.Manifest | None]:
    """The lowest listing process whose directory holds every file of its own manifest
    (``mans``: each holder's manifest bytes), with that manifest; ``(None, None)``."""
    for p in sorted(listings):
        if mans.get(p):
            man = _manifest.parse(mans[p], where)
            if plan_source({p: listings[p]}, _verify.expected_files(man)) is not None:
                return p, man
    return None, None


def blocks(sizes: list[int], block: int) -> int:
    """How many ``block``-byte collectives move files of ``sizes`` back to back."""
    return -(-sum(sizes) // block) if sizes else 0


def copy_from_holders(op: _distributed.Operation, step: int, directory: Location, holds: bool,
                      lists: bool, writes: bool, read_only: bool) -> _manifest.Manifest | None:
    """Give every group that lacks committed ``step`` a copy of a complete one.

    Every process calls it with the same ``op`` and ``step``: ``holds`` (its directory
    holds the step committed), ``lists`` (it is the first process of its group),
    ``writes`` (``lists`` and its group lacks the step). Returns the step's manifest once
    every group holds the step, ``None`` (in every process) when no single host holds
    all of it or the manager is read-only. Raises ``CheckpointError`` in every process
    when a copy failed.
    """
    final = directory.child(_commit.step_name(step))
    mine: dict[str, int] = _verify.list_files(final.local) if lists and holds else {}
    man_bytes = _kvstore.read_blob(final, "manifest.json") if holds else None
    payload = json.dumps({"files": mine if lists and holds else None}).encode()
    op.post(f"have{step}", payload)
    op.post(f"man{step}", man_bytes or b"")
    me = _distributed.process_index()
    others = [p for p in range(_distributed.process_count()) if p != me]
    posts = {p: json.loads(d) for p, d in op.wait_for(f"have{step}", others).items()}
    posts[me] = json.loads(payload)
    listings = {p: v["files"] for p, v in posts.items() if v["files"] is not None}
    mans = op.wait_for(f"man{step}", others)
    mans[me] = man_bytes or b""
    if read_only or not any(mans.values()):
        return None
    source, man = pick_source(listings, mans, str(final))
    if source is None:
        return None
    files = sorted(listings[source].items())
    _log.warning("jaxckpt: step %d of '%s' is missing on some hosts; copying it from process %d's "
                 "directory (%d files) over the job's collectives", step, directory, source, len(files))
    error: BaseException | None = None
    try:
        _move(step, final, files, source, mans[source], writes)
    except Exception as e:  # noqa: BLE001 - every process hears of it
        error = e
    op.post(f"copied{step}", error if error is not None else b"")
    try:
        op.wait_for(f"copied{step}", others)
    except CheckpointError as e:
        error = error or e
    if error is not None:
        raise CheckpointError(f"copying step {step} of '{directory}' from process {source}'s directory "
                              f"failed: {error}") from error
    return man


def _move(step: int, final: Location, files: list[tuple[str, int]], source: int, man_bytes: bytes,
          writes: bool) -> None:
    """Stream ``files`` from ``source`` to every process; writers stage and commit them."""
    from jax.experimental import multihost_utils

    me = _distributed.process_index()
    total = sum(size for _, size in files)
    block = min(BLOCK_BYTES, max(64, 1 << max(total - 1, 1).bit_length()))
    token = _commit.new_token(final) if writes else None
    staging = _commit.make_staging(final, token) if writes else None
    committed = False
    try:
        stream = _Stream(final.local, files) if me == source else None
        sink = _Sink(staging.local, files) if staging is not None else None
        for _ in range(blocks([s for _, s in files], block)):
            buf = stream.next(block) if stream is not None else np.zeros(block, np.uint8)
            got = multihost_utils.broadcast_one_to_all(buf, is_source=me == source)
            if sink is not None:
                sink.put(np.asarray(got, dtype=np.uint8))
        if sink is not None:
            sink.close()
            _commit.commit(final, staging, man_bytes, token)
            committed = True
    finally:
        if staging is not None and not committed:
            _commit.abort(final, staging, token)


class _Stream:
    """The source's files back to back, cut into blocks."""

    def __init__(self, root: str, files: list[tuple[str, int]]):
        self.root, self.files, self.i, self.f = root, list(files), 0, None

    def next(self, block: int) -> np.ndarray:
        out = np.zeros(block, np.uint8)
        filled = 0
        while filled < block and self.i < len(self.files):
            if self.f is None:
                self.f = open(os.path.join(self.root, self.files[self.i][0]), "rb")  # noqa: SIM115 - one file at a time
            data = self.f.read(block - filled)
            if not data:
                self.f.close()
                self.f, self.i = None, self.i + 1
                continue
            out[filled:filled + len(data)] = np.frombuffer(data, np.uint8)
            filled += len(data)
        return out


class _Sink:
    """Writes the blocks back into the files they came from (each fsynced)."""

    def __init__(self, root: str, files: list[tuple[str, int]]):
        self.root, self.files, self.i, self.left, self.f = root, list(files), 0, 0, None

    def put(self, buf: np.ndarray) -> None:
        view = memoryview(buf.tobytes())
        while self.i < len(self.files):
            if self.f is None:
                path, self.left = self.files[self.i]
                full = os.path.join(self.root, path)
                os.makedirs(os.path.dirname(full), exist_ok=True)
                self.f = open(full, "wb")  # noqa: SIM115 - closed when its last byte arrives
            take = min(self.left, len(view))
            self.f.write(view[:take])
            view, self.left = view[take:], self.left - take
            if self.left:
                return  # this block is used up; the file goes on in the next
            self.f.flush()
            os.fsync(self.f.fileno())
            self.f.close()
            self.f, self.i = None, self.i + 1

    def close(self) -> None:
        self.put(np.zeros(0, np.uint8))  # empty files at the end
        if self.i != len(self.files):
            raise CheckpointError(f"short copy: {len(self.files) - self.i} file(s) incomplete")
