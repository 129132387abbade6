"""Where several sequences' rows lie in a forward's concatenated tokens, as the varlen kernels read it:
the causal conv's row -> sequence map, and the scan's rounds. Built once per forward on the host and
copied in without a host sync (every layer of the forward reads the same one: memoised on the
spans' bounds and captures).

A scan cannot stop at a capture inside one call (fla returns the fp32 state only at a sequence's
end), so each sequence's rows are cut into segments at its captures, and round r scans the r-th
segment of every sequence that has one, as one varlen call from the states the round before left.
The scan takes the rows in `order` (round after round) once a layer, so each round reads a slice.
What a chunk computes from its own rows alone (the gates' cumulative sums, the WY representation)
does not depend on the states: that half runs once a layer over every segment of every round
(`SpanLayout.cu_seqlens`, `SpanLayout.chunk_indices`), and a round only carries the states through
its chunks and reads its outputs off them."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

CHUNK = 64  # fla's chunk of the gated delta rule


def to_device(values: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on the device, through pinned memory: the copy waits on nothing queued."""
    host = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


@dataclass(frozen=True)
class Round:
    """One varlen scan: the segments `pieces` [(sequence, lo, hi, captured)] in rows [lo, hi) of
    the forward, which are rows [start, end) of the rows taken in `SpanLayout.order`."""

    pieces: tuple[tuple[int, int, int, bool], ...]
    start: int
    end: int
    cu_seqlens: torch.Tensor  # [len(pieces) + 1] long
    chunk_indices: torch.Tensor  # [chunks, 2] long: each chunk's segment and its index within it
    chunk_offsets: torch.Tensor  # [len(pieces) + 1] long: each segment's first chunk


@dataclass(frozen=True)
class SpanLayout:
    span: torch.Tensor  # [T] int32: each row's sequence
    starts: torch.Tensor  # [N] int32: each sequence's first row
    order: torch.Tensor | None  # [T] long: the rows, round after round; None where that is every row in order
    rounds: tuple[Round, ...]
    cu_seqlens: torch.Tensor  # every round's segments in `order`, as one varlen batch
    chunk_indices: torch.Tensor


@functools.lru_cache(maxsize=4)
def layout(
    bounds: tuple[tuple[int, int], ...], capture_ats: tuple[tuple[int, ...], ...], device: torch.device
) -> SpanLayout:
    span = [i for i, (lo, hi) in enumerate(bounds) for _ in range(lo, hi)]
    segments = []
    for (lo, hi), caps in zip(bounds, capture_ats, strict=True):
        cuts = [0, *sorted({*caps, hi - lo})]
        segments.append([(lo + a, lo + b, b in caps) for a, b in zip(cuts, cuts[1:], strict=False)])
    rounds, order = [], []
    for r in range(max(len(s) for s in segments)):
        pieces = tuple((i, *s[r]) for i, s in enumerate(segments) if len(s) > r)
        start = len(order)
        for _, lo, hi, _ in pieces:
            order += range(lo, hi)
        cu, chunks, offsets = _index([hi - lo for _, lo, hi, _ in pieces])
        rounds.append(Round(pieces, start, len(order), to_device(cu, torch.long, device),
                            to_device(chunks, torch.long, device).view(-1, 2), to_device(offsets, torch.long, device)))  # fmt: skip
    cu, chunks, _ = _index([hi - lo for rnd in rounds for _, lo, hi, _ in rnd.pieces])
    in_order = order == list(range(len(order)))
    return SpanLayout(to_device(span, torch.int32, device), to_device([lo for lo, _ in bounds], torch.int32, device),
                      None if in_order else to_device(order, torch.long, device), tuple(rounds),
                      to_device(cu, torch.long, device), to_device(chunks, torch.long, device).view(-1, 2))  # fmt: skip


def _index(lengths: list[int]) -> tuple[list[int], list[tuple[int, int]], list[int]]:
    """Segments of `lengths` rows as fla's varlen kernels index them: cumulative lengths, each
    chunk's (segment, index within it), each segment's first chunk."""
    cu, chunks, offsets = [0], [], [0]
    for n, length in enumerate(lengths):
        cu.append(cu[-1] + length)
        chunks += [(n, j) for j in range(-(-length // CHUNK))]
        offsets.append(len(chunks))
    return cu, chunks, offsets


def scan_rounds(where: SpanLayout, q, k, v, g, beta, states: Sequence[torch.Tensor], varlen: Callable,
                local: Callable | None = None):  # fmt: skip
    """The scan of several sequences' rows (q, k [T, Hk, Dk]; v [T, Hv, Dv]; g, beta [T, Hv]), each from
    its state in `states`, round by round: `varlen(*rows, h0, round)` scans one round's rows (its
    segments as `round.cu_seqlens` says) from h0 [n, Hv, Dk, Dv] -> (out [rows, Hv, Dv], the n final
    fp32 states). The rows are q, k, v, g, beta taken in the layout's order, or what
    `local(q, k, v, g, beta, where)` makes of them there, once for every round (tensors of one row
    per input row). Returns out [T, Hv, Dv] in the rows' order, each sequence's final state and its
    captures in order."""
    ins = [q, k, v, g, beta]
    if where.order is not None:  # round after round: each round's rows are a slice
        ins = [x.index_select(0, where.order) for x in ins]
    if local is not None:
        ins = local(*ins, where)
    h = [s.float() for s in states]
    outs: list[torch.Tensor] = []
    captured: list[list[torch.Tensor]] = [[] for _ in states]
    for rnd in where.rounds:
        h0 = torch.stack([h[i] for i, *_ in rnd.pieces])  # [n, Hv, Dk, Dv]
        out, final = varlen(*(x[rnd.start : rnd.end] for x in ins), h0, rnd)
        outs.append(out)
        for n, (i, _, _, capture) in enumerate(rnd.pieces):
            h[i] = final[n]
            if capture:
                captured[i].append(final[n])
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    if where.order is not None:
        out = torch.empty_like(out).index_copy_(0, where.order, out)
    return out, h, captured
