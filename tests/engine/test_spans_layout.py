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
    assert (only.start, only.end) == (0, 70) and only.cu_seqlens.tolist() == [0, 3, 70]
    assert only.chunk_indices.tolist() == [[0, 0], [1, 0], [1, 1]]  # 67 rows: two chunks of 64
    assert only.chunk_offsets.tolist() == [0, 1, 3]
    assert torch.equal(out.cu_seqlens, only.cu_seqlens) and torch.equal(out.chunk_indices, only.chunk_indices)
    assert [p[3] for p in only.pieces] == [False, False]


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
    assert out.rounds[1].cu_seqlens.tolist() == [0, 6, 7]
    assert out.rounds[2].chunk_indices.tolist() == [[0, 0]]
    assert out.rounds[0].chunk_offsets.tolist() == [0, 1, 2, 3]
    # every round's segments in the order, as one varlen batch (the scan's chunk-local half)
    assert out.cu_seqlens.tolist() == [0, 4, 8, 10, 16, 17, 20]
    assert out.chunk_indices.tolist() == [[n, 0] for n in range(6)]
    assert torch.equal(out.order.sort().values, torch.arange(20))  # every row scanned once


def _reference_varlen(q, k, v, g, beta, h0, rnd):
    """A varlen scan on the CPU: the reference scan of each segment of the round from its state."""
    cu = rnd.cu_seqlens.tolist()
    runs = [deltanet.chunk_gated_delta_rule(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], h0[n], [])
            for n, (a, b) in enumerate(zip(cu, cu[1:], strict=False))]  # fmt: skip
    return torch.cat([r[0] for r in runs]), torch.stack([r[1] for r in runs])


def test_rounds_give_each_sequence_its_own_scan():
    """The scan round by round over the rows taken in the layout's order (what the GPU does with fla's
    varlen forward, here with the reference scan per segment) gives each sequence's out, final state
    and captures as its scan alone: states carried from round to round, outputs put back in row order."""
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
    seen = []

    def local(*rows_and_where):  # the chunk-local half: once, over the rows in the layout's order
        seen.append(rows_and_where[:-1])
        return rows_and_where[:-1]

    out, finals, captured = spans.scan_rounds(where, q, k, v, g, beta, states, _reference_varlen, local)
    assert len(seen) == 1 and all(torch.equal(a, x[where.order]) for a, x in zip(seen[0], (q, k, v, g, beta), strict=True))
    want = deltanet.chunk_gated_delta_rule_spans(q, k, v, g, beta, states, bounds, capture_ats)
    torch.testing.assert_close(out, want[0], rtol=1e-5, atol=1e-6)
    for got, expected in zip([*finals, *sum(captured, [])], [*want[1], *sum(want[2], [])], strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
