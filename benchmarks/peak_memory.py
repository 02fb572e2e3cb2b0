#!/usr/bin/env python
"""Peak host memory per path, at two state sizes (issue 30: the table in docs/guarantees.md).

    python benchmarks/peak_memory.py                    # 256 and 512 MiB, every path (3-4.5 min on 2 cores)
    python benchmarks/peak_memory.py --mib 512 1024     # other sizes
    python benchmarks/peak_memory.py --cases save_raw,verify --json bench_out/peak.json
    python benchmarks/peak_memory.py --smoke            # 4 and 8 MiB, every path, under a minute

What is measured: the peak resident memory (RSS) of a process while it runs one path,
above its RSS once the state exists. The kernel's high-water mark is reset just before
the path (``echo 5 > /proc/self/clear_refs``, then ``VmHWM`` of ``/proc/self/status``);
where the reset does not work, a thread samples ``/proc/self/statm`` every 5 ms instead
(``method`` in the JSON). Before the baseline is taken the garbage collector runs and
glibc gives freed heap back (``malloc_trim``), so memory freed earlier cannot hide an
allocation. For a save the baseline holds the state; for a restore the restored arrays
are the state, so their bytes (every addressable shard: ``held``) are subtracted from the
peak; ``verify`` holds no state. With CPU "devices", device memory is host memory and
counts here.

The state: float32 leaves of random values (zstd hardly shrinks them: the worst case
for encoded bytes) of ``--leaf-mib`` each (32; a bigger state has more leaves, not bigger
chunks, so a path that holds a chunk or a fixed number of them stays flat and one that
holds a share of the state grows), half under ``params``, half under ``mu``
(moment-like). The rows and how each runs:

* saves (one process, 4 CPU devices, each leaf sharded in row blocks over them):
  ``jaxckpt.save`` raw, with ``compression="zstd"``, with ``quantize={"mu*": "int8"}``;
  an async manager save of the state as numpy leaves (copied, as host arrays must be for
  an async save) without and with ``max_staging_bytes`` (64 MiB); to S3 (a local moto
  server, the endpoint in the kvstore spec) with boto3 (multipart uploads) and without it
  (``sys.modules["boto3"] = None`` before jaxckpt is imported); to GCS (the local
  emulator of tests/conftest.py, ``TENSORSTORE_GCS_HTTP_URL``) with a token for the
  compose request (the path google-auth's credentials open; google-auth itself is not
  installed here) and without one (``sys.modules["google.auth"] = None`` and jaxckpt's
  token variable renamed, while tensorstore keeps its own): data objects composed from
  parts, or sent whole (``parts`` in the JSON says which path a run took);
* restore (4 CPU devices, the same sharding) and ``jaxckpt.verify`` of a raw and of a
  zstd checkpoint, saved beforehand by a process of its own;
* 2-process jobs (real ``jax.distributed`` processes, gloo, one CPU device each; each
  process measures itself and the row shows the larger): a read-once restore
  (``JAXCKPT_READ_ONCE=1``) of the raw checkpoint, replicated on both; a host copy: a
  manager per process on a directory per host, the replicated state saved as step 1,
  host 1's directory wiped, then a manager start and ``restore()`` (host 0 sends the step
  over the collectives); a peer copy: ``peer_copies=1``, the state sharded over the two
  processes, ``save(1)`` with ``async_save=False`` (each process writes its half and
  sends it to its partner, receiving the partner's), and after host 1's directory is
  wiped, a manager start and ``restore()`` (host 0 sends host 1's half back);
* bound checks: S3 and GCS with parts of 8 MiB (``uploads.PART_BYTES``, 64 MiB by
  default) and read-once with waves of 64 MiB (``_exchange.WAVE_BYTES``, 512 MiB): their
  default bounds lie above the default state sizes, so those rows grow up to them;
  smaller settings show whether what they hold is the setting or the state.

Every measured process first runs the same path on a 1 MiB state (imports, thread pools,
stores opened: fixed costs that would otherwise count). Each case and size runs in fresh
processes. ``--smoke`` (1 MiB leaves) checks that every path runs, in few processes: the
one-process cases in two (the optional extras present, then hidden), the 2-process ones
in two jobs (the saves, then the rest), each for both sizes; its figures are not the table's. The servers are
processes of their own and not counted.

Columns: the peak above the state at each size, ``B/A`` (about 1 when flat, 2 when it
grows with the state; ``-`` when the smaller is under 1 MiB) and ``slope`` = (peak at B -
peak at A) / (B - A): MiB of peak per MiB of state (about 0 when flat, 1 when the path
holds a copy of the state). The exit status is 1 if any case failed.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import importlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
OUT_ROOT = os.path.join(REPO, "bench_out")  # gitignored; same disk as the repo
MARK = "@@PEAK "
MiB = 1 << 20
WARM_MIB = 1
BUDGET_MIB = 64
BUCKET_S3, BUCKET_GCS = "jaxckpt-bench", "bench"

# id -> (row label, "single" (one process) or "mp" (a 2-process job))
CASES = {
    "save_raw": ("save, local, raw", "single"),
    "save_zstd": ("save, local, `compression=\"zstd\"`", "single"),
    "save_quant": ("save, local, `quantize={\"mu*\": \"int8\"}`", "single"),
    "save_async": ("async save (manager), numpy leaves, no budget", "single"),
    "save_budget": (f"async save (manager), numpy leaves, `max_staging_bytes` {BUDGET_MIB} MiB", "single"),
    "save_s3": ("save, S3, with boto3", "single"),
    "save_s3_bare": ("save, S3, without boto3", "single"),
    "save_gcs": ("save, GCS, with a token (google-auth's path)", "single"),
    "save_gcs_bare": ("save, GCS, without google-auth", "single"),
    "restore": ("restore, raw, 4 devices", "single"),
    "restore_zstd": ("restore, zstd, 4 devices", "single"),
    "verify": ("`verify`, raw", "single"),
    "verify_zstd": ("`verify`, zstd", "single"),
    "read_once": ("read-once restore, 2 processes, replicated", "mp"),
    "host_copy": ("host copy: start + restore, a wiped host gets the step (2 processes)", "mp"),
    "peer_save": ("peer copy: save with `peer_copies=1` (2 processes)", "mp"),
    "peer_repair": ("peer copy: start + restore, a wiped host's part sent back (2 processes)", "mp"),
    "save_s3_parts8": ("bound check: save, S3, with boto3, parts of 8 MiB", "single"),
    "save_gcs_parts8": ("bound check: save, GCS, with a token, parts of 8 MiB", "single"),
    "read_once_waves64": ("bound check: read-once restore, waves of 64 MiB", "mp"),
}
# a case that is another with one of jaxckpt's constants set: (the other, module, name, value)
TUNED = {
    "save_s3_parts8": ("save_s3", "jaxckpt._storage.uploads", "PART_BYTES", 8 * MiB),
    "save_gcs_parts8": ("save_gcs", "jaxckpt._storage.uploads", "PART_BYTES", 8 * MiB),
    "read_once_waves64": ("read_once", "jaxckpt._exchange", "WAVE_BYTES", 64 * MiB),
}
# the cases reading the checkpoints one process saves before them
NEEDS_CKPT = {"restore", "restore_zstd", "verify", "verify_zstd", "read_once"}


def base(case: str) -> str:
    return TUNED[case][0] if case in TUNED else case


def store(case: str) -> str | None:
    """``"s3"``, ``"gcs"`` or ``None`` (local)."""
    name = base(case)
    return "s3" if name.startswith("save_s3") else "gcs" if name.startswith("save_gcs") else None


# --- measuring -------------------------------------------------------------------------


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(ln for ln in f if ln.startswith(field + ":")).split()[1])


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _trim() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _reset_hwm() -> bool:
    """Reset the kernel's high-water mark to the current RSS; whether that worked."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return _status_kib("VmHWM") <= _status_kib("VmRSS") + 1024


class PeakRSS:
    """The peak RSS of this process over a ``with`` block, and its RSS just before."""

    def __enter__(self) -> PeakRSS:
        _trim()
        self.before = rss_bytes()
        self.method = "VmHWM" if _reset_hwm() else "sampled"
        self._samples = [self.before]
        if self.method == "sampled":
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self._samples.append(rss_bytes())

    def __exit__(self, *exc: object) -> None:
        if self.method == "VmHWM":
            self.peak = max(_status_kib("VmHWM") << 10, rss_bytes())
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(max(self._samples), rss_bytes())
        _trim()
        self.after = rss_bytes()

    def result(self, held: int = 0, **extra: object) -> dict:
        """``peak_above_mib``: the peak over the RSS before, less ``held`` (a restore's
        result); ``after_above_mib``: the same of the RSS once the block is over (what it
        kept, the result aside)."""
        return {"peak_above_mib": (self.peak - self.before - held) / MiB,
                "after_above_mib": (self.after - self.before - held) / MiB, "before_mib": self.before / MiB,
                "held_mib": held / MiB, "method": self.method, **extra}


# --- states ----------------------------------------------------------------------------


def shape_of(mib: int, leaf_mib: float) -> tuple[int, int]:
    """(leaves, rows): ``mib / leaf_mib`` leaves (at least 2) of (rows, 1024) float32, rows
    a multiple of 4 (row blocks over 4 devices)."""
    leaves = max(2, int(mib / leaf_mib))
    return leaves, max(4, mib * MiB // leaves // 4096 // 4 * 4)


def host_state(mib: int, leaf_mib: float) -> dict:
    """numpy leaves of random values (``shape_of``), half under ``params``, half under ``mu``."""
    import numpy as np

    rng = np.random.default_rng(mib)
    leaves, rows = shape_of(mib, leaf_mib)
    return {group: {f"w{i}": rng.standard_normal((rows, 1024), dtype=np.float32) for i in ids}
            for group, ids in (("params", range(leaves // 2)), ("mu", range(leaves - leaves // 2)))}


def target(mib: int, leaf_mib: float, sharding: object) -> dict:
    """``host_state``'s structure as ``ShapeDtypeStruct``s on ``sharding``."""
    import jax
    import numpy as np

    leaves, rows = shape_of(mib, leaf_mib)
    leaf = jax.ShapeDtypeStruct((rows, 1024), np.float32, sharding=sharding)
    return {group: {f"w{i}": leaf for i in ids}
            for group, ids in (("params", range(leaves // 2)), ("mu", range(leaves - leaves // 2)))}


def put(tree: dict, sharding: object) -> dict:
    """Each leaf onto ``sharding``, its host copy dropped as it goes."""
    import jax
    import numpy as np

    out: dict = {}
    for group, leaves in tree.items():
        out[group] = {}
        for name in list(leaves):
            v = leaves.pop(name)
            out[group][name] = jax.make_array_from_callback(v.shape, sharding, lambda idx, v=v: np.array(v[idx]))
            del v
    return out


def held_bytes(tree: object) -> int:
    """Bytes of every addressable shard (on CPU each device's buffer is host memory), or
    of every numpy leaf."""
    import jax

    return sum(sum(s.data.nbytes for s in x.addressable_shards) if isinstance(x, jax.Array) else x.nbytes
               for x in jax.tree_util.tree_leaves(tree) if hasattr(x, "nbytes"))


def check_first_leaf(back: dict, mib: int, leaf_mib: float) -> None:
    """The restored ``params/w0`` is the saved one, bit for bit (what this process holds)."""
    import numpy as np

    want = np.random.default_rng(mib).standard_normal((shape_of(mib, leaf_mib)[1], 1024), dtype=np.float32)
    for shard in back["params"]["w0"].addressable_shards:
        if np.asarray(shard.data).tobytes() != want[shard.index].tobytes():
            raise AssertionError(f"restored params/w0 differs from the saved one ({mib} MiB state)")


@contextlib.contextmanager
def tuned(case: str) -> Iterator[None]:
    """The constant a tuned case sets, set for the block."""
    if case not in TUNED:
        yield
        return
    _, name, attr, value = TUNED[case]
    module = importlib.import_module(name)
    before = getattr(module, attr)
    setattr(module, attr, value)
    try:
        yield
    finally:
        setattr(module, attr, before)


# --- one process -----------------------------------------------------------------------


def ckpt_path(d: str, kind: str, mib: int) -> str:
    return os.path.join(d, "ckpt", kind, str(mib))


def four_devices() -> object:
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    return NamedSharding(jax.sharding.Mesh(np.array(jax.devices()[:4]), ("x",)), P("x", None))


def destination(case: str, args: argparse.Namespace, tag: str) -> object:
    if store(case) == "s3":
        return {"driver": "s3", "bucket": BUCKET_S3, "endpoint": args.endpoint, "aws_region": "us-east-1",
                "path": f"peak/{case}/{tag}/"}
    if store(case) == "gcs":
        return f"gs://{BUCKET_GCS}/peak/{case}/{tag}"
    return os.path.join(args.dir, case, tag)


def read_case(case: str, mib: int, args: argparse.Namespace) -> dict:
    """A restore or verify of the checkpoint the setup process saved: 1 MiB, then ``mib``."""
    import jax

    import jaxckpt

    kind = "zstd" if case.endswith("_zstd") else "raw"
    for size in (WARM_MIB, mib):
        path = ckpt_path(args.dir, kind, size)
        if case.startswith("verify"):
            with PeakRSS() as m:
                report = jaxckpt.verify(path)
            if not report.ok:
                raise AssertionError(f"verify found problems: {report.problems[:3]}")
            result = m.result(bytes_read_mib=report.bytes_read / MiB)
        else:
            tgt = target(size, args.leaf_mib, four_devices())
            with PeakRSS() as m:
                back = jaxckpt.restore(path, tgt)
                jax.block_until_ready(back)
            result = m.result(held_bytes(back))
            check_first_leaf(back, size, args.leaf_mib)
            del back
    return result


def save_case(case: str, mib: int, args: argparse.Namespace) -> dict:
    """One save path: 1 MiB, then ``mib``."""
    import jaxckpt

    name = base(case)
    if name in ("save_async", "save_budget"):
        budget = {"max_staging_bytes": BUDGET_MIB * MiB} if name == "save_budget" else {}

        def save(where: object, state: dict) -> dict:
            with jaxckpt.CheckpointManager(where, async_save=True, **budget) as mgr:
                mgr.save(1, state)
                mgr.wait_until_finished()
            staging = getattr(mgr, "_staging", None)  # the budget's own count of bytes staged at once
            return {"staged_peak_mib": staging.peak / MiB} if staging is not None else {}

        def make(size: int) -> dict:
            return host_state(size, args.leaf_mib)
    else:
        options = {"save_zstd": {"compression": "zstd"}, "save_quant": {"quantize": {"mu*": "int8"}}}.get(name, {})

        def save(where: object, state: dict) -> dict:
            jaxckpt.save(where, state, **options)
            return {}

        def make(size: int) -> dict:
            return put(host_state(size, args.leaf_mib), four_devices())
    for size, tag in ((WARM_MIB, f"warm{mib}"), (mib, str(mib))):
        where = destination(case, args, tag)
        state = make(size)
        with PeakRSS() as m:
            extra = save(where, state)
        extra["state_mib"] = held_bytes(state) / MiB
        del state
    if store(case):  # which path the save took: data objects in parts, or whole
        from jaxckpt._storage import gcs, location, s3

        loc = location.resolve(where)
        extra["parts"] = s3.client_for(loc) is not None if store(case) == "s3" else gcs.composing(loc)
    return m.result(**extra)


def single_worker(args: argparse.Namespace) -> None:
    """One process: each of ``--case`` (comma-separated; all or none ``_bare``) at each of
    ``--sizes``, or ``setup``."""
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    cases = args.case.split(",")
    if cases[0].endswith("_bare"):  # the optional extras are not installed, as jaxckpt sees it
        sys.modules["boto3"] = None  # type: ignore[assignment]
        sys.modules["google.auth"] = None  # type: ignore[assignment]
    import jaxckpt
    from jaxckpt._storage import gcs

    if "save_gcs_bare" in cases:
        gcs.TOKEN_ENV = "JAXCKPT_BENCH_NO_TOKEN"  # tensorstore still reads its own
    if cases == ["setup"]:  # the checkpoints restore, verify and read-once read
        for size in (WARM_MIB, *args.sizes):
            state = put(host_state(size, args.leaf_mib), four_devices())
            jaxckpt.save(ckpt_path(args.dir, "raw", size), state)
            jaxckpt.save(ckpt_path(args.dir, "zstd", size), state, compression="zstd")
            del state
        return
    for case in cases:
        for mib in args.sizes:
            with tuned(case):
                out = (read_case if base(case) in NEEDS_CKPT else save_case)(case, mib, args)
            print(MARK + json.dumps({"case": case, "mib": mib, "pid": 0, "out": out}), flush=True)


# --- 2-process jobs --------------------------------------------------------------------


def mp_worker(args: argparse.Namespace) -> None:
    """One process of a 2-process job: each of ``--case`` (comma-separated) at each of ``--sizes``."""
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{args.port}", num_processes=args.nproc, process_id=args.pid,
                               initialization_timeout=120)
    try:
        for case in args.case.split(","):
            for mib in args.sizes:
                with tuned(case):
                    out = mp_case(case, mib, args)
                if out is not None:
                    print(MARK + json.dumps({"case": case, "mib": mib, "pid": args.pid, "out": out}), flush=True)
    finally:
        sys.stdout.flush()
        jax.distributed.shutdown()


def mp_case(case: str, mib: int, args: argparse.Namespace) -> dict | None:
    """One 2-process path (its 1 MiB run first), or ``hosts_save``: the step a host copy
    gives the wiped host (not measured)."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxckpt

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
    everywhere, halves = NamedSharding(mesh, P()), NamedSharding(mesh, P("x", None))
    leaf_mib, timeout = args.leaf_mib, 300

    def local(kind: str, tag: str) -> str:
        return os.path.join(args.dir, kind, tag, f"host{args.pid}")

    name = base(case)
    # read-once only where measured (elsewhere the default: off for a local path)
    os.environ["JAXCKPT_READ_ONCE"] = "1" if name == "read_once" else "auto"
    if name == "hosts_save":
        for size, tag in ((WARM_MIB, f"warm{mib}"), (mib, str(mib))):
            with jaxckpt.CheckpointManager(local("hosts", tag), async_save=False, timeout_s=timeout) as mgr:
                mgr.save(1, put(host_state(size, leaf_mib), everywhere))
        return None
    for size, tag in ((WARM_MIB, f"warm{mib}"), (mib, str(mib))):
        multihost_utils.sync_global_devices(f"{case}-{tag}")
        if name == "peer_save":
            state = put(host_state(size, leaf_mib), halves)
            with jaxckpt.CheckpointManager(local("peers", tag), async_save=False, timeout_s=timeout,
                                           peer_copies=1) as mgr:
                with PeakRSS() as m:
                    mgr.save(1, state)
            if not os.listdir(os.path.join(local("peers", tag), ".jaxckpt-peers")):
                raise AssertionError("no peer copy was written")
            result = m.result(state_mib=held_bytes(state) / MiB)
            del state
            continue
        if name == "read_once":
            tgt = target(size, leaf_mib, everywhere)
            with PeakRSS() as m:
                back = jaxckpt.restore(ckpt_path(args.dir, "raw", size), tgt)
                jax.block_until_ready(back)
        elif name in ("host_copy", "peer_repair"):
            kind, copies = ("hosts", 0) if name == "host_copy" else ("peers", 1)
            tgt = target(size, leaf_mib, everywhere if name == "host_copy" else halves)
            with PeakRSS() as m:
                with jaxckpt.CheckpointManager(local(kind, tag), timeout_s=timeout, peer_copies=copies) as mgr:
                    back = mgr.restore(None, tgt)
                    jax.block_until_ready(back)
            if "1" not in os.listdir(local(kind, tag)):
                raise AssertionError("the wiped host did not get step 1")
        else:
            raise SystemExit(f"unknown case {case}")
        result = m.result(held_bytes(back))
        check_first_leaf(back, size, leaf_mib)
        del back
    return result


# --- the parent ------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _collect(procs: list[subprocess.Popen], what: str, timeout: float) -> list[dict]:
    """Every measured line of ``procs``; a process that fails or overruns fails them all."""
    outs, deadline = [], time.monotonic() + timeout
    try:
        for p in procs:
            outs.append(p.communicate(timeout=max(1, deadline - time.monotonic())))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
            p.communicate()
        raise RuntimeError(f"{what} did not finish within {timeout:.0f} s") from None
    lines = []
    for p, (out, err) in zip(procs, outs):
        if p.returncode:
            raise RuntimeError(f"{what}: a process exited {p.returncode}:\n{err[-3000:]}")
        lines += [json.loads(ln[len(MARK):]) for ln in out.splitlines() if ln.startswith(MARK)]
    return lines


def spawn(cases: list[str], sizes: list[int], args: argparse.Namespace, d: str, endpoint: str,
          timeout: float) -> list[dict]:
    """One process (a case of kind "single", or "setup") or a 2-process job (the others)."""
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    common = [sys.executable, os.path.abspath(__file__), "--case", ",".join(cases), "--dir", d,
              "--leaf-mib", str(args.leaf_mib), "--endpoint", endpoint, "--sizes", *map(str, sizes)]
    if cases[0] == "setup" or CASES.get(cases[0], ("", "mp"))[1] == "single":
        procs = [subprocess.Popen([*common, "--worker"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=env)]
    else:
        port = free_port()
        procs = [subprocess.Popen([*common, "--mp-worker", "--port", str(port), "--nproc", "2", "--pid", str(i)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                 for i in range(2)]
    return _collect(procs, f"{','.join(cases)} at {sizes} MiB", timeout)


def _wait_http(url: str, proc: subprocess.Popen, what: str) -> None:
    for _ in range(400):
        try:
            urllib.request.urlopen(url, timeout=5).read()
            return
        except urllib.error.HTTPError:
            return  # it answers
        except OSError:
            time.sleep(0.05)
    proc.terminate()
    raise RuntimeError(f"{what} did not start")


def start_moto() -> tuple[subprocess.Popen, str]:
    import boto3

    port = free_port()
    exe = os.path.join(os.path.dirname(sys.executable), "moto_server")
    proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    _wait_http(endpoint, proc, "moto_server")
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=BUCKET_S3)
    return proc, endpoint


def start_gcs() -> tuple[subprocess.Popen, str, str]:
    from gcs_uploads import EMULATOR  # the emulator with tests/conftest.py's listing fix

    port = free_port()
    fd, log = tempfile.mkstemp(suffix=".log")
    os.close(fd)
    endpoint = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-c", EMULATOR, log, "start", "-H", "127.0.0.1", "--port", str(port),
                             "--in-memory", "--default-bucket", BUCKET_GCS, "-q"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_http(f"{endpoint}/storage/v1/b/{BUCKET_GCS}", proc, "the GCS emulator")
    return proc, endpoint, log


def empty_store(kind: str | None, endpoint: str) -> None:
    """Both servers hold objects in memory: drop what a case saved."""
    if kind == "s3":
        import boto3

        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET_S3):
            for obj in page.get("Contents", []):
                client.delete_object(Bucket=BUCKET_S3, Key=obj["Key"])
    elif kind == "gcs":
        listing = f"{endpoint}/storage/v1/b/{BUCKET_GCS}/o"
        while items := json.loads(urllib.request.urlopen(listing, timeout=30).read()).get("items", []):
            for item in items:
                name = urllib.parse.quote(item["name"], safe="")
                urllib.request.urlopen(urllib.request.Request(f"{listing}/{name}", method="DELETE"), timeout=30)


def commit() -> str:
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + (" (jaxckpt/ with uncommitted changes)" if git("status", "--porcelain", "jaxckpt") else "")


def table(peaks: dict[str, dict], sizes: list[int]) -> str:
    a, b = sizes
    lines = [f"| path | peak above state, {a} MiB | {b} MiB | B/A | slope |", "|---|---|---|---|---|"]
    for case, (label, _) in CASES.items():
        got = peaks.get(case)
        if got is None:
            continue
        if "error" in got:
            lines.append(f"| {label} | failed | failed | | |")
            continue
        pa, pb = got[a], got[b]
        ratio = f"{pb / pa:.2f}" if pa >= 1 else "-"
        lines.append(f"| {label} | {pa:.0f} MiB | {pb:.0f} MiB | {ratio} | {round((pb - pa) / (b - a), 2) + 0.0:.2f} |")  # no "-0.00"
    return "\n".join(lines)


def run_all(cases: list[str], sizes: list[int], args: argparse.Namespace, d: str) -> tuple[dict, dict]:
    """Every case (the servers, the setup and the wipes around them): the measured lines
    by case, and the error of each case that failed."""
    runs: dict[str, list[dict]] = {}
    errors: dict[str, str] = {}
    timeout = 300 if args.smoke else 900
    groups = [sizes] if args.smoke else [[s] for s in sizes]  # sizes per process
    servers: list[subprocess.Popen] = []
    endpoints = {"s3": "", "gcs": ""}
    log = None

    def attempt(job: list[str], group: list[int], keep: set[str], failed: tuple[str, ...] = ()) -> None:
        """Run ``job``; its cases in ``keep`` recorded; on failure every case in ``failed``
        (default: the job's) is."""
        try:
            os.sync()  # the last case's dirty pages written back
            lines = spawn(job, group, args, d, endpoints["s3"], timeout)
            for kind in {store(c) for c in job} - {None}:
                empty_store(kind, endpoints[kind])
        except Exception as e:  # noqa: BLE001 - reported in the table and the exit status
            for case in failed or job:
                errors[case] = str(e)
            print(f"{','.join(job)} failed: {e}", file=sys.stderr, flush=True)
            return
        for line in lines:
            if line["case"] in keep:
                runs.setdefault(line["case"], []).append(line)
                print(f"  {line['case']} {line['mib']} MiB, process {line['pid']}: "
                      f"{line['out']['peak_above_mib']:.0f} MiB", file=sys.stderr, flush=True)

    try:
        if any(store(c) == "s3" for c in cases):
            proc, endpoints["s3"] = start_moto()
            servers.append(proc)
        if any(store(c) == "gcs" for c in cases):
            proc, endpoints["gcs"], log = start_gcs()
            servers.append(proc)
            os.environ.update(TENSORSTORE_GCS_HTTP_URL=endpoints["gcs"], GOOGLE_AUTH_TOKEN_FOR_TESTING="bench")
        if any(base(c) in NEEDS_CKPT for c in cases):
            spawn(["setup"], sizes, args, d, "", timeout)
        singles = [c for c in CASES if c in cases and CASES[c][1] == "single"]
        bare = [c for c in singles if c.endswith("_bare")]
        jobs = [[c for c in singles if c not in bare], bare] if args.smoke else [[c] for c in singles]
        for job in (j for j in jobs if j):
            for group in groups:
                attempt(job, group, set(job))
        mp = [c for c in CASES if c in cases and CASES[c][1] == "mp"]  # the tuned ones last
        # the steps the wiped hosts will lack (peer_save measured, hosts_save not), then the wipe
        hosts = ["hosts_save"] if "host_copy" in mp else []
        peers = ["peer_save"] if {"peer_save", "peer_repair"} & set(mp) else []
        keep, failed = {"peer_save"} & set(mp), ("host_copy",) * bool(hosts) + ("peer_save",) * bool(peers)
        if args.smoke and hosts + peers:  # one job for both
            attempt(hosts + peers, sizes, keep, failed)
        else:
            if hosts:
                attempt(hosts, sizes, set(), ("host_copy",))
            for group in groups if peers else []:
                attempt(peers, group, keep, ("peer_save",))
            if "peer_save" in errors and "peer_repair" in mp:
                errors["peer_repair"] = "not run: the save of its step failed"
        for kind in ("hosts", "peers"):
            top = os.path.join(d, kind)
            for tag in os.listdir(top) if os.path.isdir(top) else []:
                shutil.rmtree(os.path.join(top, tag, "host1"), ignore_errors=True)
        rest = [c for c in mp if c not in ("peer_save",) and c not in errors]
        for group in groups:
            for job in ([rest] if args.smoke and rest else [[c] for c in rest]):
                attempt(job, group, set(job))
    finally:
        for proc in servers:
            proc.terminate()
            proc.wait(10)
        if log and os.path.exists(log):
            os.remove(log)
    return runs, errors


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, nargs=2, default=[256, 512], metavar=("A", "B"), help="the two state sizes")
    ap.add_argument("--leaf-mib", type=float, default=32, help="MiB per leaf (default 32; 1 with --smoke)")
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated case ids (default: all)")
    ap.add_argument("--smoke", action="store_true", help="4 and 8 MiB, few processes: every path runs")
    ap.add_argument("--json", help="write every process's figures here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mp-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    ap.add_argument("--sizes", type=int, nargs="+", help=argparse.SUPPRESS)
    ap.add_argument("--endpoint", default="", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--nproc", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--pid", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        single_worker(args)
        return
    if args.mp_worker:
        mp_worker(args)
        return
    sys.path.insert(0, HERE)
    if args.smoke:
        args.mib, args.leaf_mib = [4, 8], 1
    sizes = sorted(args.mib)
    cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in cases if c not in CASES]
    if unknown or sizes[0] == sizes[1]:
        ap.error(f"unknown cases {unknown}" if unknown else "two different sizes")
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.makedirs(OUT_ROOT, exist_ok=True)
    d = tempfile.mkdtemp(prefix="peak_memory-", dir=OUT_ROOT)
    start = time.perf_counter()
    try:
        runs, errors = run_all(cases, sizes, args, d)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    peaks: dict[str, dict] = {c: {"error": e} for c, e in errors.items() if c in CASES}
    for case, lines in runs.items():
        for line in lines:  # the larger of a job's processes
            got = peaks.setdefault(case, {})
            got[line["mib"]] = max(got.get(line["mib"], float("-inf")), line["out"]["peak_above_mib"])
    methods = sorted({ln["out"]["method"] for lines in runs.values() for ln in lines})
    print(f"Peak host RSS above the state, state of {sizes[0]} and {sizes[1]} MiB (float32 leaves of "
          f"{args.leaf_mib:g} MiB, random values); jaxckpt at {commit()}; peak from {', '.join(methods) or '-'}; "
          f"{time.perf_counter() - start:.0f} s")
    print()
    print(table(peaks, sizes))
    for case, message in errors.items():
        print(f"\n{case} failed: {message[-1500:]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"sizes": sizes, "leaf_mib": args.leaf_mib, "commit": commit(), "runs": runs,
                       "errors": errors}, f, indent=1)
    if errors:
        sys.exit(1)


if __name__ == "__main__":
    main()
