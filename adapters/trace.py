"""Recorded agent sessions as one protocol-aware model: what the readers produce and the replay consumes.

A `Trace` is one agent session: the ordered model requests it made, each kept as the exact JSON
body of its wire protocol plus the assistant message the model answered with. The answer is
protocol-neutral (`AssistantOutput`) because the replay sends it back as `ft_forced_output`
(notes/CONTRACTS.md) whichever protocol the request uses.

Each request also says how faithful its body is to what the client sent (`fidelity`):
"identical" when every field the model sees (system prompt, tool schemas, messages, the
parameters the gateway reads) is exactly what went over the wire, so the gateway renders the
same token ids; "approximate", with `why`, when the source did not record something the body
needs and the reader filled it in. Fields no model sees (Claude Code's `metadata`, Codex's
installation id and the id of its base-instructions item) are not part of that promise.

The record format (`RecordLine`, with `AssistantOutput` and `ToolCall`) is the gateway's (`gateway.record`,
`gateway.conversation`).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from gateway.conversation import AssistantOutput, ToolCall
from gateway.record import PROTOCOL_PATHS, ProtocolName, RecordLine, Timings

__all__ = [
    "PROTOCOL_PATHS",
    "AssistantOutput",
    "ProtocolName",
    "RecordLine",
    "Timings",
    "Fidelity",
    "ToolCall",
    "Trace",
    "TraceRequest",
    "is_tool_result_last",
    "encode_jsonl",
]

Fidelity = Literal["identical", "approximate"]


class TraceRequest(msgspec.Struct):
    """One model call of a session.

    `body` is the request exactly as its protocol's JSON (an Anthropic Messages body, a
    Responses body, or a Chat Completions body). `after_tool_result` is true when the
    request's last message is a tool result (the requests the headline TTFT is taken over).
    `ts` is when the request was sent and `output_ts` when its output was complete, in Unix
    seconds, where the source records them (else None). `fidelity` and `why`: see the module
    docstring; `why` says what differs where the body is approximate.
    """

    protocol: ProtocolName
    body: dict[str, Any]
    output: AssistantOutput
    after_tool_result: bool = False
    ts: float | None = None
    output_ts: float | None = None
    fidelity: Fidelity = "identical"
    why: str | None = None

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
    def protocol(self) -> ProtocolName | None:
        """The protocol of the session's requests (None when it has none)."""
        return self.requests[0].protocol if self.requests else None

    @property
    def num_tool_result_requests(self) -> int:
        return sum(r.after_tool_result for r in self.requests)

    @property
    def num_approximate(self) -> int:
        return sum(r.fidelity != "identical" for r in self.requests)


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
