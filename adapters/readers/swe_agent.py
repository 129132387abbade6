"""SWE-agent trajectories (`.traj` JSON) -> Chat Completions traces.

`history` holds every message the agent sent to its model, in order: the system prompt,
user messages (the task, demonstrations, observations), assistant messages (`thought` +
`action`, with `tool_calls` in function-calling runs) and `tool` observations. Each
assistant message is one model call whose prompt is everything before it. The tool schemas
are not stored in a trajectory; for function-calling runs they are inferred from the calls
made (argument names and JSON types; required = present in every call).

In the non-function-calling runs an observation comes back as a `user` message; a request
ending in one after the agent's first action still counts as following a tool result.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from adapters.readers.common import Problems, TraceError, parse_arguments, read_bytes
from adapters.trace import AssistantOutput, ToolCall, Trace, TraceRequest, is_tool_result_last

INFERRED_TOOLS = "tool schemas inferred from the calls made (a trajectory does not record them)"
JSON_TYPES = {str: "string", bool: "boolean", int: "integer", float: "number", list: "array", dict: "object"}


def chat_message(entry: dict[str, Any]) -> dict[str, Any]:
    """A history entry as a Chat Completions message (SWE-agent's bookkeeping keys dropped)."""
    role = entry["role"]
    message: dict[str, Any] = {"role": role, "content": entry.get("content", "")}
    if role == "assistant" and entry.get("tool_calls"):
        message["tool_calls"] = entry["tool_calls"]
    if role == "tool":
        ids = entry.get("tool_call_ids") or [entry.get("tool_call_id")]
        message["tool_call_id"] = ids[0]
    return message


def output_of(entry: dict[str, Any]) -> AssistantOutput:
    """What the model answered: its text, and its tool calls when it used function calling."""
    calls = [
        ToolCall(call["function"]["name"], parse_arguments(call["function"].get("arguments")))
        for call in entry.get("tool_calls") or []
    ]
    content = entry.get("content")
    return AssistantOutput(None, content if isinstance(content, str) and content else None, calls)


def infer_tools(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat Completions tool schemas inferred from the tool calls a trajectory made."""
    seen: dict[str, list[dict[str, Any]]] = {}
    for entry in history:
        for call in entry.get("tool_calls") or []:
            function = call["function"]
            seen.setdefault(function["name"], []).append(parse_arguments(function.get("arguments")))
    tools = []
    for name, calls in seen.items():
        properties: dict[str, Any] = {}
        for args in calls:
            for key, value in args.items():
                properties.setdefault(key, {"type": JSON_TYPES.get(type(value), "string")})
        required = [key for key in properties if all(key in args for args in calls)]
        parameters = {"type": "object", "properties": properties, "required": required}
        tools.append(
            {
                "type": "function",
                "function": {
                    "name": name,
                    "description": f"SWE-agent command `{name}`.",
                    "parameters": parameters,
                },
            }
        )
    return tools


def read_swe_agent(
    path: str | Path, *, strict: bool = False, problems: list[TraceError] | None = None
) -> list[Trace]:
    """Read one SWE-agent `.traj` file into a single Chat-protocol `Trace`.

    A file that is not a trajectory, or a history entry that is malformed, is reported
    (with the entry's index in place of a line number): skipped, or raised when `strict`.
    """
    path = Path(path)
    report = Problems(strict, problems)
    try:
        data = json.loads(read_bytes(path).decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        report.report(path, getattr(exc, "lineno", None), f"not a readable JSON trajectory: {exc}")
        return []
    history = data.get("history") if isinstance(data, dict) else None
    if not isinstance(history, list):
        report.report(path, None, "no `history` list: not a SWE-agent trajectory")
        return []
    model = _model_name(data)
    tools = infer_tools([e for e in history if isinstance(e, dict)])
    messages: list[dict[str, Any]] = []
    requests: list[TraceRequest] = []
    agent = history[0].get("agent") if history and isinstance(history[0], dict) else None
    for index, entry in enumerate(history):
        try:
            if entry.get("agent", agent) != agent:
                continue
            if entry["role"] == "assistant":
                body: dict[str, Any] = {"model": model, "messages": list(messages)}
                if tools:
                    body["tools"] = tools
                body["stream"] = True
                after_tool = is_tool_result_last("chat", body) or _ends_in_observation(messages)
                output = output_of(entry)
                fidelity, why = ("approximate", INFERRED_TOOLS) if tools else ("identical", None)
                requests.append(TraceRequest("chat", body, output, after_tool, None, None, fidelity, why))
            messages.append(chat_message(entry))
        except (KeyError, TypeError, IndexError, AttributeError) as exc:
            report.report(path, None, f"history[{index}] is malformed: {exc!r}")
    meta = {"exit_status": (data.get("info") or {}).get("exit_status"), "function_calling": bool(tools)}
    return [Trace(path.stem, "swe-agent", str(path), requests, meta)]


def _ends_in_observation(messages: list[dict[str, Any]]) -> bool:
    """A text-mode observation: a user message answering an earlier assistant action."""
    return (
        bool(messages) and messages[-1]["role"] == "user" and any(m["role"] == "assistant" for m in messages)
    )


def _model_name(data: dict[str, Any]) -> str:
    config = data.get("replay_config")
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except json.JSONDecodeError:
            config = None
    name = (
        ((config or {}).get("agent") or {}).get("model", {}).get("name") if isinstance(config, dict) else None
    )
    return name or "swe-agent"
