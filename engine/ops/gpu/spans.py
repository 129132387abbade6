"""Where several sequences' rows lie in a forward's concatenated tokens, as the varlen kernels read it:
the causal conv's row -> sequence map, and the scan's rounds. Built once per forward on the host and
copied in without a host sync (every layer of the forward reads the same one: memoised on the
spans' bounds and captures).

A scan cannot stop at a capture inside one call (fla returns the fp32 state only at a sequence's
end), so each sequence's rows are cut into segments at its captures, and round r carries the r-th
segment of every sequence that has one from the states the round before left. The rows are taken in
`order` (round after round) once a layer, and every round's segments together form one varlen
batch (`SpanLayout.cu_seqlens`): what a chunk computes from its own rows alone (the gates' cumulative
sums, the WY representation) and the outputs (read off each chunk's state) run once over that
batch; only the states' pass through the chunks goes round by round, each round a slice of the
batch's segments, writing its segments' final states into one buffer of every segment's
(`scan_rounds`)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

CHUNK = 64  # fla's chunk of the gated delta rule


def to_device(values: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on the device, through pinned memory: the copy waits on nothing queued. Not
    while a CUDA graph is captured: the graph would copy from a host buffer long reused, into its
    own pool's memory (what a memoised index would then keep)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("host values copied to the device inside a CUDA graph capture")
    host = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


@dataclass(frozen=True)
class Round:
    """One pass of the states: the segments `pieces` [(sequence, lo, hi, captured)] in rows [lo, hi)
    of the forward, which are rows [start, end) of the rows taken in `SpanLayout.order` and the
    varlen batch's segments [first, first + len(pieces)), whose bounds in the batch's rows and chunks
    are `cu_seqlens` and `chunk_offsets` (tensors of their own, not slices of the batch's: Triton
    compiles a kernel again for a pointer of another alignment than warm-up's). `h0`: where their
    initial states lie among the segments' final states (each sequence's segment of the round
    before): a slice, or an index where they are not consecutive; None for the first round, which
    takes every sequence from its own state."""

    pieces: tuple[tuple[int, int, int, bool], ...]
    start: int
    end: int
    first: int
    h0: slice | torch.Tensor | None
    cu_seqlens: torch.Tensor  # [len(pieces) + 1] long: the varlen batch's rows where its segments start, and the end
    chunk_offsets: torch.Tensor  # [len(pieces) + 1] long: the batch's chunks where its segments start, and the end

    @property
    def segments(self) -> slice:
        return slice(self.first, self.first + len(self.pieces))


@dataclass(frozen=True)
class SpanLayout:
    span: torch.Tensor  # [T] int32: each row's sequence
    starts: torch.Tensor  # [N] int32: each sequence's first row
    order: torch.Tensor | None  # [T] long: the rows, round after round; None where that is every row in order
    rounds: tuple[Round, ...]
    cu_seqlens: torch.Tensor  # [S + 1] long: every round's segments in `order`, as one varlen batch
    chunk_indices: torch.Tensor  # [chunks, 2] long: each chunk's segment and its index within it
    finals: torch.Tensor  # [N] long: each sequence's last segment
    captured: tuple[tuple[int, ...], ...]  # per sequence, its captured segments in order


@functools.lru_cache(maxsize=4)
def layout(
    bounds: tuple[tuple[int, int], ...], capture_ats: tuple[tuple[int, ...], ...], device: torch.device
) -> SpanLayout:
    span = [i for i, (lo, hi) in enumerate(bounds) for _ in range(lo, hi)]
    segments = []
    for (lo, hi), caps in zip(bounds, capture_ats, strict=True):
        cuts = [0, *sorted({*caps, hi - lo})]
        segments.append([(lo + a, lo + b, b in caps) for a, b in zip(cuts, cuts[1:], strict=False)])
    rounds, order, last = [], [], {}  # last: each sequence's segment so far
    captured: list[list[int]] = [[] for _ in bounds]
    each = [tuple((i, *s[r]) for i, s in enumerate(segments) if len(s) > r) for r in range(max(map(len, segments)))]
    cu, chunks, offsets = _index([hi - lo for pieces in each for _, lo, hi, _ in pieces])
    for r, pieces in enumerate(each):
        start, first = len(order), sum(len(rnd.pieces) for rnd in rounds)
        h0 = None if r == 0 else _rows([last[i] for i, *_ in pieces], device)
        for n, (i, lo, hi, capture) in enumerate(pieces):
            order += range(lo, hi)
            last[i] = first + n
            if capture:
                captured[i].append(first + n)
        ends = slice(first, first + len(pieces) + 1)
        rounds.append(Round(pieces, start, len(order), first, h0, to_device(cu[ends], torch.long, device),
                            to_device(offsets[ends], torch.long, device)))
    in_order = order == list(range(len(order)))
    return SpanLayout(to_device(span, torch.int32, device), to_device([lo for lo, _ in bounds], torch.int32, device),
                      None if in_order else to_device(order, torch.long, device), tuple(rounds),
                      to_device(cu, torch.long, device), to_device(chunks, torch.long, device).view(-1, 2),
                      to_device([last[i] for i in range(len(bounds))], torch.long, device),
                      tuple(map(tuple, captured)))


def _rows(rows: list[int], device: torch.device) -> slice | torch.Tensor:
    """Rows of a tensor as a slice where they are consecutive, else as an index on the device."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return to_device(rows, torch.long, device)


def _index(lengths: list[int]) -> tuple[list[int], list[tuple[int, int]], list[int]]:
    """Segments of `lengths` rows as fla's varlen kernels index them: cumulative lengths, each
    chunk's (segment, index within it), each segment's first chunk."""
    cu, chunks, offsets = [0], [], [0]
    for n, length in enumerate(lengths):
        cu.append(cu[-1] + length)
        chunks += [(n, j) for j in range(-(-length // CHUNK))]
        offsets.append(len(chunks))
    return cu, chunks, offsets


class RoundScan(Protocol):
    """A scan of the rows taken in a layout's order (made from them once a layer)."""

    def carry(self, h0: torch.Tensor, rnd: Round, finals: torch.Tensor) -> None:
        """The round's segments from their states h0 [n, Hv, Dk, Dv] fp32 to their final states,
        written into `finals` [n, Hv, Dk, Dv] fp32."""

    def outputs(self) -> torch.Tensor:
        """Once every round carried its states: out [T, Hv, Dv] of every row, in the layout's order."""


def scan_rounds(where: SpanLayout, q, k, v, g, beta, states: Sequence[torch.Tensor],
                scan: Callable[..., RoundScan]):
    """The scan of several sequences' rows (q, k [T, Hk, Dk]; v [T, Hv, Dv]; g, beta [T, Hv]), each from
    its state in `states`, round by round: `scan(q, k, v, g, beta, where)` takes the rows in the
    layout's order, each round carries its segments' states into one buffer of every segment's
    final state, and the outputs come once after the last round. Returns out [T, Hv, Dv] in the rows'
    order, each sequence's final state and its captures in order (views of that buffer: one copy
    to host memory takes a layer's captures)."""
    ins = [q, k, v, g, beta]
    if where.order is not None:  # round after round: each round's rows are a slice
        ins = [x.index_select(0, where.order) for x in ins]
    run = scan(*ins, where)
    h0 = torch.stack([s.float() for s in states])
    finals = h0.new_empty(len(where.cu_seqlens) - 1, *h0.shape[1:])
    for rnd in where.rounds:
        run.carry(h0 if rnd.h0 is None else finals[rnd.h0], rnd, finals[rnd.segments])
    out = run.outputs()
    if where.order is not None:
        out = torch.empty_like(out).index_copy_(0, where.order, out)
    # the sequences' states on their own (the buffer of every segment's is held only by the captures)
    ends = finals.index_select(0, where.finals)
    return out, list(ends), [[finals[j] for j in caps] for caps in where.captured]
