"""A Claude Code transcript (`~/.claude/projects/*/*.jsonl`) parsed into its lines.

A transcript is a tree of `user` / `assistant` / `attachment` lines linked by `parentUuid`;
tool results are `user` lines, and one assistant message is split over several lines (one
per content block) that share `message.id`. Parallel tool calls branch: each tool-result
line hangs off the tool_use line it answers, in the order the tools finished. Attachments
carry what Claude Code injects around a user prompt (`rendered`, with `renderedRole`:
`system` reminders become one mid-conversation system message, `user` ones a text block).
Claude Code 2.1 also logs each model call (`api-request`, `api-request-shape`,
`api-request-blob`; see claude.py). Sidechain lines (sub-agent conversations) are left out.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from adapters.readers.common import join_texts, parse_ts
from adapters.trace import AssistantOutput, ToolCall

CHAIN_TYPES = ("user", "assistant")
THREAD_TYPES = ("user", "assistant", "attachment")


def message_hash(message: dict[str, Any]) -> str:
    """The hash Claude Code names a message by in `api-request.tail`: SHA-256 of its compact,
    key-sorted JSON."""
    canonical = json.dumps(message, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def output_of(blocks: list[dict[str, Any]]) -> AssistantOutput:
    """The protocol-neutral assistant message of an assistant message's content blocks."""
    reasoning = [b.get("thinking", "") for b in blocks if b.get("type") == "thinking"]
    content = [b.get("text", "") for b in blocks if b.get("type") == "text"]
    calls = [ToolCall(b["name"], b.get("input") or {}) for b in blocks if b.get("type") == "tool_use"]
    return AssistantOutput(join_texts(reasoning), join_texts(content), calls)


class Line:
    """One parsed user, assistant or attachment line."""

    def __init__(self, number: int, obj: dict[str, Any]) -> None:
        self.number = number
        self.type: str = obj["type"]
        self.uuid: str | None = obj.get("uuid")
        self.parent: str | None = obj.get("parentUuid")
        self.ts = parse_ts(obj.get("timestamp"))
        self.request_ref: str | None = obj.get("requestRef")
        message = obj.get("message") if self.type in CHAIN_TYPES else None
        if self.type in CHAIN_TYPES and not isinstance(message, dict):
            raise TypeError(f"{self.type} line without a message object")
        self.message: dict[str, Any] = message or {}
        rendered = obj.get("rendered") if self.type == "attachment" else None
        self.rendered: list[str] = [r["content"] for r in rendered or [] if isinstance(r.get("content"), str)]
        self.rendered_role: str | None = obj.get("renderedRole")

    @property
    def content_blocks(self) -> list[dict[str, Any]]:
        content = self.message.get("content")
        if isinstance(content, str):
            return [{"type": "text", "text": content}]
        if not isinstance(content, list):
            raise TypeError("message content is neither a string nor a list")
        return content

    @property
    def is_tool_result(self) -> bool:
        content = self.message.get("content")
        return (
            self.type == "user"
            and isinstance(content, list)
            and bool(content)
            and all(isinstance(b, dict) and b.get("type") == "tool_result" for b in content)
        )


class Transcript:
    """All lines of one transcript file, sorted by kind."""

    def __init__(self) -> None:
        self.session_id: str | None = None
        self.meta: dict[str, Any] = {}
        self.nodes: dict[str, Line] = {}  # every line with a uuid (chain walking)
        self.thread_lines: list[Line] = []  # user / assistant / attachment, file order
        self.shapes: dict[str, dict[str, Any]] = {}
        self.blobs: dict[str, dict[str, Any]] = {}
        self.api_requests: list[tuple[int, dict[str, Any]]] = []

    @property
    def chain_lines(self) -> list[Line]:
        """User and assistant lines in file order."""
        return [line for line in self.thread_lines if line.type in CHAIN_TYPES]

    def add(self, number: int, obj: dict[str, Any]) -> None:
        kind = obj["type"]
        self.session_id = self.session_id or obj.get("sessionId")
        if kind == "api-request-shape":
            self.shapes[obj["shapeHash"]] = obj["shape"]
        elif kind == "api-request-blob":
            self.blobs[obj["hash"]] = obj["message"]
        elif kind == "api-request":
            self.api_requests.append((number, obj))
        if obj.get("isSidechain") or "uuid" not in obj:
            return
        line = Line(number, obj)
        self.nodes[obj["uuid"]] = line
        if kind in THREAD_TYPES:
            self.thread_lines.append(line)
        if kind in CHAIN_TYPES:
            self.meta.setdefault("version", obj.get("version"))
            self.meta.setdefault("cwd", obj.get("cwd"))
            if kind == "assistant" and obj["message"].get("model"):
                self.meta["model"] = obj["message"]["model"]


def same_message(a: Line, b: Line) -> bool:
    """Whether two assistant lines hold blocks of one message (same `message.id` and request)."""
    message_id = b.message.get("id")
    return message_id is not None and a.message.get("id") == message_id and a.request_ref == b.request_ref


def assistant_groups(lines: list[Line]) -> list[list[Line]]:
    """Assistant lines grouped into messages: adjacent lines of the same message."""
    groups: list[list[Line]] = []
    previous: Line | None = None
    for line in lines:
        if line.type == "assistant":
            if previous is not None and previous.type == "assistant" and same_message(previous, line):
                groups[-1].append(line)
            else:
                groups.append([line])
        previous = line
    return groups


def tool_result_groups(lines: list[Line]) -> list[list[Line]]:
    """Adjacent tool-result lines: the results of one step of parallel tool calls, which Claude
    Code sends as one user message in the order the lines were written."""
    groups: list[list[Line]] = []
    previous: Line | None = None
    for line in lines:
        if line.is_tool_result:
            if previous is not None and previous.is_tool_result:
                groups[-1].append(line)
            else:
                groups.append([line])
        previous = line
    return groups
