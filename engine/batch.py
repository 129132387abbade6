"""What one forward runs: a few tokens of each of several sequences, concatenated.

Every op that treats tokens independently (projections, norms, MoE, lm_head) runs once over all
of a batch's tokens. Where a sequence's own state is read and written (attention's KV, the causal
conv and the Gated DeltaNet state) the batch says how:

- `Spans`: any number of tokens per sequence, each sequence on its own `SequenceState` (prefill,
  chunked prefill with captures). Attention runs per sequence; the conv and the chunked scan take
  every sequence's rows at once (on the GPU one conv launch and fla's varlen scan).
- `SlotBatch`: one token per sequence, every state in one slot of stacked buffers (`SlotBuffers`)
  and every index on the device, so the whole step is free of host syncs and Python-side shapes and
  one CUDA graph per batch size replays it (`engine.runner.Runner`).
- `SlotPrefill`: a few tokens of one sequence in a slot, padded to a token bucket, its slot, start
  and valid count on the device: one CUDA graph per bucket replays a short prefill (a tool result
  after a restore) whatever its length and position.
- `Mixed`: a `SlotBatch`'s decode tokens first, then `Spans` of prefill: a step that decodes the
  running sequences and prefills a chunk of another in one forward (the weights read once)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.state import SequenceState


@dataclass
class Span:
    """`length` tokens of one sequence in a forward, after `state.length`; the DeltaNet states
    after each offset in `capture_at` (1..length) are returned by the forward."""

    state: SequenceState
    length: int
    capture_at: list[int] = field(default_factory=list)


@dataclass
class Spans:
    """Tokens of several sequences, each on its own state, which the forward extends in place."""

    spans: list[Span]

    def bounds(self) -> list[tuple[int, int]]:
        """[lo, hi) rows of each span in the concatenated tokens."""
        out, lo = [], 0
        for span in self.spans:
            out.append((lo, lo + span.length))
            lo += span.length
        return out

    def positions(self, device: torch.device) -> torch.Tensor:
        """Absolute positions of every token [T], span after span."""
        return torch.cat([torch.arange(s.state.length, s.state.length + s.length, device=device) for s in self.spans])

    def wait_for(self, layer: int) -> None:
        for span in self.spans:
            span.state.wait_for(layer)  # a restore may still be copying this layer's state in

    def advance(self) -> None:
        for span in self.spans:
            span.state.length += span.length


@dataclass
class SlotBuffers:
    """Per-sequence state of `slots` sequences, stacked: KV [slots, capacity, Hkv, D] per attention
    layer, conv [slots, C, K-1] (model dtype) and recurrent [slots, Hv, Dk, Dv] (fp32) per DeltaNet
    layer."""

    k: dict[int, torch.Tensor]
    v: dict[int, torch.Tensor]
    conv: dict[int, torch.Tensor]
    rec: dict[int, torch.Tensor]

    @property
    def capacity(self) -> int:
        return next(iter(self.k.values())).shape[1] if self.k else 1 << 30


@dataclass
class SlotBatch:
    """One decode token per row: row b is the sequence in slot `index[b]`, its token at `pos[b]`
    (its length before the step). The forward writes the new KV row and states into the slots;
    lengths move when the runner commits the step (a replayed graph runs no Python)."""

    buffers: SlotBuffers
    index: torch.Tensor  # [B] long
    pos: torch.Tensor  # [B] long

    def positions(self, device: torch.device) -> torch.Tensor:
        return self.pos

    def wait_for(self, layer: int) -> None:
        return None  # the runner waits for restores when it binds a state to a slot

    def advance(self) -> None:
        return None


@dataclass
class SlotPrefill:
    """`rows` tokens (a bucket) of the sequence in slot `meta[0]`, from position `meta[1]`, of
    which the first `meta[2]` are real and the rest padding. The forward writes the KV rows of all
    of them (positions past the valid ones are free slot rows) and leaves the DeltaNet states as
    after the real tokens (padding gets no decay and no update); the runner commits the length."""

    buffers: SlotBuffers
    meta: torch.Tensor  # [3] long: slot, start position, valid tokens
    arange: torch.Tensor  # [rows] long: 0..rows-1
    slot: torch.Tensor = field(init=False)  # [1] views of meta
    start: torch.Tensor = field(init=False)
    count: torch.Tensor = field(init=False)
    valid: torch.Tensor = field(init=False)
    pos: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:  # once per forward, not once per layer that reads them
        self.slot, self.start, self.count = self.meta[0:1], self.meta[1:2], self.meta[2:3]
        self.valid = self.arange < self.count  # [rows] bool: which rows are real tokens
        self.pos = self.start + self.arange  # [rows] absolute positions

    def positions(self, device: torch.device) -> torch.Tensor:
        return self.pos

    def wait_for(self, layer: int) -> None:
        return None  # the runner waits for restores when it binds a state to a slot

    def advance(self) -> None:
        return None


@dataclass
class Mixed:
    """The decode tokens of sequences in slots (the first `rows` rows) and prefill spans after them,
    in one forward: every op that treats tokens independently runs once over all rows; attention,
    the conv and the scan run each part's way on its rows."""

    decode: SlotBatch
    prefill: Spans

    @property
    def rows(self) -> int:
        return self.decode.index.shape[0]

    @property
    def spans(self) -> list[Span]:
        return self.prefill.spans

    def positions(self, device: torch.device) -> torch.Tensor:
        return torch.cat([self.decode.pos, self.prefill.positions(device)])

    def wait_for(self, layer: int) -> None:
        self.prefill.wait_for(layer)

    def advance(self) -> None:
        self.prefill.advance()


Batch = Spans | SlotBatch | SlotPrefill | Mixed
