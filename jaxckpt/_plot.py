"""``plot_history``: a run's metrics and its checkpoint cost over steps (matplotlib,
imported only when called: ``pip install "jaxckpt[notebook]"``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._manager import history as _history


def plot_history(mgr_or_directory: Any, metrics: str | Sequence[str] | None = None, ax: Any = None) -> Any:
    """Plot metrics and the cost of each save over steps; return the figure.

    Every record of the history is plotted, steps deleted by retention included.
    Without ``ax`` the figure has two panels sharing the step axis: the metrics on top,
    the blocking and total seconds of each save below. With ``ax`` the metrics go on
    ``ax`` and the save seconds on a second y axis (``ax.twinx()``).

    Args:
      mgr_or_directory: a ``CheckpointManager``, a ``History``, or a manager directory.
      metrics: a metric name or names (default: every numeric metric recorded).
      ax: a matplotlib ``Axes`` to draw into (default: a new figure).

    Returns:
      The ``matplotlib.figure.Figure`` (the last expression of a notebook cell shows it).

    Raises:
      ImportError: matplotlib is not installed.
      KeyError: a requested metric is in no record.

    Example:
      >>> fig = jaxckpt.plot_history(mgr, metrics=["loss"])
      >>> fig.savefig("history.png")
    """
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError('jaxckpt.plot_history needs matplotlib: pip install "jaxckpt[notebook]"') from e
    hist = _as_history(mgr_or_directory)
    names = _metric_names(hist, metrics)
    if ax is None:
        fig = Figure(figsize=(8, 5.5), layout="constrained")
        metric_ax, cost_ax = fig.subplots(2, 1, sharex=True)
        cost_ax.set_xlabel("step")
    else:
        fig, metric_ax = ax.figure, ax
        cost_ax = ax.twinx()
        metric_ax.set_xlabel("step")
    for name in names:
        pts = [(r.step, r.metrics[name]) for r in hist if _numeric((r.metrics or {}).get(name))]
        metric_ax.plot([s for s, _ in pts], [v for _, v in pts], marker=".", label=name)
    metric_ax.set_ylabel("metrics" if len(names) != 1 else names[0])
    if names:
        metric_ax.legend(loc="upper left")
    for field, style in (("blocking_seconds", "--"), ("total_seconds", ":")):
        pts = [(r.step, getattr(r, field)) for r in hist if getattr(r, field) is not None]
        cost_ax.plot([s for s, _ in pts], [v for _, v in pts], style, marker="x",
                     color="C7" if field == "total_seconds" else "C9", label=f"save {field.split('_')[0]} s")
    cost_ax.set_ylabel("seconds per save")
    cost_ax.legend(loc="upper right")
    metric_ax.set_title(f"jaxckpt history: {hist.directory}" if hist.directory else "jaxckpt history")
    return fig


def _as_history(obj: Any) -> _history.History:
    if isinstance(obj, _history.History):
        return obj
    if callable(getattr(obj, "history", None)):  # a CheckpointManager (no import cycle)
        return obj.history()
    return _history.history(obj)


def _metric_names(hist: _history.History, metrics: str | Sequence[str] | None) -> list[str]:
    recorded = [n for n in hist.metric_names() if any(_numeric((r.metrics or {}).get(n)) for r in hist)]
    if metrics is None:
        return recorded
    names = [metrics] if isinstance(metrics, str) else list(metrics)
    missing = [n for n in names if n not in recorded]
    if missing:
        raise KeyError(f"no numeric metric {missing} in the history of '{hist.directory}' "
                       f"(recorded: {recorded})")
    return names


def _numeric(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
