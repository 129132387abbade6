"""Claude Code transcripts (`~/.claude/projects/*/*.jsonl`) -> Anthropic Messages traces.

Claude Code 2.1 logs each model call (2.1.332 does; 2.1.197 did not): `api-request` names the previous call it extends
(`base`), how many of its messages it keeps (`keep`) and the hashes of the messages that
follow (`tail`); `api-request-shape` holds system and tools; `api-request-blob` the
messages that are not on the chain as written. From those the bodies are rebuilt exactly as
sent. A tail message is hashed as Claude Code prepares it, before its `cache_control` marks:
a user prompt stored as a string is hashed as a one-text-block list when a mark lands on it
(and sent as a string otherwise), and the tool results of parallel calls are hashed merged.
A request whose messages cannot all be found is rebuilt from the chain (claude_chain.py),
marked approximate and named in a warning; the other requests stay exact. Transcripts
without `api-request` lines are rebuilt from the chain alone (approximate).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from adapters.readers.claude_chain import chain_prompts, from_chain
from adapters.readers.claude_transcript import (
    Line,
    Transcript,
    assistant_groups,
    message_hash,
    output_of,
    tool_result_groups,
)
from adapters.readers.common import Problems, TraceError, iter_jsonl, log, parse_ts
from adapters.trace import Trace, TraceRequest, is_tool_result_last

__all__ = ["message_hash", "output_of", "read_claude"]
NO_API_REQUESTS = (
    "no api-request lines (an older Claude Code: 2.1.197 writes none, 2.1.332 does): rebuilt from the parentUuid chain; "
    "system prompt and tools from the last logged shape, if any; no cache_control marks"
)


def read_claude(
    path: str | Path, *, strict: bool = False, problems: list[TraceError] | None = None
) -> list[Trace]:
    """Read one Claude Code transcript into a single Anthropic-protocol `Trace`.

    Malformed lines are reported with file and line number: skipped (appended to
    `problems` and logged) or, when `strict`, raised as `TraceError`.
    """
    path = Path(path)
    report = Problems(strict, problems)
    transcript = Transcript()
    for number, obj in iter_jsonl(path, report):
        try:
            transcript.add(number, obj)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            report.report(path, number, f"malformed {obj.get('type', 'line')} line: {exc!r}")
    meta = {k: v for k, v in transcript.meta.items() if v is not None}
    if transcript.api_requests:
        meta["rebuilt_from"] = "api-request"
        requests = _from_api_requests(transcript, path, report)
    else:
        meta["rebuilt_from"] = "chain"
        requests = from_chain(transcript, path, report, NO_API_REQUESTS)
    return [Trace(transcript.session_id or path.stem, "claude", str(path), requests, meta)]


def known_messages(transcript: Transcript) -> dict[str, dict[str, Any]]:
    """Every message the transcript can supply, by the hash a tail names it by."""
    known = dict(transcript.blobs)
    alternates: dict[str, dict[str, Any]] = {}
    lines = transcript.chain_lines
    for line in lines:
        if line.type == "user":
            content = line.message.get("content")
            message: dict[str, Any] = {"role": "user", "content": content}
            known.setdefault(message_hash(message), message)
            if isinstance(content, str):  # hashed in the form a cache mark gives it
                alternates[message_hash({"role": "user", "content": [{"type": "text", "text": content}]})] = (
                    message
                )
    for group in tool_result_groups(lines):
        merged = {"role": "user", "content": [block for line in group for block in line.content_blocks]}
        known.setdefault(message_hash(merged), merged)
    for group in assistant_groups(lines):
        blocks = [block for line in group for block in line.content_blocks]
        for candidate in (
            {"role": "assistant", "content": blocks},
            {"role": "assistant", "content": group[0].content_blocks},
        ):
            known.setdefault(message_hash(candidate), candidate)
    for digest, message in alternates.items():
        known.setdefault(digest, message)
    return known


class _Rebuild:
    """The api-request lines replayed in order: each request's messages from its base, the
    messages it keeps and its tail, or from the chain when that fails."""

    def __init__(self, transcript: Transcript, path: Path, report: Problems) -> None:
        self.transcript, self.path, self.report = transcript, path, report
        self.known = known_messages(transcript)
        self.answers: dict[str, list[Line]] = {}
        for line in transcript.chain_lines:
            if line.type == "assistant" and line.request_ref:
                self.answers.setdefault(line.request_ref, []).append(line)
        self.sent: dict[str, list[dict[str, Any]]] = {}  # request id -> messages before cache_control marks
        self.approximate: dict[str, str] = {}  # request id -> why
        self._chain: dict[str, list[dict[str, Any]]] | None = None

    def messages(self, index: int, number: int, obj: dict[str, Any]) -> list[dict[str, Any]] | None:
        """The request's messages (None when it cannot be rebuilt at all); notes why where approximate."""
        try:
            messages = _request_messages(obj, self.sent, self.known)
            why = _inherited(obj, self.approximate)
        except (KeyError, TypeError, ValueError) as exc:
            answer = self.answers.get(obj["id"])
            found = self.chain().get(answer[0].uuid or "") if answer else None
            why = f"api-request {index} (line {number}): {exc}"
            if found is None:
                log.warning("%s: %s; not on the chain either: left out", self.path, why)
                return None
            why += "; its messages rebuilt from the parentUuid chain"
            messages = found
        self.sent[obj["id"]] = messages
        if why:
            self.approximate[obj["id"]] = why
        return messages

    def chain(self) -> dict[str, list[dict[str, Any]]]:
        """Messages before each answer on the chain, by the answer's first line (built once, on need)."""
        if self._chain is None:
            prompts = chain_prompts(self.transcript, self.path, self.report)
            self._chain = {p.answer[0].uuid or "": p.messages for p in prompts}
        return self._chain

    def request(
        self, obj: dict[str, Any], messages: list[dict[str, Any]], answer: list[Line]
    ) -> TraceRequest:
        body = _request_body(obj, messages, self.transcript.shapes.get(obj.get("shapeHash") or "", {}))
        output = output_of([block for line in answer for block in line.content_blocks])
        after_tool = is_tool_result_last("anthropic", body)
        why = self.approximate.get(obj["id"])
        fidelity = "approximate" if why else "identical"
        ts = parse_ts(obj.get("timestamp"))
        return TraceRequest("anthropic", body, output, after_tool, ts, answer[-1].ts, fidelity, why)


def _from_api_requests(transcript: Transcript, path: Path, report: Problems) -> list[TraceRequest]:
    rebuild = _Rebuild(transcript, path, report)
    requests = []
    for index, (number, obj) in enumerate(transcript.api_requests):
        messages = rebuild.messages(index, number, obj)
        answer = rebuild.answers.get(obj["id"])
        if messages is not None and answer:  # a call that produced nothing has nothing to replay
            requests.append(rebuild.request(obj, messages, answer))
    if rebuild.approximate:
        count, first = len(rebuild.approximate), next(iter(rebuild.approximate.values()))
        log.warning(
            "%s: %d of %d requests rebuilt approximately; first: %s",
            path,
            count,
            len(transcript.api_requests),
            first,
        )
    return requests


def _inherited(obj: dict[str, Any], approximate: dict[str, str]) -> str | None:
    """Why a request is approximate when the messages it keeps come from an approximate one."""
    base = obj.get("base")
    if base in approximate and int(obj.get("keep") or 0) > 0:
        return f"keeps messages of api-request {base}, rebuilt approximately"
    return None


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
    """Set `cache_control` at a path like ["messages", 3, "content", 0]; string content on the
    way becomes one text block (as Claude Code marks it); paths that miss are ignored."""
    node: Any = body
    try:
        for i, step in enumerate(path):
            child = node[step]
            if isinstance(child, str) and step == "content" and path[i + 1 : i + 2] == [0]:
                child = node[step] = [{"type": "text", "text": child}]
            node = child
    except (KeyError, IndexError, TypeError):
        return
    if isinstance(node, dict):
        node["cache_control"] = value
