"""Long prefill chunks stream every layer's experts whole, in pieces, through a ring of buffers.

A chunk of a few hundred tokens or more routes to nearly every expert of every layer. When most
of a layer's experts are not resident (a small budget), choosing them after the routing costs a
host sync per layer and copies of scattered experts; instead such a forward copies each layer's
experts in `STREAM_PIECES` pieces of consecutive experts (one copy per part: the link's rate)
into `STREAM_BUFFERS` device buffers in turn, whatever the routing, and runs each piece's experts
on the assignments routed to them (the others at -1) as soon as it has landed. Piece j + B is
copied into the buffer of piece j once piece j's experts have run: the copies of the next pieces
(and the next layer's first ones) overlap this piece's compute and the next layer's attention
(three buffers: the link keeps copying through a layer's attention, where two left it idle until
the layer's first piece had run), and nothing waits on the host, so the host queues the whole
forward ahead of the device.

The experts resident in a layer's slots (engine/offload/cache.py) run from there, in one call
before the pieces, and a piece copies only the span of its experts that are not (nothing where
all are): the slots save link bytes here too. What decode keeps resident survives a long prefill;
only a layer's empty slots are filled, from the pieces as they pass (device to device, nothing
more over the link): after the first long prefill, decode finds its slots full.

A streamed chunk copies every missing expert whatever its routing: gathering only the routed ones
would make each layer's copies wait for its routing, where the stream's copies run ahead of the
compute.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from engine.offload.cache import ExpertCache, Lane, Parts
    from engine.offload.stats import OffloadStats

STREAM_PIECES = 4  # pieces a layer's experts stream in: a buffer holds one
STREAM_BUFFERS = 3  # pieces in flight at once
ALIGN = 256  # bytes between parts in a buffer


def piece_size(num_experts: int) -> int:
    """Experts per piece."""
    return math.ceil(num_experts / STREAM_PIECES)


def stream_bytes(num_experts: int, expert_bytes: int, parts: int = 8) -> int:
    """Device bytes of the buffers for experts of `expert_bytes` (in at most `parts` parts)."""
    return STREAM_BUFFERS * (piece_size(num_experts) * expert_bytes + parts * ALIGN)


class ExpertStream:
    """The buffers, the events ordering them, and the position in the forward being streamed
    (`begin` ... one `run` per MoE layer in order ... `end`)."""

    def __init__(self, caches: list[ExpertCache], lane: Lane, stats: OffloadStats):
        self.caches, self.lane, self.stats = caches, lane, stats
        experts = caches[0].num_experts  # every layer's
        self.size = piece_size(experts)
        # (first expert, count) of each piece
        self.ranges = [(s, min(self.size, experts - s)) for s in range(0, experts, self.size)]
        self.pieces = len(self.ranges)
        largest = max(self._offsets(c)[-1] for c in caches)
        self.buffers = [
            torch.empty(largest, dtype=torch.uint8, device=caches[0].device) for _ in range(STREAM_BUFFERS)
        ]
        # (buffer, layer's cache) -> that layer's parts as views of the buffer, and their weights
        self.views: dict[tuple[int, int], tuple[Parts, tuple[Any, ...]]] = {}
        self.copied: list[Any] = [None] * STREAM_BUFFERS  # event: the copy into each buffer
        self.read: list[Any] = [None] * STREAM_BUFFERS  # event: the last compute that read each buffer
        # the experts each buffer's piece copied ([lo, hi): those of the piece not resident when it
        # was filled, residency no piece before it in its layer changes), None: all resident
        self.spans: list[tuple[int, int] | None] = [None] * STREAM_BUFFERS
        self.cursor = 0  # the next piece to run, counted over the forward's layers
        self.active = False

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    def begin(self) -> None:
        """A forward starts: its first pieces are copied in, one per buffer."""
        self.cursor, self.active = 0, True
        for piece in range(STREAM_BUFFERS):
            self._fill(piece)

    def end(self) -> None:
        self.active = False

    def run(
        self,
        cache: ExpertCache,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        moe_experts: Callable,
    ) -> torch.Tensor:
        """This layer's experts: the resident ones from their slots, then piece by piece as each
        lands, each piece's copied assignments at their row in the piece, the others -1
        (`moe_experts(..., partial=True)`); summed in fp32."""
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("streamed experts cannot run inside a CUDA graph")
        if self.caches[self.cursor // self.pieces] is not cache:
            raise RuntimeError("a streamed forward ran its MoE layers out of order")
        cache.wait_for_table()  # a refresh's or resize's table lands first (the pieces skip what it lists)
        slot = cache.slot_table[ids]  # resident as the pieces were filled (before this layer adopts)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        resident = sum(e >= 0 for e in cache.expert_in)
        # counted as needed: a long chunk routes to nearly every expert (its routing is not read back)
        self.stats.count(resident, fetched=cache.num_experts - resident)
        if resident:
            out += moe_experts(x, weights, slot, *cache.weights, partial=True).float()
        for start, _ in self.ranges:
            buffer = self.cursor % STREAM_BUFFERS
            if (span := self.spans[buffer]) is not None:
                lo, hi = span
                self.lane.wait([self.copied[buffer]])
                parts, stacks = self._parts(buffer, cache)
                local = torch.where((ids >= lo) & (ids < hi) & (slot < 0), ids - start, -1)
                out += moe_experts(x, weights, local, *stacks, partial=True).float()
                cache.adopt(parts, start, lo, hi)
                self.read[buffer] = self.lane.record()
            self.cursor += 1
            self._fill(self.cursor + STREAM_BUFFERS - 1)  # into the buffer just read, once that read is done
        return out.to(x.dtype)

    def _fill(self, piece: int) -> None:
        """Copy piece `piece` of the forward (if there is one) into its buffer (the ring's), after the
        last compute that read that buffer."""
        layer, index = divmod(piece, self.pieces)
        if layer >= len(self.caches):
            return
        cache = self.caches[layer]
        start, count = self.ranges[index]
        buffer = piece % STREAM_BUFFERS
        missing = [e for e in range(start, start + count) if cache.slot_of[e] < 0]
        if not missing:  # every expert of the piece resident: nothing to copy or run
            self.spans[buffer] = None
            return
        lo, hi = missing[0], missing[-1] + 1
        self.spans[buffer] = (lo, hi)
        parts, _ = self._parts(buffer, cache)
        pairs = [(d[lo - start : hi - start], h[lo:hi]) for d, h in zip(parts, cache.host, strict=True)]
        self.copied[buffer] = self.lane.copy(pairs, [self.read[buffer]])
        self.stats.misses += hi - lo
        self.stats.bytes_in[self.stats.phase] += (hi - lo) * cache.expert_bytes

    def _offsets(self, cache: ExpertCache) -> list[int]:
        """Byte offsets of each part of a piece of `cache`'s layout in a buffer, and its end."""
        offsets = [0]
        for part in cache.host:
            offsets.append(-(-(offsets[-1] + self.size * part[0].nbytes) // ALIGN) * ALIGN)
        return offsets

    def _parts(self, buffer: int, cache: ExpertCache) -> tuple[Parts, tuple[Any, ...]]:
        """`cache`'s parts as views of `buffer` ([size, ...] each) and what they assemble to (made once)."""
        key = (buffer, id(cache))
        if key not in self.views:
            raw, offsets = self.buffers[buffer], self._offsets(cache)
            parts = tuple(
                raw[o : o + self.size * p[0].nbytes].view(p.dtype).view(self.size, *p.shape[1:])
                for o, p in zip(offsets[:-1], cache.host, strict=True)
            )
            self.views[key] = (parts, cache.assemble(parts))
        return self.views[key]
