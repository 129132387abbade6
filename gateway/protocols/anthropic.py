"""Anthropic Messages (`POST /v1/messages`) request body → `Conversation`.

Mapping:
- `system` (string or text blocks) → `Conversation.system` blocks, one per block.
- `messages[i]` with `role: "system"` (Claude Code sends them mid-conversation) → a
  system `Message` in place.
- user content: `text` blocks join with "\\n" into one user message; each
  `tool_result` block becomes a `tool` message (in block order, so results that
  precede the text come first, as Claude Code sends them).
- assistant content: `thinking` blocks → `reasoning` (joined with "\\n"), the last
  `signature` → `memo_handle`; `text` → `content`; `tool_use` → tool calls.
  `redacted_thinking` is accepted and dropped (its data is not ours to read).
- `thinking.type == "disabled"` → `enable_thinking=False`; `output_config`,
  `context_management`, `metadata`, `cache_control`, `service_tier` are ignored.
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
    join,
    nonempty,
    obj,
    opt,
    positive_int,
    probability,
    req,
    stop_list,
    string,
    temperature,
    top_k,
)

ROLES = ("user", "assistant", "system")
UNSUPPORTED_BLOCKS = ("image", "document", "search_result", "container_upload")


def parse_request(body: Any) -> Conversation:
    """Parse an Anthropic Messages request body; raises `BadRequest`."""
    body = obj(body, "body")
    raw_messages = req(body, "messages", arr)
    nonempty(raw_messages, "messages")
    messages: list[Message] = []
    for i, m in enumerate(raw_messages):
        messages.extend(_message(m, join("messages", i)))
    check_tool_results(messages, "messages")
    tools, notes = _tools(opt(body, "tools", arr, default=[]))
    return conversation(body, _system(body.get("system")), messages, tools, notes, _params(body))


def _system(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,) if value else ()
    blocks = []
    for i, b in enumerate(arr(value, "system")):
        p = join("system", i)
        b = obj(b, p)
        if b.get("type") != "text":
            raise BadRequest(join(p, "type"), "system blocks must be of type 'text'")
        blocks.append(req(b, "text", string, p))
    return tuple(blocks)


def _message(m: Any, path: str) -> list[Message]:
    m = obj(m, path)
    role = req(m, "role", string, path)
    if role not in ROLES:
        raise BadRequest(join(path, "role"), f"unknown role {role!r}; expected one of {', '.join(ROLES)}")
    content = m.get("content")
    blocks = [{"type": "text", "text": content}] if isinstance(content, str) else req(m, "content", arr, path)
    cpath = join(path, "content")
    if role == "assistant":
        return [_assistant(blocks, cpath)]
    return _user(blocks, cpath, role)


def _block(b: Any, path: str) -> tuple[dict, str]:
    b = obj(b, path)
    kind = req(b, "type", string, path)
    if kind in UNSUPPORTED_BLOCKS:
        raise BadRequest(
            join(path, "type"), f"content blocks of type {kind!r} are not supported by this server"
        )
    return b, kind


def _user(blocks: list, path: str, role: str) -> list[Message]:
    out: list[Message] = []
    texts: list[str] = []
    for i, raw in enumerate(blocks):
        p = join(path, i)
        b, kind = _block(raw, p)
        if kind == "text":
            texts.append(req(b, "text", string, p))
        elif kind == "tool_result" and role == "user":
            out.append(_tool_result(b, p))
        else:
            raise BadRequest(join(p, "type"), f"unexpected content block type {kind!r} in a {role} message")
    if texts or not out:
        out.append(Message(role=role, content="\n".join(texts)))  # type: ignore[arg-type]
    return out


def _tool_result(b: dict, path: str) -> Message:
    content = b.get("content")
    if content is None or isinstance(content, str):
        text = content or ""
    else:
        parts = []
        for i, raw in enumerate(arr(content, join(path, "content"))):
            p = join(join(path, "content"), i)
            part, kind = _block(raw, p)
            if kind != "text":
                raise BadRequest(join(p, "type"), f"unexpected tool_result content type {kind!r}")
            parts.append(req(part, "text", string, p))
        text = "\n".join(parts)
    return Message(
        role="tool",
        content=text,
        tool_call_id=req(b, "tool_use_id", string, path),
        is_error=opt(b, "is_error", boolean, path, False),
    )


def _assistant(blocks: list, path: str) -> Message:
    reasoning, texts, calls = [], [], []
    handle = None
    for i, raw in enumerate(blocks):
        p = join(path, i)
        b, kind = _block(raw, p)
        if kind == "text":
            texts.append(req(b, "text", string, p))
        elif kind == "thinking":
            reasoning.append(opt(b, "thinking", string, p, ""))
            handle = opt(b, "signature", string, p) or handle
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use":
            calls.append(
                ToolCall(
                    id=req(b, "id", string, p),
                    name=req(b, "name", string, p),
                    arguments=req(b, "input", obj, p),
                )
            )
        else:
            raise BadRequest(
                join(p, "type"), f"unexpected content block type {kind!r} in an assistant message"
            )
    reasoning_text = "\n".join(r for r in reasoning if r)
    return Message(
        role="assistant",
        content="\n".join(texts),
        reasoning=reasoning_text,
        tool_calls=tuple(calls),
        memo_handle=handle,
    )


def _tools(raw: list) -> tuple[list[Tool], list[str]]:
    tools, notes = [], []
    for i, t in enumerate(raw):
        p = join("tools", i)
        t = obj(t, p)
        kind = opt(t, "type", string, p, "custom")
        if kind != "custom":
            notes.append(f"{p}: tool type {kind!r} ignored (server tools are not available here)")
            continue
        tools.append(
            Tool(
                name=req(t, "name", string, p),
                description=opt(t, "description", string, p, ""),
                parameters=req(t, "input_schema", obj, p),
            )
        )
    return tools, notes


def _tool_choice(body: dict) -> str:
    choice = opt(body, "tool_choice", obj)
    if choice is None:
        return "auto"
    kind = req(choice, "type", string, "tool_choice")
    if kind == "tool":
        return req(choice, "name", string, "tool_choice")
    mapping = {"auto": "auto", "any": "required", "none": "none"}
    if kind not in mapping:
        raise BadRequest("tool_choice.type", f"unknown tool_choice type {kind!r}")
    return mapping[kind]


def _params(body: dict) -> GenerationParams:
    thinking = opt(body, "thinking", obj, default={})
    return GenerationParams(
        max_tokens=opt(body, "max_tokens", positive_int),
        temperature=opt(body, "temperature", temperature),
        top_p=opt(body, "top_p", probability),
        top_k=opt(body, "top_k", top_k),
        stop=opt(body, "stop_sequences", stop_list, default=()),
        stream=opt(body, "stream", boolean, default=False),
        tool_choice=_tool_choice(body),
        parallel_tool_calls=not opt(
            body.get("tool_choice") or {}, "disable_parallel_tool_use", boolean, default=False
        ),
        enable_thinking=thinking.get("type") != "disabled",
    )
