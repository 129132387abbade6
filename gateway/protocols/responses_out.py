"""OpenAI Responses output: the SSE event stream Codex consumes, and the response object.

Every event carries ``sequence_number``; every item is announced with
``response.output_item.added`` before its deltas and finished with
``response.output_item.done``. Reasoning is sent as a summary (what Codex shows by
default) or as raw ``reasoning_text`` (``reasoning_mode="raw"``); either way the item's
``encrypted_content`` is the caller's memo handle, which Codex sends back verbatim.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from gateway.conversation import ToolCall
from gateway.events import (
    Collected,
    ErrorEvent,
    Event,
    Finish,
    ReasoningDelta,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    Usage,
    effective_finish,
    ended_call,
    new_id,
    started_call,
)
from gateway.sse import sse_event

ReasoningMode = Literal["summary", "raw"]


def usage_json(u: Usage) -> dict:
    return {
        "input_tokens": u.input_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": u.output_tokens,
        "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
        "total_tokens": u.input_tokens + u.output_tokens,
    }


def reasoning_item(item_id: str, text: str, handle: str, mode: ReasoningMode) -> dict:
    summary = [{"type": "summary_text", "text": text}] if mode == "summary" and text else []
    content = [{"type": "reasoning_text", "text": text}] if mode == "raw" else None
    return {
        "id": item_id,
        "type": "reasoning",
        "summary": summary,
        "content": content,
        "encrypted_content": handle,
    }


def message_item(item_id: str, text: str, status: str = "completed") -> dict:
    content = (
        [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        if status == "completed"
        else []
    )
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def tool_item(item_id: str, call: ToolCall, status: str = "completed") -> dict:
    if call.is_custom:
        body = {"input": call.input if status == "completed" else ""}
        return {"id": item_id, "type": "custom_tool_call", "call_id": call.id, "name": call.name, **body}
    args = call.wire_arguments if status == "completed" else ""
    return {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "call_id": call.id,
        "name": call.name,
        "arguments": args,
    }


FAILED_CODES: dict[str, str] = {
    "context_length_exceeded": "context_length_exceeded",  # what Codex checks; not in the SDK's Literal
    "overloaded": "rate_limit_exceeded",
    "invalid_request": "invalid_prompt",
    "server_error": "server_error",
}


def error_json(ev: ErrorEvent) -> dict:
    return {"code": FAILED_CODES[ev.kind], "message": ev.message}


class ResponseShell:
    """The fields of a response object that do not depend on the output."""

    def __init__(self, model: str, response_id: str | None = None, created_at: int | None = None):
        self.id = response_id or new_id("resp_")
        self.model = model
        self.created_at = created_at if created_at is not None else int(time.time())

    def build(self, status: str, output: list[dict], usage: Usage | None = None, **extra: Any) -> dict:
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.model,
            "output": output,
            "error": None,
            "incomplete_details": None,
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "metadata": {},
            "text": {"format": {"type": "text"}},
            "usage": usage_json(usage) if usage is not None else None,
            **extra,
        }


def response_body(
    collected: Collected,
    model: str,
    memo_handle: str = "",
    *,
    response_id: str | None = None,
    reasoning_mode: ReasoningMode = "summary",
) -> dict:
    """The non-streaming response object for a finished generation."""
    output = []
    for block in collected.blocks:
        if block.kind == "reasoning":
            output.append(reasoning_item(new_id("rs_"), block.text, memo_handle, reasoning_mode))
        elif block.kind == "text":
            output.append(message_item(new_id("msg_"), block.text))
        elif block.tool_call is not None:
            prefix = "ctc_" if block.tool_call.is_custom else "fc_"
            output.append(tool_item(new_id(prefix), block.tool_call))
    shell = ResponseShell(model, response_id)
    if collected.error is not None:
        return shell.build("failed", output, collected.usage, error=error_json(collected.error))
    if collected.effective_finish == "length":
        details = {"reason": "max_output_tokens"}
        return shell.build("incomplete", output, collected.usage, incomplete_details=details)
    return shell.build("completed", output, collected.usage)


class ResponsesStream:
    """State machine from events to Responses SSE frames: `start()`, `feed(ev)` per
    event, `end()` once (returns the terminal ``response.completed`` / ``.incomplete``)."""

    def __init__(
        self,
        model: str,
        memo_handle: str = "",
        *,
        response_id: str | None = None,
        reasoning_mode: ReasoningMode = "summary",
    ):
        self.shell = ResponseShell(model, response_id)
        self.handle, self.mode = memo_handle, reasoning_mode
        self.seq = 0
        self.output: list[dict] = []
        self.open: tuple[str, str, Any] | None = None  # (kind, item id, text or ToolCall)
        self.calls: dict[int, ToolCall] = {}
        self.finish: Finish | None = None
        self.usage = Usage(0)
        self.done = False

    def event(self, type_: str, **fields: Any) -> bytes:
        data = {"type": type_, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse_event(type_, data)

    def start(self) -> list[bytes]:
        resp = self.shell.build("in_progress", [])
        return [
            self.event("response.created", response=resp),
            self.event("response.in_progress", response=resp),
        ]

    def feed(self, ev: Event) -> list[bytes]:
        if self.done:
            return []
        match ev:
            case ReasoningDelta(text):
                return self._text_delta("reasoning", text)
            case TextDelta(text):
                return self._text_delta("message", text)
            case ToolCallStart():
                return self._tool_start(ev)
            case ToolCallArgsDelta(index, text):
                return self._tool_delta(index, text)
            case ToolCallEnd(index, arguments):
                return self._tool_end(index, arguments)
            case Finish():
                self.finish = ev
            case Usage():
                self.usage = ev
            case ErrorEvent():
                return self._fail(ev)
        return []

    def end(self) -> list[bytes]:
        if self.done:
            return []
        frames = self._close()
        self.done = True
        finish = effective_finish(self.finish.reason if self.finish else "stop", bool(self.calls))
        if finish == "length":
            details = {"reason": "max_output_tokens"}
            resp = self.shell.build("incomplete", self.output, self.usage, incomplete_details=details)
            return frames + [self.event("response.incomplete", response=resp)]
        resp = self.shell.build("completed", self.output, self.usage)
        return frames + [self.event("response.completed", response=resp)]

    def _fail(self, ev: ErrorEvent) -> list[bytes]:
        frames = self._close()
        self.done = True
        resp = self.shell.build("failed", self.output, self.usage, error=error_json(ev))
        return frames + [self.event("response.failed", response=resp)]

    # -- items ------------------------------------------------------------------------

    @property
    def index(self) -> int:
        return len(self.output)

    def _text_delta(self, kind: str, text: str) -> list[bytes]:
        frames = [] if self.open and self.open[0] == kind else self._close() + self._open_text(kind)
        assert self.open is not None
        _, item_id, so_far = self.open
        self.open = (kind, item_id, so_far + text)
        where = {"item_id": item_id, "output_index": self.index}
        if kind == "message":
            return frames + [
                self.event("response.output_text.delta", **where, content_index=0, delta=text, logprobs=[])
            ]
        if self.mode == "summary":
            return frames + [
                self.event("response.reasoning_summary_text.delta", **where, summary_index=0, delta=text)
            ]
        return frames + [self.event("response.reasoning_text.delta", **where, content_index=0, delta=text)]

    def _open_text(self, kind: str) -> list[bytes]:
        item_id = new_id("msg_" if kind == "message" else "rs_")
        self.open = (kind, item_id, "")
        where = {"item_id": item_id, "output_index": self.index}
        if kind == "message":
            added = self.event(
                "response.output_item.added",
                output_index=self.index,
                item=message_item(item_id, "", "in_progress"),
            )
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            return [added, self.event("response.content_part.added", **where, content_index=0, part=part)]
        item = reasoning_item(item_id, "", "", self.mode) | {"encrypted_content": None}
        frames = [self.event("response.output_item.added", output_index=self.index, item=item)]
        if self.mode == "summary":
            part = {"type": "summary_text", "text": ""}
            frames.append(
                self.event("response.reasoning_summary_part.added", **where, summary_index=0, part=part)
            )
        return frames

    def _tool_start(self, ev: ToolCallStart) -> list[bytes]:
        frames = self._close()
        call = started_call(ev.call_id, ev.name, ev.custom)
        self.calls[ev.index] = call
        item_id = new_id("ctc_" if ev.custom else "fc_")
        self.open = ("tool", item_id, call)
        item = tool_item(item_id, call, "in_progress")
        return frames + [self.event("response.output_item.added", output_index=self.index, item=item)]

    def _tool_delta(self, index: int, text: str) -> list[bytes]:
        call = self.calls[index]
        assert self.open is not None
        where = {"item_id": self.open[1], "output_index": self.index, "delta": text}
        kind = (
            "response.custom_tool_call_input.delta"
            if call.is_custom
            else "response.function_call_arguments.delta"
        )
        return [self.event(kind, **where)]

    def _tool_end(self, index: int, arguments: dict | str) -> list[bytes]:
        call = self.calls[index] = ended_call(self.calls[index], arguments)
        if self.open is not None and self.open[0] == "tool":
            self.open = ("tool", self.open[1], call)
        return self._close()

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        kind, item_id, payload = self.open
        where = {"item_id": item_id, "output_index": self.index}
        if kind == "tool":
            frames, item = self._close_tool(where, item_id, payload)
        elif kind == "message":
            frames, item = self._close_message(where, item_id, payload)
        else:
            frames, item = self._close_reasoning(where, item_id, payload)
        frames.append(self.event("response.output_item.done", output_index=self.index, item=item))
        self.output.append(item)
        self.open = None
        return frames

    def _close_tool(self, where: dict, item_id: str, call: ToolCall) -> tuple[list[bytes], dict]:
        item = tool_item(item_id, call)
        if call.is_custom:
            return [self.event("response.custom_tool_call_input.done", **where, input=item["input"])], item
        done = self.event(
            "response.function_call_arguments.done", **where, name=call.name, arguments=item["arguments"]
        )
        return [done], item

    def _close_message(self, where: dict, item_id: str, text: str) -> tuple[list[bytes], dict]:
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        frames = [
            self.event("response.output_text.done", **where, content_index=0, text=text, logprobs=[]),
            self.event("response.content_part.done", **where, content_index=0, part=part),
        ]
        return frames, message_item(item_id, text)

    def _close_reasoning(self, where: dict, item_id: str, text: str) -> tuple[list[bytes], dict]:
        if self.mode == "raw":
            return [
                self.event("response.reasoning_text.done", **where, content_index=0, text=text)
            ], reasoning_item(item_id, text, self.handle, "raw")
        part = {"type": "summary_text", "text": text}
        frames = [
            self.event("response.reasoning_summary_text.done", **where, summary_index=0, text=text),
            self.event("response.reasoning_summary_part.done", **where, summary_index=0, part=part),
        ]
        return frames, reasoning_item(item_id, text, self.handle, "summary")
