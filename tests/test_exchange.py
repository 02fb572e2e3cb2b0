"""The plan of a read-once restore (``_exchange``): pure functions of the global layout,
the same in every process. The exchange itself runs in real multi-process jobs
(``test_multihost.py``, ``test_read_once_*``)."""

from typing import NamedTuple

import numpy as np
import pytest

from jaxckpt import _distributed, _exchange
from jaxckpt._exchange import SharedSlice
from jaxckpt._storage.location import Location


class Rec(NamedTuple):  # the fields of a LeafRecord the plan reads
    path: str
    shape: tuple
    chunk_shape: tuple
    storage_dtype: str = "float32"
    store: str = "file"
    chunks: tuple = ()  # packed leaves: (saving process, byte offset) of each chunk


def rows(rec, n):
    """``rec``'s n row blocks as indices."""
    step = rec.shape[0] // n
    return [((i * step, (i + 1) * step),) + tuple((0, d) for d in rec.shape[1:]) for i in range(n)]


def readers(plan):
    return [[p.reader for p in pieces] for pieces in plan]


def test_whole_slices_when_they_balance():
    # 8 fully replicated leaves of 4 row chunks each over 4 processes: 2 leaves each, one
    # piece per leaf (placed without a copy)
    recs = [Rec(f"w{i}", (64, 16), (16, 16)) for i in range(8)]
    shared = [SharedSlice(r, rows(r, 1)[0], (0, 1, 2, 3)) for r in recs]
    load = {}
    plan = _exchange.plan_pieces(shared, load, chunked=True)
    assert readers(plan) == [[0], [1], [2], [3], [0], [1], [2], [3]]
    assert [p.index for pieces in plan for p in pieces] == [s.index for s in shared]
    assert load == {p: 2 * 64 * 16 * 4 for p in range(4)}


def test_chunks_when_whole_slices_would_not_balance():
    # one big leaf: whole, one process would read it all; cut at its 4 saved chunks
    rec = Rec("w", (64, 16), (16, 16))
    plan = _exchange.plan_pieces([SharedSlice(rec, rows(rec, 1)[0], (0, 1, 2, 3))], {}, chunked=True)
    assert [p.index for p in plan[0]] == rows(rec, 4)
    assert sorted(readers(plan)[0]) == [0, 1, 2, 3]


def test_other_formats_are_never_cut():
    rec = Rec("w", (64, 16), (16, 16))
    plan = _exchange.plan_pieces([SharedSlice(rec, rows(rec, 1)[0], (0, 1, 2, 3))], {}, chunked=False)
    assert [(p.index, p.reader) for p in plan[0]] == [(rows(rec, 1)[0], 0)]


def test_slices_sharing_a_saved_chunk_have_one_reader():
    # column blocks of a leaf saved as one chunk: the chunk is read whole either way, so
    # both blocks go to the same process (read once per job, not once per block)
    rec = Rec("cols", (64, 512), (64, 512), "int32")
    left, right = ((0, 64), (0, 256)), ((0, 64), (256, 512))
    plan = _exchange.plan_pieces([SharedSlice(rec, left, (0, 1, 2)), SharedSlice(rec, right, (0, 1, 2))],
                                 {}, chunked=True)
    assert readers(plan) == [[0], [0]]


def test_small_leaves_in_one_packed_chunk_have_one_reader():
    # two small leaves packed into process 0's array, in its first 4 KiB chunk, and one
    # in its second chunk: the first chunk is fetched whole, so by one process only
    recs = [Rec(f"b{i}", (16,), (16,), store="packed", chunks=((0, off),)) for i, off in
            enumerate([0, 64, 4096])]
    shared = [SharedSlice(r, ((0, 16),), (0, 1)) for r in recs]
    plan = _exchange.plan_pieces(shared, {}, chunked=True, packed_chunks={0: 4096})
    first, second, third = readers(plan)
    assert first == second and first != third


def test_own_reads_count_towards_the_balance():
    recs = [Rec(f"b{i}", (16,), (16,)) for i in range(2)]
    shared = [SharedSlice(r, ((0, 16),), (0, 1)) for r in recs]
    load = {0: 1000}  # process 0 already reads 1000 bytes of its own
    plan = _exchange.plan_pieces(shared, load, chunked=True)
    assert readers(plan) == [[1], [1]]
    assert load == {0: 1000, 1: 128}


def test_a_reader_is_one_of_the_processes_that_need_the_slice():
    rec = Rec("w", (64, 16), (16, 16))
    blocks = rows(rec, 2)  # row blocks held by processes {0, 1} and {2, 3}
    plan = _exchange.plan_pieces([SharedSlice(rec, blocks[0], (0, 1)), SharedSlice(rec, blocks[1], (2, 3))],
                                 {}, chunked=True)
    assert readers(plan) == [[0, 1], [2, 3]]  # each block's 2 chunks, within its holders


def wave_rows(waves, nproc):
    """Each wave's gathered row width (every process's row padded to the longest)."""
    out = []
    for wave in waves:
        lengths = [0] * nproc
        for p in wave:
            lengths[p.piece.reader] += -(-p.nbytes // 64) * 64
        out.append(_exchange.row_width(lengths))
    return out


def test_a_wave_holds_at_most_its_budget_whatever_the_imbalance():
    # one 1 MiB replicated leaf saved as one chunk (read whole by one process) and small
    # leaves, 4 processes, 256 KiB waves: the big piece goes in blocks over many waves,
    # the small ones ride along, and no wave's own row + gathered rows pass the budget
    # (before: one wave gathered 4 rows of 1 MiB)
    nproc, budget = 4, 256 << 10
    big = Rec("big", (256, 1024), (256, 1024))
    small = [Rec(f"s{i}", (64,), (64,), "int8") for i in range(6)]
    shared = [SharedSlice(r, rows(r, 1)[0], (0, 1, 2, 3)) for r in [big, *small]]
    plan = _exchange.plan_pieces(shared, {}, chunked=True, nproc=nproc)
    assert [p.index for p in plan[0]] == [rows(big, 1)[0]]  # one chunk: one piece, one reader
    waves = _exchange.plan_waves(shared, plan, nproc, budget)
    cap = _exchange.row_cap(nproc, budget)
    assert cap == 40 << 10 and (nproc + 2) * cap <= budget
    assert all((nproc + 2) * w <= budget for w in wave_rows(waves, nproc))
    assert len(waves) == -(-(1 << 20) // cap)  # set by the busiest reader alone
    # every byte of every piece sent once, in blocks in the piece's order
    for i, pieces in enumerate(plan):
        for piece in pieces:
            sent = [p.index for w in waves for p in w if p.slice_no == i and p.piece == piece]
            assert sum(_exchange._layout.index_size(b) for b in sent) == _exchange._layout.index_size(piece.index)
            assert sent == sorted(sent)


def test_many_processes_keep_the_same_bound():
    # 64 processes, one 2 MiB piece, 512 KiB waves: rows of 4 KiB (the narrowest), so a
    # wave holds (64 + 2) x 4 KiB, not 64 x 2 MiB
    rec = Rec("big", (512, 1024), (512, 1024))
    shared = [SharedSlice(rec, rows(rec, 1)[0], tuple(range(64)))]
    plan = _exchange.plan_pieces(shared, {}, chunked=True, nproc=64)
    waves = _exchange.plan_waves(shared, plan, 64, 512 << 10)
    assert set(wave_rows(waves, 64)) == {4096}


def test_rows_balance_over_readers():
    # 4 replicated leaves of 1 MiB, one per reader: every wave carries a block from each
    rec = [Rec(f"w{i}", (256, 1024), (256, 1024)) for i in range(4)]
    shared = [SharedSlice(r, rows(r, 1)[0], (0, 1, 2, 3)) for r in rec]
    plan = _exchange.plan_pieces(shared, {}, chunked=True, nproc=4)
    waves = _exchange.plan_waves(shared, plan, 4, 6 << 20)
    assert len(waves) == 1 and sorted(p.piece.reader for p in waves[0]) == [0, 1, 2, 3]
    waves = _exchange.plan_waves(shared, plan, 4, 6 * (256 << 10))
    assert len(waves) == 4 and all(sorted(p.piece.reader for p in w) == [0, 1, 2, 3] for w in waves)


@pytest.mark.parametrize("shape, cap", [((3, 5, 7), 40), ((3, 5, 7), 140), ((3, 5, 7), 4), ((100,), 64), ((), 4),
                                        ((0, 9), 8), ((4, 1 << 10), 4096)])
def test_blocks_are_contiguous_runs_of_the_piece(shape, cap):
    x = np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape)
    index = tuple((0, d) for d in shape)
    blocks = _exchange.blocks(index, 4, cap)
    assert all(_exchange._layout.index_size(b) * 4 <= cap for b in blocks)
    got = np.concatenate([x[tuple(slice(a, b) for a, b in blk)].ravel() for blk in blocks] + [np.zeros(0, np.int32)])
    assert got.tobytes() == x.tobytes()


def test_blocks_of_a_piece_inside_a_leaf_stay_inside_it():
    piece = ((16, 48), (8, 24))
    blocks = _exchange.blocks(piece, 4, 32)  # a row is 64 bytes: each row in two blocks of 8
    assert blocks[:3] == [((16, 17), (8, 16)), ((16, 17), (16, 24)), ((17, 18), (8, 16))]
    assert len(blocks) == 64


def test_the_plan_digest_changes_with_anything_the_processes_must_agree_on():
    recs = [Rec(f"w{i}", (64, 16), (16, 16)) for i in range(4)]
    shared = [SharedSlice(r, rows(r, 1)[0], (0, 1)) for r in recs]

    def digest(shared, nproc=2, budget=1 << 20):
        plan = _exchange.plan_pieces(shared, {}, chunked=True, nproc=nproc)
        return _exchange.plan_digest(shared, _exchange.plan_waves(shared, plan, nproc, budget))

    same = digest(shared)
    assert digest(list(shared)) == same
    assert digest(shared[1:]) != same  # a leaf one process restores without the exchange
    assert digest(shared, budget=24 << 10) != same  # another wave size: other blocks
    assert digest([shared[0]._replace(processes=(0,)), *shared[1:]]) != same
    assert digest([*shared[:3], shared[3]._replace(rec=recs[3]._replace(storage_dtype="int32"))]) != same


def test_a_plan_mismatch_names_the_processes_that_differ():
    assert _exchange.plan_mismatch({0: b"aa", 1: b"aa", 2: b"aa"}) == ""
    text = _exchange.plan_mismatch({0: b"aa", 1: b"bb", 2: b"aa", 3: b"cc"})
    assert text == "processes 1, 3 planned a different exchange than process 0 (processes 0, 2: aa; process 1: bb; process 3: cc)"


@pytest.mark.parametrize("env, local, on", [(None, True, False), (None, False, True), ("auto", True, False),
                                            ("1", True, True), ("0", False, False)])
def test_jaxckpt_read_once_is_read_at_each_restore(monkeypatch, env, local, on):
    monkeypatch.setattr(_distributed, "process_count", lambda: 2)
    if env is None:
        monkeypatch.delenv("JAXCKPT_READ_ONCE", raising=False)
    else:
        monkeypatch.setenv("JAXCKPT_READ_ONCE", env)
    loc = Location((("driver", "file"), ("path", "/c/")), "/c") if local else Location((("driver", "s3"),), None)
    assert _exchange.applies(3, loc) is on
    assert _exchange.applies(0, loc) is False


def test_read_once_setting_overrides_the_environment_and_a_bad_value_is_refused(monkeypatch):
    monkeypatch.setattr(_distributed, "process_count", lambda: 2)
    monkeypatch.setenv("JAXCKPT_READ_ONCE", "1")
    remote = Location((("driver", "s3"),), None)
    monkeypatch.setattr(_exchange, "READ_ONCE", "0")
    assert _exchange.applies(3, remote) is False
    monkeypatch.setattr(_exchange, "READ_ONCE", None)
    monkeypatch.setenv("JAXCKPT_READ_ONCE", "yes")
    with pytest.raises(ValueError, match=r"JAXCKPT_READ_ONCE='yes': expected one of auto, 1, 0"):
        _exchange.applies(3, remote)


@pytest.mark.parametrize("n, width", [(0, 4096), (4096, 4096), (4097, 4608), (1 << 20, 1 << 20),
                                      ((1 << 20) + 1, (1 << 20) + (1 << 17))])
def test_row_width_rounds_up_by_at_most_an_eighth(n, width):
    assert _exchange.row_width([n, 0]) == width
    assert n <= width <= max(4096, n * 1.125)


@pytest.mark.parametrize("nproc, views", [(2, False), (8, True)])
def test_a_process_keeps_views_of_a_wave_only_for_what_others_sent_it(nproc, views):
    """Replicated state: every process needs every slice of a wave, and reads one row of it
    itself, which it keeps from its own read (``_put``). Counting that row as used made two
    processes keep views of every wave's gathered rows, their own row with them: half the
    state kept beside the result for as long as it lived (benchmarks/peak_memory.py:
    +130 / +258 MiB after restoring 256 / 512 MiB). Now a wave is viewed only when what
    the others sent is ``VIEW_SHARE`` of it (8 processes: 7/8), else copied out."""
    from types import SimpleNamespace

    from jaxckpt import _exchange

    wave = [SimpleNamespace(nbytes=100, slice_no=p, piece=SimpleNamespace(reader=p)) for p in range(nproc)]
    seen = []
    me = SimpleNamespace(me=0, needed={("w", p) for p in range(nproc)}, _key=lambda i: ("w", i),
                         _gather=lambda w: [None] * len(w), _put=lambda part, n, got, view_ok: seen.append(view_ok))
    _exchange.ReadOnce._receive(me, wave, {p: 1 for p in range(nproc)})
    assert seen == [views] * nproc
