"""Conversation → the Hugging Face chat-template inputs (`messages`, `tools`).

This is the form every chat template reads: OpenAI-style message dicts with
`reasoning_content` and `tool_calls[].function.arguments` as a dict, and tools as
`{"type": "function", "function": {...}}`. Custom (free-form) tools become a function
with one string parameter, `input`, holding the raw text.
"""

from __future__ import annotations

from gateway.conversation import Conversation, Message, Tool, ToolCall

CUSTOM_INPUT = "input"


def tool_schema(tool: Tool) -> dict:
    """The tool as a chat template sees it."""
    fn: dict = {"name": tool.name}
    if tool.description:
        fn["description"] = tool.description
    if tool.kind == "custom":
        fn["parameters"] = {
            "type": "object",
            "properties": {CUSTOM_INPUT: {"type": "string", "description": "The raw free-form input."}},
            "required": [CUSTOM_INPUT],
        }
    else:
        fn["parameters"] = tool.parameters
    return {"type": "function", "function": fn}


def call_arguments(call: ToolCall) -> dict:
    """Arguments as rendered: custom tools' raw input becomes `{"input": raw}`."""
    if call.input is not None:
        return {CUSTOM_INPUT: call.input}
    return call.arguments or {}


def message_dict(m: Message) -> dict:
    d: dict = {"role": m.role, "content": m.content}
    if m.role == "assistant":
        if m.reasoning:
            d["reasoning_content"] = m.reasoning
        if m.tool_calls:
            d["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": call_arguments(c)}}
                for c in m.tool_calls
            ]
    elif m.role == "tool":
        d["tool_call_id"] = m.tool_call_id
    return d


def template_inputs(conv: Conversation) -> tuple[list[dict], list[dict] | None]:
    """(`messages`, `tools`) for a chat template; the system blocks become messages[0]."""
    messages = [{"role": "system", "content": conv.system_text}] if conv.system else []
    messages += [message_dict(m) for m in conv.messages]
    return messages, [tool_schema(t) for t in conv.tools] or None
