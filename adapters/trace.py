"""Recorded agent sessions as one protocol-aware model: what the readers produce and the replay consumes.

A `Trace` is one agent session: the ordered model requests it made, each kept as the exact JSON
body of its wire protocol plus the assistant message the model answered with. The answer is
protocol-neutral (`AssistantOutput`) because the replay sends it back as `ft_forced_output`
(notes/CONTRACTS.md) whichever protocol the request uses.

`RecordLine` is one line of the gateway's `--record DIR` output; `read_trace` reads it back.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

Protocol = Literal["anthropic", "responses", "chat"]

# HTTP path of each protocol's generation endpoint on the gateway.
PROTOCOL_PATHS: dict[str, str] = {
    "anthropic": "/v1/messages",
    "responses": "/v1/responses",
    "chat": "/v1/chat/completions",
}


class ToolCall(msgspec.Struct, frozen=True):
    """One tool call the model made: the tool's name and its parsed JSON arguments."""

    name: str
    arguments: dict[str, Any] = {}


class AssistantOutput(msgspec.Struct, frozen=True):
    """What the model produced for one request, independent of protocol.

    Exactly the shape of the `ft_forced_output` request field: the gateway teacher-forces it.
    """

    reasoning: str | None = None
    content: str | None = None
    tool_calls: list[ToolCall] = []

    def to_forced(self) -> dict[str, Any]:
        """The `ft_forced_output` value (plain JSON types)."""
        return msgspec.to_builtins(self)


class TraceRequest(msgspec.Struct):
    """One model call of a session.

    `body` is the request exactly as its protocol's JSON (an Anthropic Messages body, a
    Responses body, or a Chat Completions body). `after_tool_result` is true when the
    request's last message is a tool result (the requests the headline TTFT is taken over).
    `ts` is when the request was sent and `output_ts` when its output was complete, in Unix
    seconds, where the source records them (else None).
    """

    protocol: Protocol
    body: dict[str, Any]
    output: AssistantOutput
    after_tool_result: bool = False
    ts: float | None = None
    output_ts: float | None = None

    @property
    def path(self) -> str:
        """The gateway path this request is sent to."""
        return PROTOCOL_PATHS[self.protocol]

    def replay_body(self) -> dict[str, Any]:
        """The body with `ft_forced_output` set to the recorded output (a new dict)."""
        return {**self.body, "ft_forced_output": self.output.to_forced()}


class Trace(msgspec.Struct):
    """One agent session: its model requests in the order they were made.

    `source` names the format it was read from ("codex", "claude", "swe-agent",
    "recording", "generated"); `path` the file; `session_id` the session's own id where the
    format has one (else the file stem); `meta` free-form facts (cli version, model, cwd).
    """

    session_id: str
    source: str
    path: str
    requests: list[TraceRequest] = []
    meta: dict[str, Any] = {}

    @property
    def protocol(self) -> Protocol | None:
        """The protocol of the session's requests (None when it has none)."""
        return self.requests[0].protocol if self.requests else None

    @property
    def num_tool_result_requests(self) -> int:
        return sum(r.after_tool_result for r in self.requests)


class Timings(msgspec.Struct, omit_defaults=True):
    """What the gateway measured for one request (milliseconds; token counts as integers)."""

    ttft_ms: float | None = None  # server side: request received -> first output token
    total_ms: float | None = None  # request received -> last output token
    prefill_tokens: int | None = None  # prompt tokens computed (x-prefill-tokens)
    cached_tokens: int | None = None  # prompt tokens restored from checkpoints (x-cached-tokens)
    output_tokens: int | None = None


class RecordLine(msgspec.Struct, omit_defaults=True):
    """One line of the gateway's `--record DIR` JSONL output: one model request and its answer.

    `path` is the HTTP path the client used (query string kept, e.g. "/v1/messages?beta=true");
    `ts` the Unix time the request arrived; `session` the client's session id where the
    request carries one (Codex `prompt_cache_key`, Claude Code `metadata.user_id`'s
    session_id, a `session-id` header), so several sessions interleaved in one file can be
    told apart. Lines without `session` form one session per file.
    """

    protocol: Protocol
    path: str
    body: dict[str, Any]
    output: AssistantOutput
    timings: Timings = msgspec.field(default_factory=Timings)
    ts: float | None = None
    session: str | None = None


def is_tool_result_last(protocol: str, body: dict[str, Any]) -> bool:
    """Whether the request body's last message is a tool result, per protocol."""
    if protocol == "anthropic":
        messages = body.get("messages") or []
        if not messages:
            return False
        last = messages[-1]
        content = last.get("content")
        return (
            last.get("role") == "user"
            and isinstance(content, list)
            and any(isinstance(b, dict) and b.get("type") == "tool_result" for b in content)
        )
    if protocol == "responses":
        items = body.get("input")
        if not isinstance(items, list) or not items:
            return False
        return items[-1].get("type") in ("function_call_output", "custom_tool_call_output")
    messages = body.get("messages") or []
    return bool(messages) and messages[-1].get("role") in ("tool", "function")


def encode_jsonl(lines: list[Any]) -> bytes:
    """JSONL bytes of structs or plain objects, one per line."""
    encoder = msgspec.json.Encoder()
    return b"".join(encoder.encode(line) + b"\n" for line in lines)
