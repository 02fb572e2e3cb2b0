"""Agreement between the processes of a multi-controller JAX job.

Everything that touches jax's distributed runtime client (a private API: its key-value
store) lives here, so a change there touches one file. With one process every function
is a cheap no-op.

Processes agree through the key-value store rather than XLA collectives, so a save's
background thread never competes with the training loop's collectives.

A collective operation (one save, one manager start) is an ``Operation``. Inside it,
processes ``post`` their outcome of a phase (``ok`` with a payload, or an error) and
``wait_for`` the posts of the peers they depend on. Waiting tells four kinds of peer
apart, so that a slow process is never mistaken for a dead one:

* a peer that is *in* the operation, alive and making progress: its heartbeat key
  (``jaxckpt/hb/<p>``, rewritten every ``HEARTBEAT_S`` by a thread of that process while
  it is inside any operation) keeps changing, and so does the progress it carries. It is
  waited for as long as it takes: writing tens of GB is slow, not broken.
* a peer in the operation whose heartbeat stopped moving for ``STALE_S``: dead (or
  wedged). The wait fails, naming it, well before JAX's coordination service kills the
  survivors (~40 s after a death).
* a peer in the operation, alive, whose progress did not move for the stall bound
  (``stall_s()``: ``JAXCKPT_STALL_S``, else ``STALL_S``, 10 minutes): hung alive. The
  wait fails, naming it, the operation and the phase it did not post.
* a peer that has not started the operation: waited for ``timeout_s`` (counted from
  when the waiting process started waiting), then the wait fails.

Progress, per process: every chunk it read or wrote (``_storage.progress``) plus every
phase it posted. A process that is itself blocked waiting for its peers does no I/O, yet
is not stalled: while it waits, its heartbeat carries the sum of the progress of the
peers it waits for, so it moves as long as they do (the coordinator of a save waiting
for a slow writer is judged by that writer's progress). Only real counters are summed,
never what a waiting peer carries, so processes waiting on each other in a cycle make no
progress and are caught like any hang. A waiting peer is given ``VERDICT_GRACE_S`` more
(and at least ``timeout_s``, its bound for a peer that has not started): its own wait,
judging the same stall a moment earlier, fails first and posts an error naming the real
culprit.

Staleness and stalls are judged on the observer's own clock from changes of the peer's
counters, so clocks of different hosts never need to agree.

Keys of an operation are deleted once no process can read them any more: each process
acknowledges (``<op>/done/<p>``) when it leaves an operation, and process 0 deletes an
operation's keys once every acknowledgement is in. This holds whatever the number of
threads running operations in a process (a manager's save thread, a plain ``save`` on
the main thread, a second manager, the persistent tier's copies): nothing is assumed
about which operations run one after another. Process 0 looks for finished operations
when it leaves one and whenever every peer has posted to it (those peers have left
their earlier operations of that thread), so keys never pile up beyond the operations
still running and the newest ones.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import jax

from . import _storage
from ._errors import CheckpointError

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 30.0  # waiting for a peer that has not started the operation
HEARTBEAT_S = 1.0  # how often a process inside an operation proves it is alive
STALE_S = 10.0  # a peer in the operation whose heartbeat did not move for this long is dead
# A peer in the operation, alive, whose progress did not move for this long is hung. Long
# enough for the slowest single step that counts nothing (one chunk of a slow store, a
# commit, a manager start's listing); ``JAXCKPT_STALL_S`` overrides it, read per wait.
STALL_S = 600.0
STALL_ENV = "JAXCKPT_STALL_S"
# A waiting peer judges the peers it waits for itself and posts its verdict; it is given
# this much longer so that its verdict (naming the real culprit) arrives first.
VERDICT_GRACE_S = 3 * HEARTBEAT_S
_WAIT_MS = 500  # one blocking wait on the key-value store, between liveness checks
_PART_BYTES = 1 << 20  # large payloads are split into parts of this size
_PART_WAIT_MS = 10_000  # reading one part of a posted payload (written before its count)
_ROOT = "jaxckpt"

_seq_lock = threading.Lock()
_seq = itertools.count()


def process_index() -> int:
    return jax.process_index()


def process_count() -> int:
    return jax.process_count()


def coordinator_host() -> str | None:
    """The host part of the job's coordinator address (``None`` without one)."""
    from jax._src import distributed

    address = getattr(distributed.global_state, "coordinator_address", None)
    if not address:
        return None
    return address.rsplit(":", 1)[0].strip("[]")


def next_id() -> int:
    """This process's n-th number for its n-th collective operation: the same in every
    process only because collective operations (saves, manager starts, read-once
    restores) must be issued in the same order by every process, as with any SPMD
    program. (The manager takes a save's number on the caller's thread, in program
    order, before the save goes to its own thread.)
    """
    with _seq_lock:
        return next(_seq)


def stall_s() -> float:
    """The stall bound in seconds: ``JAXCKPT_STALL_S`` if set (read at each call), else
    ``STALL_S``."""
    raw = os.environ.get(STALL_ENV, "").strip()
    if not raw:
        return STALL_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise CheckpointError(f"{STALL_ENV}={raw!r}: expected a positive number of seconds")
    return value


_posts_lock = threading.Lock()
_posts = 0  # phases this process posted: progress, like the chunks it reads and writes


def _count_post() -> None:
    global _posts
    with _posts_lock:
        _posts += 1


def progress() -> int:
    """This process's progress as its peers see it: chunks read and written plus phases
    posted. Only grows."""
    return _storage.progress() + _posts


def kv_client() -> Any:
    """The job's key-value store client (the coordination service), for the callers that
    keep keys of their own beside the operations' (``_manager.decisions``)."""
    return _client()


def _client():
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise CheckpointError(
            "jax.process_count() > 1 but jax.distributed is not initialized; "
            "call jax.distributed.initialize() first"
        )
    return client


# --- heartbeat ----------------------------------------------------------------------


class _Heartbeat:
    """While this process is inside any operation, rewrite ``jaxckpt/hb/<me>`` with a
    counter, its progress and the operations it is in, each with the phase it waits for
    and the progress of the peers it waits for (``<op>:<phase>:<sum>``), if it waits.

    ``"<beat> <progress> <op>[:<phase>:<sum>] ..."``, parsed by ``_parse_heartbeat``.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active: dict[str, int] = {}
        self._waits: dict[str, tuple[str, int]] = {}
        self._counter = itertools.count()
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()

    def enter(self, name: str) -> None:
        with self._lock:
            self._active[name] = self._active.get(name, 0) + 1
            self._beat_locked()
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="jaxckpt-heartbeat", daemon=True)
                self._thread.start()

    def exit(self, name: str) -> None:
        with self._lock:
            self._active[name] -= 1
            if not self._active[name]:
                del self._active[name]
                self._waits.pop(name, None)
            self._beat_locked()
        self._wake.set()

    def waiting(self, name: str, phase: str | None, peers_progress: int = 0) -> None:
        """Operation ``name`` waits for ``phase`` from peers whose progress sums to
        ``peers_progress`` (``phase=None``: it stopped waiting). Shown at the next beat."""
        with self._lock:
            if phase is None:
                self._waits.pop(name, None)
            elif name in self._active:
                self._waits[name] = (phase, peers_progress)

    def _beat_locked(self) -> None:
        ops = " ".join(name + ("" if name not in self._waits else ":%s:%d" % self._waits[name])
                       for name in sorted(self._active))
        value = f"{next(self._counter)} {progress()} {ops}"
        _client().key_value_set(f"{_ROOT}/hb/{process_index()}", value, allow_overwrite=True)

    def _run(self) -> None:
        while True:
            self._wake.wait(HEARTBEAT_S)
            self._wake.clear()
            with self._lock:
                if not self._active:
                    self._thread = None
                    return
                try:
                    self._beat_locked()
                except Exception:  # noqa: BLE001 - the runtime is shutting down; stop beating
                    self._thread = None
                    return


_heartbeat = _Heartbeat()


class _Beat:
    """One heartbeat, parsed: the peer's progress and, per operation it is in, what it
    waits for there (``None``: not waiting)."""

    def __init__(self, value: str) -> None:
        fields = value.split()
        self.progress = int(fields[1])
        self.ops: dict[str, tuple[str, int] | None] = {}
        for entry in fields[2:]:
            name, _, wait = entry.partition(":")
            phase, _, total = wait.rpartition(":")
            self.ops[name] = (phase, int(total)) if wait else None


class _Peer:
    """What a waiting process has seen of one peer's heartbeat."""

    def __init__(self) -> None:
        self.value: str | None = None
        self.changed = time.monotonic()  # when its heartbeat last moved (liveness)
        self.work: tuple[int, Any] | None = None  # its progress in this operation, as last seen
        self.progressed = self.changed  # when that last moved


def _read_heartbeat(client: Any, p: int) -> str | None:
    try:
        return client.key_value_try_get(f"{_ROOT}/hb/{p}")
    except Exception:  # noqa: BLE001 - not found: never beat yet
        return None


def _parse_heartbeat(value: str | None) -> _Beat | None:
    if value is None:
        return None
    try:
        return _Beat(value)
    except (ValueError, IndexError):  # not ours (another library version): treat as never beat
        return None


# --- operations ---------------------------------------------------------------------

# A hook for tests, called with (operation, phase) before each wait for peers' posts: one
# that blocks holds this process just before it reads what they posted. (Not one of
# ``_iostats``' fault points: the tests' hooks there fail every point they meet as an I/O
# error, and an agreement wait is no I/O.)
wait_hook: Any = None

_cleanup_lock = threading.Lock()
_finished_ops: list[str] = []  # process 0: operations it left whose keys are not deleted yet


class Operation:
    """One collective operation. Use as a context manager around its phases.

    ``name`` must be the same in every process and unique per operation (take it from
    ``next_id()``); ``what`` is for messages (e.g. the checkpoint path). Operations
    may run at the same time on different threads. ``lane`` is accepted for the callers
    that name the thread an operation runs on; the clean-up no longer needs it.
    """

    def __init__(self, name: str, what: str = "", timeout_s: float | None = None, lane: str = ""):
        self.name, self.what, self.lane = name, what, lane
        self.timeout_s = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
        self.multi = process_count() > 1
        self._prefix = f"{_ROOT}/op/{name}/"
        # a phase every process posts its verdict at (e.g. a peer copy's "copied"): a wait
        # for another phase ends, failed, as soon as a peer it waits for posted an error
        # there (it gave up on the operation) instead of waiting out the stall bound
        self.fail_on: str | None = None

    def __enter__(self) -> Operation:
        if self.multi:
            _heartbeat.enter(self.name)
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.multi:
            return
        client = _client()
        try:  # after this, this process reads nothing of the operation any more
            client.key_value_set(f"{self._prefix}done/{process_index()}", "1")
        except Exception:  # noqa: BLE001, S110 - the runtime is shutting down: the keys stay
            pass
        _heartbeat.exit(self.name)
        if process_index() == 0:
            with _cleanup_lock:
                _finished_ops.append(self.name)
            _delete_finished_ops(client, self.name)

    def _label(self, phase: str) -> str:
        return f"{self.name}/{phase}" + (f" '{self.what}'" if self.what else "")

    # --- posting ---------------------------------------------------------------

    def post(self, phase: str, payload: bytes | BaseException = b"") -> None:
        """Publish this process's outcome of ``phase``: a payload, or an error."""
        if not self.multi:
            return
        if isinstance(payload, BaseException):
            text = f"{type(payload).__name__}: {payload}"[:4000]
            data = b"E" + text.encode()
        else:
            data = b"K" + payload
        _put(_client(), f"{self._prefix}{phase}/{process_index()}", data)
        _count_post()

    def wait_for(self, phase: str, peers: list[int]) -> dict[int, bytes]:
        """The payloads ``peers`` posted for ``phase``.

        Raises ``CheckpointError`` naming the peer if one posted an error, stopped
        heartbeating inside this operation for ``STALE_S``, made no progress inside it
        for ``stall_s()``, or did not start the operation within ``timeout_s``.
        """
        if not self.multi:
            return {}
        if wait_hook is not None:
            wait_hook(self.name, phase)
        try:
            return self._wait_for(phase, peers)
        finally:
            _heartbeat.waiting(self.name, None)

    def _wait_for(self, phase: str, peers: list[int]) -> dict[int, bytes]:
        client = _client()
        prefix = f"{self._prefix}{phase}/"
        start = time.monotonic()
        stall = stall_s()
        seen = {p: _Peer() for p in peers}
        got: dict[int, bytes] = {}
        while True:
            for p in peers:
                if p not in got:
                    data = _try_get(client, prefix + str(p))
                    if data is not None:
                        got[p] = data
            failed = sorted(p for p, d in got.items() if d[:1] == b"E")
            if failed:
                detail = "; ".join(f"process {p}: {got[p][1:].decode(errors='replace')}" for p in failed)
                error = CheckpointError(
                    f"{self._label(phase)}: failed in process {', '.join(map(str, failed))} ({detail})")
                error.posted = True  # the peer reported it (not a peer given up on)
                raise error
            missing = [p for p in peers if p not in got]
            if not missing:
                if process_index() == 0 and set(peers) | {0} == set(range(process_count())):
                    # every peer posted here, so it left the operations it ran before this
                    # one on this thread: their acknowledgements are in (or it is late)
                    _delete_finished_ops(client, self.name)
                return {p: d[1:] for p, d in got.items()}
            self._check_alive(client, phase, missing, seen, start, stall)
            try:  # sleep on the server until the first missing peer posts (or a short timeout)
                client.blocking_key_value_get_bytes(prefix + str(missing[0]) + "/n", _WAIT_MS)
            except Exception:  # noqa: BLE001, S110 - a timeout: check liveness again
                pass

    def watch(self, phase: str, peers: list[int]) -> Callable[[], None]:
        """A check to call now and then while this process waits for something of
        ``peers`` that is not a post (bytes on their way over another transport): it
        raises as ``wait_for`` would (a peer dead, or alive without progress for the
        stall bound), counting from this call. Call ``done_waiting()`` after."""
        if not self.multi:
            return lambda: None
        client, start, stall = _client(), time.monotonic(), stall_s()
        seen = {p: _Peer() for p in peers}
        return lambda: self._check_alive(client, phase, peers, seen, start, stall)

    def done_waiting(self) -> None:
        if self.multi:
            _heartbeat.waiting(self.name, None)

    def _check_alive(self, client: Any, phase: str, missing: list[int], seen: dict[int, _Peer],
                     start: float, stall: float) -> None:
        now = time.monotonic()
        peers_progress = 0
        if self.fail_on is not None and phase != self.fail_on:
            for p in missing:
                data = _try_get(client, f"{self._prefix}{self.fail_on}/{p}")
                if data is not None and data[:1] == b"E":
                    error = CheckpointError(f"{self._label(phase)}: process {p} gave up on it "
                                            f"({data[1:].decode(errors='replace')})")
                    error.posted = True
                    raise error
        for p in missing:
            value = _read_heartbeat(client, p)
            peer = seen[p]
            if value != peer.value:
                peer.value, peer.changed = value, now
            beat = _parse_heartbeat(value)
            in_op = beat is not None and self.name in beat.ops
            if in_op and now - peer.changed > STALE_S:
                raise CheckpointError(
                    f"{self._label(phase)}: process {p} stopped responding (no heartbeat for "
                    f"{now - peer.changed:.0f}s; dead or hung)")
            if not in_op and now - start > self.timeout_s:
                raise CheckpointError(
                    f"{self._label(phase)}: process {p} did not report within {self.timeout_s:g}s "
                    "(failed, dead, or not running the same collective operations in the same order)")
            if in_op:
                self._check_progress(phase, p, peer, beat, now, stall)
                peers_progress += beat.progress
        _heartbeat.waiting(self.name, phase, peers_progress)

    def _check_progress(self, phase: str, p: int, peer: _Peer, beat: _Beat, now: float,
                        stall: float) -> None:
        """Fail if peer ``p``, alive inside this operation, made no progress for the stall
        bound: no chunk read or written, no phase posted and, if it waits for its own
        peers here, none of them progressing either."""
        wait = beat.ops[self.name]
        work = (beat.progress, wait)
        if work != peer.work:
            peer.work, peer.progressed = work, now
        # a waiting peer bounds its own wait: by the stall bound, or by ``timeout_s`` for
        # a peer of its that has not started (whose progress it cannot carry)
        bound = stall if wait is None else max(stall, self.timeout_s) + VERDICT_GRACE_S
        if now - peer.progressed <= bound:
            return
        doing = (f"waiting for '{wait[0]}' from its peers, who made no progress either" if wait is not None
                 else f"has not posted '{phase}', read or written nothing, posted nothing")
        raise CheckpointError(
            f"{self._label(phase)}: process {p} made no progress for {now - peer.progressed:.0f}s "
            f"(alive, inside {self.name}, {doing}; hung? the stall bound is {stall:g}s, {STALL_ENV})")

    # --- the shapes of agreement --------------------------------------------------

    def claim_commit(self, what: str) -> None:
        """Process 0, right before it commits: claim the verdict ``commit``; raises when a
        peer gave up on the operation first (``wait_for_outcome``)."""
        if self.decide("verdict", "commit") != "commit":
            raise CheckpointError(f"{what}: a process gave up waiting for this save's outcome before its "
                                  "commit (see its error); not committed")

    def lead_commit(self, what: str, stage: Callable[[], tuple[str, Any]],
                    work: Callable[[str], tuple[bytes, T]], commit: Callable[[Any, bytes, str], None],
                    abort: Callable[[Any, str], None]) -> T:
        """Process 0's side of an attempt the whole job commits as one (a save, a step's
        copy to the persistent tier); the others run ``follow_commit``.

        ``stage()`` makes the attempt (its token and staging location) and the token, or
        the error, is broadcast (``staged``); ``work(token)`` does process 0's part, waits
        for the others' and returns the manifest bytes and what to return; the commit is
        claimed (``claim_commit``) and made: ``commit(staging, data, token)``. The outcome
        (those bytes, or the error) is posted to every process; an attempt that failed
        before its commit is aborted first: ``abort(staging, token)``.
        """
        try:
            token, staging = stage()
        except BaseException as e:  # noqa: BLE001 - reported to every process, then re-raised
            self.broadcast("staged", e)
        self.broadcast("staged", token.encode())
        committed = False
        try:
            data, result = work(token)
            self.claim_commit(what)
            commit(staging, data, token)
            committed = True
        except BaseException as e:
            if not committed:
                abort(staging, token)
            self.post("outcome", e)
            raise
        self.post("outcome", data)
        return result

    def follow_commit(self, what: str, phase: str, work: Callable[[str], bytes | None],
                      undo: Callable[[], None]) -> bytes:
        """The others' side of ``lead_commit``: process 0's token, ``work(token)`` (this
        process's part), posted as ``phase`` (what it returned, or the error), then
        process 0's outcome: the manifest bytes (``wait_for_outcome``). ``undo()`` runs
        when either fails."""
        try:
            result = work(self.broadcast("staged", None).decode())
        except BaseException as e:  # process 0 must hear of any failure, not wait it out
            self.post(phase, e)
            undo()
            raise
        self.post(phase, result or b"")
        try:
            return self.wait_for_outcome(what)
        except BaseException:
            undo()
            raise

    def wait_for_outcome(self, what: str) -> bytes:
        """The others: process 0's ``outcome``. A process that gives up on process 0 (dead,
        or alive without progress) claims the verdict ``abort`` first, so that process 0
        can no longer commit what this process reports as failed; if process 0 claimed
        ``commit`` first (it is committing), its outcome is waited for once more, then the
        error says the result may be committed."""
        try:
            return self.wait_for("outcome", [0])[0]
        except CheckpointError as gave_up:
            if getattr(gave_up, "posted", False) or self.decide("verdict", "abort") == "abort":
                raise
            try:
                return self.wait_for("outcome", [0])[0]
            except CheckpointError as again:
                raise CheckpointError(f"{again} (process 0 had decided to commit '{what}': it may be committed; "
                                      "list the directory to know)") from gave_up

    def decide(self, phase: str, verdict: str) -> str:
        """Claim the one verdict of ``phase`` (the first claim wins, in every process):
        ``verdict`` when this process claimed first, else the verdict that won. A save's
        coordinator claims ``commit`` right before it commits, a peer that gave up on it
        ``abort``: both can never happen."""
        if not self.multi:
            return verdict
        client = _client()
        key = f"{self._prefix}{phase}/verdict"
        try:
            client.key_value_set(key, verdict)  # fails when the key exists: one claim wins
            return verdict
        except Exception:  # noqa: BLE001 - already claimed: read whose
            try:
                return client.blocking_key_value_get(key, 10_000)
            except Exception as e:  # noqa: BLE001 - the store is going away
                raise CheckpointError(f"{self._label(phase)}: reading the verdict failed: {e}") from e

    def broadcast(self, phase: str, payload: bytes | BaseException | None) -> bytes:
        """Process 0's payload in every process (process 0 passes it; the others ``None``).

        An error passed by process 0 is re-raised there and raised as a
        ``CheckpointError`` in the others.
        """
        if process_index() == 0:
            assert payload is not None
            self.post(phase, payload)
            if isinstance(payload, BaseException):
                raise payload
            return payload
        return self.wait_for(phase, [0])[0]


def _put(client: Any, key: str, data: bytes) -> None:
    """Write ``data`` under ``key``; big payloads go in parts, the count last (it is
    what readers wait for)."""
    parts = [data[i:i + _PART_BYTES] for i in range(0, len(data), _PART_BYTES)] or [b""]
    for i, part in enumerate(parts):
        client.key_value_set_bytes(f"{key}/{i}", part)
    client.key_value_set(f"{key}/n", str(len(parts)))


def _try_get(client: Any, key: str) -> bytes | None:
    try:
        n = int(client.key_value_try_get(f"{key}/n"))
    except Exception:  # noqa: BLE001 - not posted yet
        return None
    try:  # the parts were written before the count: there at once
        return b"".join(client.blocking_key_value_get_bytes(f"{key}/{i}", _PART_WAIT_MS) for i in range(n))
    except Exception as e:  # noqa: BLE001 - a part missing: deleted under us, or the runtime is gone
        raise CheckpointError(f"'{key}': a part of this posted message could not be read "
                              f"within {_PART_WAIT_MS / 1000:g}s ({e})") from e


def _delete_finished_ops(client: Any, current: str) -> None:
    """Process 0: delete the keys of each operation it left whose every process has
    acknowledged leaving it (``done/<p>``). ``current``, the operation just left or
    waited in, is left for a later look: its peers' acknowledgements are seldom in yet,
    and its keys show in ``op_keys`` what the last operation said."""
    with _cleanup_lock:
        candidates = [n for n in _finished_ops if n != current]
        _finished_ops[:] = [n for n in _finished_ops if n == current]
    keep = []
    for name in candidates:
        try:
            done = len(client.key_value_dir_get(f"{_ROOT}/op/{name}/done/"))
            if done >= process_count():
                client.key_value_delete(f"{_ROOT}/op/{name}/")
                continue
        except Exception:  # noqa: BLE001, S110 - cleanup is best effort: look again next time
            pass
        keep.append(name)
    with _cleanup_lock:
        _finished_ops.extend(keep)


def op_keys() -> list[str]:
    """Every key this library holds in the key-value store (tests check they do not pile up)."""
    if process_count() == 1:
        return []
    return [k for k, _ in _client().key_value_dir_get(f"{_ROOT}/op/")]
