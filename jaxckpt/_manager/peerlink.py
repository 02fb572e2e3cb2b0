"""How peer copies move their bytes: ``jax.experimental.transfer``, jaxlib's point-to-point
transport, outside the stream of collectives.

A collective (``ppermute``) must be issued by every process in the same order as every
other collective, so a copy over collectives can only run on the training loop's own
thread, where it stalls the loop. A pull over a transfer server is between two
processes only and joins no collective stream: it may run on a background thread while
the loop issues its own collectives (tests/test_peer_background.py runs both for 200
steps). Everything that touches the transfer API lives here.

Each process runs one transfer server (started on first use, on this host's CPU device:
pulled bytes land in host memory, never in an accelerator's). A copy is an
``Operation`` of the processes involved: a sender reads its files block by block
(``BLOCK_BYTES``) into fresh host buffers, offers each block under an id of its own
(``await_pull``) and posts that id; its receiver pulls the block, writes it, and posts
its acknowledgement. At most ``WINDOW`` blocks per pair are offered and not yet
acknowledged, so a copy's host memory is bounded whatever the size of the part. Every
wait is the operation's: a posted error fails it at once, a dead peer within
``STALE_S``, a peer alive but making no progress within the stall bound. A pull the
sender never completes (it died) is given up after that bound: the transfer API's own
timeout does not fire for a dead peer (checked with jaxlib 0.10.2), so the receiver
polls the pulled array's readiness instead of blocking on it.
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
import time
from typing import Any

import numpy as np

from .. import _distributed, _storage

BLOCK_BYTES = 64 << 20  # one offer: bounds a copy's host memory with WINDOW
WINDOW = 2  # blocks offered per pair before the receiver's acknowledgement
_POLL_S = 0.002  # between looks at a pulled block's readiness
_ALIVE_EVERY_S = 0.5  # between liveness checks of the sender while a pull is on its way
TAKE_BACK_S = 2.0  # a failed copy's wait for its own offers pulled back (one the receiver took never comes)

_lock = threading.Lock()
_server: Any = None
_ids = itertools.count(1)


def host_device() -> Any:
    """The device whose memory pulled bytes land in: this process's first CPU device."""
    import jax

    return jax.local_devices(backend="cpu")[0]


def advertised_host() -> str:
    """The address other hosts reach this one at: ``JAXCKPT_PEER_HOST`` when set, else
    the local address of this host's route to the job's coordinator."""
    explicit = os.environ.get("JAXCKPT_PEER_HOST")
    if explicit:
        return explicit
    coordinator = _distributed.coordinator_host()
    if coordinator in (None, "", "localhost") or coordinator.startswith("127."):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # a UDP connect sends nothing
        s.connect((coordinator, 9))
        return s.getsockname()[0]


def server() -> Any:
    """This process's transfer server (started once, kept for the process's life)."""
    global _server
    with _lock:
        if _server is None:
            from jax.experimental import transfer

            dev = host_device()
            host = advertised_host()
            _server = transfer.start_transfer_server(dev.client, f"{host}:0", [f"{host}:0"])
        return _server


def address() -> str:
    return server().address()


class Offer:
    """One sender's side of a copy to one receiver, block by block. The receiver waits for
    the blocks in order and this side for the acknowledgements in order, so a failure on
    either side is posted where the other waits next (``abort``)."""

    def __init__(self, op: _distributed.Operation, receiver: int, tag: str, total: int):
        self.op, self.receiver, self.tag, self.total = op, receiver, tag, total
        self.blocks = -(-total // BLOCK_BYTES)
        self.next = 0  # the next block the receiver waits for

    def send(self, stream: Any) -> None:
        """Offer the bytes read from ``stream`` (``read_into(buf)``); raises what failed
        here (then ``abort``) or what the receiver posted. Blocks offered and never
        pulled (the receiver failed) are taken back, so nothing stays held."""
        import jax

        srv, dev = server(), host_device()
        held: dict[int, tuple[int, Any]] = {}  # offered, not yet acknowledged: block -> (id, array)
        try:
            for b in range(self.blocks):
                if b >= WINDOW:  # the receiver wrote block b - WINDOW: its buffer goes
                    self.op.wait_for(f"{self.tag}/ack{b - WINDOW}", [self.receiver])
                    held.pop(b - WINDOW, None)
                buf = np.empty(min(BLOCK_BYTES, self.total - b * BLOCK_BYTES), np.uint8)
                stream.read_into(buf)
                _storage.count()
                arr = jax.device_put(buf, dev)  # the server holds it until pulled
                del buf
                uid = next(_ids) + (_distributed.process_index() << 40)
                srv.await_pull(uid, [arr])
                held[b] = (uid, arr)
                self.next = b + 1
                self.op.post(f"{self.tag}/blk{b}", str(uid).encode())
            for b in range(max(0, self.blocks - WINDOW), self.blocks):
                self.op.wait_for(f"{self.tag}/ack{b}", [self.receiver])
                held.pop(b, None)
        except BaseException:
            _take_back(held)
            raise

    def abort(self, error: BaseException) -> None:
        if self.next < self.blocks:
            self.op.post(f"{self.tag}/blk{self.next}", error)


class Pull:
    """One receiver's side of a copy from one sender (``Offer``)."""

    def __init__(self, op: _distributed.Operation, sender: int, sender_address: str, tag: str, total: int):
        self.op, self.sender, self.sender_address, self.tag = op, sender, sender_address, tag
        self.total, self.blocks = total, -(-total // BLOCK_BYTES)
        self.next = 0  # the next acknowledgement the sender waits for

    def receive(self, sink: Any) -> None:
        """Pull the blocks and hand each to ``sink.write_from(row)``; raises what failed
        here (then ``abort``) or what the sender posted."""
        import jax

        if not self.blocks:
            return
        conn = server().connect(self.sender_address)
        sharding = jax.sharding.SingleDeviceSharding(host_device())
        for b in range(self.blocks):
            n = min(BLOCK_BYTES, self.total - b * BLOCK_BYTES)
            uid = int(self.op.wait_for(f"{self.tag}/blk{b}", [self.sender])[self.sender])
            (arr,) = conn.pull(uid, [jax.ShapeDtypeStruct((n,), np.uint8, sharding=sharding)])
            self._arrived(arr, f"{self.tag}/blk{b}")
            _storage.fault("peer", self.tag)
            sink.write_from(np.asarray(arr))
            _storage.count()
            del arr
            self.next = b + 1
            self.op.post(f"{self.tag}/ack{b}")

    def abort(self, error: BaseException) -> None:
        if self.next < self.blocks:
            self.op.post(f"{self.tag}/ack{self.next}", error)

    def _arrived(self, arr: Any, phase: str) -> None:
        """Wait until a pulled block is here, judging the sender as the operation does
        (dead: ``STALE_S``; alive and stuck: the stall bound)."""
        check = self.op.watch(phase, [self.sender])
        checked = time.monotonic()
        try:
            while not arr.is_ready():
                time.sleep(_POLL_S)
                if time.monotonic() - checked > _ALIVE_EVERY_S:
                    check()
                    checked = time.monotonic()
        finally:
            self.op.done_waiting()
        arr.block_until_ready()  # raises the transfer's own error, if it failed


def _take_back(held: dict[int, tuple[int, Any]]) -> None:
    """Pull this process's own offers that the receiver never pulled, so that the
    server lets their buffers go (a receiver that failed leaves them offered for the
    process's life: 192 MiB more a failed copy, a breaker's case). An offer the receiver
    did pull never arrives here again: it is given up after ``TAKE_BACK_S``."""
    if not held:
        return
    import jax

    sharding = jax.sharding.SingleDeviceSharding(host_device())
    conn = server().connect(address())
    pulls = [conn.pull(uid, [jax.ShapeDtypeStruct(arr.shape, arr.dtype, sharding=sharding)])[0]
             for uid, arr in held.values()]
    held.clear()
    deadline = time.monotonic() + TAKE_BACK_S
    while any(not p.is_ready() for p in pulls) and time.monotonic() < deadline:
        time.sleep(_POLL_S)

