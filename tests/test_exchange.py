"""The plan of a read-once restore (``_exchange``): pure functions of the global layout,
the same in every process. The exchange itself runs in real multi-process jobs
(``test_multihost.py``, ``test_read_once_*``)."""

from typing import NamedTuple

import pytest

from jaxckpt import _exchange
from jaxckpt._exchange import SharedSlice


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


def test_waves_keep_plan_order_and_stay_near_the_budget():
    pieces = [_exchange.Piece("x", ((i, i + 1),), n, 0) for i, n in enumerate([10, 20, 30, 40, 5])]
    assert [[p.nbytes for p in w] for w in _exchange.waves(pieces, 50)] == [[10, 20], [30], [40, 5]]
    assert [[p.nbytes for p in w] for w in _exchange.waves(pieces, 1)] == [[10], [20], [30], [40], [5]]


@pytest.mark.parametrize("n, width", [(0, 4096), (4096, 4096), (4097, 4608), (1 << 20, 1 << 20),
                                      ((1 << 20) + 1, (1 << 20) + (1 << 17))])
def test_row_width_rounds_up_by_at_most_an_eighth(n, width):
    assert _exchange.row_width([n, 0]) == width
    assert n <= width <= max(4096, n * 1.125)
