"""What one forward runs: a few tokens of each of several sequences, concatenated.

Every op that treats tokens independently (projections, norms, MoE, lm_head) runs once over all
of a batch's tokens; attention, the causal conv and the Gated DeltaNet scan run per sequence on
that sequence's own state (`Span`), with the decode spans' scans batched into one call."""

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

    @property
    def is_decode(self) -> bool:
        """One token with no capture: its scan is one recurrent step, batched with the others."""
        return self.length == 1 and not self.capture_at


def bounds(spans: list[Span]) -> list[tuple[int, int]]:
    """[lo, hi) rows of each span in the concatenated tokens."""
    out, lo = [], 0
    for span in spans:
        out.append((lo, lo + span.length))
        lo += span.length
    return out


def positions(spans: list[Span], device: torch.device) -> torch.Tensor:
    """Absolute positions of every token [T], span after span."""
    return torch.cat([torch.arange(s.state.length, s.state.length + s.length, device=device) for s in spans])
