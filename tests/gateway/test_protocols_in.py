"""Protocol adapters on real captured requests, on bad inputs, and on arbitrary JSON."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.conversation import Conversation
from gateway.protocols import BadRequest, anthropic, chat, responses
from tests.gateway.test_render_fixtures import CLIENTS

ADAPTERS = [anthropic, responses, chat]


def captured(folder: str, name: str) -> dict:
    path = CLIENTS / folder / name
    if not path.is_file():
        pytest.skip(f"{path} is absent")
    return json.loads(path.read_text())["body"]


def test_claude_code_roundtrip_request():
    conv = anthropic.parse_request(captured("claude-code-2.1.332", "001.json"))
    assert [m.role for m in conv.messages] == ["user", "system", "assistant", "tool"]
    assert conv.system[0].startswith("You are a Claude agent")
    assistant = conv.messages[2]
    assert assistant.reasoning == "I will run echo." and assistant.memo_handle == "sig-abc"
    assert assistant.tool_calls[0].arguments == {"command": "echo hi-from-tool", "description": "echo"}
    assert conv.messages[3].tool_call_id == "toolu_1" and conv.messages[3].content == "hi-from-tool"
    assert conv.params.stream and conv.params.max_tokens == 32000 and conv.params.enable_thinking
    assert len(conv.tools) == 12 and conv.tool("Bash").parameters["required"] == ["command"]


def test_claude_code_system_message_as_string_or_blocks_is_the_same():
    a = anthropic.parse_request(captured("claude-code-2.1.332", "000.json"))
    b = anthropic.parse_request(captured("claude-code-2.1.332", "001.json"))
    assert a.messages[:2] == b.messages[:2]


def test_codex_roundtrip_request():
    conv = responses.parse_request(captured("codex-0.171.0", "001.json"))
    assert len(conv.system) == 2 and conv.system[0].startswith("You are a coding agent")
    assert [m.role for m in conv.messages] == ["user", "user", "assistant", "tool"]
    assistant = conv.messages[2]
    assert assistant.memo_handle == "opaque-1" and assistant.reasoning == "run echo"
    assert assistant.tool_calls[0].arguments == {"cmd": "echo hi-from-tool"}
    assert "Wall time: 0.0000 seconds" in conv.messages[3].content
    assert any("web_search" in n for n in conv.notes)
    names = [t.name for t in conv.tools]
    assert "spawn_agent" in names and conv.tool("spawn_agent").namespace == "multi_agent_v1"


def test_opencode_requests():
    title = chat.parse_request(captured("opencode-1.18.33", "000.json"))
    assert not title.tools and title.params.include_usage and title.params.max_tokens == 4096
    conv = chat.parse_request(captured("opencode-1.18.33", "002.json"))
    assert [m.role for m in conv.messages] == ["user", "assistant", "tool"]
    assert conv.messages[1].reasoning == "I will run echo."
    assert conv.messages[1].tool_calls[0].arguments["command"] == "echo hi-from-tool"


def test_custom_tools_and_calls_from_codex():
    body = {
        "input": [
            {"type": "message", "role": "user", "content": "patch it"},
            {
                "type": "custom_tool_call",
                "call_id": "c1",
                "name": "apply_patch",
                "input": "*** Begin Patch\n",
            },
            {"type": "custom_tool_call_output", "call_id": "c1", "output": "ok"},
        ],
        "tools": [
            {
                "type": "custom",
                "name": "apply_patch",
                "description": "Patch files",
                "format": {"type": "grammar"},
            }
        ],
    }
    conv = responses.parse_request(body)
    assert conv.tools[0].kind == "custom" and conv.tools[0].format == {"type": "grammar"}
    call = conv.messages[1].tool_calls[0]
    assert call.is_custom and call.input == "*** Begin Patch\n"


def test_responses_groups_output_items_into_turns():
    body = {
        "instructions": "be brief",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
            {
                "type": "reasoning",
                "summary": [{"type": "summary_text", "text": "r1"}],
                "encrypted_content": "h1",
            },
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "calling"}]},
            {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
            {"type": "function_call", "call_id": "b", "name": "f", "arguments": '{"x": 1}'},
            {"type": "function_call_output", "call_id": "a", "output": "A"},
            {"type": "function_call_output", "call_id": "b", "output": "B"},
            {"type": "reasoning", "summary": [], "encrypted_content": "h2"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "done"}]},
        ],
    }
    conv = responses.parse_request(body)
    assert conv.system == ("be brief",)
    assert [m.role for m in conv.messages] == ["user", "assistant", "tool", "tool", "assistant"]
    first = conv.messages[1]
    assert (first.reasoning, first.content, first.memo_handle) == ("r1", "calling", "h1")
    assert [c.id for c in first.tool_calls] == ["a", "b"]
    assert conv.messages[4].memo_handle == "h2" and conv.messages[4].content == "done"


def test_anthropic_tool_results_before_text_in_one_user_message():
    body = {
        "messages": [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t1",
                        "content": [{"type": "text", "text": "out"}],
                    },
                    {"type": "text", "text": "<system-reminder>x</system-reminder>"},
                ],
            },
        ],
        "thinking": {"type": "disabled"},
        "tools": [{"type": "web_search_20250305", "name": "web_search"}],
    }
    conv = anthropic.parse_request(body)
    assert [m.role for m in conv.messages] == ["user", "assistant", "tool", "user"]
    assert conv.messages[2].content == "out" and not conv.params.enable_thinking
    assert conv.notes and not conv.tools


BAD = [
    (anthropic, {"messages": []}, "messages"),
    (anthropic, {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    (
        anthropic,
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        "messages[0].content[0].type",
    ),
    (
        anthropic,
        {"messages": [{"role": "user", "content": [{"type": "wat"}]}]},
        "messages[0].content[0].type",
    ),
    (
        anthropic,
        {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope"}]}]},
        "messages[0]",
    ),
    (anthropic, {"messages": [{"role": "user", "content": "x"}], "max_tokens": "9"}, "max_tokens"),
    (
        anthropic,
        {"messages": [{"role": "user", "content": "x"}], "system": [{"type": "image"}]},
        "system[0].type",
    ),
    (responses, {"input": []}, "input"),
    (responses, {"input": [{"type": "function_call_output", "call_id": "x", "output": "o"}]}, "input[0]"),
    (
        responses,
        {"input": [{"type": "function_call", "call_id": "x", "name": "f", "arguments": "{"}]},
        "input[0].arguments",
    ),
    (
        responses,
        {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
        "input[0].content[0].type",
    ),
    (responses, {"input": "hi", "previous_response_id": "r"}, "previous_response_id"),
    (chat, {"messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
    (chat, {"messages": [{"role": "function", "content": "x"}]}, "messages[0].role"),
    (chat, {"messages": [{"role": "tool", "tool_call_id": "z", "content": "x"}]}, "messages[0]"),
    (
        chat,
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        "messages[0].content[0].type",
    ),
    (chat, {"messages": "hi"}, "messages"),
    (chat, [], "body"),
]


@pytest.mark.parametrize(
    "adapter,body,field", BAD, ids=[f"{a.__name__.split('.')[-1]}:{f}" for a, _, f in BAD]
)
def test_bad_requests_name_the_field(adapter, body, field):
    with pytest.raises(BadRequest) as e:
        adapter.parse_request(body)
    assert e.value.field == field


def test_forced_output_is_parsed_by_every_protocol():
    forced = {"reasoning": "r", "content": "c", "tool_calls": [{"name": "f", "arguments": {"a": 1}}]}
    bodies = [
        (anthropic, {"messages": [{"role": "user", "content": "x"}]}),
        (responses, {"input": "x"}),
        (chat, {"messages": [{"role": "user", "content": "x"}]}),
    ]
    for adapter, body in bodies:
        conv = adapter.parse_request(body | {"ft_forced_output": forced})
        message = conv.forced_output.to_message()
        assert (message.reasoning, message.content, message.tool_calls[0].arguments) == ("r", "c", {"a": 1})


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
KEYS = (
    "role content type text messages input tools tool_calls id call_id name arguments tool_use_id output "
    "system function tool_call_id summary thinking"
).split()
keys = st.sampled_from(KEYS)
shaped = st.recursive(
    json_values,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=5),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=shaped, adapter=st.sampled_from(ADAPTERS))
def test_any_json_gives_a_conversation_or_bad_request(body, adapter):
    try:
        conv = adapter.parse_request(body)
    except BadRequest as e:
        assert isinstance(e.field, str) and e.message
    else:
        assert isinstance(conv, Conversation) and conv.messages


def _paths(value, prefix=()):
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, prefix + (i,))


def _replace(value, path, new):
    if not path:
        return new
    copy = dict(value) if isinstance(value, dict) else list(value)
    copy[path[0]] = _replace(value[path[0]], path[1:], new)
    return copy


SEEDS = [
    (anthropic, ("claude-code-2.1.332", "001.json")),
    (responses, ("codex-0.171.0", "001.json")),
    (chat, ("opencode-1.18.33", "002.json")),
]


@pytest.mark.parametrize("adapter,seed", SEEDS, ids=["anthropic", "responses", "chat"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_mutated_real_requests_never_crash(adapter, seed, data):
    body = captured(*seed)
    paths = list(_paths(body))
    path = data.draw(st.sampled_from(paths))
    mutated = _replace(body, path, data.draw(json_values))
    try:
        adapter.parse_request(mutated)
    except BadRequest as e:
        assert e.field
