"""A writing manager's hold on its directory: taking it over (the writer lease, the dead
attempts and step data a gone writer left), deleting steps (retention applied and its
background deleter, ``delete``, a step that fails ``verify_before_delete``) and listing
the attempts left behind, with their sizes.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import threading
import weakref
from typing import Any, NamedTuple

from .. import _claims, _commit, _distributed, _owner, _tasks, _untrusted, _verify
from .._errors import CheckpointError, CheckpointNotFoundError
from .._formats import orbaxrun as _orbaxrun
from .._manifest import Manifest
from .._storage import kvstore as _kvstore
from .._storage import location as _location
from . import deaddata as _deaddata
from . import hosts as _hosts
from . import lease as _lease
from . import marks as _marks
from . import retention as _retention
from . import tiers as _tiers

_log = logging.getLogger("jaxckpt")


def check_lease(lease: _lease.Lease | None, directory: _location.Location) -> None:
    """Every process, before it reports its part of a save written: a lost lease (known
    to its holder) fails the save in every process (its agreement), at the same call."""
    lost = lease.lost if lease is not None else None
    if lost:
        raise CheckpointError(f"CheckpointManager for '{directory}' cannot commit: {lost}")


def check_directory(directory: _location.Location) -> None:
    local = directory.local
    if local is not None and os.path.exists(local) and not os.path.isdir(local):
        raise CheckpointError(f"CheckpointManager directory '{directory}' is a file, not a directory")


class Writer(NamedTuple):
    """What a writing manager learns as it starts: its host groups, its directory's lease
    (held by the first process of its group), the committed steps it lists."""

    groups: _hosts.HostGroups
    lease: _lease.Lease | None
    steps: dict[int, Manifest]


def start_writer(directory: _location.Location, persistent: Any, timeout_s: float | None,
                 partial: _hosts.PartialSteps, owner: object) -> Writer:
    """The first process of each directory's group takes the lease and cleans dead
    attempts; every process learns every outcome, and the steps every group holds.
    Process 0 also takes the lease of the ``persistent`` tier (if any); the leases are
    released when ``owner`` (the manager) is dropped unclosed."""
    name = f"manager{_distributed.next_id()}"
    with _distributed.Operation(name, str(directory), timeout_s) as op, \
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxckpt-listing") as beside:
        groups = _hosts.find_groups(op, directory)
        # On an object store the listing and the newest manifest are read beside the lease
        # and the sweep (round trips each): on a shared directory nothing the sweep removes
        # is a committed step, and a step it does remove reads as uncommitted (unlisted).
        early = (beside.submit(_hosts.agreed_steps, op, directory, groups, partial)
                 if directory.local is None and not groups.per_host else None)
        lease = None
        error: BaseException | None = None
        try:
            if groups.leads:
                lease = take_directory(directory, owner)
            if persistent is not None and _distributed.process_index() == 0:
                # the copies commit and retention deletes there: a writer like any other
                persistent.lease = take_directory(persistent.dir, owner)
        except BaseException as e:  # noqa: BLE001 - reported to every process
            error = e
        if error is not None:
            release_leases(lease, persistent)
        op.post("started", error if error is not None else b"")
        if error is not None:
            raise error
        try:
            op.wait_for("started", _hosts.others())
        except BaseException:
            release_leases(lease, persistent)
            raise
        try:
            steps = early.result() if early is not None else _hosts.agreed_steps(op, directory, groups, partial)
        except BaseException:
            release_leases(lease, persistent)
            raise
        return Writer(groups, lease, steps)


def release_leases(lease: _lease.Lease | None, persistent: Any, failure: BaseException | None = None) -> None:
    """Release the directory's lease and the persistent tier's (those held), each tried
    once. A release that fails is raised, unless ``failure`` (what the close is already
    raising: a save's own error) is given: then it is a note on that error, which stays
    the one raised."""
    first: BaseException | None = None
    for held in (lease, persistent.lease if persistent is not None else None):
        if held is None:
            continue
        try:
            held.release()
        except Exception as e:  # noqa: BLE001 - every lease gets its release; the error is kept
            if failure is not None:
                failure.add_note(f"Then, closing the manager: {e}")
            first = first or e
    if first is not None and failure is None:
        raise first


def _release_dropped(lease: _lease.Lease) -> None:
    """The release of a manager dropped unclosed (its finaliser, or at exit): a failure is
    logged, once (a closed manager's lease is released already: nothing happens)."""
    try:
        lease.release()
    except Exception as e:  # noqa: BLE001 - a finaliser has no caller to raise to
        _log.warning("jaxckpt: %s", e)


def take_directory(where: _location.Location, owner: object) -> _lease.Lease:
    """Create ``where``, take its writer lease, clean what a gone writer left there. An
    orbax run directory is refused first: jaxckpt never writes there."""
    _orbaxrun.refuse_writer(where)
    if where.local is not None:
        try:
            os.makedirs(where.local, exist_ok=True)
        except OSError as e:
            raise CheckpointError(f"Cannot create manager directory '{where}': {e}") from e
    lease = _lease.Lease.acquire(where)
    weakref.finalize(owner, _release_dropped, lease)  # a manager dropped unclosed
    try:
        # Every attempt left here belongs to a writer that is gone: ours to clean.
        for attempt in _commit.stale_attempts(where):
            if _claims.attempt_alive(where, attempt, lease.owner["token"]):
                _log.info("jaxckpt: keeping attempt %s in '%s': its writer (%s) is alive", attempt, where,
                          _lease.describe_owner(_claims.attempt_owner(where, attempt) or {}))
                continue
            _log.info("jaxckpt: removing attempt %s left by a writer that is gone", attempt)
            _claims.remove_attempt(where, attempt)
        _claims.remove_dead_claims(where)
        for name in _claims.remove_dead_scratch(where):  # a persistent copy's, killed while uploading
            _log.info("jaxckpt: removed %s left by a copy that is gone", name)
        # On an object store: data prefixes inside steps that no manifest names.
        for key in _deaddata.remove_dead_step_data(where, lease_token=lease.owner["token"]):
            _log.info("jaxckpt: removed data %s left by a writer that is gone", key)
    except BaseException:
        lease.release()
        raise
    return lease


class Deleter:
    """Retention's deletes, on a thread of their own: a slow delete (an object store
    deletes object by object) never holds up the next save. Each step is made
    invisible first; a step that a restore in another process is reading (see
    ``marks``) is put back and tried again after the next save. A failure is logged
    and the step, still committed on disk, is found again by the next ``reload``/start."""

    def __init__(self, directory: Any, dedup: Any = None):
        self._dir, self.dedup = directory, dedup  # dedup: the pool swept after each delete
        self._worker = _tasks.Worker("jaxckpt-delete", self._delete)
        self._lock = threading.Lock()
        self._deferred: set[int] = set()  # being read elsewhere when we tried

    def submit(self, steps: list[int]) -> None:
        with self._lock:
            retry, self._deferred = self._deferred - set(steps), set()
        for step in sorted(set(steps) | retry):
            self._worker.submit(step)

    def sweep(self) -> None:
        """A sweep of the dedup pool, after the deletes submitted before it."""
        if self.dedup is not None:
            self._worker.submit(None)

    def _delete(self, step: int | None) -> None:
        if step is None:
            self.dedup.sweep_logged()
            return
        try:
            with self.dedup.exclusive if self.dedup is not None else contextlib.nullcontext():
                deleted = _marks.delete_unless_read(self._dir, step, _commit.new_token())
            if self.dedup is not None and deleted:
                self.dedup.forget(step)
                self.dedup.sweep_logged()
            if not deleted:
                _log.info("jaxckpt: step %d in '%s' is being restored elsewhere; deleting it later", step, self._dir)
                with self._lock:
                    self._deferred.add(step)
        except Exception as e:  # noqa: BLE001 - logged; the step is still committed on disk
            _log.warning("jaxckpt: deleting step %d in '%s' failed: %s", step, self._dir, e)

    def wait(self) -> None:
        """Until every submitted delete has run."""
        self._worker.wait()

    close = wait


class Retainer:
    """Retention applied to a manager's listed local steps: the steps its policy drops
    are unlisted at once and deleted in the background by the first process of each
    directory. A step pinned by a read in this process (``marks.StepPins``) is kept, and
    dropped after the next save or once its copy to the persistent tier is done."""

    def __init__(self, policy: _retention.RetentionPolicy, listing: _tiers.Listing, pins: _marks.StepPins,
                 deleter: Deleter, leads: bool, lock: Any):
        self.policy, self._listing, self._pins, self._deleter = policy, listing, pins, deleter
        self._leads, self._lock = leads, lock  # the manager's lock
        self._deferred: set[int] = set()  # dropped by the policy while pinned

    def infos(self) -> list[_retention.StepInfo]:
        """The listed steps, each validated (read once, outside the lock: ``Listing.validate``):
        a step whose manifest is missing, damaged or of a newer format is neither counted
        nor deleted, as the start's eager discovery skipped it."""
        self._listing.validate()
        with self._lock:
            return _retention.step_infos({s: m.info for s, m in self._listing.local.items()})

    def apply(self) -> None:
        doomed = _retention.steps_to_delete(self.infos(), self.policy)
        with self._lock:
            doomed = set(doomed) | {s for s in self._deferred if s in self._listing.local}
            busy = {s for s in doomed if self._pins.held(s)}
            self._deferred = busy
            doomed -= busy
            for s in doomed:
                self._listing.local.pop(s, None)
        if self._leads and doomed:  # each directory's first process deletes there
            self._deleter.submit(sorted(doomed))

    def run(self, when: str) -> None:
        """``apply``, after a commit: a failure is logged (the step is committed; a failed
        delete is retried next time)."""
        try:
            self.apply()
        except Exception as e:  # noqa: BLE001 - the step is committed; a failed delete is retried next time
            _log.warning("jaxckpt: retention in '%s' %s failed: %s", self._listing.dir, when, e)

    def copied(self, step: int, pin: contextlib.ExitStack) -> None:
        """The copy of ``step`` to the persistent tier is done (its thread): give back the
        pin that kept the local copy."""
        pin.close()
        with self._lock:
            deferred = not self._pins.held(step) and step in self._deferred
        if deferred:  # retention wanted it gone while it was being copied
            self.run(f"after copying step {step}")

    def unlist(self, step: int) -> CheckpointError | None:
        """``delete``: stop listing ``step`` at once; the refusal instead when it is not
        listed or a restore here holds it."""
        with self._lock:
            if step not in self._listing.local:
                return CheckpointNotFoundError(
                    f"No committed step {step} in '{self._listing.dir}' (committed: {sorted(self._listing.local)})")
            if self._pins.held(step):
                return CheckpointError(f"Step {step} in '{self._listing.dir}' is being restored; delete it afterwards")
            del self._listing.local[step]
            self._deferred.discard(step)
        return None


def verify_or_delete(directory: _location.Location, step: int, op_id: int, timeout_s: float | None,
                     groups: _hosts.HostGroups) -> None:
    """``verify_before_delete``: the first process of each directory reads its copy
    back; every process learns every verdict. A step that fails is deleted. The
    reading happens inside the agreement, so the peers judge a long verify by its
    progress (the stall bound), not by ``timeout_s``."""
    final = directory.child(_commit.step_name(step))
    error: BaseException | None = None
    with _distributed.Operation(f"verify{op_id}", str(final), timeout_s) as op:
        if groups.leads:  # with a directory per host, its own part (the others' streams are theirs)
            try:
                report = (_verify.verify_part(final, set(range(_distributed.process_count())) - set(groups.mine))
                          if groups.per_host else _verify.verify(final))
                if not report.ok:  # one entry per damaged file, with the leaves it costs
                    shown = "; ".join(_damage(d) for d in report.damaged[:3])
                    more = f" (and {len(report.damaged) - 3} more)" if len(report.damaged) > 3 else ""
                    error = CheckpointError(f"step {step} failed verification after its commit: {shown}{more}")
            except CheckpointError as e:
                error = e
        error = _hosts.share_verdict(op, "verified", error)
    if error is None:
        return
    _log.error("jaxckpt: %s; deleting it", error)
    if groups.leads:
        _commit.delete_step(directory, step, _commit.new_token())
    raise error


def _damage(entry: dict[str, Any]) -> str:
    """One damaged file of a verify report: its problem and the leaves it costs."""
    leaves = entry.get("leaves") or []
    named = ", ".join(repr(p) for p in leaves[:3]) + (f" and {len(leaves) - 3} more" if len(leaves) > 3 else "")
    message = entry["message"] if entry["message"].startswith(entry["file"]) else f"{entry['file']}: {entry['message']}"
    return f"{message} (leaves {named})" if leaves else message


def delete_durable(persistent: _tiers.PersistentTier, step: int, op_id: int, timeout_s: float | None) -> None:
    """``delete`` in the persistent tier: process 0 (its lease holder) deletes ``step``;
    every process stops listing it and learns the one verdict."""
    where = persistent.dir.child(_commit.step_name(step))
    with _distributed.Operation(f"unpersist{op_id}", str(where), timeout_s) as op:
        error: BaseException | None = None
        if _distributed.process_index() == 0:
            try:
                persistent.delete(step)
            except CheckpointError as e:
                error = e
        error = _hosts.share_verdict(op, "deleted", error)
    persistent.forget(step)
    if error is not None:
        raise error


def delete_agreed(directory: _location.Location, step: int, op_id: int, timeout_s: float | None,
                  lease: _lease.Lease | None, error: BaseException | None,
                  per_host: bool) -> tuple[BaseException | None, bool]:
    """``delete`` in two rounds, so that a step is deleted on every host or on none: first
    each process says whether it may (``error``: its own refusal, e.g. a pin; the lease
    holder of each directory checks its lease and the reader marks there), one verdict for
    all; then, only if none refused, each lease holder deletes what its directory holds of
    ``step`` (nothing, for a host that lacks it), one verdict again. Returns the first
    error of any process and whether the second round ran (the step is then gone from
    every directory but where the error says). With one directory (not ``per_host``) its
    reader marks are asked once, in the second round, where the delete itself asks them."""
    with _distributed.Operation(f"delete{op_id}", str(directory), timeout_s) as op:
        if error is None and lease is not None:
            error = _may_delete(directory, step, lease, ask_readers=per_host)
        error = _hosts.share_verdict(op, "may", error)
        if error is not None:
            return error, False
        if lease is not None:
            try:
                error = _delete_as_leader(directory, step, lease)
            except Exception as e:  # noqa: BLE001 - reported to every process, then raised
                error = e
        return _hosts.share_verdict(op, "deleted", error), True


def _may_delete(directory: _location.Location, step: int, lease: _lease.Lease,
                ask_readers: bool = True) -> CheckpointError | None:
    """The refusal of deleting ``step`` in this lease holder's directory, if any (its lease;
    with ``ask_readers``, its reader marks)."""
    if lease.lost:
        return CheckpointError(f"CheckpointManager for '{directory}' cannot delete step {step}: {lease.lost}")
    readers = _marks.live_readers(directory, step) if ask_readers else []
    if not readers:
        return None
    who = ", ".join(_lease.describe_owner(r) for r in readers)
    return CheckpointError(f"Step {step} in '{directory}' is being restored by {who}; delete it afterwards")


def _delete_as_leader(directory: _location.Location, step: int, lease: _lease.Lease) -> CheckpointError | None:
    """Delete ``step`` in this process's directory; the error refusing it, if any (a reader
    that came since the first round: this directory keeps its part, unlisted)."""
    if _marks.delete_unless_read(directory, step, _commit.new_token()):
        return None
    return _may_delete(directory, step, lease) or CheckpointError(
        f"Step {step} in '{directory}' is being restored by another process; delete it afterwards")


def attempts(directory: _location.Location) -> list[dict[str, Any]]:
    """The hidden, uncommitted attempts in ``directory``, one dict each, by name (see
    ``CheckpointManager.attempts``)."""
    writer, gone = writer_lease(directory)
    token = None if gone or writer is None else writer.get("token")
    out = []
    for name in sorted(_commit.stale_attempts(directory)):
        stem = name[1:].split(_claims.TMP_MARK)[0].split(_claims.OLD_MARK)[0]
        size, mtime = _local_size_and_mtime(directory.child(name).local)
        owner = _claims.attempt_owner(directory, name)
        if owner is not None and owner.get("lease") is None:  # a plain save: judged by its own process
            who, alive = owner, _claims.attempt_alive(directory, name, token)
        elif owner is not None:  # a writer's: alive while the lease it was made under is held
            who, alive = writer, _claims.attempt_alive(directory, name, token)
        else:
            who, alive = writer, not gone or _claims.attempt_alive(directory, name, token)
        out.append({
            "step": _commit.parse_step_name(stem), "name": name,
            "kind": "tmp" if _claims.TMP_MARK in name else "old",
            "bytes": size, "mtime": mtime, "writer": who, "writer_alive": alive,
        })
    for name, dead in _claims.dead_scratch(directory):  # persistent copies' temporary files (local)
        try:
            st = os.lstat(os.path.join(directory.local, name))
        except OSError:
            continue  # gone meanwhile
        out.append({"step": None, "name": name, "kind": "upload", "bytes": st.st_size, "mtime": st.st_mtime,
                    "writer": _claims.scratch_maker(name), "writer_alive": not dead})
    live: list[str] = []  # object stores: data prefixes of attempts (claimed) in progress
    dead = _deaddata.remove_dead_step_data(directory, dry_run=True, lease_token=token, live=live)
    for key, alive in sorted([(k, False) for k in dead] + [(k, True) for k in live]):
        out.append({"step": _commit.parse_step_name(key.split("/", 1)[0]), "name": key, "kind": "data",
                    "bytes": None, "mtime": None, "writer": writer, "writer_alive": alive})
    return out


def writer_lease(directory: _location.Location) -> tuple[dict[str, Any] | None, bool]:
    """Who holds the directory's writer lease, and whether that holder is provably gone.

    Reads ``.jaxckpt-writer.json`` and nothing else (no waiting, no writing). ``(None,
    True)`` when no writer holds the directory. A holder whose liveness cannot be told
    yet (another host, recently renewed, or an unreadable lease) counts as alive.
    """
    holder = _untrusted.load_record(_kvstore.read_blob(directory, _owner.LEASE_FILE))
    if holder is None:
        return None, True
    return holder, _owner.judge(holder, _lease.lease_period(holder, _lease.LEASE_S)) == "gone"


def _local_size_and_mtime(path: str | None) -> tuple[int | None, float | None]:
    """Bytes under a local directory (links not followed) and its mtime; ``None`` elsewhere."""
    if path is None:
        return None, None
    try:
        mtime = os.lstat(path).st_mtime
    except OSError:
        return None, None
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass  # deleted while we walked
    return total, mtime


def delete_everywhere(mgr: Any, step: int) -> None:
    """``delete``: the step in every host's directory (a listed step, or the parts of one
    only the persistent tier lists), its peer copies, then its persistent copy. Whether
    each tier holds ``step`` is the same in every process (the agreed listing; the
    persistent tier's, once its copies in flight are done), so every process takes the
    same rounds; the step is deleted on every host or on none (``delete_agreed``)."""
    durable = mgr._persistent is not None and step in mgr._persistent.settled_steps()
    listed = step in mgr._steps.local
    if not listed and not durable:
        raise CheckpointNotFoundError(f"No committed step {step} in '{mgr._dir}' (committed: {mgr.all_steps()})")
    op_id = _distributed.next_id()  # before any verdict that one process may reach alone
    refusal = mgr._retention.unlist(step) if listed else (CheckpointError(
        f"Step {step} in '{mgr._dir}' is being restored; delete it afterwards") if mgr._pins.held(step) else None)
    error, ran = delete_agreed(mgr._dir, step, op_id, mgr._timeout, mgr._lease, refusal, mgr._groups.per_host)
    if error is not None and (not ran or not mgr._groups.per_host):  # refused; deleted nowhere
        if listed and refusal is None:  # listed again in every process (from its manifest, still there)
            mgr._steps.relist(step, error)
        raise error
    mgr._partial.forget(step)
    if mgr._peers is not None:  # gone from every host's directory: its peer copies go too
        mgr._peers.drain()  # no copy of it still on its way
        mgr._peers.drop(step)
    if durable:
        delete_durable(mgr._persistent, step, _distributed.next_id(), mgr._timeout)
    if error is not None:
        raise CheckpointError(f"Step {step} was deleted from '{mgr._dir}' and is listed nowhere, but a directory "
                              f"kept its part: {error}")
