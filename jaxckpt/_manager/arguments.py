"""The checks of ``CheckpointManager``'s arguments: steps to save and restore, positive
counts, metrics (cheap: types and shapes, no device sync in the training loop)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from .. import _tree
from .._errors import CheckpointError


def new_step(step: Any, force: bool, directory: Any, committed: Mapping[int, Any], submitted: set[int]) -> int:
    """``step`` as an int, unless it is not one, is committed or in flight already, or
    (without ``force``) is older than the newest of those."""
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise CheckpointError(f"step must be a non-negative int, got {step!r}")
    step = int(step)
    if step in committed:
        raise CheckpointError(f"Step {step} is already committed in '{directory}'")
    if step in submitted:
        raise CheckpointError(f"Step {step} is already being saved to '{directory}'")
    newest = max(set(committed) | submitted, default=None)
    if not force and newest is not None and step < newest:
        raise CheckpointError(
            f"Step {step} is older than step {newest} in '{directory}': it could never be "
            "restored as the latest; pass force=True to save it anyway")
    return step


def step_to_restore(step: Any, directory: Any) -> int | None:
    """``restore`` takes the step first, where ``jaxckpt.restore`` takes the target
    second: a tree passed first (``mgr.restore(abstract_state)``) would otherwise fail
    deep inside as ``unhashable type``. Say which argument it belongs to."""
    if step is None:
        return None
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
        raise CheckpointError(
            f"Restoring from '{directory}': mgr.restore() takes the step first: got a "
            f"{type(step).__name__}; pass target=... (mgr.restore(target=abstract_state), or "
            "mgr.restore(step, target=abstract_state))")
    if step < 0:
        raise CheckpointError(f"step must be a non-negative int, got {step!r} (restoring from '{directory}')")
    return int(step)


def check_positive(**values: Any) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def refuse_tracers(step: Any, state: Any, metrics: Any, directory: Any) -> None:
    """A ``save`` called inside ``jax.jit``: refused before anything starts, naming the
    first traced leaf of ``state``, else the step or the first traced metric."""
    doing = f"Saving step {step if not isinstance(step, jax.core.Tracer) else '(traced)'} to '{directory}'"
    _tree.refuse_tracers(state, doing)
    if isinstance(step, jax.core.Tracer):
        raise CheckpointError(_tree.tracer_message(doing, "the step", step))
    for key, value in (metrics.items() if isinstance(metrics, Mapping) else ()):
        if isinstance(value, jax.core.Tracer):
            raise CheckpointError(_tree.tracer_message(doing, f"metrics['{key}']", value))


def check_metrics(metrics: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Check metrics cheaply (types and shapes only: no device sync in the loop)."""
    if metrics is None:
        return None
    if not isinstance(metrics, Mapping):
        raise CheckpointError(f"metrics must be a dict of str to numbers, got {type(metrics).__name__}")
    out = {}
    for key, value in metrics.items():
        if not isinstance(key, str):
            raise CheckpointError(f"metrics key {key!r} is a {type(key).__name__}; metric names must be str")
        if isinstance(value, (jax.Array, np.ndarray, np.generic)):
            if value.size != 1:
                raise CheckpointError(f"metrics['{key}'] has shape {value.shape}; a metric must be a scalar")
            if not (jax.dtypes.issubdtype(value.dtype, np.number) or value.dtype == np.bool_):
                raise CheckpointError(f"metrics['{key}'] has dtype {value.dtype}; a metric must be a number")
        elif value is not None and not isinstance(value, (bool, int, float, str)):
            raise CheckpointError(
                f"metrics['{key}'] is a {type(value).__name__}; a metric must be a number, a str or None")
        out[key] = value
    return out


def metrics_to_json(metrics: dict[str, Any] | None) -> dict[str, Any] | None:
    """Plain Python numbers for the manifest (runs on the background thread)."""
    if metrics is None:
        return None
    return {k: np.asarray(v).reshape(()).item() if hasattr(v, "dtype") else v for k, v in metrics.items()}
