"""Manager options against each other: every pair of the options that change the data
path, each pair a manager's whole life in a real 2-process JAX job (tests/pairs_worker.py):
save, delete, save the same step again with other values, lose a host where the pair keeps
a copy elsewhere, restart, restore every step bit for bit (a quantized moment within its
int8 bound). A pair either works or is refused by the constructor with an error naming
both options; nothing builds fine and then fails its saves. The table is in
docs/guarantees.md ("Manager options against each other").

The options: ``async`` (async_save=True; otherwise False), ``staging`` (max_staging_bytes
smaller than each process's share), ``per_host`` (a local directory per host), ``peers``
(peer_copies=1, a directory per host), ``persistent`` (a persistent tier in a shared
directory, every step), ``compression`` (zstd), ``quantize`` (the moment ``mu`` as int8),
``read_only`` (the restarted manager is read-only), ``verify_before_delete``,
``read_once`` (JAXCKPT_READ_ONCE=1 for the restores) and ``s3`` (the local S3 server: the
manager's directory, or its persistent tier where the pair has a directory per host or
a persistent tier).
"""

import itertools
import json
import os

import pytest
from conftest import MotoServer, run_workers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "pairs_worker.py")

OPTIONS = ["async", "staging", "per_host", "peers", "persistent", "compression", "quantize", "read_only",
           "verify_before_delete", "read_once", "s3"]
PAIRS = list(itertools.combinations(OPTIONS, 2))
# A pair refused by the constructor, and the words its error must hold (both options').
# None is now: codecs with a directory per host (refused until issue 32) work.
REFUSED: dict[tuple[str, str], tuple[str, str]] = {}
CHUNKS = 5


def _chunk(i):
    return PAIRS[i::CHUNKS]


@pytest.mark.slow
@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_every_pair_of_data_path_options_works_or_is_refused_at_construction(tmp_path, chunk):
    pairs = _chunk(chunk)
    server = MotoServer()
    try:
        res = run_workers(WORKER, 2, lambda i, port: [port, 2, i, _args(tmp_path, server, pairs)], timeout=600,
                          label=f"option pairs {chunk}",
                          env={"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"})
    finally:
        server.close()
    for pid, verdicts in res.items():
        for pair in pairs:
            name = "+".join(pair)
            got = verdicts.get(name, "not run")
            if pair in REFUSED:
                assert got.startswith("refused: ") and all(w in got for w in REFUSED[pair]), (pid, name, got)
            else:
                assert got == "ok", (pid, name, got)


def _args(tmp_path, server, pairs):
    return json.dumps({"path": str(tmp_path), "endpoint": server.endpoint, "pairs": [list(p) for p in pairs]})
