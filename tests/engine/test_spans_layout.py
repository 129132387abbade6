"""The varlen kernels' layout of several sequences in one forward (`engine.ops.gpu.spans`): each
row's sequence, and the scan's rounds: every sequence cut at its captures, round r its r-th segment,
the segments of a round in sequence order with their chunk lists as fla's varlen kernels index them,
and the rows taken round after round so that each round is a slice."""

from __future__ import annotations

import torch

from engine.ops import deltanet
from engine.ops.gpu import spans

CPU = torch.device("cpu")


def test_rows_without_captures_are_one_round_in_order():
    out = spans.layout(((0, 3), (3, 70)), ((), ()), CPU)
    assert out.span.tolist() == [0] * 3 + [1] * 67 and out.starts.tolist() == [0, 3] and out.order is None
    (only,) = out.rounds
    assert (only.start, only.end, only.first, only.h0) == (0, 70, 0, None) and out.cu_seqlens.tolist() == [0, 3, 70]
    assert out.chunk_indices.tolist() == [[0, 0], [1, 0], [1, 1]]  # 67 rows: two chunks of 64
    assert only.chunk_offsets.tolist() == [0, 1, 3] and only.cu_seqlens.tolist() == [0, 3, 70]
    assert [p[3] for p in only.pieces] == [False, False]
    assert out.finals.tolist() == [0, 1] and out.captured == ((), ())


def test_captures_cut_segments_and_each_round_takes_the_next_segment_of_each_sequence():
    out = spans.layout(((0, 10), (10, 14), (14, 20)), ((4, 10), (), (2, 3)), CPU)
    pieces = [rnd.pieces for rnd in out.rounds]
    assert pieces == [
        ((0, 0, 4, True), (1, 10, 14, False), (2, 14, 16, True)),
        ((0, 4, 10, True), (2, 16, 17, True)),
        ((2, 17, 20, False),),
    ]
    assert out.order.tolist() == [*range(0, 4), *range(10, 16), *range(4, 10), 16, *range(17, 20)]
    assert [(rnd.start, rnd.end) for rnd in out.rounds] == [(0, 10), (10, 17), (17, 20)]
    for rnd in out.rounds:  # a round's slice of the order is its pieces' rows
        assert out.order[rnd.start : rnd.end].tolist() == [
            t for _, lo, hi, _ in rnd.pieces for t in range(lo, hi)
        ]
    # every round's segments in the order, as one varlen batch; a round is a slice of its segments
    assert out.cu_seqlens.tolist() == [0, 4, 8, 10, 16, 17, 20]
    assert out.chunk_indices.tolist() == [[n, 0] for n in range(6)]
    assert [rnd.segments for rnd in out.rounds] == [slice(0, 3), slice(3, 5), slice(5, 6)]
    # each round's bounds among the batch's rows and chunks, as tensors of their own
    assert [rnd.cu_seqlens.tolist() for rnd in out.rounds] == [[0, 4, 8, 10], [10, 16, 17], [17, 20]]
    assert [rnd.chunk_offsets.tolist() for rnd in out.rounds] == [[0, 1, 2, 3], [3, 4, 5], [5, 6]]
    # each round starts from its sequences' segments of the round before: sequences 0 and 2 (not
    # consecutive there: an index), then sequence 2 alone (a slice)
    assert out.rounds[0].h0 is None and out.rounds[1].h0.tolist() == [0, 2] and out.rounds[2].h0 == slice(4, 5)
    assert out.finals.tolist() == [3, 1, 5] and out.captured == ((0, 3), (), (2, 4))
    assert torch.equal(out.order.sort().values, torch.arange(20))  # every row scanned once


class _ReferenceRounds:
    """`spans.RoundScan` on the CPU: the reference scan of each segment of a round from its state."""

    made: list[tuple] = []

    def __init__(self, q, k, v, g, beta, where):
        self.rows, self.where, self.outs = (q, k, v, g, beta), where, []
        _ReferenceRounds.made.append(self.rows)

    def carry(self, h0, rnd, finals):
        cu = rnd.cu_seqlens.tolist()
        for n in range(len(rnd.pieces)):
            out, final, _ = deltanet.chunk_gated_delta_rule(*(x[cu[n] : cu[n + 1]] for x in self.rows), h0[n], [])
            self.outs.append(out)
            finals[n] = final

    def outputs(self):
        return torch.cat(self.outs)


def test_rounds_give_each_sequence_its_own_scan():
    """The scan round by round over the rows taken in the layout's order (what the GPU does with fla's
    kernels, here with the reference scan per segment) gives each sequence's out, final state and
    captures as its scan alone: states carried from round to round through the buffer of every
    segment's final state, outputs put back in row order."""
    gen = torch.Generator().manual_seed(0)
    lengths, capture_ats = [70, 9, 130], [[5, 64], [], [1, 70, 130]]
    bounds = [(sum(lengths[:i]), sum(lengths[: i + 1])) for i in range(3)]
    rows = sum(lengths)
    q, k = torch.randn(rows, 2, 16, generator=gen), torch.randn(rows, 2, 16, generator=gen)
    v = torch.randn(rows, 4, 16, generator=gen)
    g, beta = -torch.rand(rows, 4, generator=gen), torch.rand(rows, 4, generator=gen)
    states = [torch.randn(4, 16, 16, generator=gen) * 0.1 for _ in lengths]
    where = spans.layout(tuple(bounds), tuple(map(tuple, capture_ats)), CPU)
    assert where.order is not None and len(where.rounds) == 3
    _ReferenceRounds.made.clear()
    out, finals, captured = spans.scan_rounds(where, q, k, v, g, beta, states, _ReferenceRounds)
    (made,) = _ReferenceRounds.made  # made once, from the rows in the layout's order
    assert all(torch.equal(a, x[where.order]) for a, x in zip(made, (q, k, v, g, beta), strict=True))
    want = deltanet.chunk_gated_delta_rule_spans(q, k, v, g, beta, states, bounds, capture_ats)
    torch.testing.assert_close(out, want[0], rtol=1e-5, atol=1e-6)
    for got, expected in zip([*finals, *sum(captured, [])], [*want[1], *sum(want[2], [])], strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    # the captures are views of one buffer (one copy to host memory takes them); the final states are not
    assert len({c.untyped_storage().data_ptr() for c in sum(captured, [])}) == 1
    assert all(f.untyped_storage().data_ptr() != captured[0][0].untyped_storage().data_ptr() for f in finals)
