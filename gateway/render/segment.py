"""A `Segment`: a contiguous run of prompt tokens with one meaning (see the package's docstring)."""

from __future__ import annotations

from typing import Literal

import msgspec

SegmentKind = Literal[
    "system", "tools", "user", "assistant_text", "reasoning", "tool_call", "tool_result", "generation_prompt"
]


class Segment(msgspec.Struct, frozen=True):
    """`message_index` indexes `Conversation.messages` (None for system, tools and the
    generation prompt of the request itself)."""

    kind: str
    token_ids: list[int]
    message_index: int | None = None


def segment_ids(segments: list[Segment]) -> list[int]:
    """All token ids of `segments`, in order."""
    return [t for s in segments for t in s.token_ids]
