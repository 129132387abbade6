"""Claude Code requests rebuilt from the conversation lines alone (no `api-request` lines).

The thread is the ancestry of the last user/assistant line, widened by the branches of
parallel tool calls (the other blocks of an assistant message on the thread and the tool
results that answer them), in file order. Messages follow what Claude Code 2.1 sends: user
lines in a row merge into one message; the attachments rendered as `system` after a prompt
become one `system` message (their reminder wrappers removed, joined by blank lines); those
rendered as `user` become text blocks ahead of the prompt. The system prompt, tool schemas
and parameters come from the last logged shape and request where the transcript has them.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adapters.readers.claude_transcript import Line, Transcript, output_of, same_message
from adapters.readers.common import Problems
from adapters.trace import TraceRequest, is_tool_result_last

REMINDER_OPEN, REMINDER_CLOSE = "<system-reminder>\n", "\n</system-reminder>"


@dataclass
class Prompt:
    """One model call seen on the chain: the lines of its answer and the messages before it."""

    answer: list[Line]
    messages: list[dict[str, Any]]
    ts: float | None


def thread(transcript: Transcript) -> list[Line]:
    """The lines of the conversation that ends at the last user/assistant line, in file order."""
    chain = transcript.chain_lines
    if not chain:
        return []
    on_thread: set[str] = set()
    node: Line | None = chain[-1]
    while node is not None and node.uuid not in on_thread:
        on_thread.add(node.uuid or "")
        node = transcript.nodes.get(node.parent) if node.parent else None
    messages = {(line.message.get("id"), line.request_ref) for line in chain if line.uuid in on_thread}
    siblings = {
        line.uuid
        for line in chain
        if line.type == "assistant"
        and line.message.get("id")
        and (line.message["id"], line.request_ref) in messages
    }
    on_thread |= siblings
    on_thread |= {line.uuid or "" for line in chain if line.is_tool_result and line.parent in on_thread}
    return [line for line in transcript.thread_lines if line.uuid in on_thread]


def chain_prompts(transcript: Transcript, path: Path, report: Problems) -> list[Prompt]:
    """Every model call on the thread with the messages it was sent."""
    messages: list[dict[str, Any]] = []
    prompts: list[Prompt] = []
    last_ts: float | None = None
    last: Line | None = None  # the previous user/assistant line
    system_open = False  # the last message is a system message built from attachments
    for line in thread(transcript):
        if line.type == "attachment":
            system_open = _add_attachment(messages, line, system_open)
            continue
        try:
            blocks = line.content_blocks
        except TypeError as exc:
            report.report(path, line.number, str(exc))
            continue
        system_open = False
        if line.type == "user":
            _append_user(messages, line.message.get("content"))
            last_ts, last = line.ts, line
            continue
        if last is not None and last.type == "assistant" and same_message(last, line):
            messages[-1]["content"].extend(blocks)
            prompts[-1].answer.append(line)
        else:
            prompts.append(Prompt([line], copy.deepcopy(messages), last_ts or line.ts))
            messages.append({"role": "assistant", "content": list(blocks)})
        last = line
    return prompts


def from_chain(transcript: Transcript, path: Path, report: Problems, why: str) -> list[TraceRequest]:
    """The transcript's requests rebuilt from the chain, each marked approximate for `why`."""
    defaults = chain_body_defaults(transcript)
    requests = []
    for prompt in chain_prompts(transcript, path, report):
        body = {**copy.deepcopy(defaults), "messages": prompt.messages}
        blocks = [block for line in prompt.answer for block in line.content_blocks]
        after_tool = is_tool_result_last("anthropic", body)
        requests.append(
            TraceRequest(
                "anthropic",
                body,
                output_of(blocks),
                after_tool,
                prompt.ts,
                prompt.answer[-1].ts,
                "approximate",
                why,
            )
        )
    return requests


def chain_body_defaults(transcript: Transcript) -> dict[str, Any]:
    """Model, system, tools and parameters for chain-rebuilt bodies: the last logged shape and
    request parameters where the transcript has them, else a plain Messages body."""
    body: dict[str, Any] = {"model": transcript.meta.get("model") or "claude"}
    shape = list(transcript.shapes.values())[-1] if transcript.shapes else {}
    body.update({key: shape[key] for key in ("system", "tools") if shape.get(key)})  # each request deep-copies these
    params = dict(transcript.api_requests[-1][1].get("params") or {}) if transcript.api_requests else {}
    params.pop("betas", None)
    body.update(params or {"max_tokens": 32000})
    body["stream"] = True
    return body


def _add_attachment(messages: list[dict[str, Any]], line: Line, system_open: bool) -> bool:
    """Add a rendered attachment; returns whether the last message is now an attachment system message."""
    if not line.rendered:
        return system_open
    if line.rendered_role == "system":
        text = "\n\n".join(_unwrap(r) for r in line.rendered)
        if system_open:
            messages[-1]["content"] += "\n\n" + text
        else:
            messages.append({"role": "system", "content": text})
        return True
    users = [m for m in messages if m["role"] == "user"]
    if line.rendered_role != "user" or not users:
        return system_open
    blocks = [{"type": "text", "text": r + "\n"} for r in line.rendered]
    content = users[-1]["content"]
    if isinstance(content, str):
        users[-1]["content"] = [*blocks, {"type": "text", "text": content}]
    else:
        users[-1]["content"] = [*content, *blocks]  # beside tool results
    return system_open


def _unwrap(text: str) -> str:
    if text.startswith(REMINDER_OPEN) and text.endswith(REMINDER_CLOSE):
        return text[len(REMINDER_OPEN) : -len(REMINDER_CLOSE)]
    return text


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
