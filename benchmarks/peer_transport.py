"""Peer copies' transports, measured in one job (issue 32, item 6).

N processes (one CPU device each, a directory per process on /dev/shm), ``--mib`` MiB of
state sharded over them. In the same job, interleaved repetition by repetition:

* raw rate of each transport, every process sending its share to the next one around
  the ring at once, from memory to memory: ``jax.experimental.transfer`` (the peer
  link's blocks, offered and pulled) and JAX's collectives (a jitted ``ppermute`` in
  64 MiB waves, the transport peer copies used before);
* the copy: one committed step's peer copy as the manager makes it (read, move, write,
  commit), timed from its start to its verdict;
* the training loop: the step time of a jitted step with a ``psum`` across the processes,
  quiet and while a copy moves in the background (the manager's peer thread).

Prints a markdown table of medians (slowest process per repetition).

    python benchmarks/peer_transport.py [--procs 4] [--mib 512] [--reps 3] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(port: int, nproc: int, pid: int, args: dict) -> None:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid, initialization_timeout=120)
    import threading

    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxckpt
    from jaxckpt import _distributed
    from jaxckpt._manager import peerlink, peers

    share = args["mib"] * (1 << 20) // nproc
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
    rows = share * nproc // 4096
    sharding = NamedSharding(mesh, P("d", None))
    state = {"w": jax.make_array_from_callback((rows, 1024), sharding, lambda idx: np.full(
        ((idx[0].stop or rows) - (idx[0].start or 0), 1024), pid, np.float32)), "step": 1}
    out: dict = {"pid": pid, "transfer": [], "ppermute": [], "copy": [], "quiet": [], "busy": []}
    nxt, prv = (pid + 1) % nproc, (pid - 1) % nproc

    data = np.random.default_rng(pid).integers(0, 255, share, np.uint8)

    class Mem:  # a stream of ``share`` bytes from memory, a sink that drops them
        def __init__(self):
            self.data, self.at = data, 0

        def read_into(self, buf):
            buf[:] = self.data[self.at:self.at + buf.size]
            self.at += buf.size

        def write_from(self, row):
            self.at += row.size

    def transfer_once(rep: int) -> float:
        with _distributed.Operation(f"bench-x{rep}", "bench") as op:
            op.post("addr", peerlink.address().encode())
            addr = op.wait_for("addr", [prv])[prv].decode()
            multihost_utils.sync_global_devices(f"x{rep}")
            offer, pull, source, sink = (peerlink.Offer(op, nxt, "b", share), peerlink.Pull(op, prv, addr, "b", share),
                                         Mem(), Mem())
            t = time.perf_counter()
            sender = threading.Thread(target=offer.send, args=(source,))
            sender.start()
            pull.receive(sink)
            sender.join()
            return time.perf_counter() - t

    def ppermute_once(rep: int) -> float:
        row = np.zeros(peers.BLOCK_BYTES, np.uint8)
        pairs = tuple((p, (p + 1) % nproc) for p in range(nproc))
        peers.permute(row, pairs)  # compiled before the clock
        multihost_utils.sync_global_devices(f"p{rep}")
        t = time.perf_counter()
        for _ in range(-(-share // peers.BLOCK_BYTES)):
            peers.permute(row, pairs)
        return time.perf_counter() - t

    def total(x):
        return jax.lax.psum(x.sum(), "d")

    step = jax.jit(lambda w: w * 0.999 + jax.shard_map(total, mesh=mesh, in_specs=P("d", None), out_specs=P())(w) * 0)

    def loop(w, n=args["steps"]) -> float:
        """Mean step time over ``n`` steps (the same in every process: the psum joins them)."""
        t = time.perf_counter()
        for _ in range(n):
            w = step(w)
            w.block_until_ready()
        return (time.perf_counter() - t) / n

    local = os.path.join(args["path"], f"host{pid}")
    with jaxckpt.CheckpointManager(local, max_to_keep=1, peer_copies=1, timeout_s=120) as mgr:
        mgr.save(1, state)
        mgr.wait_until_finished()
        w = jax.device_put(np.ones((nproc * 64, 1024), np.float32), NamedSharding(mesh, P("d", None)))
        loop(w, 3)
        for rep in range(args["reps"]):
            out["transfer"].append(transfer_once(rep))
            out["ppermute"].append(ppermute_once(rep))
            multihost_utils.sync_global_devices(f"c{rep}")
            t = time.perf_counter()
            error = mgr._peers._copy(1, f"bench-c{rep}")  # the copy of a committed step, as a save makes it
            out["copy"].append(time.perf_counter() - t)
            assert error is None, error
            out["quiet"].append(loop(w))
            job = mgr._peers._executor.submit(mgr._peers._copy, 1, f"bench-b{rep}")  # in the background
            out["busy"].append(loop(w))
            out.setdefault("copy_done_in_loop", []).append(job.done())
            assert job.result() is None
            multihost_utils.sync_global_devices(f"e{rep}")
    out["share"] = share
    print("RESULT " + json.dumps(out), flush=True)


def run_job(nproc: int, args: dict) -> dict[int, dict]:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(port), str(nproc), str(i), json.dumps(args)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for i in range(nproc)]
    results = {}
    for i, p in enumerate(procs):
        out, err = p.communicate(timeout=1800)
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        if not lines:
            raise SystemExit(f"process {i} failed ({p.returncode}):\n{err[-3000:]}")
        results[i] = json.loads(lines[-1][7:])
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--worker", nargs=4)
    opts = parser.parse_args()
    if opts.worker:
        port, nproc, pid, args = opts.worker
        worker(int(port), int(nproc), int(pid), json.loads(args))
        return
    if opts.smoke:
        opts.procs, opts.mib, opts.reps, opts.steps = 2, 8, 1, 5
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    scratch = tempfile.mkdtemp(prefix="jaxckpt-peerbench-", dir=base)
    try:
        res = run_job(opts.procs, {"path": scratch, "mib": opts.mib, "reps": opts.reps, "steps": opts.steps})
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    share = res[0]["share"]

    def med(key: str) -> float:  # the slowest process of each repetition, then the median
        return statistics.median(max(res[p][key][r] for p in res) for r in range(opts.reps))

    mib = share / (1 << 20)
    print(f"{opts.procs} processes, {opts.mib} MiB sharded ({mib:.0f} MiB a process, each to the next around the "
          f"ring at once), {opts.reps} repetitions, medians")
    print("| what | seconds | MiB/s per process | vs transfer raw |")
    print("|---|---:|---:|---:|")
    raw = med("transfer")
    for key, label in (("transfer", "jax.experimental.transfer, memory to memory (raw)"),
                       ("ppermute", "ppermute over gloo in 64 MiB waves (raw; before issue 32)"),
                       ("copy", "peer copy of a committed step (transfer: read, move, write, commit)")):
        print(f"| {label} | {med(key):.3f} | {mib / med(key):.0f} | {med(key) / raw:.2f}x |")
    quiet, busy = med("quiet"), med("busy")
    print(f"| training step (psum across processes), quiet | {quiet * 1e3:.1f} ms | | |")
    done = sum(all(res[p]["copy_done_in_loop"][r] for p in res) for r in range(opts.reps))
    print(f"| training step while a copy moves ({opts.steps} steps; the copy done within them in {done} of "
          f"{opts.reps} repetitions) | {busy * 1e3:.1f} ms ({busy / quiet:.2f}x) | | |")


if __name__ == "__main__":
    main()
