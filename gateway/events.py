"""Protocol-neutral events of one generation, and their collected (non-streaming) form.

The parser turns generated text into these; each protocol encoder turns them into its
SSE events or its JSON body. Order on the wire of one generation::

    Usage? (prompt side, optional but lets message_start carry input usage)
    (ReasoningDelta | TextDelta | ToolCallStart ToolCallArgsDelta* ToolCallEnd)*
    Finish, Usage (either order)  |  ErrorEvent
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from typing import Literal

import msgspec

from gateway.conversation import ToolCall

FinishReason = Literal["stop", "length", "tool_calls", "cancelled"]


class ReasoningDelta(msgspec.Struct, frozen=True, tag=True):
    """A piece of the model's reasoning (the text inside <think>...</think>)."""

    text: str


class TextDelta(msgspec.Struct, frozen=True, tag=True):
    """A piece of the visible answer text."""

    text: str


class ToolCallStart(msgspec.Struct, frozen=True, tag=True):
    """A tool call begins; `index` counts calls of this generation from 0."""

    index: int
    call_id: str
    name: str
    custom: bool = False


class ToolCallArgsDelta(msgspec.Struct, frozen=True, tag=True):
    """More argument text: JSON text of the arguments object (function tools, the
    concatenation of all deltas is compact JSON of `ToolCallEnd.arguments`) or the raw
    input text (custom tools)."""

    index: int
    text: str


class ToolCallEnd(msgspec.Struct, frozen=True, tag=True):
    """A tool call is complete: a dict for function tools, the raw input for custom."""

    index: int
    arguments: dict | str


class Finish(msgspec.Struct, frozen=True, tag=True):
    """Why the generation stopped; `stop_sequence` names the client stop string hit."""

    reason: FinishReason
    stop_sequence: str | None = None


class Usage(msgspec.Struct, frozen=True, tag=True):
    """Token counts. `input_tokens` is the whole prompt; `cached_tokens` of it were
    restored from checkpoints, `prefill_tokens` were computed. The last Usage seen wins."""

    input_tokens: int
    cached_tokens: int = 0
    prefill_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0


ErrorKind = Literal["context_length_exceeded", "overloaded", "invalid_request", "server_error"]


class ErrorEvent(msgspec.Struct, frozen=True, tag=True):
    """The generation failed after the response started."""

    kind: ErrorKind
    message: str


Event = (
    ReasoningDelta | TextDelta | ToolCallStart | ToolCallArgsDelta | ToolCallEnd | Finish | Usage | ErrorEvent
)


class Block(msgspec.Struct):
    """One output block in order: reasoning text, answer text, or a tool call."""

    kind: Literal["reasoning", "text", "tool_call"]
    text: str = ""
    tool_call: ToolCall | None = None


class Collected(msgspec.Struct):
    """Everything one generation produced, for non-streaming responses."""

    blocks: list[Block] = msgspec.field(default_factory=list)
    finish: FinishReason = "stop"
    stop_sequence: str | None = None
    usage: Usage = msgspec.field(default_factory=lambda: Usage(0))
    error: ErrorEvent | None = None

    @property
    def reasoning(self) -> str:
        return "".join(b.text for b in self.blocks if b.kind == "reasoning")

    @property
    def text(self) -> str:
        return "".join(b.text for b in self.blocks if b.kind == "text")

    @property
    def tool_calls(self) -> list[ToolCall]:
        return [b.tool_call for b in self.blocks if b.tool_call is not None]

    @property
    def effective_finish(self) -> FinishReason:
        return effective_finish(self.finish, bool(self.tool_calls))


def effective_finish(reason: FinishReason, saw_tool_call: bool) -> FinishReason:
    """A natural stop after tool calls is a tool-call stop (the engine cannot tell)."""
    return "tool_calls" if reason == "stop" and saw_tool_call else reason


def new_id(prefix: str) -> str:
    """A fresh opaque id such as ``msg_…``, ``resp_…``, ``fc_…``."""
    return prefix + secrets.token_hex(12)


def collect(events: Iterable[Event]) -> Collected:
    """Fold an event stream into blocks; adjacent deltas of one kind merge."""
    out = Collected()
    calls: dict[int, Block] = {}
    for ev in events:
        match ev:
            case ReasoningDelta(text) | TextDelta(text):
                kind: Literal["reasoning", "text"] = "reasoning" if isinstance(ev, ReasoningDelta) else "text"
                if out.blocks and out.blocks[-1].kind == kind:
                    out.blocks[-1].text += text
                elif text:
                    out.blocks.append(Block(kind, text))
            case ToolCallStart(index, call_id, name, custom):
                calls[index] = Block("tool_call", tool_call=started_call(call_id, name, custom))
                out.blocks.append(calls[index])
            case ToolCallEnd(index, arguments):
                block = calls[index]
                block.tool_call = ended_call(block.tool_call, arguments)
            case Finish(reason, stop_sequence):
                out.finish, out.stop_sequence = reason, stop_sequence
            case Usage():
                out.usage = ev
            case ErrorEvent():
                out.error = ev
    return out


def started_call(call_id: str, name: str, custom: bool) -> ToolCall:
    """A call as its `ToolCallStart` announces it: no arguments yet."""
    return ToolCall(name, None if custom else {}, "" if custom else None, call_id)


def ended_call(call: ToolCall | None, arguments: dict | str) -> ToolCall:
    """The started `call` completed by its `ToolCallEnd` arguments."""
    assert call is not None
    if isinstance(arguments, str):
        return msgspec.structs.replace(call, arguments=None, input=arguments)
    return msgspec.structs.replace(call, arguments=arguments, input=None)
