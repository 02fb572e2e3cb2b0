"""A save's attempts: their hidden names, and the claims that say who writes each.

A local save stages under ``.<name>.jaxckpt-tmp-<token>`` beside its checkpoint (an
overwrite also renames the copy it replaces to ``.<name>.jaxckpt-old-<token>``; see
``_commit``). Before the staging directory exists, a claim beside it,
``.<name>.jaxckpt-claim-<token>.json``, says who writes it: this process (host, pid,
``_owner.identity``), when it started, and the writer lease it holds on the manager
directory above, if any. On an object store the claim is ``d/<token>.claim`` beside the
attempt's data prefix. The claim goes once the attempt is committed or aborted.

A writer cleaning a directory (a manager taking it over, a commit on an object store)
removes an attempt only when its writer is provably gone (``claim_alive``): an attempt
made under a lease lives while that lease is the one held; one made without (a plain
``jaxckpt.save``, a save on another thread) while its process does, judged like a lease
(``_owner.judge``). So a take-over never removes the attempt of a live process that
holds no lease there.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import time
from typing import Any

from . import _manifest, _owner, _untrusted
from ._storage import kvstore as _kvstore
from ._storage import location as _location
from ._storage import s3 as _s3
from ._storage.location import Location

TMP_MARK = ".jaxckpt-tmp-"  # an attempt's staging directory: .<name>.jaxckpt-tmp-<token>
OLD_MARK = ".jaxckpt-old-"  # a copy renamed aside: being replaced, or being deleted
CLAIM_MARK = ".jaxckpt-claim-"  # beside a local attempt: who writes it (see write_claim)
CLAIM_SUFFIX = ".claim"  # object stores: d/<token>.claim beside the attempt's data prefix
# A persistent copy's temporary file in a manager directory (``_manager/tiers``: the first
# bytes of a data object, uploaded from there): .jaxckpt-upload-<host>-<pid>-<start ticks>-<random>
SCRATCH_MARK = ".jaxckpt-upload-"
DATA_PREFIX_DIR = _manifest.DATA_PREFIX_DIR  # object stores: <checkpoint>/d/<token>/ per attempt
# A plain save (no writer lease) removes another attempt's data prefix only when that
# attempt started longer ago than this (by the time in its name): it may still be writing.
ATTEMPT_GRACE_S = 24 * 3600.0
_TIMED_TOKEN = re.compile(r"^([0-9]{1,12})-[0-9a-f]{12}$")
_log = logging.getLogger("jaxckpt")


def write_claim(final: Location, token: str) -> None:
    """Claim attempt ``token`` at ``final`` before it writes anything: locally a hidden
    sibling file (``claim_name``; the directory holding ``final`` is made first), on an
    object store ``d/<token>.claim`` beside the attempt's data prefix."""
    if final.local is None:
        _kvstore.write_blob(final, f"{DATA_PREFIX_DIR}/{token}{CLAIM_SUFFIX}", json.dumps(_claim(final)).encode())
        return
    parent, name = os.path.split(final.local)
    os.makedirs(parent, exist_ok=True)
    with open(os.path.join(parent, claim_name(name, token)), "w") as f:
        json.dump(_claim(final), f)


def _claim(final: Location) -> dict[str, Any]:
    """Who writes an attempt at ``final``: this process, and the lease it holds on the
    manager directory above ``final``, if any."""
    return {"host": socket.gethostname(), "pid": os.getpid(), **_owner.identity(os.getpid()),
            "started": time.time(), "lease": _owner.held_token_above(final)}


def claim_alive(owner: dict[str, Any], lease_token: str | None) -> bool:
    """Whether the writer of a claimed attempt may still be writing it, judged by a
    writer holding the directory's lease ``lease_token``: an attempt made under a lease
    lives while that lease is the one held; one made without (a plain save) while its
    process does (on another host, where that cannot be told: ``ATTEMPT_GRACE_S``). An
    unreadable claim is being written: alive."""
    if not owner:
        return True
    if owner.get("lease") is not None:
        return owner.get("lease") == lease_token
    verdict = _owner.judge(owner, float("inf"))
    started = owner.get("started")
    if verdict == "unknown" and isinstance(started, (int, float)) and time.time() - started > ATTEMPT_GRACE_S:
        return False
    return verdict != "gone"


def claim_name(name: str, token: str) -> str:
    """The file beside a local attempt ``.<name><TMP_MARK><token>`` that says who writes it."""
    return f".{name}{CLAIM_MARK}{token}.json"


def drop_claim(final: Location, token: str | None) -> None:
    if token is None:
        return
    if final.local is None:
        try:
            _kvstore.delete_blob(final, f"{DATA_PREFIX_DIR}/{token}{CLAIM_SUFFIX}")
        except Exception as e:  # noqa: BLE001 - a claim left behind is removed by a later writer
            _log.info("jaxckpt: removing the claim of attempt %s at '%s' failed: %s", token, final, e)
        return
    parent, name = os.path.split(final.local)
    try:
        os.remove(os.path.join(parent, claim_name(name, token)))
    except OSError:
        pass  # never made, or gone: a claim whose attempt is gone is removed by a later writer


def attempt_owner(directory: Location, name: str) -> dict[str, Any] | None:
    """Who writes local attempt ``name`` (its claim), or ``None`` when it does not say (a
    step being deleted, an attempt of an older version). An unreadable claim (being
    written) is ``{}``."""
    hidden = split_hidden(name)
    if directory.local is None or hidden is None or hidden[1] != TMP_MARK:
        return None
    try:
        with open(os.path.join(directory.local, claim_name(hidden[0], hidden[2])), "rb") as f:
            return _untrusted.load_record(f.read())
    except OSError:
        return None


def remove_attempt(directory: Location, name: str) -> None:
    """Remove a dead local attempt (or a step being deleted) and its claim."""
    _kvstore.delete_tree(directory.child(name))
    hidden = split_hidden(name)
    if directory.local is not None and hidden is not None and hidden[1] == TMP_MARK:
        try:
            os.remove(os.path.join(directory.local, claim_name(hidden[0], hidden[2])))
        except OSError:
            pass  # an older version's attempt: no claim


def remove_dead_claims(directory: Location) -> list[str]:
    """Claims left without their attempt (a crash between a commit and the claim's
    removal) whose writer is gone. Returns the names removed."""
    if directory.local is None:
        return []
    names = set(_kvstore.list_children(directory))
    removed = []
    for name in sorted(names):
        if CLAIM_MARK not in name or not name.startswith(".") or not name.endswith(".json"):
            continue
        target, _, token = name[1:-len(".json")].partition(CLAIM_MARK)
        if f".{target}{TMP_MARK}{token}" in names:
            continue
        owner = attempt_owner(directory, f".{target}{TMP_MARK}{token}")
        if owner is not None and owner and _owner.judge(owner, float("inf")) != "gone":
            continue  # its attempt is about to be created
        try:
            os.remove(os.path.join(directory.local, name))
            removed.append(name)
        except OSError:
            pass
    return removed


def scratch_prefix() -> str:
    """The name prefix of a temporary file this process makes in a manager directory
    (``SCRATCH_MARK``): who made it, so that a writer taking the directory over can tell
    one a killed process left from one in use (``dead_scratch``)."""
    ticks = _owner.identity(os.getpid()).get("start_ticks", 0)
    return f"{SCRATCH_MARK}{_owner.host()}-{os.getpid()}-{ticks}-"


def scratch_maker(name: str) -> dict[str, Any] | None:
    """Who made the temporary file ``name`` (``scratch_prefix``): ``host``, ``pid`` and
    ``start_ticks``; ``None`` when the name does not say (an older version's)."""
    parts = name[len(SCRATCH_MARK):].rsplit("-", 3)
    if not name.startswith(SCRATCH_MARK) or len(parts) != 4 or not parts[1].isdigit() or not parts[2].isdigit():
        return None
    maker: dict[str, Any] = {"host": parts[0], "pid": int(parts[1])}
    if int(parts[2]):
        maker["start_ticks"] = int(parts[2])
    return maker


def dead_scratch(directory: Location) -> list[tuple[str, bool]]:
    """The temporary files of persistent copies in local ``directory`` (``SCRATCH_MARK``),
    each with whether its maker is provably gone: on this host its pid no longer runs that
    process (``_owner.judge``); on another host, or when its name does not say who made
    it (an older version's), once it was last written longer ago than ``ATTEMPT_GRACE_S``."""
    if directory.local is None:
        return []
    out = []
    for name in sorted(_kvstore.list_children(directory)):
        if not name.startswith(SCRATCH_MARK):
            continue
        maker = scratch_maker(name)
        verdict = _owner.judge(maker, float("inf")) if maker is not None else "unknown"
        if verdict == "unknown":
            try:
                age = time.time() - os.lstat(os.path.join(directory.local, name)).st_mtime
            except OSError:
                continue  # gone meanwhile
            verdict = "gone" if age > ATTEMPT_GRACE_S else "alive"
        out.append((name, verdict == "gone"))
    return out


def remove_dead_scratch(directory: Location) -> list[str]:
    """Remove the temporary files of persistent copies in ``directory`` whose maker is
    provably gone (``dead_scratch``); returns their names."""
    removed = []
    for name, dead in dead_scratch(directory):
        if dead:
            try:
                os.remove(os.path.join(directory.local, name))
                removed.append(name)
            except OSError:
                pass  # gone meanwhile, or not ours to remove: the next take-over tries again
    return removed


def remove_dead_attempts_at(final: Location, names: list[str] | None = None) -> list[str]:
    """Local: remove the attempts at ``final`` (``.<name>.jaxckpt-tmp-<token>`` and its
    claim, or a claim left alone) that a save killed before its commit or abort left,
    when their writer is provably gone: a plain save's (no lease) whose process is gone
    (``claim_alive``), or, when this process holds the lease above ``final``, one made
    under another lease of that directory. An attempt without a claim (an older
    version's) or made under a lease while this process holds none is left to a writer
    taking the directory over (a manager's start, ``jaxckpt gc``), which can tell.
    ``names``: the listing of ``final``'s directory, if already made. Returns the names
    removed; a removal that fails is logged (the save goes on)."""
    if final.local is None:
        return []
    parent, target = os.path.split(final.local)
    if names is None:
        try:
            names = os.listdir(parent)
        except OSError:
            return []
    lease = _owner.held_token_above(final)
    tmp_prefix, claim_prefix = f".{target}{TMP_MARK}", f".{target}{CLAIM_MARK}"
    tokens = {n[len(tmp_prefix):] for n in names if n.startswith(tmp_prefix)}
    tokens |= {n[len(claim_prefix):-len(".json")] for n in names if n.startswith(claim_prefix) and n.endswith(".json")}
    removed = []
    for token in sorted(t for t in tokens if t):
        try:
            with open(os.path.join(parent, claim_name(target, token)), "rb") as f:
                owner = _untrusted.load_record(f.read())
        except OSError:
            continue  # no claim: an older version's attempt, or a step being deleted
        if owner is None:
            owner = {}  # unreadable: being written (alive)
        if owner.get("lease") is not None and lease is None:
            continue  # a writer's: a plain save cannot tell whether its lease is still held
        if claim_alive(owner, lease):
            continue
        staging = f"{tmp_prefix}{token}"
        try:
            if staging in names:
                _kvstore.delete_tree(_location.resolve(os.path.join(parent, staging)))
                removed.append(staging)
            os.remove(os.path.join(parent, claim_name(target, token)))
            removed.append(claim_name(target, token))
        except OSError as e:
            _log.warning("jaxckpt: removing attempt %s of '%s' left by a save that is gone failed: %s",
                         token, final, e)
    if removed:
        _log.info("jaxckpt: removed %s, left at '%s' by a save that is gone", ", ".join(removed), final)
    return removed


def attempt_alive(directory: Location, name: str, lease_token: str | None) -> bool:
    """Whether attempt ``name`` may still be written by a live process, judged by a writer
    that holds the directory's lease ``lease_token``: an attempt made under another lease
    of this directory is dead (that lease's holder is gone: we hold it now); one made
    without a lease (a plain save) lives while its process does (on another host: while
    that cannot be told); one without a claim (an older version's, a step being deleted)
    is dead."""
    owner = attempt_owner(directory, name)
    return owner is not None and claim_alive(owner, lease_token)


def split_hidden(name: str) -> tuple[str, str, str] | None:
    """``.<target><mark><token>`` -> ``(target, mark, token)``; ``None`` for other names."""
    if name.startswith("."):
        for mark in (TMP_MARK, OLD_MARK):
            target, found, token = name[1:].rpartition(mark)
            if found and target and token:
                return target, mark, token
    return None


def _attempt_age(name: str, now: float) -> float | None:
    """Seconds since attempt ``name`` (a timed token) started; ``None`` when unknown."""
    m = _TIMED_TOKEN.match(name)
    return None if m is None else now - int(m.group(1))


def remove_dead_data(loc: Location, keep: str | None, grace_s: float | None, *, dry_run: bool = False,
                     lease_token: str | None = None, live: list[str] | None = None,
                     uploads: list[tuple[str, str]] | None = None) -> list[str]:
    """Remove the data under checkpoint ``loc`` (an object store) that ``keep`` (the data
    prefix its manifest names; ``""``: the root; ``None``: no manifest) does not name.

    A prefix whose claim (``d/<token>.claim``, see ``write_claim``) says its writer may
    still be writing it (``claim_alive``, judged with the lease ``lease_token``) is kept,
    and added to ``live`` when given.

    ``grace_s=None`` (a writer holding the lease: every other writer is gone) removes
    all of it; otherwise only prefixes whose timed token is older than ``grace_s``, plus
    format-1 data dirs at the root when ``keep`` is a prefix (their writers cleared a
    checkpoint before writing; none can be in the middle of a commit). On S3 a prefix's
    multipart uploads never completed (a writer killed mid-upload; billed until aborted)
    go with it, and a prefix holding nothing else counts as one: ``uploads`` are those
    under ``loc`` (``(name relative to loc, upload id)``; listed here when ``None``).
    Returns the keys removed.
    """
    children = set(_kvstore.list_children(loc))
    pending = _uploads_by_prefix(loc, uploads)
    removed = []
    if keep != "":
        removed += sorted(children & _manifest.DATA_DIRS)
    claims: dict[str, str] = {}  # attempt token -> its claim's name
    orphans: list[str] = []  # claims whose attempt wrote nothing, their writer gone
    if DATA_PREFIX_DIR in children or pending:
        now = time.time()
        names = _kvstore.list_children(loc.child(DATA_PREFIX_DIR)) if DATA_PREFIX_DIR in children else []
        claims = {n[:-len(CLAIM_SUFFIX)]: n for n in names if n.endswith(CLAIM_SUFFIX)}
        tokens = [n for n in names if not n.endswith(CLAIM_SUFFIX)]
        tokens += sorted({key.split("/", 1)[1] for key in pending} - set(tokens))
        for name in tokens:
            key = f"{DATA_PREFIX_DIR}/{name}"
            age = _attempt_age(name, now)
            if key == keep:
                continue
            if name in claims and claim_alive(_read_claim(loc, claims[name]), lease_token):
                if live is not None:
                    live.append(key)
                continue  # a live writer's attempt (a plain save holds no lease)
            if grace_s is None or (age is not None and age > grace_s):
                removed.append(key)
        orphans = [c for t, c in claims.items() if t not in tokens and t + "/" not in names
                   and (grace_s is None or (_attempt_age(t, now) or float("-inf")) > grace_s)
                   and not claim_alive(_read_claim(loc, c), lease_token)]
    for key in () if dry_run else removed:
        _s3.abort_uploads(loc, pending.get(key, []))
        _kvstore.delete_tree(loc.child(key))
        token = key.split("/", 1)[1] if key.startswith(f"{DATA_PREFIX_DIR}/") else None
        if token in claims:
            _kvstore.delete_blob(loc, f"{DATA_PREFIX_DIR}/{claims[token]}")
    for name in () if dry_run else orphans:  # claims of the gone (a format-3 attempt killed before its first upload)
        _kvstore.delete_blob(loc, f"{DATA_PREFIX_DIR}/{name}")
    return removed


def _uploads_by_prefix(loc: Location, uploads: list[tuple[str, str]] | None) -> dict[str, list[tuple[str, str]]]:
    """``uploads`` (S3's unfinished multipart uploads under ``loc``; listed when ``None``)
    by the attempt's data prefix ``d/<token>`` they lie under."""
    if uploads is None:
        uploads = _s3.multipart_uploads(loc) if loc.kvstore.get("driver") == "s3" else None
    pending: dict[str, list[tuple[str, str]]] = {}
    for name, upload_id in uploads or ():
        head, _, rest = name.partition("/")
        if head == DATA_PREFIX_DIR and "/" in rest:
            pending.setdefault(f"{DATA_PREFIX_DIR}/{rest.split('/', 1)[0]}", []).append((name, upload_id))
    return pending


def _read_claim(loc: Location, name: str) -> dict[str, Any]:
    owner = _untrusted.load_record(_kvstore.read_blob(loc, f"{DATA_PREFIX_DIR}/{name}"))
    return {} if owner is None else owner
