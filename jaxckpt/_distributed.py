"""Agreement between the processes of a multi-controller JAX job.

Everything that touches jax's distributed runtime client (a private API: its key-value
store) lives here, so a change there touches one file. With one process every function
is a cheap no-op.

Processes agree through the key-value store rather than XLA collectives, so a save's
background thread never competes with the training loop's collectives. Each phase of
a save is an ``agree``: every process posts ``ok`` or its error under the phase's key,
then waits for all posts; one error, or a process that never posts within the timeout,
fails the phase in every process, naming the culprit.
"""

from __future__ import annotations

import itertools
import threading
import time

import jax

from ._errors import CheckpointError

DEFAULT_TIMEOUT_S = 30.0
_POLL_S = 0.005

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


def broadcast(name: str, value: str | None, timeout_s: float = DEFAULT_TIMEOUT_S) -> str:
    """Process 0's ``value`` in every process (``name`` must be unique per use)."""
    if process_count() == 1:
        assert value is not None
        return value
    client = _client()
    key = f"jaxckpt/{name}/value"
    if process_index() == 0:
        assert value is not None
        client.key_value_set(key, value)
        return value
    try:
        return client.blocking_key_value_get(key, int(timeout_s * 1000))
    except Exception as e:
        raise CheckpointError(
            f"{name}: process 0 did not answer within {timeout_s:g}s (failed or dead?)"
        ) from e


def agree(name: str, error: BaseException | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Post this process's outcome of phase ``name`` and wait for everyone's.

    Raises ``CheckpointError`` in every process if any process posted an error (naming
    it and its message) or did not post within ``timeout_s`` (naming the missing ones).
    Re-raises this process's own ``error`` unchanged if it had one.
    """
    if process_count() == 1:
        if error is not None:
            raise error
        return
    client = _client()
    me, n = process_index(), process_count()
    prefix = f"jaxckpt/{name}/"
    outcome = "ok" if error is None else "error:" + f"{type(error).__name__}: {error}"[:2000]
    client.key_value_set(prefix + str(me), outcome)
    if error is not None:
        raise error
    deadline = time.monotonic() + timeout_s
    while True:
        posted = {}
        for key, value in client.key_value_dir_get(prefix):
            tail = key.rsplit("/", 1)[-1]
            if tail.isdigit():
                posted[int(tail)] = value
        failed = sorted(p for p, v in posted.items() if v.startswith("error:"))
        if failed:
            detail = "; ".join(f"process {p}: {posted[p][6:]}" for p in failed)
            raise CheckpointError(f"{name}: failed in process {', '.join(map(str, failed))} ({detail})")
        if len(posted) == n:
            return
        if time.monotonic() > deadline:
            missing = sorted(set(range(n)) - set(posted))
            raise CheckpointError(
                f"{name}: process {', '.join(map(str, missing))} did not report within "
                f"{timeout_s:g}s (failed or dead?)"
            )
        time.sleep(_POLL_S)
