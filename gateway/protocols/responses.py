"""OpenAI Responses (`POST /v1/responses`) request body → `Conversation`.

Mapping:
- `instructions`, then the leading run of `system`/`developer` message items (Codex
  sends its base prompt that way) → `Conversation.system` blocks; such items later in
  the input → system messages in place.
- `input` as a string → one user message.
- Consecutive `reasoning`, assistant `message`, `function_call`, `custom_tool_call`
  items form one assistant message (a new one starts at a `reasoning` item, or at an
  assistant message item, once the current one has text or calls). Reasoning text is
  the item's `content` (reasoning_text parts) when present, else its `summary` texts;
  the item's `encrypted_content` → `memo_handle`.
- `function_call_output` / `custom_tool_call_output` → tool messages. Their text is kept
  verbatim, including Codex's `Wall time: …` lines (real content; see gateway/volatile.py).
- Tools of type `function` and `custom` are kept; a `namespace` tool's functions are
  flattened (with `Tool.namespace` set); other types (web_search, …) are ignored with a note.
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
    json_arguments,
    nonempty,
    obj,
    opt,
    positive_int,
    probability,
    req,
    string,
    temperature,
    tool_choice_mode,
)

MESSAGE_ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text", "refusal")
ASSISTANT_ITEMS = ("reasoning", "function_call", "custom_tool_call")


def parse_request(body: Any) -> Conversation:
    """Parse a Responses request body; raises `BadRequest`."""
    body = obj(body, "body")
    if body.get("previous_response_id") is not None:
        raise BadRequest(
            "previous_response_id", "is not supported: this server stores no responses; send the full input"
        )
    raw = req(body, "input", lambda v, p: v if isinstance(v, str) else arr(v, p))
    items = [{"type": "message", "role": "user", "content": raw}] if isinstance(raw, str) else raw
    nonempty(items, "input")
    system = [opt(body, "instructions", string, default="")]
    messages = _Builder().build(items, system)
    check_tool_results(messages, "input")
    tools, notes = _tools(opt(body, "tools", arr, default=[]), "tools")
    return conversation(body, [s for s in system if s], messages, tools, notes, _params(body))


def _text(content: Any, path: str) -> str:
    """Message content: a string or an array of text parts (joined with "\\n")."""
    if isinstance(content, str):
        return content
    parts = []
    for i, raw in enumerate(arr(content, path)):
        p = join(path, i)
        part = obj(raw, p)
        kind = req(part, "type", string, p)
        if kind not in TEXT_PARTS:
            raise BadRequest(
                join(p, "type"), f"content parts of type {kind!r} are not supported by this server"
            )
        parts.append(
            req(part, "text", string, p) if kind != "refusal" else opt(part, "refusal", string, p, "")
        )
    return "\n".join(parts)


class _Builder:
    """Walks input items, grouping assistant output items into messages."""

    def __init__(self) -> None:
        self.out: list[Message] = []
        self.open: dict | None = None  # the assistant message being grouped

    def build(self, items: list, system: list[str]) -> list[Message]:
        leading = True
        for i, raw in enumerate(items):
            p = join("input", i)
            item = obj(raw, p)
            kind = opt(item, "type", string, p, "message")
            if leading and kind == "message" and item.get("role") in ("system", "developer"):
                system.append(_text(req(item, "content", lambda v, q: v, p), join(p, "content")))
                continue
            leading = False
            self.item(item, kind, p)
        self.close()
        return self.out

    def item(self, item: dict, kind: str, p: str) -> None:
        if kind == "message":
            self.message(item, p)
        elif kind in ASSISTANT_ITEMS:
            self.assistant_item(item, kind, p)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            self.close()
            output = item.get("output")
            text = "" if output is None else _text(output, join(p, "output"))
            self.out.append(Message(role="tool", content=text, tool_call_id=req(item, "call_id", string, p)))
        else:
            raise BadRequest(join(p, "type"), f"unknown input item type {kind!r}")

    def message(self, item: dict, p: str) -> None:
        role = req(item, "role", string, p)
        if role not in MESSAGE_ROLES:
            raise BadRequest(
                join(p, "role"), f"unknown role {role!r}; expected one of {', '.join(MESSAGE_ROLES)}"
            )
        text = _text(req(item, "content", lambda v, q: v, p), join(p, "content"))
        if role == "assistant":
            if self.open is None or self.open["content"] or self.open["tool_calls"]:
                self.close()
                self.start()
            assert self.open is not None
            self.open["content"] = text
            return
        self.close()
        self.out.append(Message(role="user" if role == "user" else "system", content=text))

    def assistant_item(self, item: dict, kind: str, p: str) -> None:
        if kind == "reasoning" or self.open is None:
            self.close()
            self.start()
        assert self.open is not None
        if kind == "reasoning":
            self.open["reasoning"] = _reasoning_text(item, p)
            self.open["memo_handle"] = opt(item, "encrypted_content", string, p)
        elif kind == "function_call":
            args = json_arguments(req(item, "arguments", string, p), join(p, "arguments"))
            call = ToolCall(
                id=req(item, "call_id", string, p), name=req(item, "name", string, p), arguments=args
            )
            self.open["tool_calls"].append(call)
        else:
            call = ToolCall(
                id=req(item, "call_id", string, p),
                name=req(item, "name", string, p),
                input=opt(item, "input", string, p, ""),
            )
            self.open["tool_calls"].append(call)

    def start(self) -> None:
        self.open = {"reasoning": "", "content": "", "tool_calls": [], "memo_handle": None}

    def close(self) -> None:
        if self.open is not None:
            o = self.open
            self.out.append(
                Message(
                    role="assistant",
                    reasoning=o["reasoning"],
                    content=o["content"],
                    tool_calls=tuple(o["tool_calls"]),
                    memo_handle=o["memo_handle"],
                )
            )
        self.open = None


def _reasoning_text(item: dict, p: str) -> str:
    content = item.get("content")
    if content:
        return _text(content, join(p, "content"))
    summary = opt(item, "summary", arr, p, [])
    return _text(summary, join(p, "summary")) if summary else ""


def _tools(raw: list, path: str, namespace: str | None = None) -> tuple[list[Tool], list[str]]:
    tools: list[Tool] = []
    notes: list[str] = []
    for i, t in enumerate(raw):
        p = join(path, i)
        t = obj(t, p)
        kind = req(t, "type", string, p)
        if kind == "function":
            parameters = opt(t, "parameters", obj, p, {"type": "object", "properties": {}})
            tools.append(
                Tool(
                    name=req(t, "name", string, p),
                    description=opt(t, "description", string, p, ""),
                    parameters=parameters,
                    namespace=namespace,
                )
            )
        elif kind == "custom":
            tools.append(
                Tool(
                    name=req(t, "name", string, p),
                    description=opt(t, "description", string, p, ""),
                    kind="custom",
                    format=opt(t, "format", obj, p),
                    namespace=namespace,
                )
            )
        elif kind == "namespace" and namespace is None:
            inner, inner_notes = _tools(req(t, "tools", arr, p), join(p, "tools"), req(t, "name", string, p))
            tools += inner
            notes += inner_notes
        else:
            notes.append(f"{p}: tool type {kind!r} ignored (not available on this server)")
    return tools, notes


def _tool_choice(body: dict) -> str:
    choice = tool_choice_mode(body)
    if isinstance(choice, str):
        return choice
    kind = req(choice, "type", string, "tool_choice")
    if kind in ("function", "custom"):
        return req(choice, "name", string, "tool_choice")
    return "auto"


def _params(body: dict) -> GenerationParams:
    return GenerationParams(
        max_tokens=opt(body, "max_output_tokens", positive_int),
        temperature=opt(body, "temperature", temperature),
        top_p=opt(body, "top_p", probability),
        stream=opt(body, "stream", boolean, default=False),
        tool_choice=_tool_choice(body),
        parallel_tool_calls=opt(body, "parallel_tool_calls", boolean, default=True),
    )
