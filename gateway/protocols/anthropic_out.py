"""Anthropic Messages output: the SSE stream and the message JSON.

Stream shape: ``message_start`` (usage with cache fields), ``ping``, then per block
``content_block_start`` / ``content_block_delta``* / ``content_block_stop`` (thinking
blocks end with a ``signature_delta`` carrying the caller's memo handle), then
``message_delta`` (stop_reason, usage) and ``message_stop``; or an ``error`` event.
"""

from __future__ import annotations

from typing import Any

import msgspec

from gateway.events import (
    Collected,
    ErrorEvent,
    Event,
    Finish,
    FinishReason,
    ReasoningDelta,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    Usage,
    effective_finish,
    new_id,
)
from gateway.sse import sse_event

STOP_REASONS: dict[str, str] = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "cancelled": "end_turn",
}
ERROR_TYPES: dict[str, str] = {
    "context_length_exceeded": "invalid_request_error",
    "invalid_request": "invalid_request_error",
    "overloaded": "overloaded_error",
    "server_error": "api_error",
}


def usage_json(u: Usage) -> dict:
    """Anthropic counts: `input_tokens` excludes the prompt tokens read from cache."""
    return {
        "input_tokens": u.input_tokens - u.cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": u.cached_tokens,
        "output_tokens": u.output_tokens,
    }


def stop_reason(reason: FinishReason, stop_sequence: str | None) -> str:
    return "stop_sequence" if stop_sequence is not None else STOP_REASONS[reason]


def error_json(ev: ErrorEvent) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES[ev.kind], "message": ev.message}}


def tool_input(arguments: dict | str) -> dict:
    """A custom (free-form) tool's raw input becomes ``{"input": text}``."""
    return arguments if isinstance(arguments, dict) else {"input": arguments}


def message_body(
    collected: Collected,
    model: str,
    memo_handle: str = "",
    *,
    message_id: str | None = None,
    omit_thinking: bool = False,
) -> dict:
    """The non-streaming message JSON for a finished generation."""
    content: list[dict] = []
    for block in collected.blocks:
        if block.kind == "reasoning":
            text = "" if omit_thinking else block.text
            content.append({"type": "thinking", "thinking": text, "signature": memo_handle})
        elif block.kind == "text":
            content.append({"type": "text", "text": block.text})
        elif (call := block.tool_call) is not None:
            content.append(
                {
                    "type": "tool_use",
                    "id": call.id,
                    "name": call.name,
                    "input": tool_input(call.input if call.is_custom else call.arguments or {}),
                }
            )
    return {
        "id": message_id or new_id("msg_"),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason(collected.effective_finish, collected.stop_sequence),
        "stop_sequence": collected.stop_sequence,
        "usage": usage_json(collected.usage),
    }


class AnthropicStream:
    """State machine from events to Messages SSE frames: `start()`, `feed(ev)` per event,
    `end()` once. ``message_start`` waits for the first event, so a leading `Usage`
    (prompt counts known after restore) lands in it. `omit_thinking` sends thinking
    blocks without their text (Claude Code's ``display: "omitted"``)."""

    def __init__(
        self, model: str, memo_handle: str = "", *, message_id: str | None = None, omit_thinking: bool = False
    ):
        self.model, self.handle, self.omit_thinking = model, memo_handle, omit_thinking
        self.id = message_id or new_id("msg_")
        self.started = self.done = False
        self.block = -1
        self.open: str | None = None  # "thinking" | "text" | "tool_use"
        self.custom_input: dict[int, str] = {}
        self.saw_tool = False
        self.finish = Finish("stop")
        self.usage = Usage(0)

    def start(self) -> list[bytes]:
        return []

    def feed(self, ev: Event) -> list[bytes]:
        if self.done:
            return []
        if isinstance(ev, Usage):
            self.usage = ev
        frames = self._begin()
        match ev:
            case ReasoningDelta(text):
                return frames + self._delta("thinking", {"type": "thinking_delta", "thinking": text})
            case TextDelta(text):
                return frames + self._delta("text", {"type": "text_delta", "text": text})
            case ToolCallStart():
                return frames + self._tool_start(ev)
            case ToolCallArgsDelta(index, text):
                return frames + self._tool_delta(index, text)
            case ToolCallEnd(index, arguments):
                return frames + self._tool_end(index, arguments)
            case Finish():
                self.finish = ev
            case ErrorEvent():
                self.done = True
                return frames + [sse_event("error", error_json(ev))]
        return frames

    def end(self) -> list[bytes]:
        if self.done:
            return []
        frames = self._begin() + self._close()
        self.done = True
        reason = effective_finish(self.finish.reason, self.saw_tool)
        delta = {
            "stop_reason": stop_reason(reason, self.finish.stop_sequence),
            "stop_sequence": self.finish.stop_sequence,
        }
        frames.append(
            sse_event(
                "message_delta", {"type": "message_delta", "delta": delta, "usage": usage_json(self.usage)}
            )
        )
        return frames + [sse_event("message_stop", {"type": "message_stop"})]

    def _begin(self) -> list[bytes]:
        if self.started:
            return []
        self.started = True
        usage = usage_json(msgspec.structs.replace(self.usage, output_tokens=0))
        message: dict[str, Any] = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage,
        }
        return [
            sse_event("message_start", {"type": "message_start", "message": message}),
            sse_event("ping", {"type": "ping"}),
        ]

    def _open(self, kind: str, block: dict) -> list[bytes]:
        frames = self._close()
        self.block += 1
        self.open = kind
        return frames + [
            sse_event(
                "content_block_start",
                {"type": "content_block_start", "index": self.block, "content_block": block},
            )
        ]

    def _delta(self, kind: str, delta: dict) -> list[bytes]:
        frames: list[bytes] = []
        if self.open != kind:
            empty: dict[str, Any] = (
                {"type": "thinking", "thinking": "", "signature": ""}
                if kind == "thinking"
                else {"type": "text", "text": ""}
            )
            frames = self._open(kind, empty)
        if kind == "thinking" and self.omit_thinking:
            return frames
        return frames + [self._block_delta(delta)]

    def _block_delta(self, delta: dict) -> bytes:
        return sse_event(
            "content_block_delta", {"type": "content_block_delta", "index": self.block, "delta": delta}
        )

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        frames = []
        if self.open == "thinking":
            frames.append(self._block_delta({"type": "signature_delta", "signature": self.handle}))
        self.open = None
        return frames + [sse_event("content_block_stop", {"type": "content_block_stop", "index": self.block})]

    def _tool_start(self, ev: ToolCallStart) -> list[bytes]:
        self.saw_tool = True
        if ev.custom:
            self.custom_input[ev.index] = ""
        block = {"type": "tool_use", "id": ev.call_id, "name": ev.name, "input": {}}
        return self._open("tool_use", block)

    def _tool_delta(self, index: int, text: str) -> list[bytes]:
        if index in self.custom_input:
            self.custom_input[index] += text
            return []
        return [self._block_delta({"type": "input_json_delta", "partial_json": text})]

    def _tool_end(self, index: int, arguments: dict | str) -> list[bytes]:
        frames = []
        if index in self.custom_input:
            whole = msgspec.json.encode(tool_input(arguments)).decode()
            frames.append(self._block_delta({"type": "input_json_delta", "partial_json": whole}))
        return frames + self._close()
