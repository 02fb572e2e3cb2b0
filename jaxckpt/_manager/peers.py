"""Peer copies: with a local directory per host, each host's part of a committed step is
also kept on ``peer_copies`` partner hosts, so that losing a host (its disk with it)
does not send the whole job to the persistent tier.

Partners form a ring over the host groups (sorted; a group is the processes sharing a
directory, ``hosts.HostGroups``): the part of group ``i`` goes to groups ``i + 1``,
..., ``i + peer_copies`` (mod the number of groups). Losing any ``peer_copies`` hosts
therefore leaves a copy of every part; losing two partners of a ring of single copies
does not, and the job reads the persistent tier. A copy lives in the partner's own
directory, apart from its steps: ``<directory>/.jaxckpt-peers/p<lead>/<step>/`` (``lead``:
the first process of the source group), the source's files byte for byte and its
manifest, committed manifest last, with ``peer.json`` recording the listing it copied
and the identity of the step it copies: every host's manifest checksum of that step
(``identity``). A restore uses a copy only when those are the identities of the step
the hosts hold (``peerrepair``), so a copy of a deleted or re-saved step is never used.

When the bytes move. A save's peer copy runs in the background, after the local
commit, on this object's own thread (``PeerCopies.submit``): the training loop does not
wait for it, and the next ``save`` waits for it only where ``max_pending`` makes it wait
for the save itself. Jobs are submitted at calls that are the same in every process (a
``save``, a manager's start, a ``restore``) and run in that order on one thread, so
every process runs the same copies in the same order; a copy's outcome (the same verdict
in every process) is applied where its save is settled (``manager._Saves``), so a step
is listed, counted for retention and sent to the persistent tier once its copy is done.

A copy that fails in any process (a partner's disk full, a read or write error) fails
in every process alike, but not the save: the step is committed, so it stays listed,
goes to the persistent tier as usual and counts for retention, with a warning naming the
cause, and is marked as lacking its peer copies (``PeerCopies.missing``, shown by
``step_tiers()`` as ``"peer-copies-missing"``). The next save sends them again: once
the new step is listed (and retention has run), every step still listed in every
process that lacks copies is copied whole again, oldest first (a copy replaces any
earlier one of that step). A step whose copy never ran (the job died in between), or
whose copies a host lost with its disk, is found by ``peerrepair.repair`` when the next
manager starts, and copied at its first save the same way. ``delete(step)`` drops the
step's copies on every host once every host deleted it; retention's deletes drop them
after each save (``prune``).

How the bytes move (``peerlink``): over ``jax.experimental.transfer``, point to point
between two processes and outside the stream of collectives, so a copy never runs beside
the loop's own collectives in another order (two threads issuing collectives can
deadlock). Every process of a host sends the files of its host's part that it wrote (a
format-3 data object ``data/p<k>.<n>`` its writer ``k``, every other file the host's
first process) to the process at the same place in each partner host (``copy_routes``),
block by block with a bounded window; the partner's processes write into one staging
attempt, and its first process commits it, manifest last, once all of them received.
Before any byte moves every process posts what it will send and whether it can receive
(the receiving host checks its free space first: a full RAM disk fails the copy before a
byte moves). A failure on either side is posted where the other side waits next, so no
process waits for bytes that will not come. Restoring a lost part from its copy:
``peerrepair`` (at a restore, on the loop's thread: over the collectives, ``move``).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import os
import re
import shutil
import threading
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from .. import _commit, _distributed, _verify
from .._errors import CheckpointError
from .._manifest import CHECKSUM_FIELD, MANIFEST
from .._storage.location import Location
from . import hosts as _hosts
from . import peerlink as _link
from .peerwaves import (  # noqa: F401 - the repair's transport, here as before
    BLOCK_BYTES,
    Files,
    move,
    permute,
    waves,
)

_log = logging.getLogger("jaxckpt")

PEERS_DIR = ".jaxckpt-peers"
RECORD = "peer.json"  # in a peer copy: the listing digest of the part it copied


def check_option(copies: Any) -> int:
    """``peer_copies`` as an int >= 0."""
    if isinstance(copies, bool) or not isinstance(copies, int) or copies < 0:
        raise CheckpointError(f"peer_copies must be a non-negative int, got {copies!r}")
    return copies


def check_groups(copies: int, groups: _hosts.HostGroups, directory: Location) -> None:
    """Peer copies need a directory per host and more hosts than copies (the same facts,
    the same answer, in every process)."""
    if not groups.per_host:
        raise CheckpointError(
            f"peer_copies={copies} needs a local directory per host, but '{directory}' is shared by every "
            f"process of this job ({_distributed.process_count()} process(es), one group)")
    if copies >= len(groups.groups):
        raise CheckpointError(
            f"peer_copies={copies} needs more hosts than copies: '{directory}' is held by "
            f"{len(groups.groups)} hosts (groups {[list(g) for g in groups.groups]})")


def ring(leads: list[int], distance: int) -> list[tuple[int, int]]:
    """(sender, receiver) pairs of the first processes of the groups, each group's part
    to the group ``distance`` further around the ring."""
    n = len(leads)
    return [(leads[i], leads[(i + distance) % n]) for i in range(n)]


def partners(leads: list[int], copies: int) -> dict[int, list[int]]:
    """The leads holding each lead's peer copies, nearest first."""
    return {leads[i]: [leads[(i + d) % len(leads)] for d in range(1, copies + 1)] for i in range(len(leads))}


def digest(files: Iterable[tuple[str, int]], manifest: bytes) -> str:
    """What identifies a committed part: its files with their sizes, and its manifest."""
    h = hashlib.sha256(json.dumps(sorted(files)).encode())
    h.update(manifest)
    return h.hexdigest()[:32]


def identity(manifest: bytes) -> str:
    """The identity of a committed part: its manifest's checksum (the sha256 a manifest
    carries of itself; of its bytes for one written before manifests had checksums).
    Another save of the same step has another manifest, hence another identity."""
    try:
        value = json.loads(manifest).get(CHECKSUM_FIELD)
    except (ValueError, AttributeError, RecursionError):
        value = None
    return value if isinstance(value, str) else "sha256:" + hashlib.sha256(manifest).hexdigest()


def part_of(root: str) -> tuple[list[tuple[str, int]], bytes, str]:
    """A committed part on disk: its data files (sorted, with sizes), its manifest's
    bytes, its digest. Raises ``OSError`` when the manifest is missing."""
    files = sorted(_verify.list_files(root).items())
    with open(os.path.join(root, MANIFEST), "rb") as f:
        man = f.read()
    return files, man, digest(files, man)


def peer_root(directory: Location, source: int) -> Location:
    """Where this host keeps the peer copies of the group whose first process is ``source``."""
    return directory.child(PEERS_DIR).child(f"p{source}")


def copy_dirs(directory: Location) -> list[str]:
    """The names of the per-source folders of peer copies under ``directory`` (``p<k>``)."""
    top = os.path.join(directory.local, PEERS_DIR)
    names = sorted(os.listdir(top)) if os.path.isdir(top) else []
    return [n for n in names if n.startswith("p") and n[1:].isdigit()]


def free_bytes(path: str) -> int:
    """Bytes free to this process in the file system holding ``path`` (or its parent)."""
    while not os.path.exists(path):
        path = os.path.dirname(path)
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


# --- a save's peer copies -------------------------------------------------------------------

class PeerCopies:
    """A manager's peer copies: sent in the background after each save's commit
    (``submit``, its outcome applied where the save is settled: ``settle``), pruned to
    the listed steps (``prune``), sent back to a host that lost its part (``peerrepair``).

    Every job runs on this object's one thread, in the order the jobs were submitted, and
    every job is submitted at a point of the program that is the same in every process
    (``save``, a manager's start, ``restore``), so every process runs the same copies in
    the same order. A job's outcome is applied only where the call that settles it is
    the same in every process: a save's at that save's settle, a standalone job's
    (``submit_missing``) at the next settle after it (or ``drain``)."""

    def __init__(self, directory: Location, groups: _hosts.HostGroups, copies: int, timeout_s: float | None):
        self.dir, self.groups, self.copies, self.timeout_s = directory, groups, copies, timeout_s
        self.leads = [g[0] for g in groups.groups]
        self.me = _distributed.process_index()
        # listed steps lacking some peer copy: the same set in every process (it changes on
        # shared verdicts and on what every process posted); replaced, never changed in place
        self.missing: frozenset[int] | set[int] = frozenset()
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxckpt-peer")
        self._lock = threading.Lock()
        self._live: set[str] = set()  # staging names of copies being received here (prune keeps them)
        self._unsettled: set[int] = set()  # steps whose copy was submitted and not yet settled
        self._jobs: list[tuple[concurrent.futures.Future, bool]] = []  # (job, standalone), submission order
        self._staging: dict[int, tuple[Location, Location, str]] = {}  # the copy being received: per source
        self._received = False  # whether this process posted "received" in the copy running
        self._sent: set[int] = set()  # steps whose last copy succeeded (the peer thread's own record)
        self._drop_lock = threading.Lock()  # prune (the settling thread) and a copy's staging both drop attempts
        self._by_step: dict[int, concurrent.futures.Future] = {}  # each save's job, until settled
        # each standalone job's steps until its outcome is applied (program order, as
        # ``missing``): a second repair before then queues none of them again
        self._queued: dict[concurrent.futures.Future, frozenset[int]] = {}

    # --- jobs ---------------------------------------------------------------------------

    def submit(self, step: int, written: concurrent.futures.Future | Callable[[], Any]) -> concurrent.futures.Future:
        """At ``save(step)`` (every process, in program order): a job that waits for the
        save's commit (``written``: its future, or a callable giving its result), then
        copies ``step`` and the listed steps lacking their copies. Its result:
        ``(manifest, {step: error or None})``; the save's own failure is its exception."""
        base = _distributed.next_id()
        with self._lock:
            self._unsettled.add(step)
        retry = sorted(self.missing - {step})

        def job() -> tuple[Any, dict[int, BaseException | None]]:
            try:
                manifest = written.result() if isinstance(written, concurrent.futures.Future) else written()
            except BaseException:
                with self._lock:
                    self._unsettled.discard(step)
                raise
            outcome = {step: self._copy(step, f"peer{base}")}
            outcome.update(self._copy_listed(retry, f"peer{base}r", again=False))
            return manifest, outcome

        future = self._add(job, standalone=False)
        with self._lock:
            self._by_step[step] = future
        return future

    def submit_missing(self, listed: Iterable[int]) -> None:
        """At a manager's start or a restore, after a repair (every process): send the
        copies the listed steps lack now, in the background (a replaced host gets back
        those it held for its partners). Applied at the next settle."""
        retry = sorted(self.missing & set(listed) - set().union(*self._queued.values()))
        if not retry:
            return
        base = _distributed.next_id()
        job = self._add(lambda: (None, self._copy_listed(retry, f"peer{base}m", again=True)), standalone=True)
        self._queued[job] = frozenset(retry)

    def _add(self, job: Callable[[], Any], standalone: bool) -> concurrent.futures.Future:
        future = self._executor.submit(job)
        with self._lock:
            self._jobs.append((future, standalone))
        return future

    def settle(self, step: int | None, result: Any) -> Any:
        """Where a save is settled (the same call in every process): apply the outcomes of
        the standalone jobs submitted before its job (done: one thread runs them in order),
        then its own ``result`` (``(manifest, outcome)``; ``None``: the standalone ones
        only, every one submitted, waited for). Returns the save's manifest."""
        with self._lock:
            future = self._by_step.pop(step, None) if step is not None else None
            jobs, self._jobs = list(self._jobs), []
        keep = []
        for i, (job, standalone) in enumerate(jobs):
            if future is not None and job is future:
                keep.extend(jobs[i + 1:])
                break
            if standalone:
                self._apply(None, _outcome_of(job))
                self._queued.pop(job, None)
            elif not (job.done() and job.exception() is not None):  # a failed save: reported where settled
                keep.append((job, standalone))
        with self._lock:
            self._jobs = keep + self._jobs
        if result is None:
            return None
        manifest, outcome = result
        with self._lock:
            self._unsettled.discard(step)
        self._apply(step, outcome)
        return manifest

    def drain(self) -> None:
        """Wait for every job submitted (``delete``, ``close``); standalone outcomes are applied."""
        with self._lock:
            jobs = list(self._jobs)
        concurrent.futures.wait([j for j, _ in jobs])
        with self._lock:
            standalone = [(j, s) for j, s in self._jobs if s]
            self._jobs = [(j, s) for j, s in self._jobs if not s]
        for job, _ in standalone:
            self._apply(None, _outcome_of(job))
            self._queued.pop(job, None)

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    def _apply(self, saved: int | None, outcome: dict[int, BaseException | None]) -> None:
        for step, error in sorted(outcome.items()):
            if error is None:
                self.missing = self.missing - {step}
                continue
            self.missing = self.missing | {step}
            cause = error if isinstance(error, CheckpointError) else f"process {self.me}: {type(error).__name__}: {error}"
            what = "the peer copy" if step == saved else "sending the missing peer copy"
            _log.warning("jaxckpt: %s of step %d in '%s' failed: %s; the step is kept without its peer "
                         "copies (sent again at the next save)", what, step, self.dir, cause)

    # --- one copy ---------------------------------------------------------------------------

    def _copy(self, step: int, name: str) -> BaseException | None:
        """Every process, in the same job: each host's part of ``step`` to its partners. The
        verdict, the same in every process: ``None`` when every copy was made (noted in
        ``_sent``, which only this thread touches: the same in every process)."""
        error = self._copy_once(step, name)
        (self._sent.discard if error is not None else self._sent.add)(step)
        return error

    def _copy_once(self, step: int, name: str) -> BaseException | None:
        final = self.dir.child(_commit.step_name(step))
        with _distributed.Operation(name, str(final), self.timeout_s) as op:
            op.fail_on = "copied"  # a process that gave up posts it there: nobody waits it out
            self._received, self._staging = False, {}
            try:
                error = self._send(op, step, final)
            except Exception as e:  # noqa: BLE001 - every process hears of it
                error = e
                if not self._received:  # its host's first process waits for it there
                    op.post("received", e)
            finally:
                with self._lock:  # committed, or dead: the next copy or prune may take it
                    self._live.difference_update(os.path.basename(v[1].local) for v in self._staging.values())
            return _hosts.share_verdict(op, "copied", error)

    def _copy_listed(self, steps: list[int], name: str, again: bool) -> dict[int, BaseException | None]:
        """Copy again the ``steps`` (this process's view, when the job was submitted, of
        those lacking copies) that every process still holds; a step no process holds
        any more is forgotten (no outcome). Unless ``again`` (after a repair found copies
        lost), a step an earlier job copied since is copied once only (``_sent``: a
        save's job is submitted before the earlier ones' outcomes are applied)."""
        if not steps:  # the same in every process: ``missing`` is
            return {}
        held = [s for s in steps if (again or s not in self._sent)
                and os.path.isfile(os.path.join(self.dir.child(_commit.step_name(s)).local, MANIFEST))]
        done = {s: None for s in steps if not again and s in self._sent}  # copied by an earlier job
        steps = held
        try:
            with _distributed.Operation(name, str(self.dir), self.timeout_s) as op:
                op.post("listed", json.dumps(steps).encode())
                views = [set(json.loads(d)) for d in op.wait_for("listed", _hosts.others()).values()]
        except CheckpointError as e:
            return {s: e for s in steps}
        views.append(set(steps))
        return {**done, **{s: self._copy(s, f"{name}.{s}") for s in sorted(set.intersection(*views))}}

    def drop(self, step: int) -> None:
        """``delete(step)`` (every process, once every host deleted it): the first process
        of each group drops its peer copies of ``step``, so that no later restore or start
        brings the step back from them."""
        self.missing = self.missing - {step}
        if self.me not in self.leads:
            return
        for name in copy_dirs(self.dir):
            root = self.dir.child(PEERS_DIR).child(name)
            if step in _commit.discover_steps(root):
                try:
                    _commit.delete_step(root, step, _commit.new_token())
                except (OSError, CheckpointError) as e:
                    _log.warning("jaxckpt: dropping the peer copy of step %d in '%s' failed: %s", step, root, e)

    def _send(self, op: _distributed.Operation, step: int, final: Location) -> BaseException | None:
        """The copy of ``step``: every process sends the files of its host's part it wrote
        (the first process of a host sends the rest) to its counterpart in each partner
        host, which writes them into its host's staging attempt; each partner's first
        process commits, manifest last. Returns this process's error (the bytes moved)."""
        mine: dict[str, Any] = {"addr": _link.address()}
        man = b""
        if self.me in self.leads:
            try:
                files, man, dg = part_of(final.local)
            except Exception as e:
                op.post("part", e)
                raise
            mine.update(files=files, digest=dg)
        op.post("part", json.dumps(mine).encode())
        op.post("manifest", man)
        others = _hosts.others()
        parts = {p: json.loads(d) for p, d in op.wait_for("part", others).items()}
        parts[self.me] = json.loads(json.dumps(mine))
        mans = op.wait_for("manifest", others)
        mans[self.me] = man
        shares = {g[0]: owned([tuple(f) for f in parts[g[0]]["files"]], g) for g in self.groups.groups}
        routes = copy_routes(self.groups.groups, self.copies)
        out = [r for r in routes if r.sender == self.me]
        into = [r for r in routes if r.receiver == self.me]
        staged = _ready(op, lambda: self._stage(step, routes, shares), share=True)
        paths = {int(k): v for p, d in staged.items() for k, v in d.items()}
        error: BaseException | None = None
        sending = _Sending(op, out, shares, final.local)
        pulls = [_link.Pull(op, r.sender, parts[r.sender]["addr"], r.tag, sum(n for _, n in shares[r.source][r.sender]))
                 for r in into]
        for r, pull in zip(into, pulls):
            try:
                if error is None:
                    sink = Files(paths[r.source], shares[r.source][r.sender])
                    pull.receive(sink)
                    sink.close(check=True)
            except Exception as e:  # noqa: BLE001 - reported with the verdict
                error = e
            if error is not None:  # the sender waits for this route's next acknowledgement
                pull.abort(error)
        error = sending.join() or error
        op.post("received", error if error is not None else b"")
        self._received = True
        if error is not None:
            return error
        group = next(g for g in self.groups.groups if self.me in g)
        op.wait_for("received", [p for p in group if p != self.me])
        if self.me != group[0]:
            return None
        # the identity of the step copied: the checksum of every host's manifest of it
        ids = {str(lead): identity(mans[lead]) for lead in self.leads}
        for source, (where, staging, token) in self._staging.items():
            with open(os.path.join(staging.local, RECORD), "w") as f:
                json.dump({"source": source, "step": step, "digest": parts[source]["digest"], "parts": ids}, f)
            _commit.commit(where, staging, mans[source], token)
        return None

    def _stage(self, step: int, routes: list[Route], shares: dict[int, dict[int, list[tuple[str, int]]]]
               ) -> bytes:
        """A receiving host's first process: its staging attempts (after checking that the
        parts fit; an earlier copy that failed first gives back its room). Posts where
        each source's files go, for its host's other receivers."""
        group = next(g for g in self.groups.groups if self.me in g)
        if self.me != group[0]:
            return b"{}"
        sources = sorted({r.source for r in routes if r.receiver in group})
        with self._drop_lock:
            for source in sources:
                drop_attempts(peer_root(self.dir, source).local, self._live)
        need = sum(n for s in sources for share in shares[s].values() for _, n in share)
        if sources:
            free = free_bytes(self.dir.local)
            if need > free:
                raise CheckpointError(
                    f"no room for the peer copies of step {step} in '{self.dir}' (process {self.me}): they take "
                    f"{need} bytes, {free} are free; on a RAM disk (/dev/shm) each host holds max_to_keep steps "
                    f"of its own and of its {self.copies} partner(s), plus the step being saved")
        for source in sources:
            where = peer_root(self.dir, source).child(_commit.step_name(step))
            os.makedirs(os.path.dirname(where.local), exist_ok=True)
            token = _commit.new_token()
            with self._drop_lock:  # a prune sees it live, or does not see it at all
                staging = _commit.make_staging(where, token)
                with self._lock:
                    self._live.add(os.path.basename(staging.local))
            self._staging[source] = (where, staging, token)
        return json.dumps({str(s): v[1].local for s, v in self._staging.items()}).encode()

    # --- retention ----------------------------------------------------------------------

    def prune(self, keep: Iterable[int]) -> None:
        """The first process of each group: drop the peer copies (and their dead attempts)
        of steps not in ``keep`` (the listed local steps, the same in every process) nor
        being copied now."""
        keep = set(keep)
        self.missing = self.missing & keep  # a step no longer listed lacks nothing
        if self.me not in self.leads:
            return
        with self._drop_lock:  # the live copies read under it: none is being staged meanwhile
            with self._lock:
                keep = keep | self._unsettled
                live = set(self._live)
            self._prune(keep, live)

    def _prune(self, keep: set[int], live: set[str]) -> None:
        top = os.path.join(self.dir.local, PEERS_DIR)
        for name in sorted(os.listdir(top)) if os.path.isdir(top) else []:
            drop_attempts(os.path.join(top, name), live)
            for step in _commit.discover_steps(self.dir.child(PEERS_DIR).child(name)):
                if step not in keep:
                    try:
                        _commit.delete_step(self.dir.child(PEERS_DIR).child(name), step, _commit.new_token())
                    except OSError as e:
                        _log.warning("jaxckpt: dropping the peer copy of step %d in '%s' failed: %s", step, top, e)


class Route(NamedTuple):
    """One sender's share of a source host's part, to one receiver of a partner host."""

    source: int  # the first process of the source host
    sender: int
    receiver: int
    distance: int

    @property
    def tag(self) -> str:
        return f"d{self.distance}s{self.sender}"


def copy_routes(groups: tuple[tuple[int, ...], ...] | list, copies: int) -> list[Route]:
    """Every process of host ``i`` sends its share to the process at the same place in
    host ``i + d`` (modulo that host's size), for ``d`` in ``1..copies``."""
    groups = sorted((tuple(g) for g in groups), key=lambda g: g[0])
    n = len(groups)
    out = []
    for d in range(1, copies + 1):
        for i, g in enumerate(groups):
            to = groups[(i + d) % n]
            out.extend(Route(g[0], p, to[k % len(to)], d) for k, p in enumerate(g))
    return out


_STREAM_OBJECT = re.compile(r"^data/p(\d+)\.\d+$")


def owned(files: list[tuple[str, int]], group: tuple[int, ...]) -> dict[int, list[tuple[str, int]]]:
    """Which process of ``group`` sends which files of its host's part: a format-3 data
    object ``data/p<k>.<n>`` its writer ``k``; every other file the host's first process."""
    out: dict[int, list[tuple[str, int]]] = {p: [] for p in group}
    for name, size in files:
        m = _STREAM_OBJECT.match(name)
        k = int(m.group(1)) if m else group[0]
        out[k if k in out else group[0]].append((name, size))
    return out


class _Sending:
    """This process's sends of a copy, on a thread of their own: a host that sends and
    receives at once (every host of a ring) must do both, or the ring waits on itself."""

    def __init__(self, op: _distributed.Operation, routes: list[Route],
                 shares: dict[int, dict[int, list[tuple[str, int]]]], root: str):
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(op, routes, shares, root), daemon=True,
                                       name="jaxckpt-peer-send")
        self.thread.start()

    def _run(self, op: Any, routes: list[Route], shares: Any, root: str) -> None:
        offers = [_link.Offer(op, r.receiver, r.tag, sum(n for _, n in shares[r.source][r.sender])) for r in routes]
        for r, offer in zip(routes, offers):
            try:
                if self.error is None:
                    stream = Files(root, shares[r.source][r.sender])
                    try:
                        offer.send(stream)
                    finally:
                        stream.close(check=False)
            except Exception as e:  # noqa: BLE001 - reported with the verdict
                self.error = e
            if self.error is not None:  # the receiver waits for this route's next block
                offer.abort(self.error)

    def join(self) -> BaseException | None:
        self.thread.join()  # bounded: every wait inside is the operation's
        return self.error


def _outcome_of(job: concurrent.futures.Future) -> dict[int, BaseException | None]:
    try:
        return job.result()[1]
    except Exception:  # noqa: BLE001 - a save's own failure is reported where it is settled
        return {}


def drop_attempts(root: str, live: set[str] | frozenset[str] = frozenset()) -> None:
    """Remove the hidden attempts (and their claims) under a peer copies' directory:
    copies that failed or were killed, but not those being received now (``live``: their
    names, and their claims')."""
    for entry in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        if not entry.startswith(".") or any(entry.startswith(name) for name in live):
            continue
        path = os.path.join(root, entry)
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.remove(path)
        except OSError as e:
            _log.warning("jaxckpt: removing '%s' failed: %s", path, e)


def _ready(op: _distributed.Operation, prepare: Any, share: bool = False) -> Any:
    """``prepare()`` here, then two rounds before any collective: every process posts
    whether it is ready, then "go" once it saw every process ready. A process that gave
    up on a late peer never posts "go", so no process enters the waves alone. With
    ``share``, ``prepare()`` returns bytes that every process posts with "ready", and the
    result is every process's payload, decoded from JSON."""
    error: BaseException | None = None
    result = None
    try:
        result = prepare()
    except Exception as e:  # noqa: BLE001 - every process hears of it
        error = e
    op.post("ready", error if error is not None else (result if share else b""))
    if error is not None:  # its own cause first; the others hear of it at "ready"
        op.post("go", error)
        raise error
    try:
        posts = op.wait_for("ready", _hosts.others())
    except CheckpointError as e:
        op.post("go", e)
        raise
    op.post("go")
    op.wait_for("go", _hosts.others())
    if share:
        posts[_distributed.process_index()] = result
        return {p: json.loads(d or b"{}") for p, d in posts.items()}
    return result

