"""OpenAI Chat Completions output: ``chat.completion.chunk`` SSE and ``chat.completion``.

Reasoning goes in ``delta.reasoning_content`` (what OpenCode and vLLM-style clients read
and send back). With ``include_usage`` a final chunk with empty ``choices`` carries usage.
The stream ends with ``data: [DONE]``; an error mid-stream is ``data: {"error": {...}}``.
"""

from __future__ import annotations

import time
from typing import Any

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

FINISH_REASONS: dict[str, str] = {
    "stop": "stop",
    "length": "length",
    "tool_calls": "tool_calls",
    "cancelled": "stop",
}
ERROR_TYPES: dict[str, tuple[str, str | None]] = {
    "context_length_exceeded": ("invalid_request_error", "context_length_exceeded"),
    "invalid_request": ("invalid_request_error", None),
    "overloaded": ("server_error", "overloaded"),
    "server_error": ("server_error", None),
}
DONE = b"data: [DONE]\n\n"


def usage_json(u: Usage) -> dict:
    return {
        "prompt_tokens": u.input_tokens,
        "completion_tokens": u.output_tokens,
        "total_tokens": u.input_tokens + u.output_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
    }


def error_json(ev: ErrorEvent) -> dict:
    type_, code = ERROR_TYPES[ev.kind]
    return {"error": {"message": ev.message, "type": type_, "param": None, "code": code}}


def completion_body(collected: Collected, model: str, *, completion_id: str | None = None) -> dict:
    """The non-streaming ``chat.completion`` object for a finished generation."""
    calls = [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.wire_arguments}}
        for c in collected.tool_calls
    ]
    message: dict[str, Any] = {"role": "assistant", "content": collected.text or None}
    if collected.reasoning:
        message["reasoning_content"] = collected.reasoning
    if calls:
        message["tool_calls"] = calls
    choice = {
        "index": 0,
        "message": message,
        "logprobs": None,
        "finish_reason": FINISH_REASONS[collected.effective_finish],
    }
    return {
        "id": completion_id or new_id("chatcmpl-"),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage_json(collected.usage),
    }


class ChatStream:
    """State machine from events to chunk frames: `start()`, `feed(ev)`, `end()` once."""

    def __init__(self, model: str, *, include_usage: bool = False, completion_id: str | None = None):
        self.model, self.include_usage = model, include_usage
        self.id = completion_id or new_id("chatcmpl-")
        self.created = int(time.time())
        self.saw_tool = self.done = False
        self.finish: FinishReason = "stop"
        self.usage = Usage(0)

    def chunk(self, delta: dict, finish_reason: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return sse_event(
            None,
            {
                "id": self.id,
                "object": "chat.completion.chunk",
                "created": self.created,
                "model": self.model,
                "choices": [choice],
            },
        )

    def start(self) -> list[bytes]:
        return [self.chunk({"role": "assistant", "content": ""})]

    def feed(self, ev: Event) -> list[bytes]:
        if self.done:
            return []
        match ev:
            case ReasoningDelta(text):
                return [self.chunk({"reasoning_content": text})]
            case TextDelta(text):
                return [self.chunk({"content": text})]
            case ToolCallStart(index, call_id, name):
                self.saw_tool = True
                function = {"name": name, "arguments": ""}
                return [
                    self.chunk(
                        {
                            "tool_calls": [
                                {"index": index, "id": call_id, "type": "function", "function": function}
                            ]
                        }
                    )
                ]
            case ToolCallArgsDelta(index, text):
                return [self.chunk({"tool_calls": [{"index": index, "function": {"arguments": text}}]})]
            case ToolCallEnd():
                return []
            case Finish(reason):
                self.finish = reason
            case Usage():
                self.usage = ev
            case ErrorEvent():
                self.done = True
                return [sse_event(None, error_json(ev)), DONE]
        return []

    def end(self) -> list[bytes]:
        if self.done:
            return []
        self.done = True
        frames = [self.chunk({}, FINISH_REASONS[effective_finish(self.finish, self.saw_tool)])]
        if self.include_usage:
            frames.append(
                sse_event(
                    None,
                    {
                        "id": self.id,
                        "object": "chat.completion.chunk",
                        "created": self.created,
                        "model": self.model,
                        "choices": [],
                        "usage": usage_json(self.usage),
                    },
                )
            )
        return frames + [DONE]
