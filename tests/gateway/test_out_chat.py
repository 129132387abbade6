"""Chat Completions encoder judged by the official `openai` SDK over a loopback server."""

from __future__ import annotations

import json

import openai
import pytest

from gateway.events import ErrorEvent, Finish, TextDelta, collect
from tests.gateway.test_out_support import LoopbackServer, Script, make_app, qwen_events

ARGS = {"command": "echo 'hi' \"there\"", "timeout": 30}
REQUEST = {
    "model": "m",
    "messages": [{"role": "user", "content": "run echo"}],
    "tools": [{"type": "function", "function": {"name": "Bash", "parameters": {"type": "object"}}}],
}


@pytest.fixture(scope="module")
def client():
    with LoopbackServer(make_app()) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)


@pytest.fixture(autouse=True)
def script():
    Script.events, Script.error = qwen_events(), None


def assert_message(message, finish_reason) -> None:
    expected = collect(Script.events)
    assert message.content == "Running it now."
    assert message.model_extra["reasoning_content"] == expected.reasoning
    (call,) = message.tool_calls
    assert (call.id, call.function.name) == (expected.tool_calls[0].id, "Bash")
    assert json.loads(call.function.arguments) == ARGS
    assert finish_reason == "tool_calls"


def test_non_streaming(client):
    completion = client.chat.completions.create(**REQUEST)
    assert_message(completion.choices[0].message, completion.choices[0].finish_reason)
    assert completion.usage.prompt_tokens_details.cached_tokens == 60
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (100, 25)


def test_stream_reassembles_with_usage_chunk(client):
    chunks = list(
        client.chat.completions.create(**REQUEST, stream=True, stream_options={"include_usage": True})
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    reasoning = "".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    calls: dict[int, dict] = {}
    for d in deltas:
        for tc in d.tool_calls or []:
            call = calls.setdefault(tc.index, {"id": tc.id, "name": tc.function.name, "arguments": ""})
            call["arguments"] += tc.function.arguments or ""
    expected = collect(Script.events)
    assert (reasoning, content) == (expected.reasoning, expected.text)
    assert calls[0]["id"] == expected.tool_calls[0].id and json.loads(calls[0]["arguments"]) == ARGS
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens_details.cached_tokens == 60


def test_stream_helper_final_completion(client):
    with client.chat.completions.stream(**REQUEST) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    assert_message(final.choices[0].message, final.choices[0].finish_reason)


def test_no_usage_chunk_unless_asked(client):
    Script.events = [TextDelta("hi"), Finish("length")]
    chunks = list(client.chat.completions.create(**REQUEST, stream=True))
    assert all(c.choices for c in chunks) and chunks[-1].choices[0].finish_reason == "length"


def test_in_stream_error_raises(client):
    Script.events = [TextDelta("hi"), ErrorEvent("context_length_exceeded", "too long")]
    with pytest.raises(openai.APIError) as info:
        list(client.chat.completions.create(**REQUEST, stream=True))
    assert info.value.code == "context_length_exceeded"


def test_encode_stream_drives_an_async_event_source():
    import asyncio

    from gateway.protocols.chat_out import ChatStream
    from gateway.sse import encode_stream

    async def source():
        for ev in [TextDelta("a"), TextDelta("b"), Finish("stop")]:
            yield ev

    async def run():
        return [f async for f in encode_stream(ChatStream("m"), source())]

    frames = asyncio.run(run())
    assert frames[-1] == b"data: [DONE]\n\n" and b'"content":"b"' in frames[2]
