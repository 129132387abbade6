"""A simulated `Session` in each protocol (as a `Trace`) and written as each on-disk format.

- `to_trace(session, protocol)`: the requests the agent would send over that protocol.
- `write_codex(session, path)`: a Codex rollout (`session_meta` carries `ft_tools`, the tool
  schemas a real rollout lacks).
- `write_claude(session, path)`: a Claude Code 2.1-style transcript with `api-request` lines.
- `write_recording(session, path, protocol)`: the gateway's own `RecordLine` JSONL.
"""

from __future__ import annotations

import hashlib
import json
import random
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from adapters.readers.claude import message_hash
from adapters.readers.codex import build_body
from adapters.trace import (
    AssistantOutput,
    ProtocolName,
    RecordLine,
    Timings,
    ToolCall,
    Trace,
    TraceRequest,
    encode_jsonl,
    is_tool_result_last,
)
from traces.session import Session, Step

VERSION = "ft-synthetic-1"


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def output_of(step: Step) -> AssistantOutput:
    return AssistantOutput(step.reasoning, step.content, [ToolCall(r.name, r.arguments) for r in step.runs])


# -- per-protocol history ------------------------------------------------------------------------


def _ids(session: Session) -> random.Random:
    return random.Random(f"ids-{session.seed}")


def anthropic_tools(session: Session) -> list[dict[str, Any]]:
    return [
        {"name": t["name"], "description": t["description"], "input_schema": t["parameters"]}
        for t in session.tools
    ]


def responses_tools(session: Session) -> list[dict[str, Any]]:
    return [
        {
            "type": "function",
            "name": t["name"],
            "description": t["description"],
            "strict": False,
            "parameters": t["parameters"],
        }
        for t in session.tools
    ]


def chat_tools(session: Session) -> list[dict[str, Any]]:
    return [{"type": "function", "function": t} for t in session.tools]


def _anthropic_steps(session: Session):
    """(step, messages before it, assistant message, tool-result user message or None) per step."""
    ids = _ids(session)
    messages: list[dict[str, Any]] = []
    for turn in session.turns:
        messages.append({"role": "user", "content": turn.user})
        for step in turn.steps:
            blocks: list[dict[str, Any]] = []
            if step.reasoning:
                blocks.append(
                    {
                        "type": "thinking",
                        "thinking": step.reasoning,
                        "signature": f"sig-{ids.getrandbits(64):016x}",
                    }
                )
            if step.content:
                blocks.append({"type": "text", "text": step.content})
            blocks += [
                {"type": "tool_use", "id": "toolu_" + r.call_id[5:], "name": r.name, "input": r.arguments}
                for r in step.runs
            ]
            assistant = {"role": "assistant", "content": blocks}
            results = [
                {
                    "tool_use_id": "toolu_" + r.call_id[5:],
                    "type": "tool_result",
                    "content": r.output,
                    "is_error": r.is_error,
                }
                for r in step.runs
            ]
            result_message = {"role": "user", "content": results} if results else None
            yield step, list(messages), assistant, result_message
            messages.append(assistant)
            if result_message:
                messages.append(result_message)


def _responses_items(session: Session):
    """(step, items before it, output items, tool-output items) per step."""
    ids = _ids(session)
    env = f"<environment_context>\n  <cwd>{session.cwd}</cwd>\n  <shell>bash</shell>\n</environment_context>"
    items: list[dict[str, Any]] = [_input_message(ids, "user", env)]
    for turn in session.turns:
        items.append(_input_message(ids, "user", turn.user))
        for step in turn.steps:
            produced: list[dict[str, Any]] = []
            if step.reasoning:
                summary = [{"type": "summary_text", "text": step.reasoning}]
                produced.append(
                    {
                        "type": "reasoning",
                        "id": f"rs_{ids.getrandbits(64):016x}",
                        "summary": summary,
                        "content": None,
                    }
                )
            if step.content:
                content = [{"type": "output_text", "text": step.content}]
                produced.append(
                    {
                        "type": "message",
                        "id": f"msg_{ids.getrandbits(64):016x}",
                        "role": "assistant",
                        "content": content,
                    }
                )
            for r in step.runs:
                produced.append(
                    {
                        "type": "function_call",
                        "id": f"fc_{ids.getrandbits(64):016x}",
                        "name": r.name,
                        "arguments": json.dumps(r.arguments),
                        "call_id": r.call_id,
                    }
                )
            outputs = [
                {
                    "type": "function_call_output",
                    "id": f"fco_{ids.getrandbits(64):016x}",
                    "call_id": r.call_id,
                    "output": r.output,
                }
                for r in step.runs
            ]
            yield step, list(items), produced, outputs
            items += produced + outputs


def _input_message(ids: random.Random, role: str, text: str) -> dict[str, Any]:
    return {
        "type": "message",
        "id": f"msg_{ids.getrandbits(64):016x}",
        "role": role,
        "content": [{"type": "input_text", "text": text}],
    }


def _chat_steps(session: Session):
    messages: list[dict[str, Any]] = [{"role": "system", "content": session.system}]
    for turn in session.turns:
        messages.append({"role": "user", "content": turn.user})
        for step in turn.steps:
            yield step, list(messages)
            assistant: dict[str, Any] = {"role": "assistant", "content": step.content or ""}
            if step.reasoning:
                assistant["reasoning_content"] = step.reasoning
            if step.runs:
                assistant["tool_calls"] = [
                    {
                        "id": r.call_id,
                        "type": "function",
                        "function": {"name": r.name, "arguments": json.dumps(r.arguments)},
                    }
                    for r in step.runs
                ]
            messages.append(assistant)
            messages += [{"role": "tool", "tool_call_id": r.call_id, "content": r.output} for r in step.runs]


# -- bodies and traces ---------------------------------------------------------------------------


def anthropic_body(session: Session, messages: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "model": session.model,
        "messages": messages,
        "system": [{"type": "text", "text": session.system}],
        "tools": anthropic_tools(session),
        "max_tokens": 32000,
        "thinking": {"type": "adaptive"},
        "stream": True,
    }


def responses_body(session: Session, items: list[dict[str, Any]]) -> dict[str, Any]:
    meta = {"model": session.model, "base_instructions": session.system, "session_id": session.session_id}
    return build_body(meta, items, responses_tools(session), instructions_field=False)


def chat_body(session: Session, messages: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "model": session.model,
        "messages": messages,
        "tools": chat_tools(session),
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def to_trace(session: Session, protocol: ProtocolName) -> Trace:
    """The session as the requests an agent speaking `protocol` would send."""
    if protocol == "anthropic":
        pairs = [(s, anthropic_body(session, m)) for s, m, _, _ in _anthropic_steps(session)]
    elif protocol == "responses":
        pairs = [(s, responses_body(session, items)) for s, items, _, _ in _responses_items(session)]
    elif protocol == "chat":
        pairs = [(s, chat_body(session, m)) for s, m in _chat_steps(session)]
    else:
        raise ValueError(f"unknown protocol {protocol!r}")
    requests = [
        TraceRequest(protocol, body, output_of(s), is_tool_result_last(protocol, body), s.start, s.end)
        for s, body in pairs
    ]
    return Trace(session.session_id, "generated", f"seed:{session.seed}", requests, {"seed": session.seed})


def _turn_of(session: Session, step: Step) -> int:
    return next(i for i, turn in enumerate(session.turns) if any(s is step for s in turn.steps))


# -- writers -------------------------------------------------------------------------------------


def write_recording(session: Session, path: Path, protocol: ProtocolName = "chat") -> None:
    trace = to_trace(session, protocol)
    lines = [
        RecordLine(
            r.protocol,
            r.path,
            r.body,
            r.output,
            Timings(total_ms=round(((r.output_ts or 0.0) - (r.ts or 0.0)) * 1000, 1)),
            r.ts,
            session.session_id,
        )
        for r in trace.requests
    ]
    path.write_bytes(encode_jsonl(lines))


def write_codex(session: Session, path: Path) -> None:
    lines: list[dict[str, Any]] = []

    def emit(ts: float, kind: str, payload: dict[str, Any], metadata: dict[str, Any] | None = None) -> None:
        line = {"timestamp": iso(ts), "ordinal": len(lines), "type": kind, "payload": payload}
        if metadata:
            line["metadata"] = metadata
        lines.append(line)

    start = session.turns[0].ts
    emit(
        start,
        "session_meta",
        {
            "session_id": session.session_id,
            "id": session.session_id,
            "timestamp": iso(start),
            "cwd": session.cwd,
            "originator": "ft_generate",
            "cli_version": VERSION,
            "source": "exec",
            "model_provider": "ft",
            "base_instructions": {"text": session.system},
            "ft_tools": responses_tools(session),
        },
    )
    written = 0
    turn_index = -1
    for step, items, produced, outputs in _responses_items(session):
        turn = _turn_of(session, step)
        if turn != turn_index:
            turn_index = turn
            emit(session.turns[turn].ts, "event_msg", {"type": "task_started", "turn_id": f"turn-{turn}"})
            emit(
                session.turns[turn].ts,
                "turn_context",
                {"turn_id": f"turn-{turn}", "cwd": session.cwd, "model": session.model},
            )
        for item in items[written:]:
            emit(step.start, "response_item", item)
        seen = len(items)
        for item in produced:
            emit(step.end, "response_item", item, {"sampled_through_sequence": seen})
        for item in outputs:
            emit(
                step.end + next(r.seconds for r in step.runs if r.call_id == item["call_id"]),
                "response_item",
                item,
            )
        written = len(items) + len(produced) + len(outputs)
        if not step.runs:
            emit(
                step.end,
                "event_msg",
                {"type": "task_complete", "turn_id": f"turn-{turn}", "last_agent_message": step.content},
            )
    path.write_bytes(encode_jsonl(lines))


def write_claude(session: Session, path: Path) -> None:
    lines: list[dict[str, Any]] = []
    uuids = random.Random(f"uuid-{session.seed}")
    common = {"sessionId": session.session_id, "version": VERSION, "cwd": session.cwd, "userType": "external"}
    parent: str | None = None

    def chain(kind: str, ts: float, message: dict[str, Any], **extra: Any) -> None:
        nonlocal parent
        uuid = f"{uuids.getrandbits(128):032x}"
        lines.append(
            {
                "parentUuid": parent,
                "isSidechain": False,
                "type": kind,
                "message": message,
                "uuid": uuid,
                "timestamp": iso(ts),
                **extra,
                **common,
            }
        )
        parent = uuid

    shape = {"system": [{"type": "text", "text": session.system}], "tools": anthropic_tools(session)}
    shape_hash = hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()
    lines.append(
        {
            "type": "api-request-shape",
            "shapeHash": shape_hash,
            "shape": shape,
            "timestamp": iso(session.turns[0].ts),
            **common,
        }
    )
    previous: tuple[str, int] | None = None
    for step, messages, assistant, result in _anthropic_steps(session):
        turn = session.turns[_turn_of(session, step)]
        if turn.steps[0] is step:
            chain("user", turn.ts, {"role": "user", "content": turn.user})
        request_id = f"{uuids.getrandbits(128):032x}"
        kept = previous[1] if previous else 0
        tail = messages[kept:]
        for message in tail:
            if (
                len(message["content"]) > 1
                and message["role"] == "user"
                and not isinstance(message["content"], str)
            ):
                lines.append(
                    {"type": "api-request-blob", "hash": message_hash(message), "message": message, **common}
                )
        params = {"model": session.model, "max_tokens": 32000, "thinking": {"type": "adaptive"}}
        request: dict[str, Any] = {
            "type": "api-request",
            "id": request_id,
            "timestamp": iso(step.start),
            "shapeHash": shape_hash,
            "params": params,
        }
        if previous:
            request["base"] = previous[0]
        request.update(keep=kept, tail=[message_hash(m) for m in tail])
        lines.append({**request, **common})
        message_id = f"msg_{uuids.getrandbits(96):024x}"
        for block in assistant["content"]:
            message = {
                "id": message_id,
                "type": "message",
                "role": "assistant",
                "model": session.model,
                "content": [block],
            }
            chain("assistant", step.end, message, requestRef=request_id)
        if result:
            for block, run in zip(result["content"], step.runs, strict=True):
                chain("user", step.end + run.seconds, {"role": "user", "content": [block]})
        previous = (request_id, len(messages))
    path.write_bytes(encode_jsonl(lines))
