"""Capture policies: which prompt boundaries get a recurrent-state snapshot.

KV deltas are kept at every segment boundary whatever the policy (attention KV can be cut
anywhere, so a token-radix engine keeps all of it too); policies differ in where the
DeltaNet state is saved, which is what decides where a hybrid model can resume:

- ``anchor``: every segment boundary, the end of each generation, and the precomputed
  next-turn history (earlier reasoning dropped);
- ``prefix``: only the end of each prompt and of each generation (what token-radix
  engines such as vLLM's and SGLang's prefix caches keep);
- ``user``: the end of each client message (user turns and tool results) and of each
  generation (llama.cpp's message-boundary context checkpoints plus its live slot);
- ``none``: nothing is kept; every request is prefilled from scratch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, get_args

from gateway.render import Segment

CapturePolicy = Literal["anchor", "prefix", "user", "none"]
CAPTURE_POLICIES: tuple[CapturePolicy, ...] = get_args(CapturePolicy)
CLIENT_MESSAGE_KINDS = ("user", "tool_result")


def state_positions(policy: CapturePolicy, segments: Sequence[Segment], ends: Sequence[int]) -> set[int]:
    """Absolute positions (segment ends) that get a state snapshot."""
    if policy == "anchor":
        return set(ends)
    if policy == "prefix":
        return {ends[-1]} if ends else set()
    if policy == "user":
        return {end for seg, end in zip(segments, ends, strict=True) if seg.kind in CLIENT_MESSAGE_KINDS}
    return set()


def keeps_generation_end(policy: CapturePolicy) -> bool:
    return policy != "none"


def precomputes(policy: CapturePolicy) -> bool:
    return policy == "anchor"
