"""Responses encoder judged by the official `openai` SDK over a loopback server."""

from __future__ import annotations

import json

import openai
import pytest

from gateway.events import ErrorEvent, Finish, TextDelta, collect
from tests.gateway.test_out_support import HANDLE, LoopbackServer, Script, make_app, qwen_events

ARGS = {"command": "echo 'hi' \"there\"", "timeout": 30}
REQUEST = {
    "model": "m",
    "input": "run echo",
    "tools": [{"type": "function", "name": "Bash", "parameters": {"type": "object"}, "strict": False}],
}
PATCH = "*** Begin Patch\n*** Add File: a.txt\n+hi\n*** End Patch"


@pytest.fixture(scope="module")
def client():
    with LoopbackServer(make_app()) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)


@pytest.fixture(autouse=True)
def script():
    Script.events, Script.error, Script.reasoning_mode = qwen_events(), None, "summary"


def assert_output(output, events, mode="summary") -> None:
    reasoning, message, call = output
    expected = collect(events)
    assert reasoning.type == "reasoning" and reasoning.encrypted_content == HANDLE
    if mode == "summary":
        assert [s.text for s in reasoning.summary] == [expected.reasoning]
    else:
        assert [c.text for c in reasoning.content] == [expected.reasoning]
    assert message.type == "message" and message.content[0].text == "Running it now."
    assert (call.type, call.name, call.call_id) == ("function_call", "Bash", expected.tool_calls[0].id)
    assert json.loads(call.arguments) == ARGS


def test_non_streaming(client):
    response = client.responses.create(**REQUEST)
    assert_output(response.output, Script.events)
    assert response.status == "completed"
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (100, 25, 125)
    assert (
        usage.input_tokens_details.cached_tokens == 60 and usage.output_tokens_details.reasoning_tokens == 10
    )


@pytest.mark.parametrize("mode", ["summary", "raw"])
def test_raw_stream_is_well_formed_and_reassembles(client, mode):
    Script.reasoning_mode = mode
    events = list(client.responses.create(**REQUEST, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type == "response.completed"
    added, done, text = set(), [], {}
    for e in events:
        if e.type == "response.output_item.added":
            added.add(e.output_index)
        elif e.type == "response.output_item.done":
            done.append(e.item)
        elif e.type.endswith(".delta"):
            assert e.output_index in added and e.output_index not in {d for d in range(len(done))}
            text[e.type] = text.get(e.type, "") + e.delta
    assert_output(done, Script.events, mode)
    assert_output(events[-1].response.output, Script.events, mode)
    expected = collect(Script.events)
    kind = "response.reasoning_summary_text.delta" if mode == "summary" else "response.reasoning_text.delta"
    assert text[kind] == expected.reasoning
    assert text["response.output_text.delta"] == expected.text
    assert text["response.function_call_arguments.delta"] == expected.tool_calls[0].wire_arguments


def test_stream_helper_final_response(client):
    with client.responses.stream(**REQUEST) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert deltas == "Running it now."
    assert_output(final.output, Script.events)
    assert final.usage.input_tokens_details.cached_tokens == 60


def test_custom_tool_call(client):
    text = f"ok\n</think>\n\n<tool_call>\n<function=apply_patch>\n<parameter=input>\n{PATCH}\n</parameter>\n</function>\n</tool_call>"
    Script.events = qwen_events(text, custom=("apply_patch",))
    events = list(client.responses.create(**REQUEST, stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.custom_tool_call_input.delta")
    item = [e.item for e in events if e.type == "response.output_item.done"][-1]
    assert (item.type, item.name, item.input, deltas) == ("custom_tool_call", "apply_patch", PATCH, PATCH)
    assert client.responses.create(**REQUEST).output[-1].input == PATCH


def test_context_length_failure(client):
    Script.events = [ErrorEvent("context_length_exceeded", "too long")]
    events = list(client.responses.create(**REQUEST, stream=True))
    assert events[-1].type == "response.failed"
    assert events[-1].response.error.code == "context_length_exceeded"


def test_length_is_incomplete(client):
    Script.events = [TextDelta("partial"), Finish("length")]
    events = list(client.responses.create(**REQUEST, stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert client.responses.create(**REQUEST).status == "incomplete"
