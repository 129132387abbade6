"""Conversation structs: msgspec round trip and helpers."""

from __future__ import annotations

import msgspec

from gateway.conversation import AssistantOutput, Conversation, Message, Tool, ToolCall


def test_msgspec_round_trip():
    conv = Conversation(
        system=("a", "b"),
        tools=(Tool(name="f", parameters={"type": "object"}), Tool(name="p", kind="custom")),
        messages=(
            Message(role="user", content="q"),
            Message(
                role="assistant", reasoning="r", tool_calls=(ToolCall(id="1", name="f", arguments={"x": 1}),)
            ),
            Message(role="tool", tool_call_id="1", content="out"),
        ),
        forced_output=AssistantOutput(content="c"),
    )
    assert msgspec.json.decode(msgspec.json.encode(conv), type=Conversation) == conv
    assert conv.system_text == "a\nb" and conv.tool("p").kind == "custom" and conv.tool("zz") is None


def test_forced_output_to_message():
    forced = AssistantOutput(tool_calls=[ToolCall(name="f"), ToolCall(name="patch", input="raw")])
    m = forced.to_message()
    assert m.role == "assistant" and m.reasoning == "" and m.content == ""
    assert m.tool_calls[0].arguments == {} and m.tool_calls[1].is_custom
    assert len({c.id for c in m.tool_calls}) == 2
