"""Format 3 (JAXCKPT_FORMAT=3, issue 22) with a local directory per host: each host's
streams hold its group's copies, its manifest locates the rest in the other hosts'
(``_hoststreams``); a host that lacks a step gets a copy from one that holds all of it;
the persistent tier gets each stream's designated prefix, byte for byte. Real
multi-process job (tests/mp_f3hosts_worker.py)."""

import json
import os

import numpy as np
import pytest
from conftest import run_workers

import jaxckpt
from jaxckpt import _hoststreams, _streams

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def format3(monkeypatch):
    monkeypatch.setenv("JAXCKPT_FORMAT", "3")  # the workers inherit it


def manifest_of(path):
    with open(os.path.join(path, "manifest.json")) as f:
        return json.load(f)


def data_files(path):
    return {n: os.path.getsize(os.path.join(path, "data", n)) for n in sorted(os.listdir(os.path.join(path, "data")))}


def values(i, n=3):
    """What tests/mp_f3hosts_worker.py saves at step i on n devices."""
    return {"w": np.arange(16 * n * 96, dtype=np.float32).reshape(16 * n, 96) + i,
            "r": np.arange(50_000, dtype=np.int32) * i, "b": np.full(8, i, np.int8),
            "host": np.arange(5, dtype=np.float64) * i}


# --- the plan (pure) -------------------------------------------------------------------


def test_each_view_locates_held_chunks_in_its_own_streams_and_the_rest_at_the_designated_copy():
    # two leaves; group 0 = processes (0, 1), group 1 = process 2. Leaf a: 4 chunks, rows of
    # processes 0, 1, 2, 2 (sharded); leaf b: 2 chunks held by everyone (replicated)
    owners = [np.array([0, 0, 1, 1]), np.array([0, 0])]
    writers = {0: [np.array([0, 1, -1, -1]), np.array([0, 1])], 1: [np.array([-1, -1, 2, 2]), np.array([2, 2])]}
    view0 = _hoststreams.plan_view([60, 124], owners, writers, 0)
    view1 = _hoststreams.plan_view([60, 124], owners, writers, 1)
    # group 0's view is the designated one: b's chunks in group 0's streams only
    assert view0.runs == [((0, 0, 1, 0), (1, 1, 1, 0), (2, 2, 2, 0)), ((0, 0, 1, 64), (1, 1, 1, 64))]
    assert view0.streams == {0: 192, 1: 192, 2: 128}
    # group 1's stream: its designated entries (a's chunks 2, 3) first, then its copy of b
    assert view1.runs == [((0, 0, 1, 0), (1, 1, 1, 0), (2, 2, 2, 0)), ((2, 0, 2, 128),)]
    assert view1.streams == {0: 64, 1: 64, 2: 384}
    for view in (view0, view1):  # what a reader accepts
        leaves = [("a", 4, 64, _streams.runs_to_json(view.runs[0])), ("b", 2, 128, _streams.runs_to_json(view.runs[1]))]
        assert _streams.validate(leaves, view.streams, "/ckpt") == view.runs
    with pytest.raises(ValueError, match="a chunk its designated group holds no copy of"):
        _hoststreams.plan_view([60], [np.array([0, 1])], {0: [np.array([0, -1])], 1: [np.array([1, -1])]}, 0)


def test_a_view_plans_only_the_groups_it_needs():
    """Replicated chunks: every group holds all of them, so a view needs no other
    group's writers; a sharded leaf needs the groups holding what it lacks."""
    class Chunk:
        def __init__(self, *holders):
            self.holders = holders

    asked = []

    def writers_of(g):
        asked.append(g)
        return [[next((h for h in c.holders if h in g), -1) for c in chunks] for chunks in lists]

    replicated = [Chunk(0, 1, 2), Chunk(0, 1, 2)]
    lists = [replicated, replicated, []]
    layout = _hoststreams.lay_out([4, 4, 4], lists, [(2,), (0, 1)], (2,), [[2, 2], [2, 2], []], writers_of)
    assert asked == [] and layout.streams == {2: 4 * 64 - 56}
    sharded = [Chunk(0), Chunk(1), Chunk(2)]
    lists = [sharded]
    layout = _hoststreams.lay_out([4], lists, [(0, 1), (2,)], (2,), [[-1, -1, 2]], writers_of)
    assert asked == [(0, 1)] and layout.runs == [((0, 0, 1, 0), (1, 1, 1, 0), (2, 2, 1, 0))]
    assert layout.streams == {0: 8, 1: 8, 2: 8}


# --- real jobs -------------------------------------------------------------------------


SEGMENT = 64 << 10  # so each host's streams span several data objects


def run_hosts_job(tmp_path, durables, options=None):
    runs = [{"local": str(tmp_path / f"local{k}"), "durable": d} for k, d in enumerate(durables)]
    args = {"hosts": ["a", "a", "b"], "runs": runs, "save": [1, 2], "hostcopy": str(tmp_path / "copy"),
            "segment_bytes": SEGMENT, "options": options or {}}
    return run_workers(os.path.join(ROOT, "tests", "mp_f3hosts_worker.py"), 3,
                       lambda i, port: [port, 3, i, 1, "job", json.dumps(args)], 150)


def objects_of(files, process):
    """The sizes of one process's data objects, in order."""
    names = sorted((n for n in files if n.startswith(f"p{process}.")), key=lambda n: int(n.split(".")[1]))
    assert names == [f"p{process}.{i}" for i in range(len(names))], names
    return [files[n] for n in names]


def segments_of(length):
    return [min(SEGMENT, length - i) for i in range(0, length, SEGMENT)]


def check_host_copies(local):
    """Host a (processes 0, 1) holds its streams, host b (process 2) its own, which ends
    with its copies of the replicated leaves; host a's manifest gives b's stream only up
    to its designated entries (the rows of 'w' process 2 holds)."""
    a, b = manifest_of(os.path.join(local, "a", "2")), manifest_of(os.path.join(local, "b", "2"))
    assert a["format_version"] == b["format_version"] == 3 and a["segment_bytes"] == SEGMENT
    files_a, files_b = data_files(os.path.join(local, "a", "2")), data_files(os.path.join(local, "b", "2"))
    assert {n.split(".")[0] for n in files_a} == {"p0", "p1"} and {n.split(".")[0] for n in files_b} == {"p2"}
    for p in (0, 1):
        assert objects_of(files_a, p) == segments_of(a["streams"][str(p)])
    assert objects_of(files_b, 2) == segments_of(b["streams"]["2"])
    assert len(files_b) > 1 and b["streams"]["2"] > a["streams"]["2"] == 16 * 96 * 4 + 4
    rb = next(leaf for leaf in b["leaves"] if leaf["path"] == "r")
    assert {run[0] for run in rb["runs"]} == {2}  # host b reads its own copy
    ra = next(leaf for leaf in a["leaves"] if leaf["path"] == "r")
    assert {run[0] for run in ra["runs"]} <= {0, 1}  # host a reads its processes' copy
    return a, files_b


def check_persistent(a, loc, read_object, flip):
    """The persistent copy: process 0's manifest, b's stream cut at its designated
    entries; restores bit for bit in this single process; a flipped byte in an entry of
    'w' in b's object is caught by verify naming the leaf and the chunk."""
    man = jaxckpt.metadata(loc)
    assert man.format_version == 3
    assert len(read_object("p2.0")) == a["streams"]["2"]
    for p in (0, 1):
        assert [len(read_object(f"p{p}.{i}")) for i in range(len(segments_of(a["streams"][str(p)])))] == \
            segments_of(a["streams"][str(p)])
    back = jaxckpt.restore(loc)
    for k, want in values(2).items():
        assert back[k].dtype == want.dtype and back[k].tobytes() == want.tobytes(), k
    assert back["step"] == 2
    assert jaxckpt.verify(loc).ok
    w = next(leaf for leaf in a["leaves"] if leaf["path"] == "w")
    offset = next(run[3] for run in w["runs"] if run[0] == 2)
    flip("p2.0", offset + 100)
    report = jaxckpt.verify(loc)
    assert not report.ok and len(report.problems) == 1, report.problems
    problem = report.problems[0]
    assert (problem["leaf"], problem["chunk"]) == ("w", "cell [2, 0]")  # process 2's rows
    assert problem["message"].startswith(f"data/p2.0: DATA_LOSS: entry at offset {offset} of stream p2 ")
    assert "digest mismatch" in problem["message"]
    with pytest.raises(jaxckpt.CorruptCheckpointError, match="'w'"):
        jaxckpt.restore(loc)


def flip_local(path):
    def flip(name, at):
        with open(os.path.join(path, "data", name), "r+b") as f:
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 0x10]))
    return flip


def test_per_host_directories_persistent_tiers_and_a_replaced_host(tmp_path, s3_server):
    """Three processes, hosts a (0, 1) and b (2), saving steps 1 and 2 (every 2nd is
    persistent) twice: with a local directory, then the local S3 server, as the
    persistent tier. Each run restores step 2 from the hosts' directories, then onto
    columns (no host holds those: the persistent copy is read), bit for bit. Then
    replicated state, and host a replaced: it gets host b's copy (manifest and data
    objects byte for byte) and every process restores it bit for bit."""
    durable = str(tmp_path / "durable")
    res = run_hosts_job(tmp_path, [durable, s3_server("f3hosts")])
    for p in (0, 1, 2):
        for out in res[p]["runs"]:
            assert out["groups"] == [[0, 1], [2]]
            assert out["tiers"] == {"1": ["local"], "2": ["local", "persistent"]}
            assert out["restored"] == 2 and out["restored_columns"] == 2
        assert res[p]["hostcopy"] == {"steps_at_start": [], "restored": 7, "steps": [7]}
    copy_a, copy_b = tmp_path / "copy" / "a" / "7", tmp_path / "copy" / "b" / "7"
    names = sorted(os.listdir(copy_b / "data"))
    assert len(names) > 1 and sorted(os.listdir(copy_a / "data")) == names and names[0] == "p2.0"
    for name in ["manifest.json"] + [f"data/{n}" for n in names]:
        assert (copy_a / name).read_bytes() == (copy_b / name).read_bytes()
    assert jaxckpt.verify(str(copy_a)).ok
    for k in (0, 1):
        a, _ = check_host_copies(str(tmp_path / f"local{k}"))
        # the S3 run uploaded b's object cut at its designated entries through a temporary
        # copy in b's directory: gone
        assert sorted(os.listdir(tmp_path / f"local{k}" / "b")) == ["1", "2"]
    step = os.path.join(durable, "2")
    assert sorted(os.listdir(os.path.join(step, "data"))) == sorted(
        [f"p{p}.{i}" for p in (0, 1) for i in range(len(segments_of(a["streams"][str(p)])))] + ["p2.0"])

    def read_object(name):
        with open(os.path.join(step, "data", name), "rb") as f:
            return f.read()

    check_persistent(a, step, read_object, flip_local(step))

    client = s3_server.client
    man = json.loads(client.get_object(Bucket="jaxckpt-test", Key="f3hosts/2/manifest.json")["Body"].read())
    assert man["format_version"] == 3 and man["data"].startswith("d/")
    assert man["streams"] == a["streams"] and [leaf.get("runs") for leaf in man["leaves"]] == [
        leaf.get("runs") for leaf in a["leaves"]]
    key = f"f3hosts/2/{man['data']}/data/"

    def read_s3(name):
        return client.get_object(Bucket="jaxckpt-test", Key=key + name)["Body"].read()

    def flip_s3(name, at):
        data = bytearray(read_s3(name))
        data[at] ^= 0x10
        client.put_object(Bucket="jaxckpt-test", Key=key + name, Body=bytes(data))

    check_persistent(a, s3_server("f3hosts/2"), read_s3, flip_s3)
    check_host_parts(str(tmp_path / "local1"))


def check_host_parts(local):
    """verify_before_delete's check of one host's directory (``_verify.verify_part``): host
    a's own streams verify ok, though its manifest also locates entries in host b's stream
    (which a plain verify of a's directory finds missing); a byte flipped in a's own stream
    is still caught, naming the leaf."""
    from jaxckpt import _verify

    host_a = os.path.join(local, "a", "2")
    assert _verify.verify_part(host_a, {2}).ok
    plain = jaxckpt.verify(host_a)
    assert not plain.ok and {d["file"] for d in plain.damaged} == {"data/p2.0"}, plain.damaged
    assert _verify.verify_part(os.path.join(local, "b", "2"), {0, 1}).ok
    flip_local(host_a)("p0.0", 200)
    report = _verify.verify_part(host_a, {2})
    assert not report.ok and len(report.damaged) == 1, report.damaged  # the entry spans small objects
    assert report.damaged[0]["file"].startswith("data/p0.0") and report.damaged[0]["leaves"] == ["r"]
    assert "digest mismatch" in report.damaged[0]["message"]


def test_one_process_copies_its_data_objects_to_the_persistent_tier(tmp_path, monkeypatch):
    """A shared directory (one process): the persistent copy is the local one, object for
    object, in blocks smaller than the object."""
    from jaxckpt._manager import tiers

    monkeypatch.setattr(tiers, "COPY_BLOCK_BYTES", 4096)
    tree = {"w": np.arange(30_000, dtype=np.float32), "b": np.arange(7, dtype=np.int8), "step": 3}
    with jaxckpt.CheckpointManager(str(tmp_path / "local"), persistent_directory=str(tmp_path / "durable"),
                                   persistent_interval_steps=1) as mgr:
        mgr.save(3, tree)
        mgr.wait_until_finished()
    local, durable = str(tmp_path / "local" / "3"), str(tmp_path / "durable" / "3")
    assert data_files(durable) == data_files(local) == {"p0.0": manifest_of(local)["streams"]["0"]}
    assert (tmp_path / "durable/3/data/p0.0").read_bytes() == (tmp_path / "local/3/data/p0.0").read_bytes()
    assert manifest_of(durable)["format_version"] == 3 and jaxckpt.verify(durable).ok
    back = jaxckpt.restore(durable)
    assert back["w"].tobytes() == tree["w"].tobytes() and back["b"].tobytes() == tree["b"].tobytes()
    assert back["step"] == 3


def test_a_repeated_save_per_host_reuses_its_groups_writers_and_layout(monkeypatch):
    """A directory per host: each save plans its group's writers and its view of every
    group's streams; a repeated save of the same leaves (the same shared chunk lists)
    gets the same writer lists and the same layout back, without planning again."""
    from jaxckpt import _chunking, _snapshot

    def chunk(row, holders):
        return _chunking.Chunk(((row, row + 1), (0, 4)), 16, holders, ((row, row + 1), (0, 4)))

    sharded = [chunk(r, (r % 4,)) for r in range(8)]  # one holder each: processes 0..3
    replicated = [chunk(r, (0, 1, 2, 3)) for r in range(2)]
    groups, group = ((0, 1), (2, 3)), (2, 3)
    calls = []
    real = _hoststreams.lay_out
    monkeypatch.setattr(_hoststreams, "lay_out", lambda *a: calls.append(1) or real(*a))

    def save():
        arrays = [_snapshot._ArrayLeaf(i, {"path": f"l{i}", "dtype": "float32", "storage_dtype": "float32",
                                           "shape": (8, 4), "chunk_shape": (1, 4)}, chunks, {})
                  for i, chunks in enumerate([sharded, replicated])]
        _snapshot._assign(arrays, group)
        streams = _snapshot._lay_out_streams(arrays, group, groups)
        return [a.writers for a in arrays], [a.fields["runs"] for a in arrays], streams

    writers, runs, streams = save()
    assert writers[0] == [-1, -1, 2, 3, -1, -1, 2, 3] and sorted(writers[1]) == [2, 3]
    again = save()
    assert all(a is b for a, b in zip(again[0], writers)) and again[1] == runs and again[2] == streams
    assert again[2] is not streams and len(calls) == 1  # planned once; each save its own dict
    other = [list(sharded), replicated]  # equal chunks in another list (made anew): planned anew
    arrays = [_snapshot._ArrayLeaf(i, {"path": f"l{i}", "dtype": "float32", "storage_dtype": "float32",
                                       "shape": (8, 4), "chunk_shape": (1, 4)}, chunks, {})
              for i, chunks in enumerate(other)]
    _snapshot._assign(arrays, group)
    assert _snapshot._lay_out_streams(arrays, group, groups) == streams and len(calls) == 2
    assert [a.fields["runs"] for a in arrays] == runs


def test_codecs_with_a_directory_per_host_persistent_tier_and_a_replaced_host(tmp_path):
    """Issue 32, item 5 (refused before: c1abc6a's managers failed every save, then the
    constructor refused them). The first test's job with w in zstd and r in blosc: hosts
    a (0, 1) and b (2) each encode their own copies; host b's view locates w's rows only
    host a holds at a's entries, whose sizes it learns from a's processes. Restored from
    the hosts' directories and onto columns (from the persistent copy, which holds each
    stream up to its last designated entry), bit for bit; replicated state with host a
    replaced, the same. Each view's streams end where its last entry does."""
    durable = str(tmp_path / "durable")
    res = run_hosts_job(tmp_path, [durable], {"compression": {"w": "zstd", "r": "blosc"}})
    for p in (0, 1, 2):
        assert "crash" not in res[p], res[p]
        out, = res[p]["runs"]
        assert out["tiers"] == {"1": ["local"], "2": ["local", "persistent"]}
        assert out["restored"] == 2 and out["restored_columns"] == 2
        assert res[p]["hostcopy"] == {"steps_at_start": [], "restored": 7, "steps": [7]}
    views = {h: json.loads((tmp_path / "local0" / h / "2" / "manifest.json").read_text()) for h in "ab"}
    persistent = json.loads((tmp_path / "durable" / "2" / "manifest.json").read_text())
    for view in (*views.values(), persistent):
        leaves = {leaf["path"]: leaf for leaf in view["leaves"]}
        assert leaves["w"]["codec"] == "zstd" and leaves["r"]["codec"] == "blosc"
        ends = {}
        for leaf in leaves.values():
            for run, size in zip(leaf.get("runs", []), leaf.get("sizes", [])):
                if size:
                    ends[run[0]] = max(ends.get(run[0], 0), run[3] + size)
        for p, end in ends.items():
            assert view["streams"][str(p)] >= end
    assert {r[0] for r in {leaf["path"]: leaf for leaf in views["b"]["leaves"]}["r"]["runs"]} == {2}
    assert {r[0] for r in {leaf["path"]: leaf for leaf in views["a"]["leaves"]}["r"]["runs"]} <= {0, 1}
    assert persistent["streams"] == views["a"]["streams"]  # host a (process 0's) is the persistent view
    assert jaxckpt.verify(str(tmp_path / "durable" / "2")).ok
