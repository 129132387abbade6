"""Readers on files real agents wrote (../shared, read-only): rebuilt bodies match what was sent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from adapters.readers import detect_format, read_claude, read_codex, read_swe_agent, read_trace
from adapters.trace import AssistantOutput, ToolCall

CLIENTS = Path("../shared/clients")
CODEX = CLIENTS / "codex-0.171.0"
CLAUDE = CLIENTS / "claude-code-2.1.332"
SWE = Path("../shared/traces/swe-agent")

pytestmark = pytest.mark.skipif(
    not CLIENTS.is_dir() or not SWE.is_dir(), reason="run from the repository root"
)


def captured(folder: Path, index: int) -> dict:
    return json.loads((folder / f"{index:03d}.json").read_text())["body"]


def test_codex_rollout_rebuilds_the_input_codex_sent():
    [trace] = read_codex(CODEX / "rollout-tool-roundtrip.jsonl")
    assert trace.source == "codex" and trace.session_id == "01a2282b-8cd3-7682-b697-8b6e0a46dc71"
    assert [r.protocol for r in trace.requests] == ["responses", "responses"]
    for index, request in enumerate(trace.requests):
        sent = captured(CODEX, index)
        # Item for item; the base instructions trimmed as 0.171 sends them, without the item id.
        assert request.body["input"][1:] == sent["input"][1:]
        assert request.body["input"][0] == {k: v for k, v in sent["input"][0].items() if k != "id"}
        assert request.fidelity == "identical"
        keys = (
            "model",
            "stream",
            "tools",
            "tool_choice",
            "parallel_tool_calls",
            "reasoning",
            "store",
            "include",
        )
        for key in (*keys, "prompt_cache_key"):
            assert request.body[key] == sent[key]
    first, second = trace.requests
    assert first.output == AssistantOutput(
        "run echo", None, [ToolCall("exec_command", {"cmd": "echo hi-from-tool"})]
    )
    assert second.output == AssistantOutput(None, "ok", [])
    assert (first.after_tool_result, second.after_tool_result) == (False, True)
    assert first.ts is not None and first.ts < first.output_ts <= second.ts < second.output_ts


def test_claude_transcript_rebuilds_the_exact_bodies_claude_code_sent():
    [trace] = read_claude(CLAUDE / "transcript-tool-roundtrip.jsonl")
    assert trace.meta["rebuilt_from"] == "api-request"
    assert len(trace.requests) == 2
    for index, request in enumerate(trace.requests):
        sent = captured(CLAUDE, index)
        sent.pop("metadata")  # per-device ids: not in the transcript, not needed by the gateway
        assert request.body == sent
    first, second = trace.requests
    assert first.output.reasoning == "I will run echo."
    assert first.output.tool_calls == [
        ToolCall("Bash", {"command": "echo hi-from-tool", "description": "echo"})
    ]
    assert second.output == AssistantOutput(None, "ok", [])
    assert (first.after_tool_result, second.after_tool_result) == (False, True)


def test_claude_transcript_without_api_request_lines_falls_back_to_the_chain(tmp_path):
    source = (CLAUDE / "transcript-tool-roundtrip.jsonl").read_text().splitlines()
    kept = [line for line in source if not json.loads(line)["type"].startswith("api-request")]
    path = tmp_path / "old.jsonl"
    path.write_text("\n".join(kept) + "\n")
    [trace] = read_claude(path)
    assert trace.meta["rebuilt_from"] == "chain"
    first, second = trace.requests
    assert {first.fidelity, second.fidelity} == {"approximate"} and "no api-request lines" in first.why
    # The reminders around the prompt are kept: the messages are what was sent, less the cache marks.
    for request, index in ((first, 0), (second, 1)):
        assert request.body["messages"] == uncached(captured(CLAUDE, index)["messages"])
    assert [m["role"] for m in second.body["messages"]] == ["user", "system", "assistant", "user"]
    assert second.after_tool_result and second.output.content == "ok"


def uncached(messages: list[dict]) -> list[dict]:
    """Messages without cache_control marks, as Claude Code holds them before marking."""
    out = []
    for message in messages:
        content = message["content"]
        if isinstance(content, list):
            content = [{k: v for k, v in block.items() if k != "cache_control"} for block in content]
            if message["role"] == "system" and len(content) == 1:
                content = content[0]["text"]
        out.append({**message, "content": content})
    return out


SWE_FILES = sorted(SWE.glob("*.traj")) if SWE.is_dir() else []


@pytest.mark.parametrize("path", SWE_FILES, ids=[p.stem for p in SWE_FILES])
def test_swe_agent_trajectory_gives_one_chat_request_per_assistant_message(path):
    data = json.loads(path.read_text())
    agent = data["history"][0].get("agent")
    assistants = [m for m in data["history"] if m["role"] == "assistant" and m.get("agent", agent) == agent]
    [trace] = read_swe_agent(path)
    assert len(trace.requests) == len(assistants) > 0
    function_calling = any(m.get("tool_calls") for m in assistants)
    for request, entry in zip(trace.requests, assistants, strict=True):
        body = request.body
        assert request.protocol == "chat" and body["messages"][0]["role"] == "system"
        assert ("tools" in body) == function_calling == (request.fidelity == "approximate")
        assert all(set(m) <= {"role", "content", "tool_calls", "tool_call_id"} for m in body["messages"])
        assert all("tool_call_id" in m for m in body["messages"] if m["role"] == "tool")
        assert [c.name for c in request.output.tool_calls] == [
            c["function"]["name"] for c in entry.get("tool_calls") or []
        ]
    assert sum(r.after_tool_result for r in trace.requests) == len(trace.requests) - 1


def test_swe_agent_function_calling_tools_are_inferred_from_the_calls():
    [trace] = read_swe_agent(SWE / "function-calling-simple.traj")
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in trace.requests[0].body["tools"]}
    assert tools["open"] == {
        "type": "object",
        "properties": {"path": {"type": "string"}},
        "required": ["path"],
    }
    assert set(tools) >= {"find_file", "open", "edit", "submit"}


def test_formats_are_detected_and_folders_read_whole():
    assert detect_format(CODEX / "rollout-tool-roundtrip.jsonl") == "codex"
    assert detect_format(CLAUDE / "transcript-tool-roundtrip.jsonl") == "claude"
    assert detect_format(SWE / "pydicom-1458.traj") == "swe-agent"
    traces = read_trace(SWE)
    assert sorted(t.session_id for t in traces) == sorted(p.stem for p in SWE_FILES)
