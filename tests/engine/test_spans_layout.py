"""The varlen kernels' layout of several sequences in one forward (`engine.ops.gpu.spans`): each
row's sequence, and the scan's rounds: every sequence cut at its captures, round r its r-th segment,
the segments of a round in sequence order with their chunk lists as fla's varlen kernels index them,
and the rows taken round after round so that each round is a slice."""

from __future__ import annotations

import torch

from engine.ops.gpu import spans

CPU = torch.device("cpu")


def test_rows_without_captures_are_one_round_in_order():
    out = spans.layout(((0, 3), (3, 70)), ((), ()), CPU)
    assert out.span.tolist() == [0] * 3 + [1] * 67 and out.starts.tolist() == [0, 3] and out.order is None
    (only,) = out.rounds
    assert (only.start, only.end) == (0, 70) and only.cu_seqlens.tolist() == [0, 3, 70]
    assert only.chunk_indices.tolist() == [[0, 0], [1, 0], [1, 1]]  # 67 rows: two chunks of 64
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
    assert torch.equal(out.order.sort().values, torch.arange(20))  # every row scanned once
