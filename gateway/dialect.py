"""The three generation APIs as one table: how to parse a body, how to encode the
answer (streamed or not), and how its errors are spelled.

Each row is an `ApiDialect`: Anthropic Messages, OpenAI Responses and Chat Completions carry
the same conversation in different shapes, so they are dialects of one API (the name keeps
clear of `typing.Protocol`, of the `gateway.protocols` package of parsers and encoders a row
points into, and of `record.ProtocolName`, the name a row is recorded under)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from gateway.conversation import Conversation
from gateway.errors import ErrorStyle
from gateway.events import Collected
from gateway.parsers.qwen import new_call_id
from gateway.protocols import anthropic, anthropic_out, chat, chat_out, responses, responses_out
from gateway.sse import StreamEncoder


@dataclass(frozen=True)
class ApiDialect:
    name: Literal["anthropic", "responses", "chat"]  # the trace/record name
    error_style: ErrorStyle
    parse: Callable[[Any], Conversation]
    stream: Callable[[str, str, dict, Conversation], StreamEncoder]
    body: Callable[[Collected, str, str, dict], dict]
    call_id_prefix: str


def _omit_thinking(body: dict) -> bool:
    thinking = body.get("thinking")
    return isinstance(thinking, dict) and thinking.get("display") == "omitted"


ANTHROPIC = ApiDialect(
    "anthropic", "anthropic", anthropic.parse_request,
    lambda model, handle, body, conv: anthropic_out.AnthropicStream(model, handle, omit_thinking=_omit_thinking(body)),
    lambda c, model, handle, body: anthropic_out.message_body(c, model, handle, omit_thinking=_omit_thinking(body)),
    "toolu_",
)
RESPONSES = ApiDialect(
    "responses", "openai", responses.parse_request,
    lambda model, handle, body, conv: responses_out.ResponsesStream(model, handle),
    lambda c, model, handle, body: responses_out.response_body(c, model, handle),
    "call_",
)
CHAT = ApiDialect(
    "chat", "openai", chat.parse_request,
    lambda model, handle, body, conv: chat_out.ChatStream(model, include_usage=conv.params.include_usage),
    lambda c, model, handle, body: chat_out.completion_body(c, model),
    "call_",
)


def call_ids(protocol: ApiDialect) -> Callable[[], str]:
    return lambda: new_call_id(protocol.call_id_prefix)
