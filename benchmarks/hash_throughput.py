"""Content hashes for deduplicated checkpoints (issue 35, item 1): throughput per core
on this machine, on big buffers (a leaf's shard) and on small ones (4 KiB: a bias, a
LayerNorm scale), against crc32c (what the format checks each entry with; not strong
enough to rely on for equality) and a memory copy of the same bytes (the floor any pass
over them costs).

    python benchmarks/hash_throughput.py [--mib 256] [--reps 5]

Candidates: ``hashlib.sha256`` and ``hashlib.blake2b`` (the standard library, OpenSSL),
``blake3`` (the Rust crate's bindings, one thread and all cores), ``xxhash.xxh3_128``.
Each is given the numpy buffer itself (no copy). Medians of ``--reps``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import time

import crc32c
import numpy as np


def candidates() -> dict:
    out = {
        "memcpy (floor)": None,
        "crc32c": lambda b: crc32c.crc32c(b),
        "sha256 (hashlib)": lambda b: hashlib.sha256(b).digest(),
        "blake2b (hashlib)": lambda b: hashlib.blake2b(b).digest(),
    }
    try:
        import blake3

        out["blake3, 1 thread"] = lambda b: blake3.blake3(b).digest()
        out[f"blake3, {os.cpu_count()} threads"] = lambda b: blake3.blake3(
            b, max_threads=blake3.blake3.AUTO).digest()
    except ImportError:
        print("blake3 not installed: pip install blake3")
    try:
        import xxhash

        out["xxh3_128"] = lambda b: xxhash.xxh3_128_digest(b)
    except ImportError:
        print("xxhash not installed: pip install xxhash")
    return out


def gib_per_s(fn, buf: np.ndarray, reps: int, calls: int = 1) -> float:
    dst = np.empty_like(buf) if fn is None else None
    runs = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(calls):
            if fn is None:
                np.copyto(dst, buf)
            else:
                fn(buf)
        runs.append(time.perf_counter() - t)
    return buf.nbytes * calls / statistics.median(runs) / (1 << 30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--reps", type=int, default=5)
    opts = parser.parse_args()
    rng = np.random.default_rng(0)
    big = rng.integers(0, 255, opts.mib << 20, dtype=np.uint8)
    small = rng.integers(0, 255, 4096, dtype=np.uint8)
    print(f"{os.cpu_count()} cores; medians of {opts.reps}; big: {opts.mib} MiB, small: 4 KiB x 10,000 calls")
    print("| hash | digest bits | big [GiB/s] | small [GiB/s] | small [µs a call] |")
    print("|---|---:|---:|---:|---:|")
    for name, fn in candidates().items():
        bits = 0 if fn is None else len(fn(small)) * 8 if isinstance(fn(small), bytes) else 32
        b = gib_per_s(fn, big, opts.reps)
        s = gib_per_s(fn, small, opts.reps, calls=10000)
        print(f"| {name} | {bits or '-'} | {b:.2f} | {s:.2f} | {4096 / (s * (1 << 30)) * 1e6:.2f} |")


if __name__ == "__main__":
    main()
