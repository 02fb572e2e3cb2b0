#!/usr/bin/env python
"""Benchmark jaxckpt against orbax-checkpoint and raw disk limits.

One command::

    python benchmarks/run.py                 # big + many + import, 5 reps, medians
    python benchmarks/run.py --smoke         # tiny version for CI
    python benchmarks/run.py --reps 3 --cases big --size-gib 0.5 --json out.json
    python benchmarks/run.py --scaling       # jaxckpt at 0.25/1/4 GiB and 100/1k/10k leaves

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
CASES = ("big", "many", "import")
WORKER_TIMEOUT_S = 1800


# =====================================================================================
# worker side: runs in a fresh interpreter, prints one JSON line
# =====================================================================================


def _setup_jax():
    flag = f"--xla_force_host_platform_device_count={NDEV}"
    if flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    if len(jax.devices()) != NDEV:
        raise RuntimeError(f"expected {NDEV} CPU devices, got {jax.devices()}")
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


def build_state(jax, case: str, cfg: dict):
    """Device arrays (jax) with the case's save sharding; numpy copies are freed."""
    sharding = _shardings(jax, case, "same")
    tree: dict = {}
    for i, (path, shape) in enumerate(case_leaves(case, cfg)):
        host = leaf_data(case, i, shape)
        _set(tree, path, jax.device_put(host, sharding))
        del host
    jax.block_until_ready(tree)
    gc.collect()
    return tree


def build_target(jax, case: str, cfg: dict, which: str):
    import numpy as np

    sharding = _shardings(jax, case, which)
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

    def __init__(self, d):
        import jaxckpt

        self.mod, self.path = jaxckpt, os.path.join(d, "ckpt")

    def save(self, tree):
        self.mod.save(self.path, tree)

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


# =====================================================================================
# parent side
# =====================================================================================


JAXCKPT_FILES: set = set()  # jaxckpt/__init__.py the workers imported
JAXCKPT_SRC = None  # --jaxckpt-src: a directory holding the jaxckpt package to benchmark


def _worker_env() -> dict:
    env = dict(os.environ)
    flag = f"--xla_force_host_platform_device_count={NDEV}"
    if flag not in env.get("XLA_FLAGS", ""):
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + flag).strip()
    env["JAX_PLATFORMS"] = "cpu"
    first = [JAXCKPT_SRC] if JAXCKPT_SRC else []
    env["PYTHONPATH"] = os.pathsep.join(first + [REPO] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def spawn(case: str, libs: list[str], ops: list[str], d: str, cfg: dict, verify: bool) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--case", case,
           "--lib", ",".join(libs), "--op", ",".join(ops), "--dir", d, "--cfg", json.dumps(cfg)]
    if verify:
        cmd.append("--verify")
    p = subprocess.run(cmd, check=False, capture_output=True, text=True, env=_worker_env(), cwd=REPO,
                       timeout=WORKER_TIMEOUT_S)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith(MARK)]
    if p.returncode != 0 or not lines:
        tail = (p.stdout + p.stderr)[-3000:]
        raise RuntimeError(f"worker {case}/{','.join(libs)}/{','.join(ops)} failed "
                           f"(rc={p.returncode}):\n{tail}")
    return json.loads(lines[-1][len(MARK):])


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
COLS = ("jaxckpt", "orbax", "orbax_nocomp", "limit")
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
    ap.add_argument("--libs", default=",".join(LIBS), help="comma list of " + ",".join(LIBS))
    ap.add_argument("--size-gib", type=float, default=None, help="big case size (default 1.0)")
    ap.add_argument("--many-leaves", type=int, default=None, help="many case leaves (default 1000)")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny version: 4 MiB big case, 50 leaves, 1 rep, one process per case")
    ap.add_argument("--scaling", action="store_true",
                    help="scaling check instead of the comparison: big case at 0.25/1/4 GiB "
                         "(jaxckpt save + restore, write limit), many case at 100/1k/10k leaves "
                         "(jaxckpt); default 3 reps; with --smoke tiny sizes")
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
    args = ap.parse_args(argv)

    if args.worker:
        try:
            out = run_worker(args)
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
        if x not in LIBS:
            ap.error(f"unknown lib {x!r}")
    cfg = make_cfg(size_gib, many_leaves)

    t_start = time.perf_counter()
    samples: dict = {}
    errors: list[str] = []
    for case in cases:
        print(f"-- {case} ({reps} rep(s))", file=sys.stderr)
        if case == "import":
            try:
                run_import(reps, samples)
            except Exception as e:  # noqa: BLE001
                errors.append(f"import: {e}")
        else:
            run_case(case, libs, cfg, reps, args.smoke, samples, errors)
    table = summarize(samples, [c for c in cases if c in samples])
    print_table(table, cfg, reps)
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
