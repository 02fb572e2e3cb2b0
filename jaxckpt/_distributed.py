"""Agreement between the processes of a multi-controller JAX job.

Everything that touches jax's distributed runtime client (a private API: its key-value
store) lives here, so a change there touches one file. With one process every function
is a cheap no-op.

Processes agree through the key-value store rather than XLA collectives, so a save's
background thread never competes with the training loop's collectives.

A collective operation (one save, one manager start) is an ``Operation``. Inside it,
processes ``post`` their outcome of a phase (``ok`` with a payload, or an error) and
``wait_for`` the posts of the peers they depend on. Waiting tells three kinds of peer
apart, so that a slow process is never mistaken for a dead one:

* a peer that is *in* the operation and alive: its heartbeat key (``jaxckpt/hb/<p>``,
  rewritten every ``HEARTBEAT_S`` by a thread of that process while it is inside any
  operation) keeps changing. It is waited for as long as it takes: writing tens of GB
  is slow, not broken.
* a peer in the operation whose heartbeat stopped moving for ``STALE_S``: dead (or
  wedged). The wait fails, naming it, well before JAX's coordination service kills the
  survivors (~40 s after a death).
* a peer that has not started the operation: waited for ``timeout_s`` (counted from
  when the waiting process started waiting), then the wait fails.

Staleness is judged on the observer's own clock from changes of the peer's counter, so
clocks of different hosts never need to agree.

Keys of an operation are deleted once they can no longer be read: process 0 deletes
them when every process has posted in a later operation (each process runs its
collective operations one after another, so by then everyone is done with the old one).
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

import jax

from ._errors import CheckpointError

DEFAULT_TIMEOUT_S = 30.0  # waiting for a peer that has not started the operation
HEARTBEAT_S = 1.0  # how often a process inside an operation proves it is alive
STALE_S = 10.0  # a peer in the operation whose heartbeat did not move for this long is dead
_WAIT_MS = 500  # one blocking wait on the key-value store, between liveness checks
_PART_BYTES = 1 << 20  # large payloads are split into parts of this size
_ROOT = "jaxckpt"

_seq_lock = threading.Lock()
_seq = itertools.count()


def process_index() -> int:
    return jax.process_index()


def process_count() -> int:
    return jax.process_count()


def next_id() -> int:
    """A number that is the same in every process for the n-th collective operation.

    Collective operations (saves, manager starts) must be issued in the same order by
    every process, as with any SPMD program.
    """
    with _seq_lock:
        return next(_seq)


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
    counter and the names of the operations it is in."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active: dict[str, int] = {}
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
            self._beat_locked()
        self._wake.set()

    def _beat_locked(self) -> None:
        value = f"{next(self._counter)} {' '.join(sorted(self._active))}"
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


class _Peer:
    """What a waiting process has seen of one peer's heartbeat."""

    def __init__(self) -> None:
        self.value: str | None = None
        self.changed = time.monotonic()


def _read_heartbeat(client: Any, p: int) -> str | None:
    try:
        return client.key_value_try_get(f"{_ROOT}/hb/{p}")
    except Exception:  # noqa: BLE001 - not found: never beat yet
        return None


# --- operations ---------------------------------------------------------------------

_cleanup_lock = threading.Lock()
_finished_ops: list[tuple[str, str]] = []  # process 0: (lane, name) of operations whose keys may still be read


class Operation:
    """One collective operation. Use as a context manager around its phases.

    ``name`` must be the same in every process and unique per operation (take it from
    ``next_id()``); ``what`` is for messages (e.g. the checkpoint path). Operations
    run one after another in each ``lane`` (the saves on the save thread; ``"persist"``:
    the copies to a persistent tier, on their own thread); lanes may overlap.
    """

    def __init__(self, name: str, what: str = "", timeout_s: float | None = None, lane: str = ""):
        self.name, self.what, self.lane = name, what, lane
        self.timeout_s = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
        self.multi = process_count() > 1
        self._prefix = f"{_ROOT}/op/{name}/"

    def __enter__(self) -> Operation:
        if self.multi:
            _heartbeat.enter(self.name)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.multi:
            _heartbeat.exit(self.name)
            if process_index() == 0:
                with _cleanup_lock:
                    _finished_ops.append((self.lane, self.name))

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

    def wait_for(self, phase: str, peers: list[int]) -> dict[int, bytes]:
        """The payloads ``peers`` posted for ``phase``.

        Raises ``CheckpointError`` naming the peer if one posted an error, stopped
        heartbeating inside this operation for ``STALE_S``, or did not start the
        operation within ``timeout_s``.
        """
        if not self.multi:
            return {}
        client = _client()
        prefix = f"{self._prefix}{phase}/"
        start = time.monotonic()
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
                raise CheckpointError(
                    f"{self._label(phase)}: failed in process {', '.join(map(str, failed))} ({detail})")
            missing = [p for p in peers if p not in got]
            if not missing:
                if process_index() == 0 and set(peers) | {0} == set(range(process_count())):
                    _delete_finished_ops(client, self.lane, self.name)
                return {p: d[1:] for p, d in got.items()}
            self._check_alive(client, phase, missing, seen, start)
            try:  # sleep on the server until the first missing peer posts (or a short timeout)
                client.blocking_key_value_get_bytes(prefix + str(missing[0]) + "/n", _WAIT_MS)
            except Exception:  # noqa: BLE001, S110 - a timeout: check liveness again
                pass

    def _check_alive(self, client: Any, phase: str, missing: list[int], seen: dict[int, _Peer],
                     start: float) -> None:
        now = time.monotonic()
        for p in missing:
            value = _read_heartbeat(client, p)
            peer = seen[p]
            if value != peer.value:
                peer.value, peer.changed = value, now
            in_op = value is not None and self.name in value.split()[1:]
            if in_op and now - peer.changed > STALE_S:
                raise CheckpointError(
                    f"{self._label(phase)}: process {p} stopped responding (no heartbeat for "
                    f"{now - peer.changed:.0f}s; dead or hung)")
            if not in_op and now - start > self.timeout_s:
                raise CheckpointError(
                    f"{self._label(phase)}: process {p} did not report within {self.timeout_s:g}s "
                    "(failed, dead, or not running the same collective operations in the same order)")

    # --- the shapes of agreement --------------------------------------------------

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
    return b"".join(client.blocking_key_value_get_bytes(f"{key}/{i}", 10_000) for i in range(n))


def _delete_finished_ops(client: Any, lane: str, current: str) -> None:
    """Process 0, once every process posted in ``current``: drop the keys of the older
    operations of the same lane (a process posting in ``current`` has finished those;
    operations of other lanes run on other threads and may still be read)."""
    with _cleanup_lock:
        doomed = [n for ln, n in _finished_ops if ln == lane and n != current]
        _finished_ops[:] = [(ln, n) for ln, n in _finished_ops if ln != lane or n == current]
    for name in doomed:
        try:
            client.key_value_delete(f"{_ROOT}/op/{name}/")
        except Exception:  # noqa: BLE001, S110 - cleanup is best effort
            pass


def op_keys() -> list[str]:
    """Every key this library holds in the key-value store (tests check they do not pile up)."""
    if process_count() == 1:
        return []
    return [k for k, _ in _client().key_value_dir_get(f"{_ROOT}/op/")]
