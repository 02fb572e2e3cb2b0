"""Agreement between the processes of a multi-controller JAX job.

Everything that touches jax's distributed runtime client (a private API) lives here, so
a change there touches one file. With one process every function is a cheap no-op.
"""

from __future__ import annotations

import jax

from ._errors import CheckpointError

DEFAULT_TIMEOUT_S = 30.0


def process_index() -> int:
    return jax.process_index()


def process_count() -> int:
    return jax.process_count()


def _client():
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise CheckpointError(
            "jax.process_count() > 1 but jax.distributed is not initialized; "
            "call jax.distributed.initialize() first"
        )
    return client


def barrier(name: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Block until every process reaches the barrier ``name`` (unique per use)."""
    if process_count() == 1:
        return
    try:
        _client().wait_at_barrier(f"jaxckpt/{name}", int(timeout_s * 1000))
    except Exception as e:  # noqa: BLE001 - jax raises JaxRuntimeError
        raise CheckpointError(f"processes did not all reach '{name}' within {timeout_s:g}s: {e}") from e


def broadcast(name: str, value: str | None, timeout_s: float = DEFAULT_TIMEOUT_S) -> str:
    """Process 0's ``value`` in every process."""
    if process_count() == 1:
        assert value is not None
        return value
    client = _client()
    key = f"jaxckpt/{name}"
    if process_index() == 0:
        assert value is not None
        client.key_value_set(key, value)
        return value
    try:
        return client.blocking_key_value_get(key, int(timeout_s * 1000))
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"did not hear '{name}' from process 0 within {timeout_s:g}s: {e}") from e
