"""The manager's clean-up helpers (jaxckpt/_manager/cleanup.py) on a real directory: who
holds the writer lease, and the uncommitted attempts with their sizes."""

import json
import os

import numpy as np

import jaxckpt
from jaxckpt._manager import cleanup
from jaxckpt._storage import location as _location


def test_writer_lease_names_the_live_holder_and_none_after_close(tmp_path):
    loc = _location.resolve(str(tmp_path))
    assert cleanup.writer_lease(loc) == (None, True)
    with jaxckpt.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"x": np.ones(3)})
        mgr.wait_until_finished()
        holder, gone = cleanup.writer_lease(loc)
        assert holder["pid"] == os.getpid() and gone is False
    assert cleanup.writer_lease(loc) == (None, True)


def test_an_unreadable_lease_counts_as_a_live_holder(tmp_path):
    (tmp_path / ".jaxckpt-writer.json").write_text("{not json")
    assert cleanup.writer_lease(_location.resolve(str(tmp_path))) == ({}, False)


def test_attempts_lists_a_dead_plain_save_with_its_bytes(tmp_path):
    jaxckpt.save(tmp_path / "1", {"x": np.ones(3)})
    hidden = tmp_path / ".2.jaxckpt-tmp-dead"
    (hidden / "arrays").mkdir(parents=True)
    (hidden / "arrays" / "chunk").write_bytes(b"x" * 100)
    entries = cleanup.attempts(_location.resolve(str(tmp_path)))
    assert [(e["step"], e["name"], e["kind"], e["bytes"]) for e in entries] == [
        (2, ".2.jaxckpt-tmp-dead", "tmp", 100)]
    json.dumps([{k: v for k, v in e.items() if k != "writer"} for e in entries])  # plain values
