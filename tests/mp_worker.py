"""One process of a real multi-process JAX job, for tests/test_multihost.py.

Usage: mp_worker.py PORT NPROC PID NDEV SCENARIO JSON_ARGS
Prints one line `RESULT <json>`. In the scenario with a dead peer it exits without
jax's distributed shutdown, which would wait for the dead process.
"""

import json
import os
import sys
import time
import traceback

port, nproc, pid, ndev, scenario = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
args = json.loads(sys.argv[6])
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={ndev}"

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid,
                           initialization_timeout=60)

import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt import _storage
from jaxckpt._storage import kvstore as _kvstore


def make_mesh(shape, names):
    return jax.sharding.Mesh(np.array(jax.devices()).reshape(shape), names)


def spec_of(entries):
    return P(*[tuple(e) if isinstance(e, list) else e for e in entries])


def expected_tree():
    big = np.arange(64 * 4096, dtype=np.float32).reshape(64, 4096)  # 1 MiB: file store
    small = np.arange(8 * 16, dtype=np.int32).reshape(8, 16)  # OCDBT store
    return {"big": big, "small": small, "repl": np.arange(16, dtype=np.float32)}


def global_tree(mesh, spec):
    host = expected_tree()
    out = {}
    for k, v in host.items():
        sharding = NamedSharding(mesh, P() if k == "repl" else spec)
        out[k] = jax.make_array_from_callback(v.shape, sharding, lambda idx, v=v: v[idx])
    out["host"] = np.ones(3, np.int8) * 7
    out["step"] = 12
    return out


def main():
    result = {"pid": pid}
    mesh = make_mesh(args["mesh"], args["names"])
    spec = spec_of(args["spec"])
    path = args["path"]
    if scenario == "save":
        tree = global_tree(mesh, spec)
        _storage.reset_io_stats()
        jaxckpt.save(path, tree, timeout_s=20, compression=args.get("compression"))
        result["written"] = _storage.io_stats()["bytes_written"]
    elif scenario == "restore":
        host = expected_tree()
        target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, spec if k != "repl" else P()))
                  for k, v in host.items()}
        target["host"] = np.zeros(3, np.int8)
        target["step"] = 0
        _storage.reset_io_stats()
        back = jaxckpt.restore(path, target)
        result["read"] = _storage.io_stats()["bytes_read"]
        with open(os.path.join(path, "manifest.json")) as f:
            saved = {leaf["path"]: leaf for leaf in json.load(f)["leaves"]}
        need = chunk_bytes = 0
        for k, v in host.items():
            arr = back[k]
            assert arr.sharding == target[k].sharding
            slices, chunks = set(), set()
            for shard in arr.addressable_shards:
                got = np.asarray(shard.data)
                assert got.tobytes() == v[shard.index].tobytes(), (k, shard.index)
                key = tuple((s.start or 0, v.shape[d] if s.stop is None else s.stop)
                            for d, s in enumerate(shard.index))
                if key not in slices:
                    slices.add(key)
                    need += got.nbytes
                cs = saved[k]["chunk_shape"]
                ranges = [range(a // c, (b - 1) // c + 1) for (a, b), c in zip(key, cs)]
                for pos in np.ndindex(*[len(r) for r in ranges]):
                    chunks.add(tuple(r[i] for r, i in zip(ranges, pos)))
            chunk_bytes += len(chunks) * int(np.prod(saved[k]["chunk_shape"])) * v.itemsize
        assert back["host"].tolist() == [7, 7, 7] and back["step"] == 12
        result["needed"] = need + 3  # + the host leaf, read whole by every process
        result["chunk_bytes"] = chunk_bytes + 3  # the saved chunks those slices touch
        result["ok"] = True
    elif scenario in ("fail_write", "die"):
        from jaxckpt import _distributed

        _distributed.STALE_S = args.get("stale", _distributed.STALE_S)
        tree = global_tree(mesh, spec)
        if pid == args["bad"]:
            def hook(op, key):
                if scenario == "die":
                    os._exit(3)
                raise OSError(f"injected failure in process {pid}")
            _storage.fault_hook = hook
        t0 = time.monotonic()
        try:
            jaxckpt.save(path, tree, timeout_s=args["timeout"])
            result["error"] = None
        except jaxckpt.CheckpointError as e:
            result["error"] = str(e)
        result["seconds"] = time.monotonic() - t0
        result["committed"] = os.path.exists(os.path.join(path, "manifest.json"))
    elif scenario == "manager":
        result.update(run_manager(mesh, spec, path))
    elif scenario == "slow_write":
        result.update(run_slow_write(mesh, spec, path, args))
    elif scenario == "one_sided":
        result.update(run_one_sided(mesh, spec, path))
    elif scenario == "replicated":
        result.update(run_replicated(mesh, path, args))
    elif scenario == "no_manifest_reread":
        result.update(run_no_manifest_reread(mesh, spec, path))
    elif scenario == "two_tiers":
        result.update(run_two_tiers(mesh, spec, path, args))
    elif scenario == "read_once":
        result.update(run_read_once(path, args))
    print("RESULT " + json.dumps(result), flush=True)


def run_slow_write(mesh, spec, path, args):
    """Process `slow` takes longer than the timeout to write; it stays alive and heartbeats."""
    tree = global_tree(mesh, spec)
    if pid == args["slow"]:
        slept = []

        def hook(op, key):
            if not slept:
                slept.append(True)
                time.sleep(args["sleep"])
        _storage.fault_hook = hook
    t0 = time.monotonic()
    try:
        jaxckpt.save(path, tree, timeout_s=args["timeout"])
        error = None
    except jaxckpt.CheckpointError as e:
        error = str(e)
    return {"error": error, "seconds": time.monotonic() - t0,
            "committed": os.path.exists(os.path.join(path, "manifest.json"))}


def run_one_sided(mesh, spec, path):
    """Step 1 fails in process 1 only; both processes raise it at the same call, then step 2
    and step 3 succeed in both (the collective sequence stayed aligned)."""
    from jaxckpt import _distributed

    state = {"w": jax.make_array_from_callback((16, 32), NamedSharding(mesh, spec),
                                               lambda idx: np.ones((16, 32), np.float32)[idx])}
    fail = {"on": pid == 1}

    def hook(op, key):
        if fail["on"]:
            raise OSError(f"injected one-sided failure in process {pid}")
    _storage.fault_hook = hook
    errors = []
    with jaxckpt.CheckpointManager(path, timeout_s=20) as mgr:
        mgr.save(1, state)
        try:
            mgr.save(2, state)  # settles step 1 first (max_pending=1): raises here, in both
            errors.append("save(2) returned")
        except jaxckpt.CheckpointError as e:
            errors.append(str(e))
        fail["on"] = False
        mgr.save(2, state)
        mgr.save(3, state)
        mgr.wait_until_finished()
        steps = mgr.all_steps()
        keys = _distributed.op_keys()
    return {"errors": errors, "steps": steps, "keys": keys}


def read_once_state():
    """Leaves of several dtypes and shapes (odd sizes, a 0-d array, a PRNG key)."""
    rng = np.random.default_rng(3)
    return {
        "w": rng.standard_normal((256, 1024), dtype=np.float32),  # 1 MiB: chunk files
        "cols": np.arange(64 * 512, dtype=np.int32).reshape(64, 512),
        "across": np.arange(96 * 384, dtype=np.float32).reshape(96, 384),
        "h": rng.standard_normal((64, 96)).astype(jax.numpy.bfloat16),
        "odd": np.arange(100, dtype=np.int8),
        "mask": rng.standard_normal(48) > 0,
        "s": np.array(7, np.int32),
        "key": jax.random.key_data(jax.random.key(5)),
    }


def run_read_once(path, args):
    """Save sharded over every process, restore with replicas in several processes (fully
    replicated, and column blocks replicated over processes); report bytes read. ``bad``:
    this process's reads fail (``fail``) or it dies in one (``die``)."""
    from jaxckpt import _exchange

    _exchange.READ_ONCE = args.get("read_once", "1")
    if args.get("wave"):
        _exchange.WAVE_BYTES = args["wave"]
    if args.get("view_share"):
        _exchange.VIEW_SHARE = args["view_share"]
    if args.get("start_timeout"):
        _exchange.START_TIMEOUT_S = args["start_timeout"]
    devices = np.array(jax.devices()).reshape(nproc, ndev)
    mesh = jax.sharding.Mesh(devices, ("d", "m"))
    host = read_once_state()
    rows = {k: (P("d") if v.ndim and v.shape[0] % nproc == 0 and k != "key" else P()) for k, v in host.items()}
    saved = {k: jax.make_array_from_callback(v.shape, NamedSharding(mesh, rows[k]), lambda i, v=v: v[i])
             for k, v in host.items()}
    saved["key"] = jax.random.wrap_key_data(saved["key"])
    saved["step"] = 3
    if args.get("endpoint"):  # a plain s3:// URL, configured as users do: the environment
        os.environ.update(AWS_ENDPOINT_URL=args["endpoint"], AWS_REGION="us-east-1")
    jaxckpt.save(path, saved, timeout_s=30, compression=args.get("compression"))
    specs = {k: P() for k in host}
    specs["cols"] = P(None, "m")  # column blocks, each replicated over the processes
    specs["across"] = P(None, ("d", "m"))  # column blocks of row-block chunks: no replicas
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, specs[k]))
              for k, v in host.items() if k != "key"}
    target["key"] = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=NamedSharding(mesh, P()))
    target["step"] = 0
    if pid == args.get("bad"):
        def hook(op, key):
            if op == "read":
                if args["fault"] == "die":
                    os._exit(3)
                raise OSError(f"injected read failure in process {pid}")
        _storage.fault_hook = hook
    if args.get("stale"):
        from jaxckpt import _distributed
        _distributed.STALE_S = args["stale"]
    if args.get("gather_fails"):
        def broken(row, lengths):
            raise RuntimeError("injected: no collectives")
        _exchange.all_gather = broken
    import logging

    class Collect(logging.Handler):
        def __init__(self):
            super().__init__(logging.WARNING)
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    collect = Collect()
    logging.getLogger("jaxckpt").addHandler(collect)
    if pid == args.get("late"):
        time.sleep(args["late_s"])  # reaches the restore late (loading data, say)
    _storage.reset_io_stats()
    t0 = time.monotonic()
    try:
        back = jaxckpt.restore(path, target, max_staging_bytes=args.get("budget"))
    except jaxckpt.CheckpointError as e:
        return {"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - t0}
    read = _storage.io_stats()["bytes_read"]
    same = True
    for k, v in host.items():
        arr = jax.random.key_data(back[k]) if k == "key" else back[k]
        if arr.sharding.spec != (specs[k] if k != "key" else P(None)):
            same = False
        for shard in arr.addressable_shards:
            same &= np.asarray(shard.data).tobytes() == v[shard.index].tobytes()
    same &= back["step"] == 3
    return {"read": read, "same": bool(same), "state_bytes": int(sum(v.nbytes for v in host.values())),
            "seconds": time.monotonic() - t0, "warnings": collect.messages}


def run_replicated(mesh, path, args):
    """A fully replicated state: every process holds everything; writes must be balanced."""
    rng = np.random.default_rng(0)
    host = {f"big{i}": rng.standard_normal(n, dtype=np.float32) for i, n in enumerate(args["big"])}
    host.update({f"small{i}": np.full(1024, i, np.float32) for i in range(args["small"])})
    replicated = NamedSharding(mesh, P())
    tree = {k: jax.device_put(v, replicated) for k, v in host.items()}
    tree["host"] = rng.standard_normal(args["host"], dtype=np.float32)
    _storage.reset_io_stats()
    jaxckpt.save(path, tree, timeout_s=60)
    written = _storage.io_stats()["bytes_written"]
    back = jaxckpt.restore(path)
    same = all(np.asarray(back[k]).tobytes() == np.asarray(v).tobytes() for k, v in {**host, "host": tree["host"]}.items())
    return {"written": written, "same": same}


def run_no_manifest_reread(mesh, spec, path):
    """Processes other than 0 must not read manifest.json after the commit (NFS)."""
    from jaxckpt import _commit

    if pid != 0:
        def refuse(*a, **k):
            raise AssertionError("re-read the manifest")
        _commit.read_manifest = refuse
        original = _kvstore.read_blob

        def read_blob(root, key, *a, **k):
            if key == "manifest.json":
                raise AssertionError("re-read manifest.json")
            return original(root, key, *a, **k)
        _kvstore.read_blob = read_blob
    steps = []
    with jaxckpt.CheckpointManager(path, timeout_s=20) as mgr:
        for i in range(1, 4):
            mgr.save(i, global_tree(mesh, spec))
        mgr.wait_until_finished()
        steps = mgr.all_steps()
        info = mgr.info(3)
    return {"steps": steps, "bytes": info["bytes"]}


def run_manager(mesh, spec, path):
    sharding = NamedSharding(mesh, spec)
    state = {"w": jax.make_array_from_callback((16, 32), sharding,
                                               lambda idx: np.arange(16 * 32, dtype=np.float32).reshape(16, 32)[idx]),
             "n": jax.device_put(np.int32(0), NamedSharding(mesh, P()))}
    step_fn = jax.jit(lambda s: {"w": s["w"] * 2.0 + 1.0, "n": s["n"] + 1}, donate_argnums=0)
    expected = {}
    with jaxckpt.CheckpointManager(path, max_to_keep=2, timeout_s=20) as mgr:
        for i in range(1, 6):
            state = step_fn(state)
            # a cross-process collective in the loop while background saves agree
            total = float(jax.jit(lambda w: w.sum())(state["w"]))
            expected[i] = total
            mgr.save(i, state)
        mgr.wait_until_finished()
        steps = mgr.all_steps()
        back = mgr.restore(None, state)
        restored_total = float(jax.jit(lambda w: w.sum())(back["w"]))
    files = sorted(os.listdir(path))
    return {"steps": steps, "files": files, "restored_total": restored_total, "expected": expected[5],
            "n": int(back["n"].addressable_shards[0].data)}


def tier_state(mesh, spec, i):
    """Step i's state: a sharded leaf, a replicated one, a small one, host and inline values."""
    w = np.arange(64 * 1024, dtype=np.float32).reshape(64, 1024) + i
    r = np.arange(300_000, dtype=np.int32) * i
    return {"w": jax.make_array_from_callback(w.shape, NamedSharding(mesh, spec), lambda idx: w[idx]),
            "r": jax.make_array_from_callback(r.shape, NamedSharding(mesh, P()), lambda idx: r[idx]),
            "b": jax.make_array_from_callback((8,), NamedSharding(mesh, P()), lambda idx: np.full(8, i, np.int8)[idx]),
            "host": np.arange(5, dtype=np.float64) * i, "step": i}


def check_tier_state(back, i):
    """Every addressable shard and value equals step i's, bit for bit."""
    want = {"w": np.arange(64 * 1024, dtype=np.float32).reshape(64, 1024) + i,
            "r": np.arange(300_000, dtype=np.int32) * i, "b": np.full(8, i, np.int8)}
    for k, full in want.items():
        for shard in back[k].addressable_shards:
            got = np.asarray(shard.data)
            assert got.dtype == full.dtype and got.tobytes() == full[shard.index].tobytes(), (k, i)
    assert back["host"].tobytes() == (np.arange(5, dtype=np.float64) * i).tobytes()
    assert back["step"] == i
    return back["step"]


def run_two_tiers(mesh, spec, path, args):
    """A manager whose local directory is this process's own (per host) or shared, with
    the local S3 server as its persistent tier."""
    local = path if args.get("shared") else os.path.join(path, f"host{pid}")
    opts = dict(max_to_keep=3, persistent_directory=args["durable"], persistent_interval_steps=2,
                persistent_max_to_keep=2, timeout_s=20)
    out = {}
    with jaxckpt.CheckpointManager(local, **opts) as mgr:
        out["groups"] = [list(g) for g in mgr._groups.groups]
        out["tiers_at_start"] = {str(s): list(t) for s, t in mgr.step_tiers().items()}
        for i in args.get("save", []):
            mgr.save(i, tier_state(mesh, spec, i))
        mgr.wait_until_finished()
        out["tiers"] = {str(s): list(t) for s, t in mgr.step_tiers().items()}
        if args.get("restore"):
            back = mgr.restore(None, tier_state(mesh, spec, 0))
            out["restored"] = check_tier_state(back, back["step"])
            for i in args.get("then_save", []):
                mgr.save(i, tier_state(mesh, spec, i))
            mgr.wait_until_finished()
            out["tiers_after"] = {str(s): list(t) for s, t in mgr.step_tiers().items()}
    out["local_steps"] = sorted(n for n in os.listdir(local) if n.isdigit()) if os.path.isdir(local) else []
    return out


try:
    main()
except BaseException:
    print("RESULT " + json.dumps({"pid": pid, "crash": traceback.format_exc()}), flush=True)
sys.stdout.flush()
if scenario != "die" and args.get("fault") != "die":  # a dead peer: the shutdown would wait for it
    jax.distributed.shutdown()  # waits for every process, so the coordinator outlives them
os._exit(0)
