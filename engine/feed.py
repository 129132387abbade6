"""Tokens to run through one sequence, over one forward or several (chunked prefill).

The engine's `step` takes a few tokens of each of several feeds and runs them in one batched
forward; a feed collects what it asked for as its tokens go through (the DeltaNet states at its
capture positions, the hidden state of its last token) and holds its `result` once complete."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from checkpoint_store.snapshot import Snapshot
from engine.batch import Span
from engine.state import SequenceState


def _no_wait() -> None:
    return None


@dataclass
class PrefillResult:
    logits: torch.Tensor  # [V] fp32 at the last position, or [T, V] with all_logits
    snapshots: list[Snapshot]
    ready: Callable[[], None] = _no_wait  # blocks until the snapshots' host copies are complete


class Feed:
    """Run `token_ids` after `state` (extended in place). For each absolute position p in
    `capture_at` (state.length < p <= state.length + len(token_ids)) the result holds a Snapshot
    with the KV of [previous capture, p) (the first from `kv_start`, default state.length) and, if
    p is in `state_at` (default: all), the exact DeltaNet states at p."""

    def __init__(
        self, state: SequenceState, token_ids: Sequence[int], capture_at: Sequence[int] = (),
        state_at: set[int] | None = None, kv_start: int | None = None, all_logits: bool = False,
    ):
        self.state, self.token_ids = state, list(token_ids)
        self.start = state.length
        self.capture_at = sorted(set(capture_at))
        end = self.start + len(self.token_ids)
        if not self.token_ids:
            raise ValueError("nothing to feed")
        if self.capture_at and not (self.start < self.capture_at[0] and self.capture_at[-1] <= end):
            raise ValueError(f"capture positions {self.capture_at[0]}..{self.capture_at[-1]} outside ({self.start}, {end}]")
        self.state_at, self.kv_start, self.all_logits = state_at, kv_start, all_logits
        self.done = 0
        self.captured: dict[int, dict[str, torch.Tensor]] = {}
        self.hidden: list[torch.Tensor] = []  # [t, H] rows kept for the logits
        self.result: PrefillResult | None = None

    @property
    def remaining(self) -> int:
        return len(self.token_ids) - self.done

    @property
    def is_prefill(self) -> bool:
        """False for one decode token: no capture, only its logits (a runner step on its slot)."""
        return len(self.token_ids) > 1 or bool(self.capture_at) or self.all_logits

    def span(self, count: int) -> Span:
        """The next `count` tokens as a span of the coming forward, which captures the DeltaNet
        states at the positions in `state_at` alone: a KV-only capture's KV is read from the cache
        afterwards (a DeltaNet state is the same size at every position, however few tokens precede
        it, so copying it out at a KV-only boundary would be whole states copied to be dropped)."""
        base = self.start + self.done
        wanted = (p for p in self.capture_at if self.state_at is None or p in self.state_at)
        return Span(self.state, count, [p - base for p in wanted if base < p <= base + count])

    def next_ids(self, count: int) -> list[int]:
        return self.token_ids[self.done : self.done + count]
