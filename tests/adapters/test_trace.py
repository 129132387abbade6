"""The Trace model and RecordLine: what readers produce, the recorder writes and the replay sends."""

from __future__ import annotations

import msgspec

from adapters.trace import (
    AssistantOutput,
    RecordLine,
    Timings,
    ToolCall,
    TraceRequest,
    encode_jsonl,
    is_tool_result_last,
)


def test_replay_body_adds_forced_output_without_touching_the_body():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    output = AssistantOutput("think", None, [ToolCall("shell", {"command": "ls"})])
    request = TraceRequest("chat", body, output)
    sent = request.replay_body()
    assert sent["ft_forced_output"] == {
        "reasoning": "think",
        "content": None,
        "tool_calls": [{"name": "shell", "arguments": {"command": "ls"}}],
    }
    assert "ft_forced_output" not in body
    assert request.path == "/v1/chat/completions"


def test_record_line_round_trips_through_jsonl():
    line = RecordLine(
        "anthropic",
        "/v1/messages?beta=true",
        {"model": "m", "messages": []},
        AssistantOutput(content="ok"),
        Timings(ttft_ms=12.5, total_ms=40.0, prefill_tokens=100, cached_tokens=900),
        ts=1.5,
        session="abc",
    )
    decoded = msgspec.json.decode(encode_jsonl([line]).strip(), type=RecordLine)
    assert decoded == line
    minimal = msgspec.json.decode(
        b'{"protocol":"chat","path":"/v1/chat/completions","body":{},"output":{}}', type=RecordLine
    )
    assert minimal.output == AssistantOutput() and minimal.timings == Timings() and minimal.session is None


def test_tool_result_last_per_protocol():
    tool_result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "x"}]}
    assert is_tool_result_last("anthropic", {"messages": [tool_result]})
    assert not is_tool_result_last("anthropic", {"messages": [{"role": "user", "content": "x"}]})
    assert is_tool_result_last(
        "responses", {"input": [{"type": "function_call_output", "call_id": "c", "output": ""}]}
    )
    assert not is_tool_result_last("responses", {"input": "just text"})
    assert is_tool_result_last("chat", {"messages": [{"role": "tool", "tool_call_id": "c", "content": ""}]})
    assert not is_tool_result_last("chat", {"messages": []})
