"""The gateway's record format: one JSONL line per generation request and its answer.

`RecordLine` is one line of `ft serve --record DIR`; its `output` is the protocol-neutral answer
(`gateway.conversation.AssistantOutput`), the `ft_forced_output` request field the replay sends back
(notes/CONTRACTS.md).
`adapters.trace` builds recorded sessions on these types.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from gateway.conversation import AssistantOutput

ProtocolName = Literal["anthropic", "responses", "chat"]  # a recording's name of its API

# HTTP path of each protocol's generation endpoint on the gateway.
PROTOCOL_PATHS: dict[str, str] = {
    "anthropic": "/v1/messages",
    "responses": "/v1/responses",
    "chat": "/v1/chat/completions",
}


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

    protocol: ProtocolName
    path: str
    body: dict[str, Any]
    output: AssistantOutput
    timings: Timings = msgspec.field(default_factory=Timings)
    ts: float | None = None
    session: str | None = None
