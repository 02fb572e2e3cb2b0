"""One process of a 2-process JAX job over one shared manager directory whose step 2 is
damaged or has lost its manifest (tests/test_time_to_step.py): process 0 alone looks at
the steps (logging metrics, or ``all_steps()``), then every process deletes or saves
step 2 again, then saves step 10. Prints ``RESULT <json>``.

Usage: mp_steplist_worker.py PORT PID DIRECTORY SCENARIO
"""

import json
import os
import sys
import time

port, pid, path, scenario = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid, initialization_timeout=60)

import numpy as np

import jaxckpt

out = {}
mgr = jaxckpt.CheckpointManager(path, async_save=False, timeout_s=20)
if pid == 0:  # a job that logs from its first process only
    out["seen"] = {s: mgr.metrics(s) for s in mgr.all_steps()} if scenario == "info" else mgr.all_steps()
t = time.monotonic()
try:
    if scenario == "info":
        mgr.delete(2)
    else:
        mgr.save(2, {"w": np.full(4, 22, np.float32)}, force=True)
    out["first"] = "ok"
except jaxckpt.CheckpointError as e:
    out["first"] = f"{type(e).__name__}: {e}"
out["first_s"] = time.monotonic() - t
mgr.save(10, {"w": np.full(4, 10, np.float32)})
out["steps"] = mgr.all_steps()
out["ten"] = np.asarray(mgr.restore(10, {"w": np.zeros(4, np.float32)})["w"]).tolist()
mgr.close()
print("RESULT " + json.dumps(out), flush=True)
