"""What the notebook view and ``info()`` show of a manager's steps."""

from __future__ import annotations

from typing import Any

from .. import _html


def step_info(man: Any) -> dict[str, Any]:
    """``man.info``, with ``stored_bytes`` and ``codecs`` when some of its leaves are compressed."""
    info = dict(man.info)
    stored, codecs = _html.stored_size(man.leaves)
    if codecs:
        info.update(stored_bytes=stored, codecs=codecs)
    return info


def step_infos(mgr: Any) -> dict[int, dict[str, Any]]:
    """``step_info`` of each listed local step (the notebook view's rows)."""
    with mgr._lock:
        listed = dict(mgr._steps.local.items())
    return {s: step_info(m) for s, m in listed.items()}


def best(mgr: Any) -> tuple[int, str, str] | None:
    """``(best step, best_metric, best_mode)``; ``None`` without ``best_metric`` or a step reporting it."""
    policy = mgr._retention.policy
    step = mgr.best_step() if policy.best_metric is not None else None
    return None if step is None else (step, policy.best_metric, policy.best_mode)


def html(mgr: Any) -> str:
    """The notebook view: directory, mode, steps (stored sizes, the best marked), totals, advice."""
    mode = "read-only" if mgr._read_only else "writer"
    return _html.render_manager(str(mgr._dir), mode, step_infos(mgr), mgr._clock(), mgr._advice,
                                best(mgr), None if mgr._read_only else mgr._decider.describe())
