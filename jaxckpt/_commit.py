"""Atomic visibility: temporary locations, the manifest-last commit, and discovery of
committed checkpoints.

On a local file system a checkpoint is written under a hidden temporary sibling
(``.<name>.jaxckpt-tmp-<token>``) and renamed into place after its manifest is durable.
On an object store there is no rename: data goes straight under the final prefix and
the manifest, written last, is the commit marker.
"""

from __future__ import annotations

import os
import uuid

from . import _manifest, _storage
from ._errors import CheckpointError, CheckpointNotFoundError
from ._storage import Location

TMP_MARK = ".jaxckpt-tmp-"
OLD_MARK = ".jaxckpt-old-"


def new_token() -> str:
    return uuid.uuid4().hex[:12]


def is_temporary_name(name: str) -> bool:
    return name.startswith(".") and (TMP_MARK in name or OLD_MARK in name)


def staging_location(final: Location, token: str) -> Location:
    """Where the data of a save to ``final`` is written before the commit."""
    if final.local is None:
        return final
    parent, name = os.path.split(final.local)
    return _storage.resolve(os.path.join(parent, f".{name}{TMP_MARK}{token}"))


def has_manifest(loc: Location) -> bool:
    return _storage.read_blob(loc, _manifest.MANIFEST) is not None


def exists_nonempty(loc: Location) -> bool:
    return bool(_storage.list_children(loc))


def prepare(final: Location, token: str, overwrite: bool) -> Location:
    """Check the destination and create the staging location (process 0 only)."""
    if exists_nonempty(final):
        if not overwrite:
            raise CheckpointError(
                f"Checkpoint '{final}' already exists; pass overwrite=True to replace it"
            )
        if not has_manifest(final):
            raise CheckpointError(
                f"'{final}' exists and is not a jaxckpt checkpoint (no manifest.json); "
                "refusing to overwrite it"
            )
    staging = staging_location(final, token)
    if staging.local is not None:
        parent = os.path.dirname(staging.local)
        os.makedirs(parent, exist_ok=True)
        os.mkdir(staging.local)
    elif exists_nonempty(final):
        # Object store: un-commit the old checkpoint first (manifest gone = not visible),
        # then clear its data so stale chunks cannot mix with the new ones.
        _storage.delete_blob(final, _manifest.MANIFEST)
        _storage.delete_tree(final)
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
        _storage.delete_tree(_storage.resolve(old))


def abort(final: Location, staging: Location) -> None:
    """Remove what a failed save wrote (best effort; never touches a committed step)."""
    if staging.local is not None and staging.local != final.local:
        _storage.delete_tree(staging)


def read_manifest(loc: Location) -> _manifest.Manifest:
    data = _storage.read_blob(loc, _manifest.MANIFEST)
    if data is None:
        raise CheckpointNotFoundError(
            f"No checkpoint at '{loc}': {_manifest.MANIFEST} is missing (not committed, or not a checkpoint)"
        )
    return _manifest.parse(data, str(loc))
