"""Anthropic encoder judged by the official `anthropic` SDK over a loopback server."""

from __future__ import annotations

import anthropic
import pytest

from gateway.events import ErrorEvent, Finish, TextDelta, Usage, collect
from tests.gateway.test_out_support import HANDLE, LoopbackServer, Script, make_app, qwen_events

ARGS = {"command": "echo 'hi' \"there\"", "timeout": 30}
REQUEST = {
    "model": "m",
    "max_tokens": 1000,
    "messages": [{"role": "user", "content": "run echo"}],
    "tools": [{"name": "Bash", "input_schema": {"type": "object"}}],
}


@pytest.fixture(scope="module")
def client():
    with LoopbackServer(make_app()) as url:
        yield anthropic.Anthropic(base_url=url, api_key="k", max_retries=0)


@pytest.fixture(autouse=True)
def script():
    Script.events, Script.error = qwen_events(prefix="toolu_"), None


def assert_message(message, events) -> None:
    thinking, text, tool = message.content
    expected = collect(events)
    assert (thinking.type, thinking.thinking, thinking.signature) == ("thinking", expected.reasoning, HANDLE)
    assert (text.type, text.text) == ("text", "Running it now.")
    assert (tool.type, tool.name, tool.input) == ("tool_use", "Bash", ARGS)
    assert tool.id == expected.tool_calls[0].id and tool.id.startswith("toolu_")
    assert message.stop_reason == "tool_use"
    assert message.usage.input_tokens == 40 and message.usage.cache_read_input_tokens == 60
    assert message.usage.output_tokens == 25


def test_non_streaming(client):
    assert_message(client.messages.create(**REQUEST), Script.events)


def test_stream_helper_accumulates_the_same_message(client):
    with client.messages.stream(**REQUEST) as stream:
        kinds = [e.type for e in stream]
        message = stream.get_final_message()
    assert_message(message, Script.events)
    assert kinds.count("thinking") > 1 and kinds.count("text") > 1 and "signature" in kinds


def test_raw_stream_order_and_start_usage(client):
    events = list(client.messages.create(**REQUEST, stream=True))
    types = [e.type for e in events]
    assert types[0] == "message_start" and types[1] == "content_block_start"
    assert types[-2:] == ["message_delta", "message_stop"]
    start = events[0].message
    assert start.usage.input_tokens == 40 and start.usage.cache_read_input_tokens == 60
    assert [e.content_block.type for e in events if e.type == "content_block_start"] == [
        "thinking",
        "text",
        "tool_use",
    ]
    partial = "".join(
        e.delta.partial_json
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    )
    assert partial == collect(Script.events).tool_calls[0].wire_arguments


def test_length_and_plain_end_turn(client):
    Script.events = [TextDelta("partial"), Finish("length"), Usage(5, output_tokens=3)]
    assert client.messages.create(**REQUEST).stop_reason == "max_tokens"
    Script.events = [TextDelta("done"), Finish("stop", stop_sequence="###")]
    message = client.messages.create(**REQUEST)
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "###")
    Script.events = [TextDelta("hello"), Finish("stop")]
    with client.messages.stream(**REQUEST) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "end_turn" and final.content[0].text == "hello"


def test_in_stream_error_raises_in_sdk(client):
    Script.events = [TextDelta("hi"), ErrorEvent("overloaded", "busy")]
    with pytest.raises(anthropic.APIStatusError) as info:
        with client.messages.stream(**REQUEST) as stream:
            stream.get_final_message()
    assert info.value.body["error"]["type"] == "overloaded_error"


def test_omitted_thinking_keeps_the_signature():
    from gateway.protocols.anthropic_out import AnthropicStream, message_body

    stream = AnthropicStream("m", HANDLE, omit_thinking=True)
    frames = b"".join(f for ev in Script.events for f in stream.feed(ev)) + b"".join(stream.end())
    assert b"thinking_delta" not in frames and b'"signature":"memo-7f3a"' in frames
    body = message_body(collect(Script.events), "m", HANDLE, omit_thinking=True)
    assert body["content"][0] == {"type": "thinking", "thinking": "", "signature": HANDLE}
