#!/usr/bin/env python
"""Benchmark jaxckpt against orbax-checkpoint and raw disk limits.

One command::

    python benchmarks/run.py                 # big + many + import, 5 reps, medians
    python benchmarks/run.py --smoke         # tiny version for CI
    python benchmarks/run.py --reps 3 --cases big --size-gib 0.5 --json out.json
    python benchmarks/run.py --scaling       # jaxckpt at 0.25/1/4 GiB and 100/1k/10k leaves
    python benchmarks/run.py --reshard --cold --reps 5   # restore matrix + cold-cache rows

Every measurement runs in a fresh subprocess (this file re-invoked with ``--worker``)
that prints one JSON line; the parent collects the medians. See ``benchmarks/README.md``
for what each number means.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_ROOT = os.path.join(REPO, "bench_out")  # gitignored; same disk as the repo
MARK = "@@BENCH "
NDEV = 4
THREADS = 4
GiB = 1 << 30
MiB = 1 << 20
LIBS = ("jaxckpt", "orbax", "orbax_nocomp", "limit")
# restore matrix only (--reshard / --cold): jaxckpt saving format 3 (JAXCKPT_FORMAT=3, issue 22)
MATRIX_LIBS = LIBS + ("jaxckpt3",)
CASES = ("big", "many", "import")
WORKER_TIMEOUT_S = 1800


# =====================================================================================
# worker side: runs in a fresh interpreter, prints one JSON line
# =====================================================================================


def _xla_flags(flags: str, ndev: int) -> str:
    """``flags`` with the forced CPU device count set to ``ndev`` (any other count removed)."""
    keep = [f for f in flags.split() if not f.startswith("--xla_force_host_platform_device_count=")]
    return " ".join(keep + [f"--xla_force_host_platform_device_count={ndev}"])


def _setup_jax(ndev: int = NDEV):
    os.environ["XLA_FLAGS"] = _xla_flags(os.environ.get("XLA_FLAGS", ""), ndev)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    if len(jax.devices()) != ndev:
        raise RuntimeError(f"expected {ndev} CPU devices, got {jax.devices()}")
    return jax


def _mem() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, val, _unit = line.split()
                out[key[:-1]] = int(val) * 1024
    return out


class PeakRSS:
    """Peak resident memory over the baseline taken on entry.

    Resets the kernel's high-water mark (``echo 5 > /proc/self/clear_refs``) so the
    peak comes from the measured block only.
    """

    def __enter__(self):
        gc.collect()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.reset_ok = True
        except OSError:
            self.reset_ok = False
        self.base = _mem()["VmRSS"]
        return self

    def __exit__(self, *exc):
        self.peak = _mem()["VmHWM"]
        self.delta = max(0, self.peak - self.base)
        return False


# --- states -------------------------------------------------------------------------


def big_shapes(size_bytes: int) -> list[tuple[int, int]]:
    """8 float32 leaves of (rows, 4096), rows a multiple of 4 (the mesh size)."""
    cols = 4096
    rows = max(4, (size_bytes // 8 // (4 * cols)) // 4 * 4)
    return [(rows, cols)] * 8


def many_specs(n_leaves: int) -> list[tuple[tuple[str, ...], tuple[int, ...]]]:
    """``n_leaves`` float32 leaves of 1-16 KiB with mixed shapes, named like a deep model."""
    import numpy as np

    rng = np.random.default_rng(1234)
    params = [("attn", p, k) for p in ("q", "k", "v", "o") for k in ("kernel", "bias")]
    params += [("mlp", p, k) for p in ("fc1", "fc2", "fc3") for k in ("kernel", "bias")]
    params += [(ln, "norm", k) for ln in ("ln1", "ln2") for k in ("scale", "bias")]
    params += [("adapter", "down", "kernel"), ("adapter", "up", "kernel")]  # 20 per block
    out = []
    for i in range(n_leaves):
        block, j = divmod(i, len(params))
        a, b, c = params[j]
        n = int(rng.integers(1, 17)) * 256  # 1..16 KiB of float32
        kind = i % 4
        if kind == 0:
            shape = (n,)
        elif kind == 1:
            shape = (n // 16, 16)
        elif kind == 2:
            shape = (16, n // 16)
        else:
            shape = (n // 64, 4, 16)
        out.append((("model", f"block_{block:03d}", a, b, c), shape))
    return out


def leaf_data(case: str, i: int, shape) -> np.ndarray:  # noqa: F821
    import numpy as np

    rng = np.random.default_rng([0 if case == "big" else 1, i])
    return rng.standard_normal(shape, dtype=np.float32)


def _set(tree: dict, path, value) -> None:
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def case_leaves(case: str, cfg: dict):
    """[(path, shape)] of the case's state."""
    if case == "big":
        return [(("params", f"w{i}"), s) for i, s in enumerate(big_shapes(cfg["size_bytes"]))]
    return many_specs(cfg["many_leaves"])


def _shardings(jax, case: str, which: str):
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    devs = jax.devices()
    if case == "many":
        return jax.sharding.SingleDeviceSharding(devs[0])
    if which == "same":
        return NamedSharding(Mesh(np.array(devs), ("data",)), P("data", None))
    return NamedSharding(Mesh(np.array(devs).reshape(2, 2), ("a", "b")), P(None, "b"))


def build_state(jax, case: str, cfg: dict, sharding=None):
    """Device arrays (jax) with the case's save sharding (or ``sharding``); numpy copies
    are freed."""
    sharding = sharding or _shardings(jax, case, "same")
    tree: dict = {}
    for i, (path, shape) in enumerate(case_leaves(case, cfg)):
        host = leaf_data(case, i, shape)
        _set(tree, path, jax.device_put(host, sharding))
        del host
    jax.block_until_ready(tree)
    gc.collect()
    return tree


def build_target(jax, case: str, cfg: dict, which: str, sharding=None):
    import numpy as np

    sharding = sharding or _shardings(jax, case, which)
    tree: dict = {}
    for path, shape in case_leaves(case, cfg):
        _set(tree, path, jax.ShapeDtypeStruct(shape, np.float32, sharding=sharding))
    return tree


def build_host_arrays(case: str, cfg: dict):
    return [leaf_data(case, i, shape) for i, (_, shape) in enumerate(case_leaves(case, cfg))]


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def verify(jax, case: str, cfg: dict, restored, target, full: bool) -> None:
    """Check restored values (leaf 0, or all when ``full``) and shardings."""
    import numpy as np

    leaves = case_leaves(case, cfg)
    check = range(len(leaves)) if (full or case == "many") else [0]
    for i in check:
        path, shape = leaves[i]
        got = _get(restored, path)
        want_sh = _get(target, path).sharding
        if not got.sharding.is_equivalent_to(want_sh, len(shape)):
            raise AssertionError(f"leaf {path}: sharding {got.sharding} != {want_sh}")
        if not np.array_equal(np.asarray(got), leaf_data(case, i, shape)):
            raise AssertionError(f"leaf {path}: restored values differ")


def dir_stats(path: str) -> tuple[int, int]:
    files = size = 0
    for root, _dirs, names in os.walk(path):
        for n in names:
            files += 1
            size += os.path.getsize(os.path.join(root, n))
    return files, size


# --- libraries ----------------------------------------------------------------------


class JaxckptLib:
    name = "jaxckpt"

    def __init__(self, d, fmt: str = ""):
        import jaxckpt

        self.mod, self.path, self.fmt = jaxckpt, os.path.join(d, "ckpt"), fmt

    def save(self, tree):
        if self.fmt:  # the format switch is read per save
            os.environ["JAXCKPT_FORMAT"] = self.fmt
        try:
            self.mod.save(self.path, tree)
        finally:
            if self.fmt:
                os.environ.pop("JAXCKPT_FORMAT", None)

    def restore(self, target):
        return self.mod.restore(self.path, target)

    def ckpt_dir(self):
        return self.path


class OrbaxLib:
    """orbax-checkpoint CheckpointManager, sync saves (save + wait_until_finished).

    ``compression=True``: defaults (StandardSave/StandardRestore: OCDBT, zarr2, zstd
    level 1). ``compression=False``: ``PyTreeCheckpointHandler(use_compression=False)``
    with PyTreeSave/PyTreeRestore (StandardCheckpointHandler has no such option);
    otherwise the same defaults.
    """

    def __init__(self, d, compression: bool):
        import orbax.checkpoint as ocp

        self.ocp, self.compression = ocp, compression
        self.dir = os.path.join(d, "orbax")
        t0 = time.perf_counter()
        # enable_async_checkpointing=True is orbax's default; explicit because the async
        # rows depend on it (sync saves call wait_until_finished inside the timed block).
        opts = ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=True)
        if compression:
            self.mngr = ocp.CheckpointManager(self.dir, options=opts)
        else:
            handler = ocp.PyTreeCheckpointHandler(use_compression=False)
            self.mngr = ocp.CheckpointManager(self.dir, options=opts, item_handlers=handler)
        self.open_s = time.perf_counter() - t0

    def save(self, tree):
        self.save_async(0, tree)
        self.mngr.wait_until_finished()

    def save_async(self, step, tree):
        """``mngr.save`` only: returns when orbax hands the write to its background thread."""
        ocp = self.ocp
        args = ocp.args.StandardSave(tree) if self.compression else ocp.args.PyTreeSave(tree)
        self.mngr.save(step, args=args)

    def wait(self):
        self.mngr.wait_until_finished()

    def restore(self, target, step=0):
        ocp = self.ocp
        if self.compression:
            args = ocp.args.StandardRestore(target)
        else:
            args = ocp.args.PyTreeRestore(
                item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target))
        return self.mngr.restore(step, args=args)

    def ckpt_dir(self):
        return os.path.join(self.dir, "0")

    def close(self):
        self.mngr.close()


def _groups(n: int) -> list[list[int]]:
    return [list(range(t, n, THREADS)) for t in range(THREADS)]


def limit_write(d: str, arrays) -> None:
    """Thread t appends leaves t, t+4, ... to file t with ndarray.tofile, then fsyncs."""
    os.makedirs(d, exist_ok=True)

    def work(t, idx):
        with open(os.path.join(d, f"part{t}.bin"), "wb") as f:
            for i in idx:
                arrays[i].tofile(f)
            f.flush()
            os.fsync(f.fileno())

    with ThreadPoolExecutor(THREADS) as ex:
        list(ex.map(work, range(THREADS), _groups(len(arrays))))
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def limit_read(d: str, shapes) -> list:
    """Read the files back with 4 threads into fresh numpy arrays."""
    import numpy as np

    out = [None] * len(shapes)

    def work(t, idx):
        with open(os.path.join(d, f"part{t}.bin"), "rb", buffering=0) as f:
            for i in idx:
                a = np.empty(shapes[i], np.float32)
                view = memoryview(a).cast("B")
                got = 0
                while got < a.nbytes:
                    n = f.readinto(view[got:])
                    if not n:
                        raise EOFError(f"short read in part{t}.bin")
                    got += n
                out[i] = a

    with ThreadPoolExecutor(THREADS) as ex:
        list(ex.map(work, range(THREADS), _groups(len(shapes))))
    return out


def limit_copy(arrays) -> float:
    """np.copyto from the arrays into pre-touched buffers with 4 threads; seconds."""
    import numpy as np

    dst = [np.empty_like(a) for a in arrays]
    for b in dst:
        b.fill(1.0)  # touch every page before timing

    def work(idx):
        for i in idx:
            np.copyto(dst[i], arrays[i])

    with ThreadPoolExecutor(THREADS) as ex:
        t0 = time.perf_counter()
        list(ex.map(work, _groups(len(arrays))))
        return time.perf_counter() - t0


# --- worker ops ---------------------------------------------------------------------


class JaxckptAsync:
    """``jaxckpt.CheckpointManager(dir, async_save=True)``."""

    def __init__(self, d):
        import jaxckpt

        self.mngr = jaxckpt.CheckpointManager(os.path.join(d, "mgr"), async_save=True)

    def save_async(self, step, tree):
        self.mngr.save(step, tree)

    def wait(self):
        self.mngr.wait_until_finished()

    def restore(self, target, step):
        return self.mngr.restore(step, target)

    def close(self):
        self.mngr.close()


def timed_async(jax, lib: str, d: str, case: str, cfg: dict, full_verify: bool) -> dict:
    """Async save of the case's state with a fresh manager.

    Timed: ``save(1)`` (the blocking part) and until ``wait_until_finished`` returns
    (committed); peak RSS over both. Then, untimed ``os.sync()``, a second save (step 2)
    in the same process with the same manager: the steady state of a training loop,
    without first-call costs. With ``full_verify`` step 1 is restored and checked.
    """
    tree = build_state(jax, case, cfg)
    d = os.path.join(d, "async")
    t0 = time.perf_counter()
    h = JaxckptAsync(d) if lib == "jaxckpt" else OrbaxLib(d, lib == "orbax")
    res: dict = {"async_open_s": time.perf_counter() - t0}
    try:
        with PeakRSS() as m:
            t0 = time.perf_counter()
            h.save_async(1, tree)
            t1 = time.perf_counter()
            h.wait()
            t2 = time.perf_counter()
        res.update(async_block_s=t1 - t0, async_total_s=t2 - t0, async_rss=m.delta)
        if lib == "jaxckpt":  # the library's own account of the blocking part
            res["async_block_self_s"] = h.mngr.info(1).get("blocking_seconds")
        os.sync()
        t0 = time.perf_counter()
        h.save_async(2, tree)
        t1 = time.perf_counter()
        h.wait()
        t2 = time.perf_counter()
        res.update(async_block2_s=t1 - t0, async_total2_s=t2 - t0)
        del tree
        gc.collect()
        if full_verify:
            target = build_target(jax, case, cfg, "same")
            restored = h.restore(target, step=1)
            verify(jax, case, cfg, restored, target, full=True)
            del restored
    finally:
        h.close()
    gc.collect()
    return res


def _timed_save(fn) -> dict:
    with PeakRSS() as m:
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        os.sync()
        t2 = time.perf_counter()
    return {"save_call_s": t1 - t0, "save_s": t2 - t0, "save_rss": m.delta,
            "hwm_reset": m.reset_ok}


def run_worker(args) -> dict:
    cfg = json.loads(args.cfg)
    case, libs, ops = args.case, args.lib.split(","), args.op.split(",")
    jax = _setup_jax()
    import numpy as np

    import jaxckpt

    out: dict = {"case": case, "results": {}, "jaxckpt_file": jaxckpt.__file__}
    for lib in libs:
        d = os.path.join(args.dir, lib)
        res: dict = {}
        out["results"][lib] = res
        if lib == "limit":
            shapes = [s for _, s in case_leaves(case, cfg)]
            arrays = None
            if "save" in ops or "copy" in ops:
                arrays = build_host_arrays(case, cfg)
            if "save" in ops:
                res.update(_timed_save(lambda d=d, a=arrays: limit_write(d, a)))
                res["files"], res["disk_bytes"] = dir_stats(d)
            if "copy" in ops:
                res["copy_s"] = limit_copy(arrays)
            del arrays
            gc.collect()
            if "restore_same" in ops:
                with PeakRSS() as m:
                    t0 = time.perf_counter()
                    got = limit_read(d, shapes)
                    res["restore_same_s"] = time.perf_counter() - t0
                res["restore_same_rss"] = m.delta
                if args.verify or case == "many":
                    for i, a in enumerate(got):
                        if not np.array_equal(a, leaf_data(case, i, shapes[i])):
                            raise AssertionError(f"limit read leaf {i} differs")
                del got
            continue
        for op in ops:
            if op == "copy":  # a limit-only op
                continue
            if op == "async":
                res.update(timed_async(jax, lib, d, case, cfg, full_verify=args.verify))
            elif op == "save":
                tree = build_state(jax, case, cfg)
                h = JaxckptLib(d) if lib == "jaxckpt" else OrbaxLib(d, lib == "orbax")
                res.update(_timed_save(lambda h=h, t=tree: h.save(t)))
                res["files"], res["disk_bytes"] = dir_stats(h.ckpt_dir())
                if isinstance(h, OrbaxLib):
                    h.close()
                del tree, h
                gc.collect()
            elif op in ("restore_same", "restore_other"):
                which = op.split("_")[1]
                target = build_target(jax, case, cfg, which)
                h = JaxckptLib(d) if lib == "jaxckpt" else OrbaxLib(d, lib == "orbax")
                with PeakRSS() as m:
                    t0 = time.perf_counter()
                    restored = h.restore(target)
                    jax.block_until_ready(restored)
                    res[op + "_s"] = time.perf_counter() - t0
                res[op + "_rss"] = m.delta
                if isinstance(h, OrbaxLib):
                    res[op + "_open_s"] = h.open_s
                verify(jax, case, cfg, restored, target, full=args.verify)
                if isinstance(h, OrbaxLib):
                    h.close()
                del restored, h
                gc.collect()
            else:
                raise ValueError(f"unknown op {op!r}")
    return out


# --- restore matrix (--reshard, --cold): worker side ----------------------------------

MATRIX_NDEV = 8  # every matrix worker has 8 CPU devices; 4-device meshes use the first 4
LAYOUTS = {  # name -> short label; built by layout_sharding
    "4": "4 P(data,-)",
    "2x2ab": "2x2 P(a,b)",
    "2x2b": "2x2 P(-,b)",
    "1": "1 device",
    "4x2": "4x2 P(data,model)",
}


def layout_sharding(jax, name: str):
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    devs = jax.devices()
    if name == "1":
        return jax.sharding.SingleDeviceSharding(devs[0])
    if name == "4":
        return NamedSharding(Mesh(np.array(devs[:4]), ("data",)), P("data", None))
    if name in ("2x2ab", "2x2b"):
        mesh = Mesh(np.array(devs[:4]).reshape(2, 2), ("a", "b"))
        return NamedSharding(mesh, P("a", "b") if name == "2x2ab" else P(None, "b"))
    if name == "4x2":
        mesh = Mesh(np.array(devs[:8]).reshape(4, 2), ("data", "model"))
        return NamedSharding(mesh, P("data", "model"))
    raise ValueError(f"unknown layout {name!r}")


def target_slices(state: str, cfg: dict, sharding) -> tuple[list, int, int]:
    """The distinct slices the target's devices hold, leaf by leaf in device order:
    ``[(leaf, ((start, stop), ...))]``, the bytes they hold once (``needed``) and with
    replicas counted per device (``held``)."""
    out, needed, held = [], 0, 0
    for i, (_, shape) in enumerate(case_leaves(state, cfg)):
        seen = set()
        for idx in sharding.devices_indices_map(tuple(shape)).values():
            norm = tuple(s.indices(n)[:2] for s, n in zip(idx, shape))
            nbytes = 4 * math.prod(b - a for a, b in norm)
            held += nbytes
            if norm not in seen:
                seen.add(norm)
                needed += nbytes
                out.append((i, norm))
    return out, needed, held


def _slice_of(entry):
    return tuple(slice(a, b) for a, b in entry[1])


def proc_io() -> dict[str, int]:
    """``/proc/self/io`` (all threads of this process): ``rchar`` counts every byte
    returned by read-type system calls, page cache or not; ``read_bytes`` only what the
    process caused to be fetched from the block device. Empty where unavailable."""
    try:
        with open("/proc/self/io") as f:
            return {k.strip(): int(v) for k, v in (ln.split(":") for ln in f if ":" in ln)}
    except OSError:
        return {}


def drop_page_cache(root: str) -> int:
    """fsync + ``POSIX_FADV_DONTNEED`` every regular file under ``root`` (the kernel
    drops clean pages only, hence the fsync). Returns the number of files."""
    n = 0
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            p = os.path.join(dirpath, name)
            if not os.path.islink(p) and os.path.isfile(p):
                _drop_file(p)
                n += 1
    return n


def _drop_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _matrix_lib(job: dict):
    d = os.path.join(job["dir"], job["lib"])
    if job["lib"].startswith("jaxckpt"):
        return JaxckptLib(d, "3" if job["lib"] == "jaxckpt3" else "")
    return OrbaxLib(d, job["lib"] == "orbax")


def matrix_job(jax, job: dict, cfg: dict, full_verify: bool) -> dict:
    """One job of the restore matrix.

    ``save``: the state saved with ``job["src"]``'s sharding by ``job["lib"]`` (untimed
    here: set-up). ``limit_save``: the distinct slices ``job["dst"]``'s devices hold,
    each stored contiguously, slice k in file k % 4. ``restore``: timed restore onto
    ``job["dst"]``, peak RSS and bytes read; with ``job["cold"]`` the library's files
    leave the page cache first (after opening, right before the timed block).
    """
    import numpy as np

    state = job["state"]
    if job["do"] == "save":
        tree = build_state(jax, state, cfg, layout_sharding(jax, job["src"]))
        h = _matrix_lib(job)
        t0 = time.perf_counter()
        h.save(tree)
        res = {"save_s": time.perf_counter() - t0}
        if isinstance(h, OrbaxLib):
            h.close()
        return res
    sharding = layout_sharding(jax, job["dst"])
    entries, needed, held = target_slices(state, cfg, sharding)
    ldir = os.path.join(job["dir"], "limit", job["dst"])
    if job["do"] == "limit_save":
        leaves = case_leaves(state, cfg)
        host = {}
        parts = []
        for i, _sl in entries:
            if i not in host:
                host[i] = leaf_data(state, i, leaves[i][1])
            parts.append(host[i][_slice_of((i, _sl))])  # tofile writes views in C order
        t0 = time.perf_counter()
        limit_write(ldir, parts)
        return {"save_s": time.perf_counter() - t0}
    if job["do"] != "restore":
        raise ValueError(f"unknown job {job['do']!r}")
    import jaxckpt._storage as jx_storage

    lib = job["lib"]
    h = None
    if lib == "limit":
        shapes = [tuple(b - a for a, b in e[1]) for e in entries]
        droot = ldir
    else:
        target = build_target(jax, state, cfg, "", sharding=sharding)
        h = _matrix_lib(job)
        droot = os.path.join(job["dir"], lib)
    res: dict = {"needed": needed, "held": held}
    if job.get("cold"):
        res["files_dropped"] = drop_page_cache(droot)
    jx_storage.reset_io_stats()
    with PeakRSS() as m:
        io0 = proc_io()
        t0 = time.perf_counter()
        if h is None:
            restored = limit_read(ldir, shapes)
        else:
            restored = h.restore(target)
            jax.block_until_ready(restored)
        res["s"] = time.perf_counter() - t0
        io1 = proc_io()
    res["rss"] = m.delta
    for k in ("rchar", "read_bytes"):
        if k in io0 and k in io1:
            res[k] = io1[k] - io0[k]
    if lib.startswith("jaxckpt"):
        res["jx_bytes_read"] = jx_storage.io_stats()["bytes_read"]
    if isinstance(h, OrbaxLib):
        res["open_s"] = h.open_s
    # check the values (leaf 0; every leaf with --verify or for the many-leaf state)
    full = full_verify or state == "many"
    if h is None:
        leaves = case_leaves(state, cfg)
        for e, got in zip(entries, restored):
            if full or e[0] == 0:
                want = leaf_data(state, e[0], leaves[e[0]][1])[_slice_of(e)]
                if not np.array_equal(got, want):
                    raise AssertionError(f"limit slice {e} differs")
    else:
        verify(jax, state, cfg, restored, target, full=full_verify)
        if isinstance(h, OrbaxLib):
            h.close()
    del restored
    gc.collect()
    return res


def run_matrix_worker(args) -> dict:
    cfg = json.loads(args.cfg)
    jobs = json.loads(args.jobs)
    jax = _setup_jax(MATRIX_NDEV)
    import jaxckpt

    out: dict = {"jaxckpt_file": jaxckpt.__file__, "results": []}
    for job in jobs:
        out["results"].append(matrix_job(jax, job, cfg, args.verify))
    return out


# =====================================================================================
# parent side
# =====================================================================================


JAXCKPT_FILES: set = set()  # jaxckpt/__init__.py the workers imported
JAXCKPT_SRC = None  # --jaxckpt-src: a directory holding the jaxckpt package to benchmark


def _worker_env(ndev: int = NDEV) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = _xla_flags(env.get("XLA_FLAGS", ""), ndev)
    env["JAX_PLATFORMS"] = "cpu"
    first = [JAXCKPT_SRC] if JAXCKPT_SRC else []
    env["PYTHONPATH"] = os.pathsep.join(first + [REPO] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def spawn(case: str, libs: list[str], ops: list[str], d: str, cfg: dict, verify: bool) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--case", case,
           "--lib", ",".join(libs), "--op", ",".join(ops), "--dir", d, "--cfg", json.dumps(cfg)]
    if verify:
        cmd.append("--verify")
    return _run_cmd(cmd, f"{case}/{','.join(libs)}/{','.join(ops)}", NDEV)


def _sync_rmtree(d: str) -> None:
    shutil.rmtree(d, ignore_errors=True)
    os.sync()


OP_ORDER = ["save", "copy", "restore_same", "restore_other", "async"]


def _ops_for(case: str, lib: str, mode: str = "default") -> list[list[str]]:
    """Worker processes (each a list of ops) for one rep of one library."""
    if mode == "scaling":  # jaxckpt sync save + same-sharding restore; the write limit
        return [["save"]] if lib == "limit" else [["save"], ["restore_same"]]
    restores = ["restore_same", "restore_other"] if case == "big" else ["restore_same"]
    if lib == "limit":
        return [["save", "copy"], ["restore_same"]]
    asyncs = [["async"]] if case == "big" else []
    return [["save"]] + [[r] for r in restores] + asyncs


def run_case(case: str, libs: list[str], cfg: dict, reps: int, smoke: bool, samples: dict,
             errors: list, mode: str = "default", tag: str = "") -> None:
    tag = tag or case
    os.makedirs(OUT_ROOT, exist_ok=True)
    for rep in range(reps):
        order = libs[rep % len(libs):] + libs[: rep % len(libs)]  # rotate to spread drift
        tmp = tempfile.mkdtemp(prefix=f"{case}-r{rep}-", dir=OUT_ROOT)
        try:
            if smoke:  # one process for the whole case: checks every code path quickly
                all_ops = sorted({op for lib in order for g in _ops_for(case, lib, mode) for op in g},
                                 key=OP_ORDER.index)
                groups = [(order, [all_ops])]
            else:  # one process per (library, op group); a library's files go when it is done
                groups = [([lib], _ops_for(case, lib, mode)) for lib in order]
            for job_libs, jobs in groups:
                for ops in jobs:
                    t0 = time.perf_counter()
                    try:
                        out = spawn(case, job_libs, ops, tmp, cfg, verify=smoke)
                    except Exception as e:  # noqa: BLE001 - keep going, report at the end
                        errors.append(f"[{tag} rep {rep}] {e}")
                        print(f"  [{tag} rep {rep}] {','.join(job_libs)} {','.join(ops)}: "
                              "FAILED", file=sys.stderr)
                        continue
                    JAXCKPT_FILES.add(out.get("jaxckpt_file"))
                    for lib, res in out["results"].items():
                        for k, v in res.items():
                            samples.setdefault(case, {}).setdefault(lib, {}).setdefault(k, []).append(v)
                    print(f"  [{tag} rep {rep}] {','.join(job_libs)} {','.join(ops)}: "
                          f"{time.perf_counter() - t0:.1f}s wall", file=sys.stderr)
                for lib in job_libs:
                    _sync_rmtree(os.path.join(tmp, lib))
        finally:
            _sync_rmtree(tmp)


IMPORTS = {
    "interpreter": "pass",
    "jaxckpt": "import jaxckpt",
    "orbax": "import orbax.checkpoint",
    "limit": "import jax, tensorstore",
}


def run_import(reps: int, samples: dict) -> None:
    raw: dict = {k: [] for k in IMPORTS}
    env = _worker_env()
    for _ in range(reps):
        for k, code in IMPORTS.items():
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=REPO)
            raw[k].append(time.perf_counter() - t0)
    base = statistics.median(raw["interpreter"])
    for k in ("jaxckpt", "orbax", "limit"):
        samples.setdefault("import", {})[k] = {
            "import_s": [x - base for x in raw[k]], "raw_s": raw[k]}
    samples["import"]["interpreter"] = {"raw_s": raw["interpreter"]}


# --- table --------------------------------------------------------------------------

ROWS = {
    "big": [
        ("save_call_s", "s", "save call"),
        ("save_s", "s", "save incl. os.sync (durable)"),
        ("save_rss", "MiB", "  save: peak RSS over baseline"),
        ("restore_same_s", "s", "restore, saved sharding"),
        ("restore_same_rss", "MiB", "  restore: peak RSS over baseline"),
        ("restore_other_s", "s", "restore onto 2x2 mesh P(None,'b')"),
        ("restore_other_rss", "MiB", "  restore 2x2: peak RSS over baseline"),
        ("async_block_s", "s", "async save: blocking"),
        ("async_total_s", "s", "async save: total to commit"),
        ("async_rss", "MiB", "  async save: peak RSS over baseline"),
        ("async_block2_s", "s", "  async: blocking, 2nd save same mgr"),
        ("async_total2_s", "s", "  async: total, 2nd save same mgr"),
        ("copy_s", "s", "memcpy of all bytes (limit only)"),
        ("files", "", "files per checkpoint"),
        ("disk_bytes", "MiB", "bytes per checkpoint"),
    ],
    "import": [("import_s", "s", "import time minus `python -c pass`")],
}
ROWS["many"] = [r for r in ROWS["big"] if not r[0].startswith(("restore_other", "async_"))]
# Rows whose limit column borrows another limit metric: the blocking part of an async
# save against the memcpy of all bytes, its total against the write limit (tofile+fsync).
LIMIT_ALIAS = {"restore_other_s": "restore_same_s", "restore_other_rss": "restore_same_rss",
               "async_block_s": "copy_s", "async_block2_s": "copy_s",
               "async_total_s": "save_call_s", "async_total2_s": "save_call_s"}
COLS = ("jaxckpt", "jaxckpt3", "orbax", "orbax_nocomp", "limit")
RATIOS = (("jaxckpt", "orbax"), ("jaxckpt", "orbax_nocomp"), ("jaxckpt", "limit"))


def summarize(samples: dict, cases: list[str]) -> dict:
    table: dict = {}
    for case in cases:
        rows = []
        for key, unit, label in ROWS[case]:
            vals, raw = {}, {}
            for lib in COLS:
                k = LIMIT_ALIAS.get(key, key) if lib == "limit" else key
                xs = samples.get(case, {}).get(lib, {}).get(k)
                if xs:
                    scale = GiB if unit == "GiB" else MiB if unit == "MiB" else 1
                    raw[lib] = [x / scale for x in xs]
                    vals[lib] = statistics.median(raw[lib])
            if not vals:
                continue
            ratios = {f"{a}/{b}": vals[a] / vals[b] for a, b in RATIOS
                      if a in vals and b in vals and vals[b] > 0}
            rows.append({"metric": key, "unit": unit, "label": label, "median": vals,
                         "ratios": ratios, "samples": raw})
        table[case] = rows
    return table


def _fmt(x, unit) -> str:
    if x is None:
        return "-"
    if unit == "":
        return f"{x:.0f}"
    if unit in ("MiB", "GiB"):
        return f"{x:.1f}"
    return f"{x:.3f}" if x < 100 else f"{x:.1f}"


def print_table(table: dict, cfg: dict, reps: int) -> None:
    heads = {"big": f"big: {cfg['big_bytes'] / GiB:.3f} GiB float32, 8 leaves {cfg['big_shape']}, "
                    "NamedSharding mesh (4,) P('data', None)",
             "many": f"many: {cfg['many_leaves']} float32 leaves, 1-16 KiB each "
                     f"({cfg['many_bytes'] / MiB:.2f} MiB), single device",
             "import": "import: wall time of `python -c ...` minus `python -c pass` "
                       "(limit column = `import jax, tensorstore`)"}
    cols = list(COLS) + [f"{a}/{b}".replace("jaxckpt/", "jx/").replace("_nocomp", "_nc")
                         for a, b in RATIOS]
    w0 = 44
    for case, rows in table.items():
        print(f"\n== {heads[case]}  [median of {reps}]")
        print(f"{'metric':<{w0}}" + "".join(f"{c:>13}" for c in cols))
        for r in rows:
            label = f"{r['label']} [{r['unit']}]" if r["unit"] else r["label"]
            cells = [_fmt(r["median"].get(c), r["unit"]) for c in COLS]
            cells += [f"{r['ratios'][f'{a}/{b}']:.2f}" if f"{a}/{b}" in r["ratios"] else "-"
                      for a, b in RATIOS]
            print(f"{label[:w0]:<{w0}}" + "".join(f"{c:>13}" for c in cells))
        if case != "import":
            print("limit: save = ndarray.tofile + fsync, 4 threads into 4 files; restore = those "
                  "files read by 4 threads into fresh numpy arrays (also the limit for the 2x2 "
                  "restore); RSS limit = that read")
        if case == "big":
            _print_async_note(rows)


def _print_async_note(rows) -> None:
    by = {r["metric"]: r for r in rows}
    for key, what in (("async_block_s", "first save in a fresh process"),
                      ("async_block2_s", "2nd save, same manager")):
        r = by.get(key)
        if not r:
            continue
        med = r["median"]
        parts = [f"{lib} {med[lib] * 1e3:.0f} ms" for lib in ("jaxckpt", "orbax", "orbax_nocomp")
                 if lib in med]
        if "limit" in med:
            parts.append(f"memcpy limit {med['limit'] * 1e3:.0f} ms")
        ratios = [f"{k.replace('limit', 'memcpy')} {v:.2f}" for k, v in r["ratios"].items()]
        print(f"async save blocking ({what}): " + ", ".join(parts)
              + ("; " + ", ".join(ratios) if ratios else ""))
    r = by.get("async_block_s")
    if r and "jaxckpt" in r["median"] and r["median"].get("limit") \
            and r["median"]["jaxckpt"] < 0.5 * r["median"]["limit"]:
        print("  note: jaxckpt blocks for less than half a memcpy of the state, so its save "
              "copies no bytes before returning: on CPU devices np.asarray(shard) is a "
              "zero-copy view of the device buffer, which the snapshot keeps (jax arrays are "
              "immutable). On GPU/TPU the device-to-host transfer would be in this time.")


# --- scaling ------------------------------------------------------------------------

SCALING_GIB = (0.25, 1.0, 4.0)
SCALING_LEAVES = (100, 1000, 10000)
SCALING_SMOKE_GIB = (1 / 1024, 4 / 1024, 16 / 1024)
SCALING_SMOKE_LEAVES = (10, 50, 200)
# (case, lib, metric, unit, label)
SCALING_SERIES = {
    "big": [("jaxckpt", "save_call_s", "s", "jaxckpt save call"),
            ("jaxckpt", "save_s", "s", "jaxckpt save incl. os.sync"),
            ("jaxckpt", "restore_same_s", "s", "jaxckpt restore, same sharding"),
            ("limit", "save_call_s", "s", "limit write (tofile+fsync)"),
            ("jaxckpt", "save_rss", "MiB", "jaxckpt save peak RSS"),
            ("jaxckpt", "restore_same_rss", "MiB", "jaxckpt restore peak RSS")],
    "many": [("jaxckpt", "save_call_s", "s", "jaxckpt save call"),
             ("jaxckpt", "save_s", "s", "jaxckpt save incl. os.sync"),
             ("jaxckpt", "restore_same_s", "s", "jaxckpt restore"),
             ("jaxckpt", "save_rss", "MiB", "jaxckpt save peak RSS"),
             ("jaxckpt", "restore_same_rss", "MiB", "jaxckpt restore peak RSS")],
}


def make_cfg(size_gib: float, many_leaves: int) -> dict:
    shapes = big_shapes(int(size_gib * GiB))
    return {"size_bytes": int(size_gib * GiB), "many_leaves": many_leaves,
            "big_shape": list(shapes[0]), "big_bytes": sum(r * c * 4 for r, c in shapes),
            "many_bytes": sum(4 * math.prod(s) for _, s in many_specs(many_leaves))}


def fit_line(xs, ys) -> dict:
    """Least-squares y = a + b x, plus two linearity checks.

    ``ratio``: (y/x at the largest x) / (y/x at the smallest x); 1 = proportional,
    < 1 = a fixed cost weighs on the small end, > 1 = superlinear. ``marginal``: the
    slope between the two largest points over the slope between the two smallest;
    1 = linear whatever the fixed cost, > 1 = the cost per unit grows with size.
    """
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else float("nan")
    a = my - b * mx
    pts = sorted(zip(xs, ys))
    (x0, y0), (xn, yn) = pts[0], pts[-1]
    out = {"slope": b, "intercept": a,
           "ratio": (yn / xn) / (y0 / x0) if y0 > 0 and x0 > 0 else None, "marginal": None}
    if n >= 3:
        lo = (pts[1][1] - pts[0][1]) / (pts[1][0] - pts[0][0])
        hi = (pts[-1][1] - pts[-2][1]) / (pts[-1][0] - pts[-2][0])
        out["marginal"] = hi / lo if lo > 0 else None
    return out


def run_scaling(reps: int, smoke: bool, samples: dict, errors: list) -> dict:
    """Big case at SCALING_GIB (jaxckpt + write limit), many case at SCALING_LEAVES."""
    gibs = SCALING_SMOKE_GIB if smoke else SCALING_GIB
    leaves = SCALING_SMOKE_LEAVES if smoke else SCALING_LEAVES
    points = {"big": [(g, make_cfg(g, 50)) for g in gibs],
              "many": [(n, make_cfg(1 / 1024, n)) for n in leaves]}
    libs = {"big": ["jaxckpt", "limit"], "many": ["jaxckpt"]}
    for case in ("big", "many"):
        for x, cfg in points[case]:
            tag = f"{case}@{x:g}{'GiB' if case == 'big' else 'leaves'}"
            print(f"-- scaling {tag} ({reps} rep(s))", file=sys.stderr)
            run_case(case, libs[case], cfg, reps, smoke, samples.setdefault(tag, {}), errors,
                     mode="scaling", tag=tag)
    out: dict = {}
    for case in ("big", "many"):
        series = []
        for lib, key, unit, label in SCALING_SERIES[case]:
            xs, ys, raw, xlab = [], [], [], []
            for x, cfg in points[case]:
                tag = f"{case}@{x:g}{'GiB' if case == 'big' else 'leaves'}"
                vals = samples.get(tag, {}).get(case, {}).get(lib, {}).get(key)
                if not vals:
                    continue
                scale = MiB if unit == "MiB" else 1
                # x in GiB actually saved / in thousands of leaves
                xs.append(cfg["big_bytes"] / GiB if case == "big" else cfg["many_leaves"] / 1000)
                ys.append(statistics.median(vals) / scale)
                raw.append([v / scale for v in vals])
                xlab.append(x)
            if len(xs) < 2:
                continue
            series.append({"lib": lib, "metric": key, "unit": unit, "label": label, "x": xs,
                           "points": xlab, "median": ys, "samples": raw, "fit": fit_line(xs, ys)})
        out[case] = {"x_unit": "GiB" if case == "big" else "1000 leaves",
                     "points": [x for x, _ in points[case]], "series": series}
    return out


def print_scaling(sc: dict, reps: int) -> None:
    heads = {"big": "scaling, big: 8 float32 leaves, mesh (4,) P('data', None); jaxckpt.save/"
                    "restore vs the write limit",
             "many": "scaling, many: float32 leaves of 1-16 KiB, single device"}
    for case, d in sc.items():
        per = "GiB" if case == "big" else "1k leaves"
        if case == "many":
            pts = [f"{x} leaves" for x in d["points"]]
        else:
            pts = [f"{x:g} GiB" if x >= 0.1 else f"{x * 1024:g} MiB" for x in d["points"]]
        print(f"\n== {heads[case]}  [median of {reps}]")
        w0 = 36
        hdr = (f"{'series':<{w0}}" + "".join(f"{p:>13}" for p in pts)
               + f"{'slope/' + per:>17}{'intercept':>11}{'t/x hi:lo':>11}{'marginal':>10}")
        print(hdr)
        for s in d["series"]:
            cells = {p: m for p, m in zip(s["points"], s["median"])}
            f = s["fit"]
            row = f"{(s['label'] + ' [' + s['unit'] + ']')[:w0]:<{w0}}"
            row += "".join(f"{_fmt(cells.get(x), s['unit']):>13}" for x in d["points"])
            row += f"{f['slope']:>17.3f}{f['intercept']:>11.3f}"
            row += f"{f['ratio']:>11.2f}" if f["ratio"] is not None else f"{'-':>11}"
            row += f"{f['marginal']:>10.2f}" if f["marginal"] is not None else f"{'-':>10}"
            print(row)
        if case == "big":  # jaxckpt over the write limit per size
            by = {(s["lib"], s["metric"]): s for s in d["series"]}
            j, lim = by.get(("jaxckpt", "save_call_s")), by.get(("limit", "save_call_s"))
            if j and lim:
                lm = dict(zip(lim["points"], lim["median"]))
                cells = [f"{m / lm[p]:.2f}" if lm.get(p) else "-" for p, m in zip(j["points"], j["median"])]
                print(f"{'jaxckpt save / limit write':<{w0}}" + "".join(f"{c:>13}" for c in cells))
        print(f"slope: least squares over the medians, in the row's unit per {per} (x = "
              + ("bytes actually saved)" if case == "big" else "leaves / 1000)"))
        print("t/x hi:lo = (time/size at the largest) / (time/size at the smallest): 1 = "
              "proportional, < 1 = fixed costs; marginal = slope between the two largest points / "
              "slope between the two smallest: 1 = linear, > 1 = superlinear")


# --- restore matrix (--reshard, --cold): parent side ----------------------------------


def _row(src: str, dst: str, cold: bool = False, state: str = "big") -> dict:
    return {"id": f"{state}:{src}>{dst}" + (":cold" if cold else ""), "state": state,
            "src": src, "dst": dst, "cold": cold}


# saved on 4 devices P('data', None) -> restored onto five layouts, and three the other way
RESHARD_ROWS = [_row("4", "4"), _row("4", "2x2ab"), _row("4", "2x2b"), _row("4", "1"),
                _row("4", "4x2"), _row("4x2", "4"), _row("2x2ab", "4")]
# page cache dropped before each restore, next to the same restore warm
COLD_ROWS = [_row("4", "4"), _row("4", "4", True), _row("4", "2x2b"), _row("4", "2x2b", True),
             _row("1", "1", state="many"), _row("1", "1", True, state="many")]
# (key, bound, column head): what the restore should reach (issue 14)
MATRIX_TARGETS = (("jx/orbax", 0.5, "t<=.5orb"), ("jx/limit", 1.3, "t<=1.3lim"),
                  ("rss/restored", 1.15, "RSS<=1.15"), ("read/held", 1.25, "read<=1.25"))


def matrix_rows(reshard: bool, cold: bool) -> list[dict]:
    rows, seen = [], set()
    for r in (RESHARD_ROWS if reshard else []) + (COLD_ROWS if cold else []):
        if r["id"] not in seen:
            seen.add(r["id"])
            rows.append(r)
    return rows


def row_label(r: dict) -> str:
    dst = "same" if r["dst"] == r["src"] else LAYOUTS[r["dst"]]
    label = f"{LAYOUTS[r['src']]} -> {dst}"
    if r["state"] == "many":
        label = "many: " + label
    return label + (" [cold]" if r["cold"] else "")


def _run_cmd(cmd: list[str], what: str, ndev: int) -> dict:
    p = subprocess.run(cmd, check=False, capture_output=True, text=True, env=_worker_env(ndev),
                       cwd=REPO, timeout=WORKER_TIMEOUT_S)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith(MARK)]
    if p.returncode != 0 or not lines:
        tail = (p.stdout + p.stderr)[-3000:]
        raise RuntimeError(f"worker {what} failed (rc={p.returncode}):\n{tail}")
    return json.loads(lines[-1][len(MARK):])


def _job_name(job: dict) -> str:
    if job["do"] == "save":
        return f"{job['lib']} save {job['state']} {job['src']}"
    if job["do"] == "limit_save":
        return f"limit save {job['state']} slices of {job['dst']}"
    return f"{job['lib']} restore {job['row']}"


def _matrix_spawn(jobs: list[dict], cfg: dict, verify: bool, samples: dict, errors: list,
                  tag: str) -> bool:
    what = "; ".join(_job_name(j) for j in jobs) if len(jobs) <= 2 else f"{len(jobs)} jobs"
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--jobs", json.dumps(jobs),
           "--cfg", json.dumps(cfg)] + (["--verify"] if verify else [])
    t0 = time.perf_counter()
    try:
        out = _run_cmd(cmd, what, MATRIX_NDEV)
    except Exception as e:  # noqa: BLE001 - keep going, report at the end
        errors.append(f"[{tag}] {e}")
        print(f"  [{tag}] {what}: FAILED", file=sys.stderr)
        return False
    JAXCKPT_FILES.add(out.get("jaxckpt_file"))
    for job, res in zip(jobs, out["results"]):
        if job["do"] == "restore":
            key, lib = job["row"], job["lib"]
        else:
            key = f"save:{job['state']}:{job['src'] if job['do'] == 'save' else job['dst']}"
            lib = job.get("lib", "limit")
        for k, v in res.items():
            samples.setdefault(key, {}).setdefault(lib, {}).setdefault(k, []).append(v)
    print(f"  [{tag}] {what}: {time.perf_counter() - t0:.1f}s wall", file=sys.stderr)
    return True


def run_matrix(rows: list[dict], libs: list[str], cfg: dict, reps: int, smoke: bool,
               samples: dict, errors: list) -> None:
    """Per saved layout: each library saves once (one process each), then every restore
    of that layout runs in its own fresh process, the libraries interleaved (A B C D A B
    C D ...). The limit's files (the target's slices) are written once per target.
    With ``smoke``: one process does everything, every leaf checked."""
    os.makedirs(OUT_ROOT, exist_ok=True)
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["state"], r["src"]), []).append(r)
    smoke_jobs: list = []
    smoke_dirs: list = []
    for (state, src), grows in groups.items():
        dsts = list(dict.fromkeys(r["dst"] for r in grows))
        grows = sorted(grows, key=lambda r: dsts.index(r["dst"]))  # one limit save per target
        gdir = tempfile.mkdtemp(prefix=f"matrix-{state}-{src}-", dir=OUT_ROOT)
        tag = f"{state} saved {LAYOUTS[src]}"
        if not smoke:
            print(f"-- restore matrix: {tag}, {len(grows)} row(s), {reps} rep(s)", file=sys.stderr)

        def restore(r, lib, gdir=gdir):
            return {"do": "restore", "lib": lib, "state": r["state"], "dst": r["dst"],
                    "cold": r["cold"], "dir": gdir, "row": r["id"]}

        def limit_save(dst, gdir=gdir, state=state):
            return {"do": "limit_save", "state": state, "dst": dst, "dir": gdir}

        saves = [{"do": "save", "lib": lib, "state": state, "src": src, "dir": gdir}
                 for lib in libs if lib != "limit"]
        if smoke:
            smoke_dirs.append(gdir)
            smoke_jobs += saves + ([limit_save(d) for d in dsts] if "limit" in libs else [])
            smoke_jobs += [restore(r, lib) for r in grows for _ in range(reps) for lib in libs]
            continue
        try:
            failed = {j["lib"] for j in saves
                      if not _matrix_spawn([j], cfg, False, samples, errors, tag)}
            cur = None
            for r in grows:
                if "limit" in libs and r["dst"] != cur:
                    if cur is not None:
                        _sync_rmtree(os.path.join(gdir, "limit", cur))
                    cur = r["dst"]
                    failed.discard("limit")
                    if not _matrix_spawn([limit_save(cur)], cfg, False, samples, errors, tag):
                        failed.add("limit")
                for rep in range(reps):
                    for lib in libs:
                        if lib not in failed:
                            _matrix_spawn([restore(r, lib)], cfg, False, samples, errors,
                                          f"{tag} rep {rep}")
        finally:
            _sync_rmtree(gdir)
    if smoke_jobs:
        print(f"-- restore matrix, smoke: {len(rows)} row(s), one process", file=sys.stderr)
        try:
            _matrix_spawn(smoke_jobs, cfg, True, samples, errors, "matrix smoke")
        finally:
            for d in smoke_dirs:
                _sync_rmtree(d)


def summarize_matrix(samples: dict, rows: list[dict]) -> list[dict]:
    out = []
    ids = {r["id"] for r in rows}
    for r in rows:
        s = samples.get(r["id"])
        if not s:
            continue
        med = {lib: {k: statistics.median(v) for k, v in m.items()
                     if v and all(isinstance(x, (int, float)) for x in v)}
               for lib, m in s.items()}
        needed = next((m["needed"] for m in med.values() if "needed" in m), None)
        held = next((m["held"] for m in med.values() if "held" in m), None)
        t = {lib: m["s"] for lib, m in med.items() if "s" in m}
        ratios = {f"jx/{b.replace('_nocomp', '_nc')}": t["jaxckpt"] / t[b]
                  for b in ("orbax", "orbax_nocomp", "limit")
                  if "jaxckpt" in t and t.get(b)}
        if "jaxckpt3" in t and t.get("jaxckpt"):
            ratios["jx3/jx"] = t["jaxckpt3"] / t["jaxckpt"]
        per_lib: dict = {}
        for lib, m in med.items():
            d = {}
            for key, src in (("rss/restored", "rss"), ("read/held", "rchar"),
                             ("disk/held", "read_bytes"), ("self/held", "jx_bytes_read")):
                if src in m and needed:
                    d[key] = m[src] / needed
            warm = r["id"].removesuffix(":cold")
            if r["cold"] and warm in ids and "s" in m:
                w = samples.get(warm, {}).get(lib, {}).get("s")
                if w:
                    d["cold/warm"] = m["s"] / statistics.median(w)
            per_lib[lib] = d
        jx = per_lib.get("jaxckpt", {})
        vals = {**ratios, **jx}
        targets = {key: (vals[key] <= bound) if key in vals else None
                   for key, bound, _ in MATRIX_TARGETS}
        out.append({**r, "label": row_label(r), "needed": needed, "held": held, "time": t,
                    "ratios": ratios, "per_lib": per_lib, "targets": targets, "median": med,
                    "samples": s})
    return out


def print_matrix(mx: list[dict], cfg: dict, reps: int, libs: list[str], smoke: bool) -> None:
    big = cfg["big_bytes"]
    how = ("smoke: one process for everything, so times and RSS say little" if smoke else
           "each restore a fresh process, libraries interleaved")
    print(f"\n== restore matrix: big = {big / GiB:.3f} GiB float32 in 8 leaves "
          f"{tuple(cfg['big_shape'])}, many = {cfg['many_leaves']} leaves of 1-16 KiB "
          f"({cfg['many_bytes'] / MiB:.2f} MiB); {MATRIX_NDEV} CPU devices per process; "
          f"{how}; median of {reps}")
    cols = [c for c in COLS if c in libs]
    heads = {"jaxckpt": "jaxckpt", "jaxckpt3": "jaxckpt3", "orbax": "orbax", "orbax_nocomp": "orbax_nc",
             "limit": "limit"}
    short = {"jaxckpt": "jx", "jaxckpt3": "jx3", "orbax": "orb", "orbax_nocomp": "orb_nc", "limit": "lim"}
    w0 = 40
    rat = ["jx/orbax", "jx/orbax_nc", "jx/limit"] + (["jx3/jx"] if "jaxckpt3" in libs else [])
    print(f"{'restore time [s]':<{w0}}" + "".join(f"{heads[c]:>10}" for c in cols)
          + "".join(f"{c:>12}" for c in rat) + "".join(f"{h:>11}" for _, _, h in MATRIX_TARGETS))
    for r in mx:
        line = f"{r['label'][:w0]:<{w0}}"
        line += "".join(f"{_fmt(r['time'].get(c), 's'):>10}" for c in cols)
        line += "".join(f"{r['ratios'][k]:>12.2f}" if k in r["ratios"] else f"{'-':>12}"
                        for k in rat)
        line += "".join(f"{'-' if v is None else 'met' if v else 'NOT met':>11}"
                        for v in r["targets"].values())
        print(line)
    print("targets (jaxckpt): time <= 0.5x orbax (defaults), <= 1.3x the read limit; peak RSS "
          "<= 1.15x the bytes restored; bytes read <= 1.25x the bytes held")

    def cell(r, lib, key):
        v = r["per_lib"].get(lib, {}).get(key)
        return f"{'-':>9}" if v is None else f"{v:>9.2f}"

    print(f"\n{'RSS/restored, bytes read/held (rchar)':<{w0}}{'MiB held':>10}"
          + "".join(f"{short[c] + ' RSS':>11}{short[c] + ' rd':>10}" for c in cols)
          + f"{'jx self':>9}" + (f"{'jx3 self':>9}" if "jaxckpt3" in libs else ""))
    for r in mx:
        held = f"{r['needed'] / MiB:.4g}" if r["needed"] else "-"
        if r["held"] and r["needed"] and r["held"] != r["needed"]:
            held += f" ({r['held'] / MiB:.4g})"
        line = f"{r['label'][:w0]:<{w0}}{held:>10}"
        line += "".join(f"{cell(r, c, 'rss/restored'):>11}{cell(r, c, 'read/held'):>10}"
                        for c in cols)
        line += cell(r, "jaxckpt", "self/held") + (cell(r, "jaxckpt3", "self/held") if "jaxckpt3" in libs else "")
        print(line)
    print("MiB held: the distinct bytes the target's devices hold (with replicas counted per "
          "device in parentheses when different); RSS = peak RSS over the baseline / MiB held; "
          "rd = rchar delta from /proc/self/io around the restore call (every byte read(2) "
          "returned, page cache or disk, all threads) / MiB held; jx self = "
          "jaxckpt._storage.io_stats()['bytes_read'] / MiB held")
    cold = [r for r in mx if r["cold"]]
    if cold:
        print(f"\n{'cold rows: from disk/held, cold/warm':<{w0}}"
              + "".join(f"{short[c] + ' disk':>12}{short[c] + ' c/w':>11}" for c in cols))
        for r in cold:
            line = f"{r['label'][:w0]:<{w0}}"
            line += "".join(f"{cell(r, c, 'disk/held'):>12}{cell(r, c, 'cold/warm'):>11}"
                            for c in cols)
            print(line)
        print("disk = read_bytes delta from /proc/self/io (bytes the process had fetched from "
              "the block device) / MiB held; c/w = cold time / warm time of the same restore")
    print("limit: the distinct slices the target's devices hold, each stored contiguously "
          "(slice k in file k % 4), read by 4 threads with readinto into fresh numpy arrays: "
          "the bytes this process needs, once")


def fadvise_check(size: int, reps: int) -> dict:
    """Does fsync + POSIX_FADV_DONTNEED drop a file's pages here? Times a warm and a
    dropped read of a ``size``-byte file and counts what came from the block device."""
    os.makedirs(OUT_ROOT, exist_ok=True)
    path = os.path.join(OUT_ROOT, f"fadvise-check-{os.getpid()}.bin")
    block = os.urandom(MiB)
    try:
        with open(path, "wb") as f:
            for _ in range(max(1, size // MiB)):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        nbytes = os.path.getsize(path)
        buf = bytearray(8 * MiB)

        def read() -> tuple[float, int]:
            io0 = proc_io()
            t0 = time.perf_counter()
            with open(path, "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass
            dt = time.perf_counter() - t0
            io1 = proc_io()
            return dt, io1.get("read_bytes", 0) - io0.get("read_bytes", 0)

        read()  # make sure it is cached
        warm, cold = [], []
        for _ in range(reps):
            warm.append(read())
            _drop_file(path)
            cold.append(read())
    finally:
        if os.path.exists(path):
            os.remove(path)
    w_s = statistics.median(x[0] for x in warm)
    c_s = statistics.median(x[0] for x in cold)
    c_b = statistics.median(x[1] for x in cold)
    has_io = bool(proc_io())
    effective = (c_b >= 0.9 * nbytes) if has_io and c_b else c_s > 2 * w_s
    return {"bytes": nbytes, "reps": reps, "warm_s": w_s, "cold_s": c_s,
            "warm_read_bytes": statistics.median(x[1] for x in warm), "cold_read_bytes": c_b,
            "effective": effective, "samples": {"warm": warm, "cold": cold}}


def print_fadvise(fc: dict) -> None:
    n = fc["bytes"]
    print(f"\nfadvise check ({n / MiB:.0f} MiB file, one thread, median of {fc['reps']}): "
          f"warm read {fc['warm_s'] * 1e3:.1f} ms ({n / GiB / fc['warm_s']:.2f} GiB/s, "
          f"{fc['warm_read_bytes'] / MiB:.0f} MiB from the device); after fsync + "
          f"POSIX_FADV_DONTNEED {fc['cold_s'] * 1e3:.1f} ms ({n / GiB / fc['cold_s']:.2f} GiB/s, "
          f"{fc['cold_read_bytes'] / MiB:.0f} MiB from the device): cold/warm "
          f"{fc['cold_s'] / fc['warm_s']:.1f}x -> pages "
          + ("dropped: the cold rows read from the device" if fc["effective"] else
             "NOT dropped: the cold rows are not cold here"))


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": sys.version.split()[0]}
    for d in ("jaxckpt", "jax", "jaxlib", "orbax-checkpoint", "tensorstore", "numpy"):
        try:
            out[d] = version(d)
        except PackageNotFoundError:
            out[d] = None
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=None, help="repetitions (default 5; 1 with --smoke)")
    ap.add_argument("--cases", default="big,many,import", help="comma list of big,many,import")
    ap.add_argument("--libs", default=",".join(LIBS),
                    help="comma list of " + ",".join(LIBS) + " (with --reshard / --cold also jaxckpt3: "
                    "jaxckpt saving format 3, JAXCKPT_FORMAT=3)")
    ap.add_argument("--size-gib", type=float, default=None, help="big case size (default 1.0)")
    ap.add_argument("--many-leaves", type=int, default=None, help="many case leaves (default 1000)")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny version: 4 MiB big case, 50 leaves, 1 rep, one process per case")
    ap.add_argument("--scaling", action="store_true",
                    help="scaling check instead of the comparison: big case at 0.25/1/4 GiB "
                         "(jaxckpt save + restore, write limit), many case at 100/1k/10k leaves "
                         "(jaxckpt); default 3 reps; with --smoke tiny sizes")
    ap.add_argument("--reshard", action="store_true",
                    help="restore matrix instead of the comparison: 1 GiB saved on 4 devices "
                         "P('data', None) restored onto the same, 2x2 P('a','b'), 2x2 "
                         "P(None,'b'), one device, 4x2 P('data','model'), and 4x2 / 2x2 "
                         "layouts restored onto 4 P('data', None); 8 CPU devices per worker")
    ap.add_argument("--cold", action="store_true",
                    help="cold-cache rows instead of the comparison (with --reshard: added to "
                         "the matrix): the same-layout big restore, big onto 2x2 P(None,'b') and "
                         "the many-leaf restore, each warm and with the checkpoint's pages "
                         "dropped (fsync + POSIX_FADV_DONTNEED) before every restore; plus a "
                         "check that dropping works here")
    ap.add_argument("--json", metavar="FILE", help="also write the table (and samples) as JSON")
    ap.add_argument("--jaxckpt-src", metavar="DIR",
                    help="benchmark the jaxckpt package found in DIR (e.g. a `git archive` of a "
                         "commit) instead of the installed one")
    # worker mode
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--lib", help=argparse.SUPPRESS)
    ap.add_argument("--op", help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    ap.add_argument("--cfg", help=argparse.SUPPRESS)
    ap.add_argument("--verify", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--jobs", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.worker:
        try:
            out = run_matrix_worker(args) if args.jobs else run_worker(args)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            return 1
        print(MARK + json.dumps(out), flush=True)
        return 0

    global JAXCKPT_SRC
    if args.jaxckpt_src:
        JAXCKPT_SRC = os.path.abspath(args.jaxckpt_src)
        if not os.path.isfile(os.path.join(JAXCKPT_SRC, "jaxckpt", "__init__.py")):
            ap.error(f"no jaxckpt package in {JAXCKPT_SRC}")
    if args.scaling:
        return main_scaling(args)
    reps = args.reps if args.reps is not None else (1 if args.smoke else 5)
    size_gib = args.size_gib if args.size_gib is not None else (4 / 1024 if args.smoke else 1.0)
    many_leaves = args.many_leaves or (50 if args.smoke else 1000)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    libs = [x.strip() for x in args.libs.split(",") if x.strip()]
    for c in cases:
        if c not in CASES:
            ap.error(f"unknown case {c!r}")
    for x in libs:
        if x not in (MATRIX_LIBS if args.reshard or args.cold else LIBS):
            ap.error(f"unknown lib {x!r}" + (" (jaxckpt3: --reshard / --cold only)" if x in MATRIX_LIBS else ""))
    cfg = make_cfg(size_gib, many_leaves)
    # --reshard / --cold replace the comparison; --smoke alone runs everything, tiny
    comparison = not (args.reshard or args.cold)
    rows = matrix_rows(args.reshard or (args.smoke and comparison),
                       args.cold or (args.smoke and comparison))

    t_start = time.perf_counter()
    samples: dict = {}
    errors: list[str] = []
    table: dict = {}
    for case in cases if comparison else []:
        print(f"-- {case} ({reps} rep(s))", file=sys.stderr)
        if case == "import":
            try:
                run_import(reps, samples)
            except Exception as e:  # noqa: BLE001
                errors.append(f"import: {e}")
        else:
            run_case(case, libs, cfg, reps, args.smoke, samples, errors)
    if comparison:
        table = summarize(samples, [c for c in cases if c in samples])
        print_table(table, cfg, reps)
    fadvise = mx = None
    mx_samples: dict = {}
    if any(r["cold"] for r in rows):
        fadvise = fadvise_check(16 * MiB if args.smoke else 256 * MiB, 1 if args.smoke else 3)
    if rows:
        run_matrix(rows, libs, cfg, reps, args.smoke, mx_samples, errors)
        mx = summarize_matrix(mx_samples, rows)
        print_matrix(mx, cfg, reps, libs, args.smoke)
    if fadvise:
        print_fadvise(fadvise)
    print(f"jaxckpt imported from: {', '.join(sorted(f for f in JAXCKPT_FILES if f)) or '-'}")
    print(f"\nratios: value(jaxckpt) / value(other); < 1 means jaxckpt is faster/smaller. "
          f"total wall {time.perf_counter() - t_start:.0f}s")
    for e in errors:
        print(f"\nERROR: {e}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": {**cfg, "reps": reps, "smoke": args.smoke, "devices": NDEV,
                                  "threads": THREADS, "libs": libs,
                                  "jaxckpt_files": sorted(f for f in JAXCKPT_FILES if f)},
                       "versions": _versions(), "table": table, "raw": samples,
                       "matrix": mx, "matrix_raw": mx_samples, "fadvise": fadvise,
                       "errors": errors}, f, indent=1)
    return 1 if errors else 0


def main_scaling(args) -> int:
    reps = args.reps if args.reps is not None else (1 if args.smoke else 3)
    t_start = time.perf_counter()
    samples: dict = {}
    errors: list[str] = []
    sc = run_scaling(reps, args.smoke, samples, errors)
    print_scaling(sc, reps)
    print(f"jaxckpt imported from: {', '.join(sorted(f for f in JAXCKPT_FILES if f)) or '-'}")
    print(f"total wall {time.perf_counter() - t_start:.0f}s")
    for e in errors:
        print(f"\nERROR: {e}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": {"mode": "scaling", "reps": reps, "smoke": args.smoke,
                                  "devices": NDEV, "threads": THREADS,
                                  "jaxckpt_files": sorted(f for f in JAXCKPT_FILES if f)},
                       "versions": _versions(), "scaling": sc, "raw": samples,
                       "errors": errors}, f, indent=1)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
