"""The corruption matrix on format 3 (issue 22, item 5): "a flipped byte still names the
leaf and the chunk". (The crash matrix on format 3 is in tests/test_crash.py, its cases
``v3-*``.)

One saved checkpoint, 4 KiB data objects so that an entry straddles two of them:

    e  int16 (7,)        entry [0, 18)           in data/p0.0
    s  int32 (3, 4)      entry [64, 116)
    w  float32 (64, 24)  4 chunks of 16 rows: entries [128 + 1600 i, 1668 + 1600 i);
                         chunk 2 straddles p0.0 and p0.1 (stream byte 4096)

A byte flipped anywhere in an entry (its payload's first, middle and last byte, the first
and last byte of its crc32c, the two bytes either side of a segment boundary) makes every
way of reading that chunk raise ``CorruptCheckpointError`` naming the leaf and the chunk,
and ``verify`` (and ``jaxckpt verify``) report exactly that chunk; the other leaves read
right. A flipped byte in the alignment padding between entries is no damage: no reader
reads it and no checksum covers it, so ``verify`` does not flag it. A truncated, emptied
or missing data object costs exactly the chunks it cuts off (missing: every chunk in it;
verify names each leaf with its first chunk there); a longer one or a stray one costs
none. A manifest whose runs point past a stream's end, or whose stream length disagrees
with its runs, is refused with the leaf named.
"""

import json
import os
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import assert_bit_equal, mesh, sharded
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt import _layout, _snapshot, _streams, _verify, cli

SEGMENT = 4096
W = np.arange(64 * 24, dtype=np.float32).reshape(64, 24) * np.float32(0.5)
S = np.arange(12, dtype=np.int32).reshape(3, 4) - 5
E = np.arange(7, dtype=np.int16) * 3
VALUES = {"w": W, "s": S, "e": E}
READS = ("restore", "restore_target", "view", "view_slice", "verify", "cli")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    path = tmp_path_factory.mktemp("pristine") / "ckpt"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JAXCKPT_FORMAT", "3")
        mp.setattr(_snapshot, "SEGMENT_BYTES", SEGMENT)
        jaxckpt.save(path, {"w": sharded(W, (4,), ("x",), ("x", None)), "s": S, "e": E, "step": 3})
    man = manifest(path)
    assert man["streams"] == {"0": 6468} and sorted(os.listdir(path / "data")) == ["p0.0", "p0.1"]
    assert [(leaf["path"], leaf.get("runs")) for leaf in man["leaves"]] == [
        ("e", [[0, 0, 1, 0]]), ("s", [[0, 0, 1, 64]]), ("step", None), ("w", [[0, 0, 4, 128]])]
    return path


@pytest.fixture
def ckpt(pristine, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(pristine, path)
    return path


def manifest(path):
    with open(os.path.join(path, "manifest.json")) as f:
        return json.load(f)


def entries(path):
    """Every entry: (leaf, chunk label, cell, stream offset, entry bytes), in stream order."""
    out = []
    for leaf in manifest(path)["leaves"]:
        if leaf["kind"] == "value":
            continue
        grid = _layout.chunk_grid_shape(tuple(leaf["shape"]), tuple(leaf["chunk_shape"]))
        stride = _streams.stride_for(leaf["entry_bytes"])
        for p, first, count, offset in leaf["runs"]:
            assert p == 0
            for i in range(count):
                cell = tuple(int(c) for c in np.unravel_index(first + i, grid)) if grid else ()
                out.append((leaf["path"], f"cell {list(cell)}", cell, offset + i * stride, leaf["entry_bytes"]))
    return sorted(out, key=lambda e: e[3])


def flip(path, at):
    """Flip one bit of stream byte ``at`` (in place; a second flip undoes it)."""
    name = os.path.join(path, "data", f"p0.{at // SEGMENT}")
    with open(name, "r+b") as f:
        f.seek(at % SEGMENT)
        byte = f.read(1)[0]
        f.seek(at % SEGMENT)
        f.write(bytes([byte ^ 0x10]))


def positions(path):
    """(stream byte, the entry it lies in) for the matrix: in every entry the payload's
    first, middle and last byte and the crc32c's first and last; both sides of 4096."""
    out = []
    for entry in entries(path):
        start, size = entry[3], entry[4]
        payload = size - 4
        for at in sorted({start, start + payload // 2, start + payload - 1, start + payload, start + size - 1}):
            out.append((at, entry))
        if start < SEGMENT < start + size:
            out += [(SEGMENT - 1, entry), (SEGMENT, entry)]
    return out


def _target():
    rows = NamedSharding(mesh((2,), ("x",)), P("x"))  # each device: 2 of w's 4 chunks
    return {"w": jax.ShapeDtypeStruct(W.shape, W.dtype, sharding=rows), "s": S, "e": E, "step": 0}


def _read(path, how, leaf, cell):
    """Read ``leaf`` one way: whole, or (``view_slice``) a few elements of ``cell`` only."""
    if how == "restore":
        return jaxckpt.restore(path)[leaf]
    if how == "restore_target":
        return np.asarray(jaxckpt.restore(path, _target())[leaf])
    if how == "view":
        return jaxckpt.open(path)[leaf][...]
    if leaf == "w":
        return jaxckpt.open(path)["w"][16 * cell[0] + 1:16 * cell[0] + 3, 2:5]
    return jaxckpt.open(path)[leaf][(slice(1, 2),) * len(cell)]


@pytest.mark.parametrize("how", READS)
def test_a_flipped_byte_in_an_entry_names_its_leaf_and_chunk(ckpt, how, capsys):
    cases = positions(ckpt)
    assert len(cases) == 32
    for at, (leaf, chunk, cell, start, _) in cases:
        flip(ckpt, at)
        if how in ("verify", "cli"):
            _assert_verify_finds(ckpt, how, capsys, leaf, chunk, start)
        else:
            with pytest.raises(jaxckpt.CorruptCheckpointError) as err:
                _read(ckpt, how, leaf, cell)
            message = str(err.value)
            assert message.startswith(f"Checkpoint '{ckpt}': leaf '{leaf}' chunk {chunk} could not be read: "
                                       f"DATA_LOSS: entry at offset {start} of stream p0 (data object "), (at, message)
            assert "digest mismatch" in message, message
            if how == "view":  # the other leaves still read, and right
                view = jaxckpt.open(ckpt)
                for other in VALUES.keys() - {leaf}:
                    assert_bit_equal(view[other][...], VALUES[other])
        flip(ckpt, at)
    assert jaxckpt.verify(ckpt).ok  # every flip undone


def _assert_verify_finds(path, how, capsys, leaf, chunk, start):
    """``verify`` (or ``jaxckpt verify``) reports exactly one problem: ``leaf``'s ``chunk``."""
    if how == "verify":
        report = jaxckpt.verify(path)
        [problem] = report.problems
        assert (problem["leaf"], problem["chunk"]) == (leaf, chunk), problem
        assert re.match(rf"data/p0\.[01]( and data/p0\.1)?: DATA_LOSS: entry at offset {start} of stream p0 .*"
                        "digest mismatch", problem["message"]), problem
        assert report.unrestorable == [leaf] and len(report.damaged) == 1
        return
    assert cli.run(["verify", str(path)]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"{path}: CORRUPT"), out
    lines = [line for line in out.splitlines() if line.startswith("  ")]
    assert len(lines) == 1 and lines[0].startswith(f"  leaf '{leaf}' chunk {chunk}: data/p0."), out
    assert f"entry at offset {start} of stream p0" in lines[0] and "digest mismatch" in lines[0], out


def test_the_alignment_padding_is_no_damage(ckpt):
    """Every byte between entries flipped at once: nothing reads them, no checksum covers
    them; verify reports nothing and every leaf restores bit for bit."""
    covered = np.zeros(6468, bool)
    for _, _, _, start, size in entries(ckpt):
        covered[start:start + size] = True
    gaps = np.flatnonzero(~covered)
    assert len(gaps) == 6468 - 18 - 52 - 4 * 1540 == 238
    for at in gaps:
        flip(ckpt, int(at))
    report = jaxckpt.verify(ckpt)
    assert report.ok and report.chunks == 6, report.summary()
    out = jaxckpt.restore(ckpt, _target())
    for leaf, want in VALUES.items():
        assert_bit_equal(out[leaf], want)


def _truncate(size):
    def damage(f):
        with open(f, "r+b") as fh:
            fh.truncate(size)
    return damage


def _append(f):
    with open(f, "ab") as fh:
        fh.write(b"\0" * 10)


# damage to a data object -> (object, how, its size message, the chunks it costs as
# (leaf, chunk, the start of the read error's message))
OBJECT_DAMAGE = {
    "truncate-tail": ("p0.1", _truncate(1000), "has 1000 bytes, expected 2372",
                      [("w", "cell [3, 0]", "DATA_LOSS: data object {obj} ended early: it has 1000 bytes, "
                                            "the entry needs bytes [832, 2372) (entry at offset 4928 of stream p0)")]),
    "truncate-straddling": ("p0.1", _truncate(500), "has 500 bytes, expected 2372",
                            [("w", "cell [2, 0]", "DATA_LOSS: data object {obj} ended early: it has 500 bytes, "
                                                  "the entry needs bytes [0, 772) (entry at offset 3328 of stream p0)"),
                             ("w", "cell [3, 0]", "DATA_LOSS: data object {obj} ended early: it has 500 bytes, "
                                                  "the entry needs bytes [832, 2372) (entry at offset 4928 of stream p0)")]),
    "truncate-first": ("p0.0", _truncate(3000), "has 3000 bytes, expected 4096",
                       [("w", "cell [1, 0]", "DATA_LOSS: data object {obj} ended early: it has 3000 bytes, "
                                             "the entry needs bytes [1728, 3268) (entry at offset 1728 of stream p0)"),
                        ("w", "cell [2, 0]", "DATA_LOSS: data object {obj} ended early: it has 3000 bytes, "
                                             "the entry needs bytes [3328, 4096) (entry at offset 3328 of stream p0)")]),
    "empty": ("p0.0", _truncate(0), "has 0 bytes, expected 4096",
              [(leaf, chunk, "DATA_LOSS: data object {obj} ended early: it has 0 bytes")
               for leaf, chunk in [("e", "cell [0]"), ("s", "cell [0, 0]"), ("w", "cell [0, 0]"),
                                   ("w", "cell [1, 0]"), ("w", "cell [2, 0]")]]),
    "longer": ("p0.1", _append, "has 2382 bytes, expected 2372", []),
    "delete": ("p0.1", os.remove, "is missing", [("w", f"cell [{i}, 0]", "NOT_FOUND: data object {obj} is missing")
                                                 for i in (2, 3)]),
}


@pytest.mark.parametrize("damage", sorted(OBJECT_DAMAGE))
def test_a_damaged_data_object_costs_exactly_the_chunks_it_cuts_off(ckpt, damage):
    name, fn, size_message, hit = OBJECT_DAMAGE[damage]
    obj = os.path.join(ckpt, "data", name)
    fn(obj)
    report = jaxckpt.verify(ckpt)
    assert not report.ok
    lost = sorted({leaf for leaf, _, _ in hit})
    assert report.unrestorable == lost, report.summary()
    if damage == "delete":  # the object is the damage: each leaf named with its first chunk there
        assert report.damaged == [{"file": f"data/{name}", "message": f"data/{name} is missing", "leaves": ["w"],
                                   "chunks": ["cell [2, 0]"], "unrestorable": True}]
    else:
        assert {"file": f"data/{name}", "message": f"data/{name} {size_message}", "leaves": [], "chunks": [],
                "unrestorable": False} in report.damaged
        problems = [(p["leaf"], p["chunk"]) for p in report.problems if p["leaf"] is not None]
        assert problems == [(leaf, chunk) for leaf, chunk, _ in hit], report.problems
        for p, (_, _, said) in zip([p for p in report.problems if p["leaf"] is not None], hit):
            assert said.format(obj=obj) in p["message"], p
    view = jaxckpt.open(ckpt)
    for leaf in VALUES.keys() - set(lost):
        assert_bit_equal(view[leaf][...], VALUES[leaf])
    if not hit:
        assert_bit_equal(view["w"][...], W)
        return
    with pytest.raises(jaxckpt.CorruptCheckpointError) as err:
        jaxckpt.restore(ckpt)
    message = str(err.value)
    chunks = "|".join(re.escape(f"leaf '{leaf}' chunk {chunk}") for leaf, chunk, _ in hit)
    assert re.match(rf"Checkpoint '{re.escape(str(ckpt))}': ({chunks}) could not be read: ", message), message
    said = dict(((leaf, chunk), s) for leaf, chunk, s in hit)
    named = message.split(": leaf ")[1].split(" could not")[0]
    leaf, chunk = named.split("' chunk ")[0].strip("'"), named.split(" chunk ")[1]
    assert said[(leaf, chunk)].format(obj=obj) in message, message
    for i in range(4):  # w's chunks not cut off still read
        if ("w", f"cell [{i}, 0]") not in [(leaf, chunk) for leaf, chunk, _ in hit]:
            assert_bit_equal(view["w"][16 * i:16 * (i + 1)], W[16 * i:16 * (i + 1)])


def test_a_stray_data_object_harms_no_leaf(ckpt):
    with open(os.path.join(ckpt, "data", "p1.0"), "wb") as f:
        f.write(b"x" * 100)
    report = jaxckpt.verify(ckpt)
    assert report.unrestorable == [] and [d["message"] for d in report.damaged] == ["unexpected file data/p1.0"]
    assert_bit_equal(jaxckpt.restore(ckpt)["w"], W)


def _rewrite(path, change):
    doc = manifest(path)
    doc.pop("checksum")  # accepted without one (older writers); with a stale one it is refused as such
    change(doc)
    with open(os.path.join(path, "manifest.json"), "w") as f:
        json.dump(doc, f)


def _leaf(doc, name):
    return next(leaf for leaf in doc["leaves"] if leaf["path"] == name)


MANIFEST_DAMAGE = {
    "run-past-the-end": (lambda doc: _leaf(doc, "s").update(runs=[[0, 0, 1, 6528]]),
                         "leaf 's': run #0 [0, 0, 1, 6528]: its entries end at byte 6580, past the end of "
                         "process 0's stream (6468 bytes)"),
    "stream-shorter": (lambda doc: doc.update(streams={"0": 6400}),
                       "leaf 'w': run #0 [0, 0, 4, 128]: its entries end at byte 6468, past the end of "
                       "process 0's stream (6400 bytes)"),
    "stream-longer": (lambda doc: doc.update(streams={"0": 8000}),
                      "stream of process 0: 8000 bytes, but its last entry (leaf 'w' run #0) ends at byte 6468"),
    "runs-overlap": (lambda doc: _leaf(doc, "s").update(runs=[[0, 0, 1, 0]]),
                     "leaf 's': run #0 (bytes 0..52) overlaps leaf 'e' run #0 (bytes 0..18) in the stream of process 0"),
}


@pytest.mark.parametrize("damage", sorted(MANIFEST_DAMAGE))
def test_a_manifest_whose_runs_do_not_fit_its_streams_is_refused(ckpt, damage):
    change, said = MANIFEST_DAMAGE[damage]
    _rewrite(ckpt, change)
    with pytest.raises(jaxckpt.CorruptCheckpointError) as err:
        jaxckpt.restore(ckpt)
    assert str(err.value).startswith(f"Checkpoint '{ckpt}': invalid manifest: ") and said in str(err.value), err.value
    report = jaxckpt.verify(ckpt)
    assert [d["file"] for d in report.damaged] == ["manifest.json"] and said in report.damaged[0]["message"]


@pytest.mark.parametrize("kind", ["fifo", "directory", "link_to_dev_zero", "link_outside"])
def test_a_data_object_that_is_not_a_regular_file_is_corrupt_and_never_blocks(ckpt, tmp_path, kind):
    obj = ckpt / "data" / "p0.1"  # w's chunks 2 (half of it) and 3
    outside = tmp_path / "outside"
    outside.write_bytes(obj.read_bytes()[:-1] + b"\x00")  # a regular file, not the data object
    obj.unlink()
    {"fifo": lambda: os.mkfifo(obj), "directory": obj.mkdir,
     "link_to_dev_zero": lambda: obj.symlink_to("/dev/zero"), "link_outside": lambda: obj.symlink_to(outside),
     }[kind]()
    said = "digest mismatch" if kind == "link_outside" else "is not a regular file"
    for read in (lambda: jaxckpt.restore(ckpt), lambda: jaxckpt.open(ckpt)["w"][50:51, 1:2]):
        with pytest.raises(jaxckpt.CorruptCheckpointError) as err:
            read()
        assert re.match(rf"Checkpoint '{re.escape(str(ckpt))}': leaf 'w' chunk cell \[[23], 0\] could not be read: ",
                        str(err.value)), err.value
        assert str(obj) in str(err.value) and said in str(err.value), err.value
    report = jaxckpt.verify(ckpt)
    assert report.unrestorable == ["w"], report.summary()
    assert_bit_equal(jaxckpt.open(ckpt)["w"][:32], W[:32])  # chunks 0 and 1 lie in p0.0


# --- work a manifest implies, checked against what the checkpoint holds --------------------


def _huge_leaves_manifest(leaves, dim, chunk, segment_bytes, dtype="uint8"):
    """A format-3 manifest (no checksum, no data objects): ``leaves`` leaves of shape
    ``[dim]`` in chunks of ``[chunk]``, one run each, back to back in process 0's stream."""
    itemsize = np.dtype(dtype).itemsize
    entry = chunk * itemsize + 4
    stride = _streams.stride_for(entry)
    count = -(-dim // chunk)
    span = -(-((count - 1) * stride + entry) // _streams.ALIGN) * _streams.ALIGN
    recs = [{"path": f"l{i}", "kind": "array", "dtype": dtype, "shape": [dim], "store": "stream",
             "chunk_shape": [chunk], "nbytes": dim * itemsize, "codec": "raw", "entry_bytes": entry,
             "runs": [[0, 0, count, i * span]]} for i in range(leaves)]
    doc = {"format": "jaxckpt", "format_version": 3, "process_count": 1, "segment_bytes": segment_bytes,
           "streams": {"0": (leaves - 1) * span + (count - 1) * stride + entry},
           "structure": {"dict": [[f"l{i}", {"leaf": i}] for i in range(leaves)]}, "leaves": recs}
    return json.dumps(doc, separators=(",", ":")).encode()


# verify in a process of its own, its address space capped 2 GiB above what it holds after
# importing jaxckpt and its run bounded by the caller: a verify that walks billions of data
# objects fails the test (out of memory or out of time) instead of blocking it.
_VERIFY_CAPPED = """
import json, resource, sys, time
import jaxckpt
with open("/proc/self/status") as f:
    held = next(int(line.split()[1]) << 10 for line in f if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (held + (2 << 30), resource.RLIM_INFINITY))
start = time.perf_counter()
report = jaxckpt.verify(sys.argv[1])
print("RESULT " + json.dumps({"report": report.to_json(), "seconds": time.perf_counter() - start}))
"""


def _verify_capped(path, timeout=120):
    root = os.path.dirname(os.path.dirname(os.path.abspath(jaxckpt.__file__)))
    try:
        run = subprocess.run([sys.executable, "-c", _VERIFY_CAPPED, str(path)], capture_output=True, text=True,
                             timeout=timeout, env=dict(os.environ, PYTHONPATH=root, JAX_PLATFORMS="cpu"))
    except subprocess.TimeoutExpired:
        raise AssertionError(f"verify of {path} did not finish within {timeout}s") from None
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(next(ln for ln in run.stdout.splitlines() if ln.startswith("RESULT "))[7:])["report"]


def test_a_1kb_manifest_implying_17_billion_data_objects_is_refused_at_once(tmp_path):
    # 4 leaves of 16 TiB in 4 KiB data objects: 17,179,869,184 of them (c1abc6a's verify
    # listed them all, without end)
    path = tmp_path / "hostile"
    path.mkdir()
    body = _huge_leaves_manifest(4, (1 << 44) - 64, (1 << 44) - 64, 4096)
    assert len(body) < 1100
    (path / "manifest.json").write_bytes(body)
    said = (f"Checkpoint '{path}': invalid manifest: streams of 70368744177604 bytes in data objects of 4096 bytes "
            "are 17179869184 data objects (at most 1048576)")
    report = _verify_capped(path)
    assert (report["ok"], report["problems"]) == (False, [{"leaf": None, "chunk": "manifest.json", "message": said}])
    for read in (jaxckpt.restore, jaxckpt.metadata, jaxckpt.open):
        with pytest.raises(jaxckpt.CorruptCheckpointError) as err:
            read(path)
        assert str(err.value) == said


def test_a_stream_missing_more_objects_than_verify_names_is_one_problem_per_leaf(tmp_path):
    # 4 leaves of 2**20 one-byte chunks (4M entries of 64 bytes: 256 MiB of stream in 65,536
    # data objects of 4 KiB, within the manifest's bounds) and no data object at all: one
    # problem per leaf, no object or entry walked one by one
    path = tmp_path / "lied"
    path.mkdir()
    (path / "manifest.json").write_bytes(_huge_leaves_manifest(4, 1 << 20, 1, 4096))
    report = _verify_capped(path, timeout=60)
    said = ("data/p0.*: the stream of process 0 is 268435397 bytes in 65536 data objects of 4096 bytes, "
            "65536 of them missing")
    assert report["problems"] == [{"leaf": f"l{i}", "chunk": "cell [0]", "message": said} for i in range(4)]
    assert report["damaged"] == [{"file": "data/p0.*", "message": said, "leaves": ["l0", "l1", "l2", "l3"],
                                  "chunks": ["cell [0]"] * 4, "unrestorable": True}]
    assert (report["ok"], report["chunks"], report["bytes_read"]) == (False, 4 << 20, 0)
    with pytest.raises(jaxckpt.CorruptCheckpointError, match=r"leaf 'l1' chunk cell \[5\] could not be read: "
                                                             r"NOT_FOUND: data object .*p0\.16384 is missing"):
        jaxckpt.open(path)["l1"][5]


def test_a_stream_missing_as_many_objects_as_verify_names_names_each(ckpt, monkeypatch):
    # the bound's edge: a stream missing exactly MISSING_OBJECTS_NAMED objects still names each
    monkeypatch.setattr(_verify, "MISSING_OBJECTS_NAMED", 2)
    for name in ("p0.0", "p0.1"):
        os.remove(ckpt / "data" / name)
    report = jaxckpt.verify(ckpt)
    assert [d["file"] for d in report.damaged] == ["data/p0.0", "data/p0.1"]
    monkeypatch.setattr(_verify, "MISSING_OBJECTS_NAMED", 1)
    report = jaxckpt.verify(ckpt)
    said = "data/p0.*: the stream of process 0 is 6468 bytes in 2 data objects of 4096 bytes, 2 of them missing"
    assert report.damaged == [{"file": "data/p0.*", "message": said, "leaves": ["e", "s", "w"],
                               "chunks": ["cell [0]", "cell [0, 0]", "cell [0, 0]"], "unrestorable": True}]
