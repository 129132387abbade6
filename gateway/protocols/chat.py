"""OpenAI Chat Completions (`POST /v1/chat/completions`) request body → `Conversation`.

Mapping:
- The leading run of `system`/`developer` messages → `Conversation.system` blocks;
  later ones → system messages in place.
- `content` as a string, null, or text parts (joined with "\\n"); image parts are refused.
- assistant `reasoning_content` (or `reasoning`) → `reasoning`; `tool_calls` with
  JSON-string `arguments` (or `custom` calls with raw `input`).
- `tool` messages → tool results by `tool_call_id`.
- `stream_options.include_usage`, `chat_template_kwargs.enable_thinking` (vLLM's
  extension) and `top_k` are honoured; `n` must be 1.
"""

from __future__ import annotations

from typing import Any

from gateway.conversation import Conversation, GenerationParams, Message, Tool, ToolCall
from gateway.protocols import (
    BadRequest,
    arr,
    boolean,
    check_tool_results,
    conversation,
    integer,
    join,
    json_arguments,
    nonempty,
    obj,
    opt,
    penalty,
    positive_int,
    probability,
    req,
    seed,
    stop_list,
    string,
    temperature,
    tool_choice_mode,
    top_k,
)

ROLES = ("system", "developer", "user", "assistant", "tool")


def parse_request(body: Any) -> Conversation:
    """Parse a Chat Completions request body; raises `BadRequest`."""
    body = obj(body, "body")
    raw = req(body, "messages", arr)
    nonempty(raw, "messages")
    system: list[str] = []
    messages: list[Message] = []
    for i, m in enumerate(raw):
        msg = _message(m, join("messages", i))
        if msg.role == "system" and not messages:
            system.append(msg.content)
        else:
            messages.append(msg)
    check_tool_results(messages, "messages")
    tools, notes = _tools(opt(body, "tools", arr, default=[]))
    if opt(body, "n", integer, default=1) != 1:
        raise BadRequest("n", "only n=1 is supported")
    return conversation(body, [s for s in system if s], messages, tools, notes, _params(body))


def _content(value: Any, path: str) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    parts = []
    for i, raw in enumerate(arr(value, path)):
        p = join(path, i)
        part = obj(raw, p)
        kind = req(part, "type", string, p)
        if kind != "text":
            raise BadRequest(
                join(p, "type"), f"content parts of type {kind!r} are not supported by this server"
            )
        parts.append(req(part, "text", string, p))
    return "\n".join(parts)


def _message(m: Any, path: str) -> Message:
    m = obj(m, path)
    role = req(m, "role", string, path)
    if role not in ROLES:
        raise BadRequest(join(path, "role"), f"unknown role {role!r}; expected one of {', '.join(ROLES)}")
    content = _content(m.get("content"), join(path, "content"))
    if role == "assistant":
        reasoning = opt(m, "reasoning_content", string, path) or opt(m, "reasoning", string, path, "")
        calls = tuple(
            _call(c, join(join(path, "tool_calls"), i))
            for i, c in enumerate(opt(m, "tool_calls", arr, path, []))
        )
        return Message(role="assistant", content=content, reasoning=reasoning, tool_calls=calls)
    if role == "tool":
        return Message(role="tool", content=content, tool_call_id=req(m, "tool_call_id", string, path))
    return Message(role="system" if role == "developer" else role, content=content)  # type: ignore[arg-type]


def _call(c: Any, path: str) -> ToolCall:
    c = obj(c, path)
    kind = opt(c, "type", string, path, "function")
    call_id = req(c, "id", string, path)
    if kind == "custom":
        custom = req(c, "custom", obj, path)
        p = join(path, "custom")
        return ToolCall(
            id=call_id, name=req(custom, "name", string, p), input=opt(custom, "input", string, p, "")
        )
    if kind != "function":
        raise BadRequest(join(path, "type"), f"unknown tool call type {kind!r}")
    fn = req(c, "function", obj, path)
    p = join(path, "function")
    return ToolCall(
        id=call_id,
        name=req(fn, "name", string, p),
        arguments=json_arguments(opt(fn, "arguments", string, p, ""), join(p, "arguments")),
    )


def _tools(raw: list) -> tuple[list[Tool], list[str]]:
    tools, notes = [], []
    for i, t in enumerate(raw):
        p = join("tools", i)
        t = obj(t, p)
        kind = opt(t, "type", string, p, "function")
        if kind == "function":
            fn = req(t, "function", obj, p)
            q = join(p, "function")
            parameters = opt(fn, "parameters", obj, q, {"type": "object", "properties": {}})
            tools.append(
                Tool(
                    name=req(fn, "name", string, q),
                    description=opt(fn, "description", string, q, ""),
                    parameters=parameters,
                )
            )
        elif kind == "custom":
            c = req(t, "custom", obj, p)
            q = join(p, "custom")
            tools.append(
                Tool(
                    name=req(c, "name", string, q),
                    description=opt(c, "description", string, q, ""),
                    kind="custom",
                    format=opt(c, "format", obj, q),
                )
            )
        else:
            notes.append(f"{p}: tool type {kind!r} ignored (not available on this server)")
    return tools, notes


def _tool_choice(body: dict) -> str:
    choice = tool_choice_mode(body)
    if isinstance(choice, str):
        return choice
    kind = opt(choice, "type", string, "tool_choice", "function")
    if kind not in ("function", "custom"):
        raise BadRequest("tool_choice.type", f"unknown tool_choice type {kind!r}")
    return req(req(choice, kind, obj, "tool_choice"), "name", string, join("tool_choice", kind))


def _params(body: dict) -> GenerationParams:
    for name in ("presence_penalty", "frequency_penalty"):  # range-checked; the engine applies none
        opt(body, name, penalty)
    stream_options = opt(body, "stream_options", obj, default={})
    kwargs = opt(body, "chat_template_kwargs", obj, default={})
    max_tokens = opt(body, "max_completion_tokens", positive_int) or opt(body, "max_tokens", positive_int)
    return GenerationParams(
        max_tokens=max_tokens,
        temperature=opt(body, "temperature", temperature),
        top_p=opt(body, "top_p", probability),
        top_k=opt(body, "top_k", top_k),
        stop=opt(body, "stop", stop_list, default=()),
        seed=opt(body, "seed", seed),
        stream=opt(body, "stream", boolean, default=False),
        include_usage=opt(stream_options, "include_usage", boolean, "stream_options", False),
        tool_choice=_tool_choice(body),
        parallel_tool_calls=opt(body, "parallel_tool_calls", boolean, default=True),
        enable_thinking=opt(kwargs, "enable_thinking", boolean, "chat_template_kwargs", True),
    )
