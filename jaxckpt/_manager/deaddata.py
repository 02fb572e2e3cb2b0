"""The data no manifest names under a manager's steps on an object store (attempts that
died before their commit, replaced data never deleted, multipart uploads never
completed), found and removed by a writer holding the directory's lease.
"""

from __future__ import annotations

from .. import _claims, _commit, _manifest, _tasks
from .._storage import kvstore as _kvstore
from .._storage import s3 as _s3
from .._storage.location import Location

CLEAN_THREADS = 8  # steps looked at at once by a manager cleaning dead data at its start


def remove_dead_step_data(directory: Location, *, dry_run: bool = False, lease_token: str | None = None,
                          live: list[str] | None = None) -> list[str]:
    """Remove, under every step of manager ``directory`` on an object store, the data no
    manifest names: attempts that died before their commit, or whose replaced data was
    never deleted, with their S3 multipart uploads never completed (listed once for the
    directory). Only for a writer holding the directory's lease (every earlier writer
    is gone). A step whose manifest does not validate is left alone. Steps are looked at
    on a few threads (one or two listings each). Returns the keys removed, relative to
    ``directory`` (``dry_run``: the keys it would remove, removing nothing).

    On a local disk dead attempts live in hidden siblings (``stale_attempts``); what
    this does there is ``recover`` (unless ``dry_run``): a step an overwrite left between
    its renames is put back. Returns ``[]``."""
    if directory.local is not None:
        if not dry_run:
            _commit.recover(directory)
        return []
    removed: list[str] = []
    # S3: the multipart uploads never completed under the directory, by step (one listing)
    uploads: dict[str, list[tuple[str, str]]] = {}
    for key, upload_id in (_s3.multipart_uploads(directory) if directory.kvstore.get("driver") == "s3" else None) or ():
        step, _, rest = key.partition("/")
        if _commit.step_of(step) is not None:
            uploads.setdefault(step, []).append((rest, upload_id))
    shapes = _step_shapes(directory)
    names = sorted(set(shapes) | set(uploads))
    names = [n for n in names if n in uploads or not _clean(*shapes[n])]
    _tasks.run_tasks([lambda n=n: removed.extend(_remove_dead_in_step(directory, n, dry_run, lease_token, live,
                                                                      uploads.get(n, [])))
                      for n in names], CLEAN_THREADS)
    return sorted(removed)


def _step_shapes(directory: Location) -> dict[str, tuple[set[str], set[str]]]:
    """For each step of manager ``directory`` (an object store), from one walk of its
    keys (1,000 a request, not two listings a step): the names directly below it and
    those below its ``d/``. Only steps whose shape is not that of a clean committed
    step (``_clean``) are looked at again, listed afresh, by ``_remove_dead_in_step``."""
    shapes: dict[str, tuple[set[str], set[str]]] = {}

    def visit(key: str) -> None:
        parts = key.split("/", 3)
        if len(parts) < 2 or _commit.step_of(parts[0]) is None:
            return
        children, data = shapes.setdefault(parts[0], (set(), set()))
        children.add(parts[1])
        if parts[1] == _manifest.DATA_PREFIX_DIR and len(parts) > 2:
            data.add(parts[2])

    _kvstore.walk(directory, visit)
    return shapes


def _clean(children: set[str], data: set[str]) -> bool:
    """A step holding its manifest and one data location only (or nothing at all), as
    ``_remove_dead_in_step`` leaves alone without reading its manifest."""
    candidates = (1 if children & _manifest.DATA_DIRS else 0) + (len(data) if _manifest.DATA_PREFIX_DIR in children else 0)
    return not candidates or (candidates == 1 and _manifest.MANIFEST in children)


def _remove_dead_in_step(directory: Location, name: str, dry_run: bool = False,
                         lease_token: str | None = None, live: list[str] | None = None,
                         uploads: list[tuple[str, str]] | None = None) -> list[str]:
    loc = directory.child(name)
    children = set(_kvstore.list_children(loc))
    candidates = 1 if children & _manifest.DATA_DIRS else 0
    if _manifest.DATA_PREFIX_DIR in children:
        candidates += len(_kvstore.list_children(loc.child(_manifest.DATA_PREFIX_DIR)))
    if not uploads and (not candidates or (candidates == 1 and _manifest.MANIFEST in children)):
        return []  # nothing, or only the data its manifest names
    keep = _commit.named_data(loc)
    if keep is None and _manifest.MANIFEST in children:
        return []  # a manifest that does not validate: not ours to judge
    kept: list[str] = []
    dead = _claims.remove_dead_data(loc, keep, None, dry_run=dry_run, lease_token=lease_token, live=kept,
                                    uploads=uploads or [])
    if live is not None:
        live.extend(f"{name}/{key}" for key in kept)
    return [f"{name}/{key}" for key in dead]
