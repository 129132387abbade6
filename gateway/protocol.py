"""The three generation protocols as one table: how to parse a body, how to encode the
answer (streamed or not), and how its errors are spelled."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from gateway.conversation import Conversation
from gateway.errors import Protocol as ErrorStyle
from gateway.events import Collected
from gateway.parsers.qwen import new_call_id
from gateway.protocols import anthropic, anthropic_out, chat, chat_out, responses, responses_out
from gateway.sse import StreamEncoder


@dataclass(frozen=True)
class Protocol:
    name: Literal["anthropic", "responses", "chat"]  # the trace/record name
    error_style: ErrorStyle
    parse: Callable[[Any], Conversation]
    stream: Callable[[str, str, dict, Conversation], StreamEncoder]
    body: Callable[[Collected, str, str, dict], dict]
    call_id_prefix: str


def _omit_thinking(body: dict) -> bool:
    thinking = body.get("thinking")
    return isinstance(thinking, dict) and thinking.get("display") == "omitted"


ANTHROPIC = Protocol(
    "anthropic", "anthropic", anthropic.parse_request,
    lambda model, handle, body, conv: anthropic_out.AnthropicStream(model, handle, omit_thinking=_omit_thinking(body)),
    lambda c, model, handle, body: anthropic_out.message_body(c, model, handle, omit_thinking=_omit_thinking(body)),
    "toolu_",
)
RESPONSES = Protocol(
    "responses", "openai", responses.parse_request,
    lambda model, handle, body, conv: responses_out.ResponsesStream(model, handle),
    lambda c, model, handle, body: responses_out.response_body(c, model, handle),
    "call_",
)
CHAT = Protocol(
    "chat", "openai", chat.parse_request,
    lambda model, handle, body, conv: chat_out.ChatStream(model, include_usage=conv.params.include_usage),
    lambda c, model, handle, body: chat_out.completion_body(c, model),
    "call_",
)


def call_ids(protocol: Protocol) -> Callable[[], str]:
    return lambda: new_call_id(protocol.call_id_prefix)
