"""Atomic visibility: temporary locations, the manifest-last commit, and discovery of
committed checkpoints.

On a local file system a checkpoint is written under a hidden temporary sibling
(``.<name>.jaxckpt-tmp-<token>``) and renamed into place after its manifest is durable.
On an object store there is no rename: each attempt writes its data under a prefix of
its own inside the checkpoint (``<name>/d/<token>/``), and the manifest, written last
(one atomic PUT), names that prefix and is the commit. The data the replaced manifest
named is deleted only after that PUT, so at every instant the old or the new checkpoint
is restorable, and two attempts never share a chunk (docs/format.md, "Commit"). Each
attempt is claimed before it writes, by a record of who writes it (``_claims``), so
that a writer cleaning a directory never removes the attempt of a live process.

A local overwrite (``<name>`` exists) swaps the two directories in one atomic step
where the file system can (Linux ``renameat2(RENAME_EXCHANGE)``: ext4, xfs, btrfs,
tmpfs); the staging name then holds the replaced copy, which is deleted. Elsewhere
it takes two renames, ``<name>`` to ``.<name>.jaxckpt-old-<token>`` and the staging
directory to ``<name>``, and for an instant in between nothing is at ``<name>``. The
commit point is the second rename: a writer stopped between them (a crash, a kill)
left a save that never committed, and the checkpoint it was replacing, whole, aside.
Both renamed copies carry the same token, and that pair with ``<name>`` missing is
what no other state looks like (a deleted step's hidden copy has no staging sibling):

* readers never write: discovery does not list such a step but reports it as skipped
  (with why; it is not gone), and a restore of it says where the old copy is;
* a writer puts it back before it writes there (``recover``: the old copy renamed
  back to ``<name>``, the uncommitted staging deleted): a manager at its start
  (``_manager.deaddata.remove_dead_step_data``, which it calls under its lease), a save in ``prepare``,
  a failed commit in ``abort``. ``stale_attempts`` never lists such a pair, so a
  cleanup of dead attempts can never delete the only copy of a step.

A deleted local step is renamed aside first (it is unlisted at once), then its
manifest is removed, then its data (``_kvstore.delete_tree``): a half-deleted copy
never has a manifest.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import copy
import ctypes
import dataclasses
import errno
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from . import _claims, _manifest, _owner, _storage, _untrusted
from ._claims import OLD_MARK, TMP_MARK
from ._errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from ._storage import kvstore as _kvstore
from ._storage import location as _location
from ._storage.location import Location

DATA_DIRS = _manifest.DATA_DIRS  # a checkpoint's data when it has no data prefix (formats 1 and 3)
DATA_PREFIX_DIR = _manifest.DATA_PREFIX_DIR  # object stores: <checkpoint>/d/<token>/ per attempt
# A local overwrite swaps the old and the new directory atomically where the file system
# can (False: always two renames; tests set it to reach ``commit:between-renames``).
RENAME_EXCHANGE = True
_log = logging.getLogger("jaxckpt")


def new_token(final: Location | None = None) -> str:
    """A fresh attempt token. On an object store (``final`` given, not local) it starts
    with the attempt's start time in Unix seconds, ``<seconds>-<12 hex>``: its data
    prefix's age, which a later plain save reads to tell a dead attempt from a live one."""
    token = uuid.uuid4().hex[:12]
    if final is not None and final.local is None:
        return f"{int(time.time())}-{token}"
    return token


def is_temporary_name(name: str) -> bool:
    return name.startswith(".") and (TMP_MARK in name or OLD_MARK in name)


def staging_location(final: Location, token: str) -> Location:
    """Where a save to ``final`` stages before the commit: a hidden local sibling that is
    renamed at the commit; on an object store ``final`` itself (no rename there: the data
    goes to ``data_location``)."""
    if final.local is None:
        return final
    parent, name = os.path.split(final.local)
    return _location.resolve(os.path.join(parent, f".{name}{TMP_MARK}{token}"))


def data_key(final: Location, token: str) -> str:
    """The data prefix (relative to the checkpoint) that the manifest of attempt ``token``
    names: ``d/<token>`` on an object store, ``""`` (data at the root) on a local disk."""
    return "" if final.local is not None else f"{DATA_PREFIX_DIR}/{token}"


def data_location(final: Location, token: str) -> Location:
    """Where attempt ``token`` writes its array data (every process computes the same)."""
    key = data_key(final, token)
    return final.child(key) if key else staging_location(final, token)


def has_manifest(loc: Location) -> bool:
    return _kvstore.read_blob(loc, _manifest.MANIFEST) is not None


def manifest_if_any(loc: Location) -> _manifest.Manifest | None:
    """The validated manifest at ``loc``, ``None`` when there is none (one read)."""
    data = _read_manifest_bytes(loc)
    return None if data is None else parse_manifest(data, str(loc))


def prepare(final: Location, token: str, overwrite: bool) -> Location:
    """Check the destination and create the staging location (process 0 only).

    No checkpoint is deleted here: on a local disk the old checkpoint is renamed
    aside at the commit; on an object store its data goes after the new manifest. A
    local checkpoint that an overwrite stopped between its renames left aside is put
    back first (``recover``): it is the one this save replaces, or refuses to. The
    attempts (staging directory and claim) that earlier saves to ``final`` left when they
    were killed go, once their writer is provably gone (``_claims.remove_dead_attempts_at``).
    """
    if final.local is not None and not os.path.lexists(final.local):
        try:
            _recover_local(*os.path.split(final.local))
        except OSError as e:
            raise CheckpointError(f"Putting back the checkpoint an overwrite of '{final}' left aside "
                                  f"failed: {e}") from e
    # the attempts of earlier saves here that were killed before their commit or abort
    _claims.remove_dead_attempts_at(final)
    children = set(_kvstore.list_children(final))
    if children:
        # On an object store, data prefixes (and format-1 data dirs) without a manifest
        # are attempts that died before their commit: not a checkpoint, and no obstacle.
        # (Locally a dead attempt stays in its hidden staging directory.)
        dead_attempt = final.local is None and children <= DATA_DIRS | {DATA_PREFIX_DIR}
        if not dead_attempt and not has_manifest(final):
            raise CheckpointError(
                f"'{final}' exists and is not a jaxckpt checkpoint (no manifest.json); "
                "refusing to overwrite it"
            )
        if not dead_attempt and not overwrite:
            raise CheckpointError(
                f"Checkpoint '{final}' already exists; pass overwrite=True to replace it"
            )
    return make_staging(final, token)


def make_staging(final: Location, token: str) -> Location:
    """Create the staging location of attempt ``token`` at ``final``. Locally it is a
    hidden directory, claimed first by a sibling file that says who writes it
    (``_claims.write_claim``), so that a writer taking the manager directory over never removes
    the attempt of a live process that holds no lease there (a plain ``jaxckpt.save`` of
    a step, a save on another thread). The claim goes once the attempt is committed or
    aborted."""
    staging = staging_location(final, token)
    if staging.local is None:  # an object store: the claim sits beside the attempt's data prefix
        _claims.write_claim(final, token)
        return staging
    try:
        _claims.write_claim(final, token)
        os.makedirs(staging.local, exist_ok=True)
    except OSError as e:  # permission denied, a read-only file system, a full disk
        raise CheckpointError(f"Cannot create the staging directory of '{final}': {e}") from e
    return staging


def commit(final: Location, staging: Location, manifest_bytes: bytes, token: str) -> None:
    """Write the manifest last, then make the checkpoint visible (process 0 only).

    A local failure raises a ``CheckpointError`` with its cause (``No space left on
    device``, ``Permission denied``, ...) and leaves ``final`` as it was."""
    if final.local is None:
        _commit_object_store(final, manifest_bytes, token)
        return
    try:
        _commit_local(final, staging, manifest_bytes, token)
    except OSError as e:
        raise CheckpointError(f"Committing checkpoint '{final}' failed: {e}") from e


def _commit_local(final: Location, staging: Location, manifest_bytes: bytes, token: str) -> None:
    where = str(final)
    _storage.fault("commit:before-manifest", where)
    _kvstore.write_blob(staging, _manifest.MANIFEST, manifest_bytes, fault="manifest:partial")
    _storage.fault("commit:after-manifest", where)
    parent, name = os.path.split(final.local)
    replaced = None  # where the copy this commit replaces is once it is committed
    if not os.path.lexists(final.local):
        os.rename(staging.local, final.local)
    elif _exchange(staging.local, final.local):
        replaced = staging.local
    else:
        replaced = os.path.join(parent, f".{name}{OLD_MARK}{token}")
        os.rename(final.local, replaced)
        try:
            _storage.fault("commit:between-renames", where)
            os.rename(staging.local, final.local)  # the commit
        except BaseException:
            os.rename(replaced, final.local)  # not committed: the old copy goes back
            raise
    _claims.drop_claim(final, token)
    try:  # committed: nothing raises from here on
        _kvstore.fsync_dir(parent)
        _storage.fault("commit:after-rename", where)
        if replaced is not None:
            _kvstore.delete_tree(_location.resolve(replaced))  # its manifest first
    except Exception as e:  # noqa: BLE001 - what is left is a dead attempt, removed by a later writer
        _log.warning("jaxckpt: '%s' is committed, but removing the copy it replaced failed: %s", final, e)


def _exchange(a: str, b: str) -> bool:
    """Swap the paths ``a`` and ``b`` in one atomic step (Linux ``renameat2`` with
    ``RENAME_EXCHANGE``). ``False``, with nothing done, where that is not available
    (``RENAME_EXCHANGE`` off, another OS, no such libc call, a file system without it)."""
    fn = _renameat2() if RENAME_EXCHANGE else None
    if fn is None:
        return False
    if fn(-100, os.fsencode(a), -100, os.fsencode(b), 2) == 0:  # AT_FDCWD, RENAME_EXCHANGE
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False  # this file system (NFS, ...) cannot: two renames
    raise OSError(err, os.strerror(err), a, None, b)


_renameat2_fn: Any = None


def _renameat2() -> Any:
    global _renameat2_fn
    if _renameat2_fn is None:
        _renameat2_fn = False
        if sys.platform.startswith("linux"):
            try:
                fn = ctypes.CDLL(None, use_errno=True).renameat2
            except (OSError, AttributeError):  # not glibc 2.28+
                return None
            fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
            fn.restype = ctypes.c_int
            _renameat2_fn = fn
    return _renameat2_fn or None


def _commit_object_store(final: Location, manifest_bytes: bytes, token: str) -> None:
    """The manifest PUT (atomic: readers see the old manifest or the new one) is the
    commit; the data the replaced manifest named is deleted after it, then dead attempts
    older than ``ATTEMPT_GRACE_S``. Nothing after the PUT raises: the save is committed."""
    ours = data_key(final, token)
    replaced = named_data(final)  # read just before the PUT: what this commit replaces
    where = str(final)
    _storage.fault("commit:before-manifest", where)
    _kvstore.write_blob(final, _manifest.MANIFEST, manifest_bytes)
    _claims.drop_claim(final, token)
    try:
        _storage.fault("commit:after-manifest", where)
        if replaced is not None and replaced != ours:
            _delete_data(final, replaced)
        _storage.fault("commit:after-old-delete", where)
        _claims.remove_dead_data(final, ours, _claims.ATTEMPT_GRACE_S)
    except Exception as e:  # noqa: BLE001 - committed; what is left is removed by a later writer
        _log.warning("jaxckpt: '%s' is committed, but removing the data it replaced failed: %s", final, e)


def named_data(loc: Location) -> str | None:
    """The data prefix the manifest at ``loc`` names (``""``: data at the root, format 1),
    or ``None`` when there is no manifest or it does not validate."""
    try:
        data = _read_manifest_bytes(loc)  # a storage error raises
        return None if data is None else _manifest.parse(data, str(loc)).data
    except CorruptCheckpointError:  # too big is as invalid in the read as in parse()
        return None


def _delete_data(loc: Location, key: str) -> None:
    if key:
        _kvstore.delete_tree(loc.child(key))
        return
    for name in sorted(DATA_DIRS):
        _kvstore.delete_tree(loc.child(name))


def abort(final: Location, staging: Location, token: str | None = None) -> None:
    """Remove what a failed save wrote (best effort; never touches a committed step).

    On an object store that is attempt ``token``'s data prefix, unless the manifest
    names it (a PUT that reported an error may still have landed). Locally, a commit
    that failed between its renames without putting the old copy back gets it back
    here first; if that fails too the staging directory stays, for ``recover``."""
    with _kvstore.cleaning_up():  # a store that failed: all of it within one bound (kvstore)
        _abort(final, staging, token)


def _abort(final: Location, staging: Location, token: str | None) -> None:
    if staging.local is not None and staging.local != final.local:
        try:
            _recover_local(*os.path.split(final.local))
            _kvstore.delete_tree(staging)
        except Exception as e:  # noqa: BLE001 - best effort: the save's own error is what matters
            _log.warning("jaxckpt: cleaning up after a failed save to '%s' failed: %s", final, e)
        else:
            hidden = _claims.split_hidden(os.path.basename(staging.local))
            _claims.drop_claim(final, hidden[2] if hidden is not None else token)
        return
    if final.local is None and token is not None:
        key = data_key(final, token)
        try:
            if named_data(final) != key:
                _kvstore.delete_tree(final.child(key))
                _claims.drop_claim(final, token)
        except Exception as e:  # noqa: BLE001 - best effort: the save's own error is what matters
            _log.warning("jaxckpt: removing the data of a failed save to '%s' failed: %s", final, e)


# The last few manifests parsed, by their exact bytes: a manager's start reads the newest
# step's manifest and the restore that follows reads the same bytes again (a 1,000-leaf
# manifest takes ~17 ms to validate). Bounded in entries and in bytes.
_PARSED: collections.OrderedDict[tuple[bytes, str], _manifest.Manifest] = collections.OrderedDict()
_PARSED_LOCK = threading.Lock()
PARSED_ENTRIES, PARSED_BYTES = 4, 16 << 20


def parse_manifest(data: bytes, where: str) -> _manifest.Manifest:
    """``_manifest.parse``, the same bytes parsed again given from a small cache (an
    equal manifest, its ``metadata`` and ``info`` copies of their own: callers may
    change those)."""
    key = (bytes(data), where)
    with _PARSED_LOCK:
        hit = _PARSED.get(key)
        if hit is not None:
            _PARSED.move_to_end(key)
    if hit is not None:
        return dataclasses.replace(hit, metadata=copy.deepcopy(hit.metadata), info=copy.deepcopy(hit.info))
    man = _manifest.parse(key[0], where)
    with _PARSED_LOCK:
        _PARSED[key] = dataclasses.replace(man, metadata=copy.deepcopy(man.metadata), info=copy.deepcopy(man.info))
        while len(_PARSED) > PARSED_ENTRIES or sum(len(k[0]) for k in _PARSED) > PARSED_BYTES:
            _PARSED.popitem(last=False)
    return man


# A manifest the caller has just read or holds for certain (a manager's restore: the
# reader's check after its mark, a writer's own step on an object store), handed to the
# restore on the same thread so it does not read the same bytes again (a round trip on
# an object store). Only ``read_manifest`` of that very location takes it.
_KNOWN: contextvars.ContextVar[tuple[str, _manifest.Manifest] | None] = contextvars.ContextVar(
    "jaxckpt_known_manifest", default=None)


@contextlib.contextmanager
def known_manifest(loc: Location, man: _manifest.Manifest) -> Iterator[None]:
    """Within the block, ``read_manifest(loc)`` on this thread gives ``man`` (a copy)
    instead of reading it."""
    token = _KNOWN.set((str(loc), man))
    try:
        yield
    finally:
        _KNOWN.reset(token)


def read_manifest(loc: Location) -> _manifest.Manifest:
    known = _KNOWN.get()
    if known is not None and known[0] == str(loc):
        man = known[1]
        return dataclasses.replace(man, metadata=copy.deepcopy(man.metadata), info=copy.deepcopy(man.info))
    data = _read_manifest_bytes(loc)
    if data is None:
        raise CheckpointNotFoundError(
            f"No checkpoint at '{loc}': {_manifest.MANIFEST} is missing (not committed, or not a checkpoint)"
            + (_interrupted_hint(loc) or _manager_hint(loc)))
    return parse_manifest(data, str(loc))


def _manager_hint(loc: Location) -> str:
    """When ``loc`` is a ``CheckpointManager``'s directory (committed step directories, or
    a writer's lease): its committed steps and how to open one. A run's directory is what
    a user passes first where a step is expected (``restore``, ``open``, ``jaxckpt show``)."""
    try:
        names = _kvstore.list_children(loc)
        steps = sorted(s for s in map(step_of, names) if s is not None)
        committed = _committed_steps(loc, steps)
    except (OSError, CheckpointError):  # only a hint: the not-found error is the answer
        return ""
    if committed:
        latest = loc.child(step_name(committed[-1]))
        unchecked = loc.local is None and len(steps) > HINT_CHECKS
        return (f"; '{loc}' is a CheckpointManager directory, not a checkpoint: its committed steps are "
                f"{_list_steps(committed, len(steps) if unchecked else None)}. Open one by its step "
                f"directory, e.g. jaxckpt.restore('{latest}') (or `jaxckpt show {latest}`), or the "
                f"latest with jaxckpt.CheckpointManager('{loc}').restore()")
    if _owner.LEASE_FILE in names:
        return (f"; '{loc}' is a CheckpointManager directory with no committed step yet (a writer "
                "holds or held its lease)")
    return ""


# Object stores: a manifest looked for is a request, so a hint checks at most this many
# step directories (the oldest and the newest halves); local disks check every one.
HINT_CHECKS = 64
HINT_SHOWN = 3  # steps named at each end of a long list


def _committed_steps(loc: Location, steps: list[int]) -> list[int]:
    """Those of ``steps`` (sorted) whose directory holds a manifest. An uncommitted save's
    directory exists before its manifest does, so a step name alone is not a step."""
    if loc.local is not None:
        return [s for s in steps if os.path.isfile(os.path.join(loc.local, step_name(s), _manifest.MANIFEST))]
    if len(steps) > HINT_CHECKS:
        steps = steps[: HINT_CHECKS // 2] + steps[-HINT_CHECKS // 2:]
    return [s for s in steps if has_manifest(loc.child(step_name(s)))]


def _list_steps(steps: list[int], of_directories: int | None = None) -> str:
    """``10, 20, 30`` or, when long, the first and last few: ``10, 20, 30, …, 980, 990,
    1000 (100 steps)``; ``of_directories``: the count of step directories, when not all
    were checked (an object store with many)."""
    if len(steps) <= 2 * HINT_SHOWN + 1:
        return ", ".join(map(str, steps))
    ends = [*map(str, steps[:HINT_SHOWN]), "…", *map(str, steps[-HINT_SHOWN:])]
    count = f"{len(steps)} steps" if of_directories is None else f"{of_directories} step directories"
    return f"{', '.join(ends)} ({count})"


def _interrupted_hint(loc: Location) -> str:
    """Where the checkpoint an overwrite of ``loc`` stopped between its renames is."""
    if loc.local is None or os.path.lexists(loc.local):
        return ""
    parent, name = os.path.split(loc.local)
    try:
        pair = interrupted_overwrites(os.listdir(parent)).get(name)
    except OSError:  # no parent, not a directory, not readable: nothing to say
        return ""
    if pair is None:
        return ""
    return (f"; an overwrite of it stopped between its two renames: the checkpoint it replaced is "
            f"whole at '{os.path.join(parent, pair[0])}' (the next save to '{loc}', or a "
            f"CheckpointManager starting in '{parent}', puts it back)")


def _read_manifest_bytes(loc: Location) -> bytes | None:
    """The manifest's bytes (``None`` when there is none), never more than the cap,
    read as ``_untrusted.read_small`` reads any small untrusted file."""
    return _untrusted.read_small(loc, _manifest.MANIFEST, _manifest.MAX_MANIFEST_BYTES,
                                 lambda why, detail: _manifest_refused(loc, why, detail), _kvstore.read_blob)


def _manifest_refused(loc: Location, why: str, detail: Any) -> BaseException | None:
    if why in (_untrusted.ABSENT, _untrusted.CANNOT_OPEN):
        return None  # no manifest; or permission denied...: the OSError itself
    if why == _untrusted.TOO_BIG:  # the words parse() uses for the same bytes
        return CorruptCheckpointError(f"Checkpoint '{loc}': invalid manifest: {detail} bytes is more than the "
                                      f"{_manifest.MAX_MANIFEST_BYTES} a manifest may have")
    return CorruptCheckpointError(f"Checkpoint '{loc}': {_manifest.MANIFEST} is {why}")


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
    ``jaxckpt`` logger), so that one bad step never stops a manager from starting. So is
    a step an overwrite left between its two renames (see the module docstring).
    """
    found: dict[int, _manifest.Manifest] = {}
    steps, skipped = listed_steps(directory)
    for step in steps:
        man = load_step(directory, step, skipped)
        if man is not None:
            found[step] = man
    return found, skipped


def listed_steps(directory: Location) -> tuple[list[int], dict[int, str]]:
    """The steps ``directory``'s one listing names (their manifests not read), and those
    an overwrite left between its two renames (skipped, with why; see ``discover``)."""
    skipped: dict[int, str] = {}
    names = _kvstore.list_children(directory)
    for name, (old, _) in interrupted_overwrites(names).items():
        step = step_of(name)
        if step is not None:  # not gone: a writer puts it back (``recover``)
            skipped[step] = (f"an overwrite of it is between its two renames, or stopped there; the "
                             f"committed copy it replaces is whole at '{old}' (a writer's start puts it back)")
            _log.warning("Skipping step %d in '%s': %s", step, directory, skipped[step])
    return sorted({s for s in map(step_of, names) if s is not None}), skipped


def load_step(directory: Location, step: int, skipped: dict[int, str] | None = None) -> _manifest.Manifest | None:
    """The validated manifest of ``step`` in manager ``directory``; ``None`` when it has
    none (not committed) or it fails (then skipped: the reason in ``skipped`` and a
    warning on the ``jaxckpt`` logger).

    A store that fails to answer (the ``CheckpointError`` of ``_storage.kvstore``: no
    answer in the I/O bound, no connection, a missing bucket) is not a bad step: it
    raises, and nothing is skipped. Skipping it would list an older step as the latest
    (a restore of older values without an error), leave the step out of retention (never
    deleted), and differ between processes that read it at different moments."""
    loc = directory.child(step_name(step))
    try:
        data = _read_manifest_bytes(loc)
        if data is None:
            return None
        man = parse_manifest(data, str(loc))
        _manifest.check_step(man, step, str(loc))  # not a manifest copied from another step
        return man
    except Exception as e:  # noqa: BLE001 - a bad step is skipped, whatever is wrong with it
        if isinstance(e, CheckpointError) and not isinstance(e, CorruptCheckpointError):
            raise  # the store failed, not the step
        why = str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
        if skipped is not None:
            skipped[step] = why
        _log.warning("Skipping step %d at '%s': %s", step, loc, why)
        return None


def step_of(name: str) -> int | None:
    """The step of a directory entry named like one, or ``None``: ``parse_step_name``
    made safe for any name a listing returns."""
    # str.isdigit() accepts '²' and int() refuses it, or a name of 5,000 digits: a
    # hostile directory name must not stop discovery.
    if not name.isascii() or len(name) > 40:
        return None
    return parse_step_name(name)


def stale_attempts(directory: Location) -> list[str]:
    """Names of temporary step attempts left behind by a crashed save or delete.

    Never the two copies of an overwrite stopped between its renames (``<step>``
    missing): the old one is the step, which ``recover`` puts back."""
    out = []
    names = _kvstore.list_children(directory)
    pairs = {n for pair in interrupted_overwrites(names).values() for n in pair}
    for name in names:
        if is_temporary_name(name) and name not in pairs:
            stem = name[1:].split(TMP_MARK)[0].split(OLD_MARK)[0]
            if parse_step_name(stem) is not None:
                out.append(name)
    return out


def interrupted_overwrites(names: Iterable[str]) -> dict[str, tuple[str, str]]:
    """The local overwrites stopped between their two renames, from the listing of one
    directory: ``{<name>: (old, staging)}`` for each ``<name>`` that is missing while
    ``.<name>.jaxckpt-old-<t>`` (the committed copy it replaces, whole: it is deleted
    only after the second rename) and ``.<name>.jaxckpt-tmp-<t>`` (the new one, never
    committed; the same token: the same commit) are both there."""
    names = set(names)
    out: dict[str, tuple[str, str]] = {}
    for name in sorted(names):
        parts = _claims.split_hidden(name)
        if parts is None or parts[1] != OLD_MARK:
            continue
        target, _, token = parts
        staging = f".{target}{TMP_MARK}{token}"
        if target not in names and staging in names:
            out[target] = (name, staging)
    return out


def recover(directory: Location, name: str | None = None) -> list[str]:
    """Put back, in local ``directory``, each checkpoint (only ``name``, if given) that an
    overwrite stopped between its two renames left aside, and delete that overwrite's
    uncommitted staging directory. A writer's step (a manager holding the lease, a save
    about to write there), never a reader's: a live overwrite is between its renames for
    an instant too. Returns the names put back (``[]`` on an object store)."""
    if directory.local is None:
        return []
    return _recover_local(directory.local, name)


def _recover_local(parent: str, name: str | None) -> list[str]:
    try:
        names = os.listdir(parent)
    except OSError:  # no parent, not a directory, not readable: nothing left aside to see
        return []
    found = interrupted_overwrites(names)
    done = []
    for target, (old, staging) in sorted(found.items()):
        if name is not None and target != name:
            continue
        os.rename(os.path.join(parent, old), os.path.join(parent, target))
        _kvstore.fsync_dir(parent)
        _log.warning("jaxckpt: an overwrite of '%s' stopped between its renames; the checkpoint it "
                     "replaced is back in place", os.path.join(parent, target))
        _claims.remove_attempt(_location.resolve(parent), staging)
        done.append(target)
    return done


def delete_step(directory: Location, step: int, token: str, *,
                held: Callable[[], bool] | None = None) -> bool:
    """Make a committed step invisible first, then delete its data (locally: renamed
    aside, then ``_kvstore.delete_tree``: its manifest, then the rest; no staging
    sibling shares its token, so it is never taken for an interrupted overwrite's old
    copy). ``held`` is asked once the step is invisible (no new reader can find it):
    ``True`` puts the step back as it was and returns ``False``. ``True``: it is gone."""
    loc = directory.child(step_name(step))
    if loc.local is not None:
        doomed = os.path.join(directory.local, f".{step_name(step)}{OLD_MARK}{token}")
        try:
            os.rename(loc.local, doomed)
        except FileNotFoundError:
            return True
        if held is not None and held():
            os.rename(doomed, loc.local)
            return False
        _kvstore.fsync_dir(directory.local)
        _storage.fault("delete:after-rename", str(loc))
        _kvstore.delete_tree(_location.resolve(doomed))  # its manifest first
        return True
    # No rename on an object store: the manifest goes first (the step is unlisted at
    # once; a crash here leaves data that is no checkpoint), then everything under it.
    manifest = _kvstore.read_blob(loc, _manifest.MANIFEST) if held is not None else None
    _kvstore.delete_blob(loc, _manifest.MANIFEST)
    _storage.fault("delete:after-manifest", str(loc))
    if manifest is not None and held():
        _kvstore.write_blob(loc, _manifest.MANIFEST, manifest)
        return False
    _kvstore.delete_tree(loc)
    return True
