"""Preemption: every process of a job agrees on one step at which to save and exit.

``PreemptionWatch.reached(step)`` is called by the training loop once per step, with
consecutive step numbers that are the same in every process. It returns ``False`` until
a preemption notice (SIGTERM, or JAX's own notice) has arrived in *any* process; then it
returns ``True`` at exactly one step, the same step in every process, which the loop
saves (``save(step, state, force=True)``, ``wait_until_finished()``) before exiting.

Two mechanisms, chosen at the first call:

**A job with jax.distributed** (any process count) uses JAX's preemption sync manager
(``jax._src.distributed.global_state.preemption_sync_manager``; the one behind
``jax.experimental.multihost_utils.reached_preemption_sync_point`` and orbax). It is
created by ``jax.distributed.initialize()`` (``jax_enable_preemption_service``, on by
default) and installs its own C++ SIGTERM handler there, so jaxckpt installs none. Its
protocol, over the coordination service:

1. Each call ``reached_sync_point(step)`` records ``step`` as this process's counter,
   under a mutex, and returns ``counter == sync_point`` (unset: -1). Cost: 0.07 us
   (0.3 us through ``reached``).
2. A process that gets SIGTERM notices it within 1 s (a listener thread polls a flag
   the signal handler sets) and writes the key ``RECEIVED_PREEMPTION_NOTICE``.
3. Every process waits on that key in the background. When it appears, a protocol
   thread takes the mutex and **keeps it** (the training thread cannot record a newer
   step: its next ``reached`` call blocks) while it posts its counter, waits at a
   barrier of all processes (up to 3 min) and reads every counter.
4. ``sync_point = max(counters) + 1``; the mutex is released.

Why every process returns ``True`` at the same step: counters are frozen while they
are compared, so each posted counter is the last step its process was told about, and
no process has passed ``max + 1`` (the fastest one's next step). Every process computes
the same max from the same keys and, stepping through consecutive steps, meets
``max + 1`` exactly once. A slow process keeps stepping until it gets there; a fast one
waits at most the barrier, once. The notice is one per job (JAX's design): after it the
job is meant to exit.

Limits (JAX's): steps must fit a C ``int`` and be non-negative (``reached_sync_point(-1)``
is ``True`` with no notice at all, so negative steps raise here); a notice that arrives
before any process has made its first call syncs at step 1 (every counter is still 0),
which a loop resuming at a later step never meets (it just restored: there is nothing
new to save); a Python SIGTERM handler installed *after* ``jax.distributed.initialize()``
replaces JAX's C++ one and the notice is never seen (a warning says so when one is
found).

**A single process without jax.distributed** needs no agreement: jaxckpt installs a
SIGTERM handler that sets a flag, and ``reached(step)`` returns ``True`` at the first
call after the flag was set (and again if called with that same step). The handler is
installed on the first ``reached`` call made from the main thread (Python only allows
that thread; calls from other threads return ``False`` until then), once per process
for all watches. A Python handler that was there before still runs after the flag is
set (if it raises, e.g. ``SystemExit``, that propagates as it always did). So does a
native one that Python's ``signal.getsignal`` does not see (``faulthandler.register``,
a C library's): on Linux its ``sigaction`` is saved before ours is installed, and on
SIGTERM it is put back for the time of re-raising the signal, so it runs as a signal
handler, not called from Python. When the last watch is closed the previous handler is
put back (the native one as it was), unless someone replaced ours since; if ours cannot
be removed (closed from another thread, or someone chained to it), it forwards SIGTERM
to the previous disposition, so an unwatched process still terminates. A SIGTERM that
arrived is remembered for the life of the process.

A multi-process job whose JAX preemption service is disabled is refused with an error
naming the option.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import signal
import sys
import threading
from typing import Any

from .._errors import CheckpointError

_log = logging.getLogger("jaxckpt")

# Native dispositions, read and written with libc's sigaction: a ``struct sigaction``
# kept as opaque bytes (glibc's is 152 bytes on x86-64 and aarch64, where its first
# member is the handler's address: 0 is SIG_DFL, 1 is SIG_IGN). Elsewhere: not used.
_ACTION_BYTES = 512
_NATIVE = sys.platform.startswith("linux") and platform.machine() in ("x86_64", "aarch64")


def _get_action(signum: int) -> bytes | None:
    """The process's ``struct sigaction`` for ``signum``; ``None`` where not available."""
    if not _NATIVE:
        return None
    buf = ctypes.create_string_buffer(_ACTION_BYTES)
    try:
        return buf.raw if ctypes.CDLL(None).sigaction(signum, None, buf) == 0 else None
    except (OSError, AttributeError):
        return None


def _set_action(signum: int, action: bytes) -> None:
    ctypes.CDLL(None).sigaction(signum, ctypes.create_string_buffer(action, _ACTION_BYTES), None)


def _handler_address(action: bytes) -> int:
    return int.from_bytes(action[:ctypes.sizeof(ctypes.c_void_p)], sys.byteorder)


class _SigtermFlag:
    """Process-wide: one SIGTERM handler that sets ``received`` while a watch uses it."""

    def __init__(self, signum: int = signal.SIGTERM):
        self.signum = signum
        self.received = False
        self._lock = threading.Lock()
        self._users = 0
        self._installed = False
        self._previous: Any = signal.SIG_DFL
        # A native handler Python does not see (``getsignal`` reports SIG_DFL or None for
        # it), and our own handler's action: both as ``struct sigaction`` bytes.
        self._native: bytes | None = None
        self._ours: bytes | None = None
        self._chaining = False  # the native handler is running (see _run_native)

    def acquire(self) -> bool:
        """Count one more user; install the handler if needed. ``False`` (nothing done)
        when not called from the main thread."""
        if threading.current_thread() is not threading.main_thread():
            return False
        with self._lock:
            self._users += 1  # first: a signal right after the install is already watched
            if not self._installed:
                try:
                    before = _get_action(self.signum)
                    self._previous = signal.getsignal(self.signum)
                    signal.signal(self.signum, self._handle)
                    self._ours = _get_action(self.signum)
                    self._native = _native_previous(before, self._ours)
                except BaseException:
                    self._users -= 1
                    raise
                self._installed = True
        return True

    def release(self) -> None:
        """One user fewer; the last one puts the previous handler back where it can."""
        with self._lock:
            self._users -= 1
            if self._users or not self._installed:
                return
            if threading.current_thread() is not threading.main_thread():
                return  # stays installed and forwards to the previous disposition
            if signal.getsignal(self.signum) == self._handle and self._still_ours():
                previous = self._previous
                signal.signal(self.signum, signal.SIG_DFL if previous is None else previous)
                if self._native is not None:
                    _set_action(self.signum, self._native)
                self._installed = False

    def _still_ours(self) -> bool:
        """No native handler replaced ours since (Python's own view cannot tell)."""
        now = _get_action(self.signum)
        return now is None or self._ours is None or _handler_address(now) == _handler_address(self._ours)

    def _handle(self, signum: int, frame: Any) -> None:
        # Runs in the main thread between bytecodes: no locks, no logging here.
        if self._chaining:  # the native handler chained on to Python's: to the Python one before it
            if callable(self._previous):
                self._previous(signum, frame)
            return
        if self._users:
            self.received = True
            if self._native is not None:
                self._run_native(signum)
            elif callable(self._previous):
                self._previous(signum, frame)
            return
        self._forward(signum, frame)

    def _run_native(self, signum: int) -> None:
        """The native handler that was there before ours, run as a signal handler: its
        action back while the signal is raised again in this thread (delivered before
        ``raise`` returns), then ours."""
        assert self._native is not None and self._ours is not None
        _set_action(signum, self._native)
        self._chaining = True
        try:
            signal.raise_signal(signum)  # Python runs what it chained to before this returns
        finally:
            self._chaining = False
            _set_action(signum, self._ours)

    def _forward(self, signum: int, frame: Any) -> None:
        """Unwatched: do what would have happened without us."""
        previous = self._previous
        if self._native is not None:
            self._run_native(signum)
        elif callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:  # the default (or a handler Python cannot call)
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)


def _native_previous(before: bytes | None, ours: bytes | None) -> bytes | None:
    """``before``, when it was a native handler: neither SIG_DFL, SIG_IGN nor Python's own
    (which ``ours`` is too, whatever the Python function)."""
    if before is None or ours is None:
        return None
    return None if _handler_address(before) in (0, 1, _handler_address(ours)) else before


_SIGTERM = _SigtermFlag()


def _jax_sync_manager() -> Any:
    """JAX's preemption sync manager if jax.distributed is initialized, else ``None``."""
    from jax._src import distributed

    state = distributed.global_state
    if state.client is None:
        return None
    manager = state.preemption_sync_manager
    if manager is None and state.num_processes > 1:
        raise CheckpointError(
            "reached_preemption in a multi-process job needs JAX's preemption service; "
            "it is disabled (jax.config.update('jax_enable_preemption_service', True) "
            "before jax.distributed.initialize())")
    return manager


class PreemptionWatch:
    """``reached(step)``: ``True`` at the one step, agreed by every process, at which a
    preempted job saves and exits (see the module docstring). Nothing is installed until
    the first call; ``close()`` gives the SIGTERM handler back."""

    def __init__(self, *, _flag: _SigtermFlag | None = None):
        self._flag = _SIGTERM if _flag is None else _flag
        self._check = self._start
        self._sync: Any = None  # JAX's sync manager, in a job with jax.distributed
        self._acquired = False
        self._warned_thread = False
        self._at: int | None = None  # single process: the step the notice was seen at

    def reached(self, step: int) -> bool:
        """Call once per step, every step, in every process; ``True``: save ``step``
        (``force=True``), wait for it, exit."""
        return self._check(step)

    @property
    def mode(self) -> str | None:
        """``"jax"`` (JAX's sync manager), ``"signal"`` (our SIGTERM handler), or ``None``
        before the first call."""
        if self._sync is not None:
            return "jax"
        return "signal" if self._acquired else None

    def close(self) -> None:
        if self._acquired:
            self._acquired = False
            self._flag.release()
        self._check = self._closed

    def _start(self, step: int) -> bool:
        sync = _jax_sync_manager()
        if sync is not None:
            self._sync = sync
            handler = signal.getsignal(signal.SIGTERM)
            if callable(handler):
                _log.warning("jaxckpt: a Python SIGTERM handler (%r) is installed; if it was installed after "
                             "jax.distributed.initialize() it replaced JAX's preemption notifier and "
                             "reached_preemption will not see SIGTERM", handler)
            self._check = self._check_jax
        elif self._flag.acquire():
            self._acquired = True
            self._check = self._check_signal
        else:
            if not self._warned_thread:
                self._warned_thread = True
                _log.warning("jaxckpt: reached_preemption called from a thread other than the main one; "
                             "the SIGTERM handler is installed at the first call from the main thread")
            return False
        return self._check(step)

    def _check_jax(self, step: int) -> bool:
        if step < 0:  # JAX's "no sync point yet" is -1: reached_sync_point(-1) would be True
            raise _bad_step(step)
        try:
            hit = self._sync.reached_sync_point(step)
        except TypeError as e:  # not an int, or beyond a C int
            raise _bad_step(step) from e
        if hit:
            _log.warning("jaxckpt: preemption notice: every process saves step %d and exits", step)
        return hit

    def _check_signal(self, step: int) -> bool:
        if step < 0:
            raise _bad_step(step)
        if self._at is None:
            if not self._flag.received:
                return False
            self._at = step
            _log.warning("jaxckpt: SIGTERM received: saving step %d and exiting", step)
        return step == self._at

    def _closed(self, step: int) -> bool:
        raise CheckpointError("reached_preemption: the CheckpointManager is closed")


def _bad_step(step: object) -> CheckpointError:
    return CheckpointError(f"reached_preemption: step must be a non-negative int below 2**31, got {step!r}")
