"""The varlen kernels' layout of several sequences in one forward (`engine.ops.gpu.spans`): each
row's sequence, and the scan's rounds: every sequence cut at its captures, round r its r-th segment,
the segments of a round in sequence order with their chunk lists as fla's varlen kernels index them."""

from __future__ import annotations

import torch

from engine.ops.gpu import spans

CPU = torch.device("cpu")


def test_rows_without_captures_are_one_round_in_order():
    out = spans.layout(((0, 3), (3, 70)), ((), ()), CPU)
    assert out.span.tolist() == [0] * 3 + [1] * 67 and out.starts.tolist() == [0, 3]
    (only,) = out.rounds
    assert only.rows is None and only.cu_seqlens.tolist() == [0, 3, 70]
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
    assert out.rounds[0].rows.tolist() == [*range(0, 4), *range(10, 16)]
    assert out.rounds[1].rows.tolist() == [*range(4, 10), 16]
    assert out.rounds[1].cu_seqlens.tolist() == [0, 6, 7]
    assert out.rounds[2].chunk_indices.tolist() == [[0, 0]]
    rows = torch.cat([rnd.rows for rnd in out.rounds]).sort().values
    assert torch.equal(rows, torch.arange(20))  # every row scanned once
