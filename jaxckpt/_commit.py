"""Atomic visibility: temporary locations, the manifest-last commit, and discovery of
committed checkpoints.

On a local file system a checkpoint is written under a hidden temporary sibling
(``.<name>.jaxckpt-tmp-<token>``) and renamed into place after its manifest is durable.
On an object store there is no rename: data goes straight under the final prefix and
the manifest, written last, is the commit marker.
"""

from __future__ import annotations

import logging
import os
import stat
import uuid

from . import _location, _manifest, _storage
from ._errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from ._location import Location

TMP_MARK = ".jaxckpt-tmp-"
DATA_DIRS = {"arrays", "packed"}  # what a checkpoint holds besides its manifest
OLD_MARK = ".jaxckpt-old-"
_log = logging.getLogger("jaxckpt")


def new_token() -> str:
    return uuid.uuid4().hex[:12]


def is_temporary_name(name: str) -> bool:
    return name.startswith(".") and (TMP_MARK in name or OLD_MARK in name)


def staging_location(final: Location, token: str) -> Location:
    """Where the data of a save to ``final`` is written before the commit."""
    if final.local is None:
        return final
    parent, name = os.path.split(final.local)
    return _location.resolve(os.path.join(parent, f".{name}{TMP_MARK}{token}"))


def has_manifest(loc: Location) -> bool:
    return _storage.read_blob(loc, _manifest.MANIFEST) is not None


def prepare(final: Location, token: str, overwrite: bool) -> Location:
    """Check the destination and create the staging location (process 0 only)."""
    children = set(_storage.list_children(final))
    if children:
        # On object stores data is written in place, so our own data dirs without a
        # manifest are an attempt that died before its commit: not a checkpoint, and
        # ours to clear. (Locally a dead attempt stays in its hidden staging directory.)
        dead_attempt = final.local is None and children <= DATA_DIRS
        if not dead_attempt and not has_manifest(final):
            raise CheckpointError(
                f"'{final}' exists and is not a jaxckpt checkpoint (no manifest.json); "
                "refusing to overwrite it"
            )
        if not dead_attempt and not overwrite:
            raise CheckpointError(
                f"Checkpoint '{final}' already exists; pass overwrite=True to replace it"
            )
        if final.local is None:
            # Un-commit first (no manifest = not visible), then clear the data so stale
            # chunks cannot mix with the new ones. Unlike a local overwrite, the old
            # checkpoint is gone before the new one is complete.
            _storage.delete_blob(final, _manifest.MANIFEST)
            _storage.delete_tree(final)
    staging = staging_location(final, token)
    if staging.local is not None:
        os.makedirs(os.path.dirname(staging.local), exist_ok=True)
        os.mkdir(staging.local)
    return staging


def commit(final: Location, staging: Location, manifest_bytes: bytes, token: str) -> None:
    """Write the manifest last, then make the checkpoint visible (process 0 only)."""
    _storage.write_blob(staging, _manifest.MANIFEST, manifest_bytes)
    if final.local is None:
        return
    parent, name = os.path.split(final.local)
    old = None
    if os.path.lexists(final.local):
        old = os.path.join(parent, f".{name}{OLD_MARK}{token}")
        os.rename(final.local, old)
    os.rename(staging.local, final.local)
    _storage.fsync_dir(parent)
    if old is not None:
        _storage.delete_tree(_location.resolve(old))


def abort(final: Location, staging: Location) -> None:
    """Remove what a failed save wrote (best effort; never touches a committed step)."""
    if staging.local is not None and staging.local != final.local:
        _storage.delete_tree(staging)


def read_manifest(loc: Location) -> _manifest.Manifest:
    data = _read_manifest_bytes(loc)
    if data is None:
        raise CheckpointNotFoundError(
            f"No checkpoint at '{loc}': {_manifest.MANIFEST} is missing (not committed, or not a checkpoint)"
        )
    return _manifest.parse(data, str(loc))


def _read_manifest_bytes(loc: Location) -> bytes | None:
    """The manifest's bytes (``None`` when there is none), never more than the cap.

    A local manifest is checked before it is read: a hostile checkpoint could hold a
    huge (or sparse) file, or a FIFO that would block ``open`` forever.
    """
    if loc.local is None:
        return _storage.read_blob(loc, _manifest.MANIFEST)  # parse() checks the size
    path = os.path.join(loc.local, _manifest.MANIFEST)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except (FileNotFoundError, NotADirectoryError):
        return None
    except IsADirectoryError:
        raise CorruptCheckpointError(f"Checkpoint '{loc}': {_manifest.MANIFEST} is not a file") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise CorruptCheckpointError(f"Checkpoint '{loc}': {_manifest.MANIFEST} is not a regular file")
        if st.st_size > _manifest.MAX_MANIFEST_BYTES:
            raise CorruptCheckpointError(
                f"Checkpoint '{loc}': invalid manifest: {st.st_size} bytes is more than the "
                f"{_manifest.MAX_MANIFEST_BYTES} a manifest may have")
        return f.read(_manifest.MAX_MANIFEST_BYTES + 1)  # it may grow after the fstat


# --- step directories (the manager's layout) -----------------------------------------


def step_name(step: int) -> str:
    return str(step)


def parse_step_name(name: str) -> int | None:
    """The step of a directory named like one (``"7"``); ``None`` for anything else."""
    if not name.isdigit() or (len(name) > 1 and name[0] == "0"):
        return None
    return int(name)


def discover_steps(directory: Location) -> dict[int, _manifest.Manifest]:
    """Committed steps under ``directory`` with their manifests (see ``discover``)."""
    return discover(directory)[0]


def discover(directory: Location) -> tuple[dict[int, _manifest.Manifest], dict[int, str]]:
    """Committed steps under ``directory``, and the steps skipped with the reason why.

    A step directory counts only when its manifest exists and validates. One without a
    manifest (an empty ``7/``, a save that never committed) is silently not a step; one
    whose manifest fails in any way is skipped and reported (a warning on the
    ``jaxckpt`` logger), so that one bad step never stops a manager from starting.
    """
    found: dict[int, _manifest.Manifest] = {}
    skipped: dict[int, str] = {}
    for name in _storage.list_children(directory):
        step = _step_of(name)
        if step is None:
            continue
        loc = directory.child(name)
        try:
            data = _read_manifest_bytes(loc)
            if data is None:
                continue
            found[step] = _manifest.parse(data, str(loc))
        except Exception as e:  # noqa: BLE001 - a bad step is skipped, whatever is wrong with it
            skipped[step] = str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
            _log.warning("Skipping step %d at '%s': %s", step, loc, skipped[step])
    return found, skipped


def _step_of(name: str) -> int | None:
    # str.isdigit() accepts '²' and int() refuses it, or a name of 5,000 digits: a
    # hostile directory name must not stop discovery.
    if not name.isascii() or len(name) > 40:
        return None
    return parse_step_name(name)


def stale_attempts(directory: Location) -> list[str]:
    """Names of temporary step attempts left behind by a crashed save or delete."""
    out = []
    for name in _storage.list_children(directory):
        if is_temporary_name(name):
            stem = name[1:].split(TMP_MARK)[0].split(OLD_MARK)[0]
            if parse_step_name(stem) is not None:
                out.append(name)
    return out


def delete_step(directory: Location, step: int, token: str) -> None:
    """Make a committed step invisible first, then delete its data."""
    loc = directory.child(step_name(step))
    if loc.local is not None:
        doomed = os.path.join(directory.local, f".{step_name(step)}{OLD_MARK}{token}")
        try:
            os.rename(loc.local, doomed)
        except FileNotFoundError:
            return
        _storage.fsync_dir(directory.local)
        _storage.delete_tree(_location.resolve(doomed))
        return
    _storage.delete_blob(loc, _manifest.MANIFEST)
    _storage.delete_tree(loc)
