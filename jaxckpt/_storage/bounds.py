"""The bounds on storage waits, from the environment: how long a wait for the store
may go without an answer (``JAXCKPT_IO_TIMEOUT_S``), tensorstore's retries sized to give
up within it, and curl's timeouts that fit it (docs/storage.md, "Failing, never
hanging"). Pure: nothing here talks to a store or writes the environment."""

from __future__ import annotations

import math
import os
from typing import Any

from .._errors import CheckpointError

IO_TIMEOUT_ENV = "JAXCKPT_IO_TIMEOUT_S"
DEFAULT_IO_TIMEOUT_S = 60.0


def io_timeout_s() -> float | None:
    """The I/O bound in seconds (``JAXCKPT_IO_TIMEOUT_S``, default 60); ``None`` when
    set to ``0``, ``inf`` or ``none`` (tensorstore's own retries, no bound: ~15 min)."""
    text = os.environ.get(IO_TIMEOUT_ENV, "").strip().lower()
    if not text:
        return DEFAULT_IO_TIMEOUT_S
    if text in ("0", "inf", "none"):
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or math.isinf(value):
        raise CheckpointError(f"{IO_TIMEOUT_ENV} must be a positive number of seconds (or 0 for no bound), "
                              f"got {text!r}")
    return value


def request_retries(bound: float) -> dict[str, Any]:
    """tensorstore's retry policy for object-store requests, sized so that its backoff
    delays add up to at most a third of ``bound`` even with the most jitter: a dead
    endpoint then fails with tensorstore's own cause, well within the bound.

    tensorstore waits ``min(initial * 2**i + U(0, initial), max)`` before retry ``i``;
    its default (32 retries, 1 s to 32 s) adds up to about 15 minutes.
    """
    initial = min(1.0, bound / 60)
    largest = max(initial, bound / 6)
    retries, total = 0, 0.0
    while retries < 32:
        total += min(initial * 2 ** retries + initial, largest)
        if total > bound / 3:
            break
        retries += 1
    return {"max_retries": max(1, retries), "initial_delay": f"{initial * 1000:.0f}ms",
            "max_delay": f"{largest * 1000:.0f}ms"}


def http_timeouts(bound: float) -> dict[str, str]:
    """curl's connect timeout and low-speed time that fit ``bound``: the environment
    variables, and their values, with which curl drops a request that cannot connect (in
    bound/12) or moves next to nothing (for bound/8), and tensorstore retries it.

    A library call never sets them. tensorstore 0.1.86 has no context resource or spec
    member for curl's timeouts: it reads these variables (or its absl flags) once per
    process, when it makes its one HTTP transport, which every tensorstore user of the
    process then shares and which cannot be changed back. So they are the user's to set
    (docs/storage.md, "Failing, never hanging"); the ``jaxckpt`` command, which owns its
    process, sets the ones the user left unset. Without them tensorstore's own defaults
    hold (it drops a stalled transfer after 120 s), and the bound on every wait
    (``wait``) still fails a silent store's requests within ``bound``.
    """
    return {"TENSORSTORE_CURL_CONNECT_TIMEOUT_SECONDS": str(max(1, round(bound / 12))),
            "TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS": str(max(2, round(bound / 8)))}


def command_http_timeouts() -> dict[str, str]:
    """curl's timeouts (``http_timeouts``) for the I/O bound the environment sets, for the
    ``jaxckpt`` command to put in its own process's environment (a library call never
    changes the process); none for no bound, or for a bad ``JAXCKPT_IO_TIMEOUT_S``, which
    the command reports when it first waits."""
    try:
        bound = io_timeout_s()
    except CheckpointError:
        return {}
    return http_timeouts(bound) if bound is not None else {}
