"""Every frame the encoders write validates against the SDKs' own pydantic types
(the SDK clients themselves only `construct`, which would let missing fields pass)."""

from __future__ import annotations

import json
import typing

import httpx
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent

from gateway.events import ErrorEvent, Finish, TextDelta
from tests.gateway.test_out_support import LoopbackServer, Script, make_app, qwen_events


@pytest.fixture(scope="module")
def url():
    with LoopbackServer(make_app()) as base:
        yield base


def by_type(union) -> dict:
    """Map each event type literal of a union to its pydantic model (precise errors)."""
    args = typing.get_args(union)
    args = typing.get_args(args[0]) if len(args) and typing.get_origin(args[0]) is typing.Union else args
    return {typing.get_args(m.model_fields["type"].annotation)[0]: m for m in args}


def frames(url: str, path: str, body: dict) -> list[tuple[str | None, str]]:
    """(event name, data) of each SSE frame, parsed by hand."""
    text = httpx.post(url + path, json=body | {"stream": True}).text
    assert text.endswith("\n\n")
    out = []
    for block in text.strip("\n").split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.split("\n"))
        out.append((fields.get("event"), fields["data"]))
    return out


SCRIPTS = {
    "tool": lambda: qwen_events(custom=()),
    "custom": lambda: qwen_events(
        "x\n</think>\n\n<tool_call>\n<function=apply_patch>\n<parameter=input>\np\n</parameter>\n</function>\n</tool_call>",
        custom=("apply_patch",),
    ),
    "length": lambda: [TextDelta("a"), Finish("length")],
    "error": lambda: [TextDelta("a"), ErrorEvent("context_length_exceeded", "too long")],
}


@pytest.fixture(params=list(SCRIPTS))
def script(request):
    Script.events, Script.error = SCRIPTS[request.param](), None
    return request.param


def test_anthropic_frames(url, script):
    models = by_type(RawMessageStreamEvent)
    for event, data in frames(url, "/v1/messages", {}):
        payload = json.loads(data)
        assert payload["type"] == event
        if event not in ("ping", "error"):
            models[event].model_validate(payload)
    if script != "error":
        Message.model_validate(httpx.post(url + "/v1/messages", json={}).json())


def test_responses_frames(url, script):
    models = by_type(ResponseStreamEvent)
    for event, data in frames(url, "/v1/responses", {}):
        payload = json.loads(data)
        assert payload["type"] == event
        if event == "response.failed":  # Codex needs this code; the SDK's Literal lacks it
            assert payload["response"]["error"]["code"] == "context_length_exceeded"
            payload["response"]["error"]["code"] = "server_error"
        models[event].model_validate(payload)
    if script != "error":
        Response.model_validate(httpx.post(url + "/v1/responses", json={}).json())


def test_chat_frames(url, script):
    body = {"stream_options": {"include_usage": True}}
    got = frames(url, "/v1/chat/completions", body)
    assert got[-1] == (None, "[DONE]")
    for event, data in got[:-1]:
        payload = json.loads(data)
        assert event is None
        if "error" not in payload:
            ChatCompletionChunk.model_validate(payload)
    if script != "error":
        ChatCompletion.model_validate(httpx.post(url + "/v1/chat/completions", json={}).json())
