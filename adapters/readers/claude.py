"""Claude Code transcripts (`~/.claude/projects/*/*.jsonl`) -> Anthropic Messages traces.

A transcript is a tree of `user` / `assistant` / `attachment` lines linked by `parentUuid`;
tool results are `user` lines, and one assistant message is split over several lines (one
per content block) that share `message.id`. Claude Code 2.1 also logs each model call
(`api-request`: the previous call it extends (`base`), how many of its messages it keeps
(`keep`), and the hashes of the messages that follow (`tail`); `api-request-shape`: system
and tools; `api-request-blob`: messages not found on the chain). When those lines are
present the bodies are rebuilt exactly as sent; a tail hash is SHA-256 of the message's
compact, key-sorted JSON. Older transcripts are rebuilt from the chain alone, without the
system prompt, tool schemas and system reminders, which they do not record.

Sidechain lines (sub-agent conversations) are left out.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any

from adapters.readers.common import Problems, TraceError, iter_jsonl, join_texts, parse_ts
from adapters.trace import AssistantOutput, ToolCall, Trace, TraceRequest, is_tool_result_last

CHAIN_TYPES = ("user", "assistant")


def message_hash(message: dict[str, Any]) -> str:
    """The hash Claude Code names a message by in `api-request.tail`."""
    canonical = json.dumps(message, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def output_of(blocks: list[dict[str, Any]]) -> AssistantOutput:
    """The protocol-neutral assistant message of an assistant message's content blocks."""
    reasoning = [b.get("thinking", "") for b in blocks if b.get("type") == "thinking"]
    content = [b.get("text", "") for b in blocks if b.get("type") == "text"]
    calls = [ToolCall(b["name"], b.get("input") or {}) for b in blocks if b.get("type") == "tool_use"]
    return AssistantOutput(join_texts(reasoning), join_texts(content), calls)


class _Line:
    """One parsed chain line."""

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

    @property
    def content_blocks(self) -> list[dict[str, Any]]:
        content = self.message.get("content")
        if isinstance(content, str):
            return [{"type": "text", "text": content}]
        if not isinstance(content, list):
            raise TypeError("message content is neither a string nor a list")
        return content


class _Transcript:
    """All lines of one transcript file, sorted by kind."""

    def __init__(self) -> None:
        self.session_id: str | None = None
        self.meta: dict[str, Any] = {}
        self.nodes: dict[str, _Line] = {}  # every line with a uuid (chain walking)
        self.chain_lines: list[_Line] = []  # user / assistant, file order
        self.shapes: dict[str, dict[str, Any]] = {}
        self.blobs: dict[str, dict[str, Any]] = {}
        self.api_requests: list[tuple[int, dict[str, Any]]] = []

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
        line = _Line(number, obj)
        self.nodes[obj["uuid"]] = line
        if kind in CHAIN_TYPES:
            self.chain_lines.append(line)
            self.meta.setdefault("version", obj.get("version"))
            self.meta.setdefault("cwd", obj.get("cwd"))
            if kind == "assistant" and obj["message"].get("model"):
                self.meta["model"] = obj["message"]["model"]


def read_claude(
    path: str | Path, *, strict: bool = False, problems: list[TraceError] | None = None
) -> list[Trace]:
    """Read one Claude Code transcript into a single Anthropic-protocol `Trace`.

    Malformed lines are reported with file and line number: skipped (appended to
    `problems` and logged) or, when `strict`, raised as `TraceError`.
    """
    path = Path(path)
    report = Problems(strict, problems)
    transcript = _Transcript()
    for number, obj in iter_jsonl(path, report):
        try:
            transcript.add(number, obj)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            report.report(path, number, f"malformed {obj.get('type', 'line')} line: {exc!r}")
    requests = _from_api_requests(transcript, path, report) if transcript.api_requests else None
    meta = {k: v for k, v in transcript.meta.items() if v is not None}
    meta["rebuilt_from"] = "api-request" if requests is not None else "chain"
    if requests is None:
        requests = _from_chain(transcript, path, report)
    return [Trace(transcript.session_id or path.stem, "claude", str(path), requests, meta)]


# -- exact rebuild from api-request lines -------------------------------------------------------


def _assistant_groups(lines: list[_Line]) -> list[list[_Line]]:
    """Assistant lines grouped into messages: adjacent lines with the same `message.id` and request."""
    groups: list[list[_Line]] = []
    previous: _Line | None = None
    for line in lines:
        if line.type == "assistant":
            if previous is not None and previous.type == "assistant" and _same_message(previous, line):
                groups[-1].append(line)
            else:
                groups.append([line])
        previous = line
    return groups


def _same_message(a: _Line, b: _Line) -> bool:
    message_id = b.message.get("id")
    return message_id is not None and a.message.get("id") == message_id and a.request_ref == b.request_ref


def _chain_messages(transcript: _Transcript) -> dict[str, dict[str, Any]]:
    """Every message the chain can supply, by its hash (user lines and merged assistant messages)."""
    known = dict(transcript.blobs)
    for line in transcript.chain_lines:
        if line.type == "user":
            message: dict[str, Any] = {"role": "user", "content": line.message.get("content")}
            known.setdefault(message_hash(message), message)
    for group in _assistant_groups(transcript.chain_lines):
        blocks = [block for line in group for block in line.content_blocks]
        candidates: list[dict[str, Any]] = [
            {"role": "assistant", "content": blocks},
            {"role": "assistant", "content": group[0].content_blocks},
        ]
        for message in candidates:
            known.setdefault(message_hash(message), message)
    return known


def _from_api_requests(transcript: _Transcript, path: Path, report: Problems) -> list[TraceRequest] | None:
    """Bodies exactly as sent; None (after reporting why) when one cannot be rebuilt."""
    known = _chain_messages(transcript)
    outputs: dict[str, list[_Line]] = {}
    for line in transcript.chain_lines:
        if line.type == "assistant" and line.request_ref:
            outputs.setdefault(line.request_ref, []).append(line)
    sent: dict[str, list[dict[str, Any]]] = {}  # request id -> messages before cache_control marks
    requests = []
    for number, obj in transcript.api_requests:
        try:
            messages = _request_messages(obj, sent, known)
        except (KeyError, TypeError, ValueError) as exc:
            report.report(
                path, number, f"cannot rebuild api-request ({exc}); rebuilding from the parentUuid chain"
            )
            return None
        sent[obj["id"]] = messages
        answer = outputs.get(obj["id"])
        if not answer:
            continue  # a call that produced nothing (aborted or failed): nothing to replay
        body = _request_body(obj, messages, transcript.shapes.get(obj.get("shapeHash") or "", {}))
        output = output_of([block for line in answer for block in line.content_blocks])
        after_tool = is_tool_result_last("anthropic", body)
        requests.append(
            TraceRequest("anthropic", body, output, after_tool, parse_ts(obj.get("timestamp")), answer[-1].ts)
        )
    return requests


def _request_messages(
    obj: dict[str, Any], sent: dict[str, list[dict[str, Any]]], known: dict[str, dict[str, Any]]
) -> list[dict[str, Any]]:
    base: list[dict[str, Any]] = []
    if obj.get("base"):
        if obj["base"] not in sent:
            raise KeyError(f"base request {obj['base']} not found")
        base = sent[obj["base"]]
    keep = int(obj.get("keep") or 0)
    if keep > len(base):
        raise ValueError(f"keep={keep} but the base request has {len(base)} messages")
    missing = [h for h in obj.get("tail") or [] if h not in known]
    if missing:
        raise KeyError(f"message {missing[0][:12]}… is neither a blob nor on the chain")
    return base[:keep] + [known[h] for h in obj.get("tail") or []]


def _request_body(
    obj: dict[str, Any], messages: list[dict[str, Any]], shape: dict[str, Any]
) -> dict[str, Any]:
    params = dict(obj.get("params") or {})
    body: dict[str, Any] = {
        "model": params.pop("model", None) or "claude",
        "messages": copy.deepcopy(messages),
    }
    for key in ("system", "tools"):
        if shape.get(key):
            body[key] = copy.deepcopy(shape[key])
    params.pop("betas", None)
    body.update(params)
    body["stream"] = True
    for mark in obj.get("cacheControl") or []:
        _set_path(body, mark.get("path") or [], mark.get("value"))
    for message in body["messages"]:
        _collapse_system_text(message)
    return body


def _collapse_system_text(message: dict[str, Any]) -> None:
    """A `system` message of one plain text block goes out as a string (seen in Claude Code 2.1.332)."""
    content = message.get("content")
    if message.get("role") == "system" and isinstance(content, list) and len(content) == 1:
        block = content[0]
        if isinstance(block, dict) and block.keys() == {"type", "text"} and block["type"] == "text":
            message["content"] = block["text"]


def _set_path(body: dict[str, Any], path: list[Any], value: Any) -> None:
    """Set `cache_control` at a path like ["messages", 3, "content", 0]; paths that miss are ignored."""
    node: Any = body
    try:
        for step in path:
            node = node[step]
    except (KeyError, IndexError, TypeError):
        return
    if isinstance(node, dict):
        node["cache_control"] = value


# -- rebuild from the parentUuid chain alone ----------------------------------------------------


def _leaf_chain(transcript: _Transcript) -> list[_Line]:
    """The user/assistant lines from the root to the last chain line, following `parentUuid`."""
    if not transcript.chain_lines:
        return []
    chain: list[_Line] = []
    seen: set[str] = set()
    node: _Line | None = transcript.chain_lines[-1]
    while node is not None and node.uuid not in seen:
        seen.add(node.uuid or "")
        if node.type in CHAIN_TYPES:
            chain.append(node)
        node = transcript.nodes.get(node.parent) if node.parent else None
    return chain[::-1]


def _from_chain(transcript: _Transcript, path: Path, report: Problems) -> list[TraceRequest]:
    messages: list[dict[str, Any]] = []
    requests: list[TraceRequest] = []
    model = transcript.meta.get("model") or "claude"
    last_ts: float | None = None
    chain = _leaf_chain(transcript)
    for i, line in enumerate(chain):
        try:
            blocks = line.content_blocks
        except TypeError as exc:
            report.report(path, line.number, str(exc))
            continue
        if line.type == "user":
            _append_user(messages, line.message.get("content"))
            last_ts = line.ts
            continue
        if i > 0 and chain[i - 1].type == "assistant" and _same_message(chain[i - 1], line):
            messages[-1]["content"].extend(blocks)
            requests[-1] = _with_output(requests[-1], messages[-1]["content"], line.ts)
            continue
        body = {**_chain_body_defaults(transcript, model), "messages": copy.deepcopy(messages)}
        after_tool = is_tool_result_last("anthropic", body)
        requests.append(
            TraceRequest("anthropic", body, output_of(blocks), after_tool, last_ts or line.ts, line.ts)
        )
        messages.append({"role": "assistant", "content": list(blocks)})
    return requests


def _chain_body_defaults(transcript: _Transcript, model: str) -> dict[str, Any]:
    """Model, system, tools and parameters for chain-rebuilt bodies: the last logged shape and
    request parameters where the transcript has them, else a plain Messages body."""
    body: dict[str, Any] = {"model": model}
    shape = list(transcript.shapes.values())[-1] if transcript.shapes else {}
    body.update({key: copy.deepcopy(shape[key]) for key in ("system", "tools") if shape.get(key)})
    params = dict(transcript.api_requests[-1][1].get("params") or {}) if transcript.api_requests else {}
    params.pop("betas", None)
    body.update(params or {"max_tokens": 32000})
    body["stream"] = True
    return body


def _append_user(messages: list[dict[str, Any]], content: Any) -> None:
    """Add a user message; consecutive user lines merge into one message, as Claude Code sends them."""
    if messages and messages[-1]["role"] == "user":
        previous = messages[-1]["content"]
        as_blocks = [{"type": "text", "text": c} if isinstance(c, str) else c for c in (previous, content)]
        merged: list[Any] = []
        for part in as_blocks:
            merged.extend(part if isinstance(part, list) else [part])
        messages[-1]["content"] = merged
    else:
        messages.append({"role": "user", "content": content})


def _with_output(request: TraceRequest, blocks: list[dict[str, Any]], ts: float | None) -> TraceRequest:
    return TraceRequest(
        request.protocol, request.body, output_of(blocks), request.after_tool_result, request.ts, ts
    )
