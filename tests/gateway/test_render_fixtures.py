"""Real sessions as (name, Conversation) pairs for the renderer tests.

Captured client requests (../shared/clients) through their protocol adapter, and every
turn of every SWE-agent trajectory (../shared/traces/swe-agent) as a Chat Completions
request: the history before each assistant message. Missing folders give no cases.
"""

from __future__ import annotations

import json
from pathlib import Path

from gateway.conversation import Conversation
from gateway.protocols import anthropic, chat, responses

ROOT = Path(__file__).resolve().parents[2]
CLIENTS = ROOT.parent / "shared" / "clients"
TRACES = ROOT.parent / "shared" / "traces" / "swe-agent"
ADAPTERS = {"/v1/messages": anthropic, "/v1/responses": responses, "/v1/chat/completions": chat}


def client_requests() -> list[tuple[str, dict, dict]]:
    """(name, path-less request, body) of every captured request."""
    out = []
    for f in sorted(CLIENTS.glob("*/*.json")):
        d = json.loads(f.read_text())
        out.append((f"{f.parent.name}/{f.name}", d["path"].split("?")[0], d["body"]))
    return out


def client_conversations() -> list[tuple[str, Conversation]]:
    return [(name, ADAPTERS[path].parse_request(body)) for name, path, body in client_requests()]


def _chat_message(m: dict) -> list[dict]:
    if m["role"] == "tool":
        return [{"role": "tool", "tool_call_id": i, "content": m["content"]} for i in m["tool_call_ids"]]
    out = {"role": m["role"], "content": m["content"]}
    if m.get("tool_calls"):
        out["tool_calls"] = m["tool_calls"]
    return [out]


def trajectory_bodies(path: Path) -> list[dict]:
    """One Chat Completions body per assistant turn of a trajectory."""
    history = json.loads(path.read_text())["history"]
    messages = [x for m in history for x in _chat_message(m)]
    names = sorted({c["function"]["name"] for m in messages for c in m.get("tool_calls", [])})
    tools = [
        {"type": "function", "function": {"name": n, "parameters": {"type": "object", "properties": {}}}}
        for n in names
    ]
    bodies = []
    for k, m in enumerate(messages):
        if m["role"] == "assistant":
            bodies.append({"messages": messages[:k], "tools": tools} if tools else {"messages": messages[:k]})
    bodies.append({"messages": messages, "tools": tools} if tools else {"messages": messages})
    return bodies


def trajectory_conversations() -> list[tuple[str, list[Conversation]]]:
    """(trajectory name, its turns in order)."""
    return [
        (f.name, [chat.parse_request(b) for b in trajectory_bodies(f)]) for f in sorted(TRACES.glob("*.traj"))
    ]


def all_conversations() -> list[tuple[str, Conversation]]:
    out = client_conversations()
    for name, turns in trajectory_conversations():
        out += [(f"{name}#{k}", c) for k, c in enumerate(turns)]
    return out


def test_every_captured_request_parses():
    convs = client_conversations()
    if not convs:
        import pytest

        pytest.skip("../shared/clients is absent")
    assert all(c.messages for _, c in convs)


def test_trajectories_become_growing_turns():
    for _, turns in trajectory_conversations():
        for a, b in zip(turns, turns[1:], strict=False):
            assert b.messages[: len(a.messages)] == a.messages
