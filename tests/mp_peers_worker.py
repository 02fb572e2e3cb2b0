"""One process of a real multi-process JAX job whose manager keeps a local directory per
host with peer copies (tests/test_peers.py). One CPU device per process.

Usage: mp_peers_worker.py PORT NPROC PID SCENARIO JSON_ARGS
Prints one line `RESULT <json>`. With "tmpfs" in the arguments, the process first moves
into a mount namespace of its own where its host directory is a RAM disk of that many
bytes (``unshare -rm``: a full RAM disk without root or a shared /dev/shm).
"""

import json
import logging
import os
import shlex
import sys
import time
import traceback

port, nproc, pid, scenario = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
args = json.loads(sys.argv[5])
local = os.path.join(args["path"], f"host{pid}")
if args.get("tmpfs") and not os.environ.get("MP_PEERS_IN_NS"):
    os.makedirs(local, exist_ok=True)
    inner = " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])
    os.execvp("unshare", ["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size={args['tmpfs']} none "
                          f"{shlex.quote(local)} && MP_PEERS_IN_NS=1 exec {inner}"])
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid, initialization_timeout=60)

import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt import _storage

MESH = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
ROWS = args.get("rows", 64)
# "codecs": w and r compressed (zstd; r replicated, so each host writes its own copy), mu
# (sharded) quantized to int8: restored w, r, b bit for bit, mu within its int8 bound
CODECS = args.get("codecs", False)


def values(i, version=1):
    """Sharded over the processes: each host's part exists only in its directory. A step
    saved again (``version`` 2, 3, ...) has other values."""
    rng = np.random.default_rng(i + 1000 * (version - 1))
    w = rng.standard_normal((ROWS * nproc, 256)).astype(np.float32)
    out = {"w": w, "b": np.arange(1000, dtype=np.int32) * i * version}
    if CODECS:  # a compressed replicated leaf (half its rows zero: chunks stored as nothing) and a moment
        r = np.round(rng.standard_normal((ROWS * nproc, 64)), 1).astype(np.float32)
        r[: ROWS * nproc // 2] = 0
        out.update(r=r, mu=rng.standard_normal((ROWS * nproc, 128)).astype(np.float32) * (i + 1))
    return out


def state(i, version=1):
    out = {}
    for k, v in values(i, version).items():
        spec = P("x", None) if k in ("w", "mu") else P(None)
        out[k] = jax.make_array_from_callback(v.shape, NamedSharding(MESH, spec), lambda idx, v=v: v[idx])
    out["step"] = i
    out["version"] = version
    return out


def check(back):
    i = back["step"]
    for k, full in values(i, back["version"]).items():
        for shard in back[k].addressable_shards:
            got, want = np.asarray(shard.data), full[shard.index]
            if k == "mu":  # int8 with a scale per block: within half a step of the largest block's
                bound = np.abs(full).max() / 127 / 2 * 1.001
                assert got.dtype == want.dtype and np.abs(got - want).max() <= bound, (k, i)
                assert not np.array_equal(got, want), (k, i)  # it was quantized, not stored raw
                continue
            assert got.dtype == full.dtype and got.tobytes() == want.tobytes(), (k, i)
    return i


def versions_of(back, versions=(1, 2, 3)):
    """Which saved version each leaf of this process's shards matches bit for bit (0: none)."""
    out = {"version": back["version"]}
    for k in ("w", "b"):
        shards = [(np.asarray(s.data), s.index) for s in back[k].addressable_shards]
        out[k] = next((v for v in versions
                       if all(got.tobytes() == values(back["step"], v)[k][index].tobytes() for got, index in shards)),
                      0)
    return out


def listing(root):
    return sorted(n for n in os.listdir(root) if n.isdigit()) if os.path.isdir(root) else []


def peer_listing():
    top = os.path.join(local, ".jaxckpt-peers")
    return {n: listing(os.path.join(top, n)) for n in sorted(os.listdir(top))} if os.path.isdir(top) else {}


def fail_peer_write(op, key):
    if op == "peer":
        raise OSError(28, "No space left on device (injected)")


def tiers(mgr):
    return {str(k): list(v) for k, v in mgr.step_tiers().items()}


def arm_faults(step):
    """The explicit fault points of ``args``: "fail_read": [pid, step, block] (this process's
    read of that block of its part fails, mid-copy), "late": [pid, step, seconds] (this
    process starts that step's copy so late)."""
    from jaxckpt._manager import peers, peerwaves

    fail, late = args.get("fail_read"), args.get("late")
    if fail and fail[:2] == [pid, step]:
        real, calls = peerwaves.Files.read_into, []

        def read_into(self, buf):
            calls.append(1)
            if len(calls) == fail[2] + 1:
                raise OSError(5, "injected read error")
            return real(self, buf)

        peerwaves.Files.read_into = read_into
    if late and late[:2] == [pid, step]:
        real_copy = peers.PeerCopies._copy_once

        def copy_once(self, s, name):
            if s == step and late:
                time.sleep(late.pop())  # once: its copy again at the next save is on time
            return real_copy(self, s, name)

        peers.PeerCopies._copy_once = copy_once


def run_op(mgr, op):
    """One of "ops": ["save", step, version], ["delete", step], ["restore", step or None],
    ["no_room", pid, step] (this process's partner finds no room for the peer copies of
    that step: its free-space check reports 0 bytes), ["tiers"], ["wait"]."""
    from jaxckpt._manager import peers

    kind = op[0]
    try:
        if kind == "save":
            room = peers.free_bytes
            if args.get("no_room") in ([pid, op[1]], [pid, op[1], op[2] if len(op) > 2 else 1]):
                peers.free_bytes = lambda path: 0
            arm_faults(op[1])
            try:
                t = time.monotonic()
                mgr.save(op[1], state(op[1], op[2] if len(op) > 2 else 1))
                mgr.wait_until_finished()
            finally:
                peers.free_bytes = room
            timed = {"seconds": time.monotonic() - t} if args.get("time_ops") else {}
            return {"steps": mgr.all_steps(), "tiers": tiers(mgr), **timed}
        if kind == "delete":
            mgr.delete(op[1])
            return {"steps": mgr.all_steps()}
        if kind == "restore":
            back = mgr.restore(op[1], state(0))
            return {"step": back["step"], **versions_of(back), "steps": mgr.all_steps()}
        if kind == "tiers":
            return {"steps": mgr.all_steps(), "tiers": tiers(mgr)}
        if kind == "wait":
            mgr.wait_until_finished()
            return {"steps": mgr.all_steps(), "tiers": tiers(mgr)}
        raise ValueError(f"unknown op {op!r}")
    except jaxckpt.CheckpointError as e:
        return {"error": f"{type(e).__name__}: {e}"}


class Warnings(logging.Handler):
    """jaxckpt's warnings and errors in this process, for the result."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.seen = []

    def emit(self, record):
        self.seen.append(record.getMessage())


copied = []  # every copy this process took part in: (step, its operation's name)


def count_copies():
    from jaxckpt._manager import peers

    real = peers.PeerCopies._copy

    def copy(self, step, name):
        copied.append([step, name])
        return real(self, step, name)

    peers.PeerCopies._copy = copy


def main():
    out = {"pid": pid}
    if args.get("block_bytes"):  # smaller blocks: a part of several
        from jaxckpt._manager import peerlink

        peerlink.BLOCK_BYTES = args["block_bytes"]
    if args.get("count_copies"):
        count_copies()
    seen = Warnings()
    logging.getLogger("jaxckpt").addHandler(seen)
    options = dict(max_to_keep=args.get("keep", 2), timeout_s=20, peer_copies=args.get("copies", 1),
                   async_save=args.get("async", True), max_pending=args.get("max_pending", 1))
    if CODECS:
        options.update(compression={"w": "zstd", "r": ("zstd", 1)}, quantize={"mu": "int8"})
    if "durable" in args:
        options.update(persistent_directory=args["durable"], persistent_interval_steps=args.get("every", 2))
    with jaxckpt.CheckpointManager(local, **options) as mgr:
        out["steps_at_start"] = mgr.all_steps()
        out["latest_at_start"] = mgr.latest_step()
        if "restore" in args:
            try:
                out["restored"] = check(mgr.restore(args["restore"], state(0)))
            except jaxckpt.CheckpointError as e:
                out["error"] = f"{type(e).__name__}: {e}"
            out["tiers_after_restore"] = {str(k): list(v) for k, v in mgr.step_tiers().items()}
            out["on_disk_after_restore"] = listing(local)
        for i in args.get("save", []):
            if args.get("fail_peer") == [pid, i]:
                _storage.fault_hook = fail_peer_write
            try:
                mgr.save(i, state(i))
                mgr.wait_until_finished()
            except jaxckpt.CheckpointError as e:
                out.setdefault("save_errors", {})[str(i)] = str(e)
            _storage.fault_hook = None
        out["ops"] = [run_op(mgr, op) for op in args.get("ops", [])]
        out["steps"] = mgr.all_steps()
    out["on_disk"] = listing(local)
    out["peers"] = peer_listing()
    if "durable" in args and not isinstance(args["durable"], dict):
        out["durable_on_disk"] = listing(args["durable"])
    top = os.path.join(local, ".jaxckpt-peers")
    out["peer_attempts"] = sorted(n for d in (os.listdir(top) if os.path.isdir(top) else [])
                                  for n in os.listdir(os.path.join(top, d)) if n.startswith("."))
    out["warnings"] = seen.seen
    out["copied"] = copied
    print("RESULT " + json.dumps(out), flush=True)


try:
    main()
except BaseException:
    print("RESULT " + json.dumps({"pid": pid, "crash": traceback.format_exc()}), flush=True)
sys.stdout.flush()
jax.distributed.shutdown()
os._exit(0)
