"""Format 3's pure layout (jaxckpt/_streams.py): exact runs for hand-computed trees, a
property test over random trees against a naive reference, and the validation of
untrusted runs and streams (each kind of corruption, its exact message)."""

import math

import numpy as np
import pytest

from jaxckpt import _streams
from jaxckpt._errors import CorruptCheckpointError
from jaxckpt._storage import objectnames as _objectnames
from jaxckpt._streams import Layout

WHERE = "/ckpt/7"


# --- plan: hand-computed trees -----------------------------------------------------------


def test_one_writer():
    # payload 100 -> entry 104 -> stride 128; the stream ends where the last entry does
    assert _streams.plan([(100, [0, 0, 0])]) == Layout([((0, 0, 3, 0),)], {0: 2 * 128 + 104})


def test_alternating_replicated_writers():
    # entry 64 = stride: each process's entries follow each other; no run merges across writers
    assert _streams.plan([(60, [0, 1, 0, 1])]) == Layout(
        [((0, 0, 1, 0), (1, 1, 1, 0), (0, 2, 1, 64), (1, 3, 1, 64))], {0: 128, 1: 128})


def test_a_process_writing_twice_in_a_leaf_continues_its_stream():
    # stride 64: process 0's second run is its second entry of the leaf
    assert _streams.plan([(8, [0, 1, 1, 0, 0])]) == Layout(
        [((0, 0, 1, 0), (1, 1, 2, 0), (0, 3, 2, 64))], {0: 2 * 64 + 12, 1: 64 + 12})


def test_edge_chunks_take_the_full_chunk():
    # shape (5,) float32 in chunks of (2,): three chunks, the last padded to 8 bytes (as zarr)
    payload = math.prod((2,)) * 4
    assert _streams.plan([(payload, [0, 0, 1])]) == Layout([((0, 0, 2, 0), (1, 2, 1, 0))], {0: 64 + 12, 1: 12})


def test_tiny_leaves_align_dominates():
    # scalars: entry 8, stride 64; three leaves, each one entry of process 0
    assert _streams.plan([(4, [0]), (4, [0]), (4, [0])]) == Layout(
        [((0, 0, 1, 0),), ((0, 0, 1, 64),), ((0, 0, 1, 128),)], {0: 128 + 8})


def test_leaves_follow_each_other_and_an_empty_process_has_no_stream():
    # leaf 1 (stride 64) then leaf 2 (entry 1004, stride 1024) continue process 2's stream;
    # process 1 writes nothing: no stream; a zero-size leaf has no runs
    layout = _streams.plan([(8, [2]), (1000, [0, 0, 2, 2]), (4, [])])
    assert layout == Layout([((2, 0, 1, 0),), ((0, 0, 2, 0), (2, 2, 2, 64)), ()],
                            {0: 1024 + 1004, 2: 64 + 1024 + 1004})


def test_a_shared_writer_list_gives_what_copies_give():
    shared = [3, 3, 1, 1]
    assert _streams.plan([(100, shared), (50, shared), (100, shared)]) == _streams.plan(
        [(100, list(shared)), (50, np.array(shared)), (100, tuple(shared))])


def test_plan_refuses_a_chunk_without_writer():
    with pytest.raises(ValueError, match="every chunk needs a writing process"):
        _streams.plan([(8, [0, -1])])


# --- locate, segments, objects -----------------------------------------------------------


def test_locate():
    runs = ((0, 0, 1, 0), (1, 1, 2, 0), (0, 3, 2, 64))
    assert [_streams.locate(runs, f, 64) for f in range(5)] == [(0, 0), (1, 0), (1, 64), (0, 64), (0, 128)]
    for flat in (-1, 5):
        with pytest.raises(IndexError, match=f"chunk {flat} lies in no run"):
            _streams.locate(runs, flat, 64)


def test_segments():
    assert _objectnames.segments(3, 100, 50, 128) == [("p3.0", 100, 128), ("p3.1", 0, 22)]
    assert _objectnames.segments(0, 128, 128, 128) == [("p0.1", 0, 128)]
    assert _objectnames.segments(1, 10, 300, 128) == [("p1.0", 10, 128), ("p1.1", 0, 128), ("p1.2", 0, 54)]
    assert _objectnames.segments(1, 10, 0, 128) == []
    assert _objectnames.segments(12, 5 << 30, 68) == [("p12.5", 0, 68)]  # the 1 GiB default


def test_objects():
    streams = {0: 1, 1: 128, 2: 129, 5: 1000}
    assert _objectnames.objects_per_process(streams, 128) == {0: 1, 1: 1, 2: 2, 5: 8}
    assert _objectnames.object_count(streams, 128) == 12
    assert _objectnames.object_count({}, 128) == 0
    assert _objectnames.objects_per_process({0: (5 << 30) + 1}) == {0: 6}


def test_json_round_trip():
    layout = _streams.plan([(8, [2]), (1000, [0, 0, 2, 2])])
    assert _streams.runs_to_json(layout.runs[1]) == [[0, 0, 2, 0], [2, 2, 2, 64]]
    assert _streams.streams_to_json(layout.streams) == {"0": 2028, "2": 2092}
    streams = _streams.streams_from_json({"0": 2028, "2": 2092}, 4, WHERE)
    raw = [("a", 1, 12, [[2, 0, 1, 0]]), ("b", 4, 1004, [[0, 0, 2, 0], [2, 2, 2, 64]])]
    assert _streams.validate(raw, streams, WHERE) == layout.runs


# --- property test: random trees against a naive reference -------------------------------


def _reference(leaves):
    """Each chunk's (process, offset), entry by entry, and each stream's end: the spec read literally."""
    ends, where = {}, []
    for payload, writers in leaves:
        entry = payload + 4
        placed = []
        for w in writers:
            at = -(-ends.get(w, 0) // 64) * 64
            placed.append((w, at))
            ends[w] = at + entry
        where.append(placed)
    return where, ends


def _random_writers(rng, n, processes):
    kind = rng.integers(3)
    if kind == 0:  # anything
        return rng.integers(processes, size=n).tolist()
    if kind == 1:  # blocks, as sharded leaves give
        return np.repeat(rng.integers(processes, size=-(-n // 3)), 3)[:n].tolist()
    return [(i + int(rng.integers(processes))) % processes for i in range(n)]  # round robin-ish


def _random_tree(rng):
    processes = int(rng.integers(1, 6))
    return [(int(rng.choice([0, 1, 4, 59, 60, 61, 124, int(rng.integers(300))])),
             _random_writers(rng, int(rng.integers(0, 12)), processes)) for _ in range(rng.integers(1, 8))]


@pytest.mark.parametrize("seed", range(300))
def test_random_trees(seed):
    rng = np.random.default_rng(seed)
    leaves = _random_tree(rng)
    layout = _streams.plan(leaves)
    where, ends = _reference(leaves)
    assert layout.streams == ends  # only processes that write, each ending at its last entry
    segment_bytes = int(rng.choice([64, 100, 128, 1000, 4096]))
    entries = []
    for (payload, writers), runs, placed in zip(leaves, layout.runs, where):
        entry = payload + 4
        stride = _streams.stride_for(entry)
        firsts = [r[1] for r in runs]
        assert firsts == sorted(firsts) and sum(r[2] for r in runs) == len(writers)
        for a, b in zip(runs, runs[1:]):  # maximal: no run continues the one before
            assert a[1] + a[2] == b[1] and not (a[0] == b[0] and a[3] + a[2] * stride == b[3])
        for flat, expected in enumerate(placed):  # every chunk located exactly once, where the spec puts it
            assert _streams.locate(runs, flat, stride) == expected
            process, offset = expected
            assert offset % 64 == 0
            entries.append((process, offset, offset + entry))
            _check_segments(process, offset, entry, segment_bytes)
    entries.sort()
    for a, b in zip(entries, entries[1:]):  # no overlap within a stream
        assert a[0] != b[0] or a[2] <= b[1]
    assert _objectnames.objects_per_process(layout.streams, segment_bytes) == {
        p: math.ceil(n / segment_bytes) for p, n in ends.items()}
    raw = [(f"leaf{i}", len(w), p + 4, _streams.runs_to_json(r)) for i, ((p, w), r) in
           enumerate(zip(leaves, layout.runs))]
    streams = _streams.streams_from_json(_streams.streams_to_json(layout.streams), 8, WHERE)
    assert _streams.validate(raw, streams, WHERE) == layout.runs


def _check_segments(process, offset, nbytes, segment_bytes):
    """The pieces tile [offset, offset + nbytes) in order, each inside its object."""
    at = offset
    for name, start, stop in _objectnames.segments(process, offset, nbytes, segment_bytes):
        n = at // segment_bytes
        assert name == f"p{process}.{n}"
        assert start == at - n * segment_bytes and start < stop <= segment_bytes
        at += stop - start
    assert at == offset + nbytes


# --- validation: each kind of corruption, its exact message ------------------------------

PREFIX = f"Checkpoint '{WHERE}': invalid manifest: "
# leaf 'w': 5 chunks, entry 68 (stride 128); leaf 's': one entry of 12 bytes after w's two in process 1
GOOD_STREAMS = {0: 2 * 128 + 68, 1: 2 * 128 + 12}
GOOD = [[0, 0, 2, 0], [1, 2, 1, 0], [0, 3, 1, 256], [1, 4, 1, 128]]


def _validate(w_runs=None, s_runs=None, streams=None):
    leaves = [("w", 5, 68, GOOD if w_runs is None else w_runs), ("s", 1, 12, [[1, 0, 1, 256]] if s_runs is None
                                                                 else s_runs)]
    return _streams.validate(leaves, GOOD_STREAMS if streams is None else streams, WHERE)


def test_the_good_manifest_validates():
    assert _validate() == [tuple(map(tuple, GOOD)), ((1, 0, 1, 256),)]
    # what plan itself lays out for it
    assert _streams.plan([(64, [0, 0, 1, 0, 1]), (8, [1])]) == Layout(_validate(), GOOD_STREAMS)


@pytest.mark.parametrize("runs, message", [
    ({"0": 1}, "leaf 'w': runs is not a list"),
    ([[0, 0, 1, 0]] * 6, "leaf 'w': 6 runs for 5 chunks"),
    ([[0, 0, 2, 0], [1, 2, 1]], "leaf 'w': run #1 [1, 2, 1] is not [process, first, count, offset] of integers"),
    ([[0, 0, 2, 0], (1, 2, 1, 0)], "leaf 'w': run #1 (1, 2, 1, 0) is not [process, first, count, offset] of "
                                   "integers"),
    ([[0, 0, 2, 0], [1, 2, True, 0]], "leaf 'w': run #1 [1, 2, True, 0] is not [process, first, count, offset] "
                                      "of integers"),
    ([[0, 0, 2, 0.0]], "leaf 'w': run #0 [0, 0, 2, 0.0] is not [process, first, count, offset] of integers"),
    ([[0, 0, 2, "0"]], "leaf 'w': run #0 [0, 0, 2, '0'] is not [process, first, count, offset] of integers"),
    ([[0, 0, 2, 1 << 63]], f"leaf 'w': run #0 [0, 0, 2, {1 << 63}] is not [process, first, count, offset] of "
                           "integers"),
    ([[0, 0, 0, 0], [1, 0, 5, 0]], "leaf 'w': run #0 [0, 0, 0, 0]: count 0 is not between 1 and the leaf's 5 "
                                   "chunks"),
    ([[0, 0, 6, 0]], "leaf 'w': run #0 [0, 0, 6, 0]: count 6 is not between 1 and the leaf's 5 chunks"),
    ([[0, 1, 2, 0]], "leaf 'w': run #0 [0, 1, 2, 0]: starts at chunk 1, but the runs before it end at chunk 0 "
                     "(runs cover every chunk once, in order)"),
    ([[0, 0, 2, 0], [1, 1, 1, 0]], "leaf 'w': run #1 [1, 1, 1, 0]: starts at chunk 1, but the runs before it "
                                   "end at chunk 2 (runs cover every chunk once, in order)"),
    ([[0, 0, 2, 0], [1, 3, 1, 0]], "leaf 'w': run #1 [1, 3, 1, 0]: starts at chunk 3, but the runs before it "
                                   "end at chunk 2 (runs cover every chunk once, in order)"),
    ([[0, 0, 2, 0], [1, 2, 1, 0]], "leaf 'w': runs cover 3 chunks, but the leaf has 5"),
    ([], "leaf 'w': runs cover 0 chunks, but the leaf has 5"),
    ([[0, 0, 2, 0], [2, 2, 1, 0], [0, 3, 1, 256], [1, 4, 1, 128]],
     "leaf 'w': run #1 [2, 2, 1, 0]: process 2 has no stream"),
    ([[0, 0, 2, 0], [1, 2, 1, 32], [0, 3, 1, 256], [1, 4, 1, 128]],
     "leaf 'w': run #1 [1, 2, 1, 32]: offset 32 is not a non-negative multiple of 64"),
    ([[0, 0, 2, -128], [1, 2, 1, 0], [0, 3, 1, 256], [1, 4, 1, 128]],
     "leaf 'w': run #0 [0, 0, 2, -128]: offset -128 is not a non-negative multiple of 64"),
    ([[0, 0, 2, 0], [1, 2, 1, 0], [0, 3, 1, 256], [1, 4, 1, 320]],
     "leaf 'w': run #3 [1, 4, 1, 320]: its entries end at byte 388, past the end of process 1's stream "
     "(268 bytes)"),
    ([[0, 0, 2, 1 << 62], [1, 2, 1, 0], [0, 3, 1, 256], [1, 4, 1, 128]],
     f"leaf 'w': run #0 [0, 0, 2, {1 << 62}]: its entries end at byte {(1 << 62) + 196}, past the end of "
     "process 0's stream (324 bytes)"),
    ([[0, 0, 1, 0], [0, 1, 1, 128], [1, 2, 1, 0], [0, 3, 1, 256], [1, 4, 1, 128]],
     "leaf 'w': run #1 [0, 1, 1, 128] continues run #0 [0, 0, 1, 0] (runs are maximal)"),
])
def test_validation_refuses_bad_runs(runs, message):
    with pytest.raises(CorruptCheckpointError) as e:
        _validate(w_runs=runs)
    assert str(e.value) == PREFIX + message


def test_validation_refuses_overlapping_runs():
    with pytest.raises(CorruptCheckpointError) as e:
        _validate(s_runs=[[1, 0, 1, 128]])  # on top of leaf 'w''s last entry in process 1
    assert str(e.value) == PREFIX + ("leaf 's': run #0 (bytes 128..140) overlaps leaf 'w' run #3 (bytes 128..196) "
                                     "in the stream of process 1")
    # interleaved spans are refused even where the entries themselves would fit in the gaps
    with pytest.raises(CorruptCheckpointError) as e:
        _streams.validate([("a", 2, 12, [[0, 0, 2, 0]]), ("b", 1, 12, [[0, 0, 1, 64]])], {0: 76}, WHERE)
    assert str(e.value) == PREFIX + ("leaf 'b': run #0 (bytes 64..76) overlaps leaf 'a' run #0 (bytes 0..76) "
                                     "in the stream of process 0")


def test_validation_refuses_streams_that_do_not_end_at_their_last_entry():
    with pytest.raises(CorruptCheckpointError) as e:
        _validate(streams={0: 324, 1: 400})
    assert str(e.value) == PREFIX + ("stream of process 1: 400 bytes, but its last entry (leaf 's' run #0) ends "
                                     "at byte 268")
    with pytest.raises(CorruptCheckpointError) as e:
        _validate(streams={**GOOD_STREAMS, 3: 64})
    assert str(e.value) == PREFIX + "stream of process 3: 64 bytes, but no run lies in it"


@pytest.mark.parametrize("raw, message", [
    ([], "streams is not an object"),
    ({str(p): 1 for p in range(5)}, "5 streams for 4 processes"),
    ({"4": 10}, "streams: key '4' is not a process below process_count 4"),
    ({"01": 10}, "streams: key '01' is not a process below process_count 4"),
    ({"-1": 10}, "streams: key '-1' is not a process below process_count 4"),
    ({"0": 0}, f"streams: process 0's length 0 is not between 1 and {1 << 50}"),
    ({"0": True}, f"streams: process 0's length True is not between 1 and {1 << 50}"),
    ({"0": 1.0}, f"streams: process 0's length 1.0 is not between 1 and {1 << 50}"),
    ({"0": (1 << 50) + 1}, f"streams: process 0's length {(1 << 50) + 1} is not between 1 and {1 << 50}"),
])
def test_streams_from_json_refuses(raw, message):
    with pytest.raises(CorruptCheckpointError) as e:
        _streams.streams_from_json(raw, 4, WHERE)
    assert str(e.value) == PREFIX + message


def test_streams_from_json_sorts_by_process():
    assert list(_streams.streams_from_json({"3": 5, "0": 7}, 4, WHERE).items()) == [(0, 7), (3, 5)]


@pytest.mark.parametrize("raw", [None, 4095, (5 << 40) + 1, True, float(1 << 30), "1073741824"])
def test_segment_bytes_from_json_refuses(raw):
    with pytest.raises(CorruptCheckpointError) as e:
        _streams.segment_bytes_from_json(raw, WHERE)
    assert str(e.value) == PREFIX + f"segment_bytes {raw!r} is not between 4096 and {5 << 40}"


def test_segment_bytes_from_json():
    assert _streams.segment_bytes_from_json(1 << 30, WHERE) == 1 << 30


@pytest.mark.parametrize("raw, message", [
    ({"entry_bytes": 68}, "leaf 'w': codec None (this jaxckpt reads raw, zstd, blosc, int8, int4)"),
    ({"codec": "lz77", "entry_bytes": 68}, "leaf 'w': codec 'lz77' (this jaxckpt reads raw, zstd, blosc, int8, int4)"),
    ({"codec": "raw", "entry_bytes": 64}, "leaf 'w': entry_bytes 64, but its chunks are 64 bytes and a crc32c "
                                          "of 4"),
    ({"codec": "raw", "entry_bytes": 68.0}, "leaf 'w': entry_bytes 68.0, but its chunks are 64 bytes and a "
                                            "crc32c of 4"),
])
def test_entry_bytes_from_json_refuses(raw, message):
    with pytest.raises(CorruptCheckpointError) as e:
        _streams.entry_bytes_from_json(raw, "w", 64, WHERE)
    assert str(e.value) == PREFIX + message


def test_a_hostile_repr_is_cut():
    with pytest.raises(CorruptCheckpointError) as e:
        _validate(w_runs=[["x" * 10_000, 0, 0, 0]])
    assert len(str(e.value)) < 300 and str(e.value).startswith(PREFIX + "leaf 'w': run #0 ['xxx")


def test_runs_from_json_checks_one_leaf():
    assert _streams.runs_from_json(GOOD, "w", 5, 68, GOOD_STREAMS, WHERE) == tuple(map(tuple, GOOD))
    with pytest.raises(CorruptCheckpointError) as e:
        _streams.runs_from_json(GOOD[:2], "w", 5, 68, GOOD_STREAMS, WHERE)
    assert str(e.value) == PREFIX + "leaf 'w': runs cover 3 chunks, but the leaf has 5"


def test_the_module_stays_pure():
    # core and pure: numpy, the standard library and the error types; no jax, no storage
    import ast
    import sys

    with open(_streams.__file__) as f:
        tree = ast.parse(f.read())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add("." + node.module if node.level else node.module.split(".")[0])
    assert {m for m in imported if m not in sys.stdlib_module_names} == {"numpy", "._errors"}


def test_a_leaf_of_one_writer_is_laid_out_as_the_general_plan_lays_it_out():
    # the fast path (a list whose every chunk one process writes) against the numpy path
    # (the same writers as an array), leaves interleaved with other writers
    leaves = [(60, [1, 1, 1]), (4, [0, 1, 0, 1]), (4096, [2] * 5), (8, [0]), (60, [1, 1])]
    fast = _streams.plan(leaves)
    general = _streams.plan([(p, np.array(w)) for p, w in leaves])
    assert fast == general
    assert fast.runs[0] == ((1, 0, 3, 0),) and fast.runs[2] == ((2, 0, 5, 0),)


def _numpy_checks_pass(raw, n_chunks, entry_bytes, table) -> bool:
    try:
        t = _streams._run_table(raw, CorruptCheckpointError)
        _streams._check_cover(t, n_chunks, CorruptCheckpointError)
        _streams._check_places(t, entry_bytes, table, CorruptCheckpointError)
    except CorruptCheckpointError:
        return False
    return True


@pytest.mark.parametrize("seed", range(4))
def test_the_plain_check_of_a_few_runs_agrees_with_the_tables_checks(seed):
    """A leaf of up to 16 runs is checked in plain Python: on valid layouts and on each
    of their one-number mutations it says yes exactly when the numpy checks pass."""
    rng = np.random.default_rng(seed)
    agreed = {True: 0, False: 0}
    for _ in range(300):
        procs = int(rng.integers(1, 5))
        n_chunks = int(rng.integers(1, 13))
        entry = int(rng.choice([12, 68, 100, 4100]))
        stride = _streams.stride_for(entry)
        writers = [int(rng.integers(0, procs)) for _ in range(n_chunks)]
        ends = dict.fromkeys(range(procs), 0)
        raw = []
        for c, p in enumerate(writers):
            if raw and raw[-1][0] == p:
                raw[-1][2] += 1
            else:
                raw.append([p, c, 1, ends[p] + int(rng.integers(0, 2)) * stride])
            ends[p] = raw[-1][3] + raw[-1][2] * stride
        streams = {p: ends[p] - stride + entry for p in ends if ends[p]}
        table = _streams._StreamTable.of(streams)
        cases = [raw]
        for _ in range(6):  # one number changed, a run dropped or doubled
            m = [list(r) for r in raw]
            i, j = int(rng.integers(0, len(m))), int(rng.integers(0, 4))
            kind = int(rng.integers(0, 4))
            if kind == 0:
                m[i][j] += int(rng.choice([-stride, -64, -1, 1, 64, stride]))
            elif kind == 1:
                m[i][j] = int(rng.choice([0, -1, 1 << 62, True]))
            elif kind == 2:
                del m[i]
            else:
                m.insert(i, list(m[i]))
            cases.append(m)
        for case in cases:
            if len(case) > n_chunks:
                continue  # refused before either check runs
            fast = _streams._few_valid_runs(case, n_chunks, entry, table)
            assert fast == _numpy_checks_pass(case, n_chunks, entry, table), (case, n_chunks, entry, streams)
            agreed[fast] += 1
    assert agreed[True] >= 300 and agreed[False] >= 300, agreed
