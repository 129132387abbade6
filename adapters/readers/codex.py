"""Codex CLI rollout files (`~/.codex/sessions/YYYY/MM/DD/rollout-*.jsonl`) -> Responses API traces.

A rollout logs the conversation history item by item (`response_item` lines) together with
bookkeeping (`event_msg`, `world_state`, `token_usage_record`, ...; ignored here). Each model
call's `input` is the history up to the point where the model produced its next output
items. Codex 0.171 stamps each output item with `metadata.sampled_through_sequence` (the
last history item the call saw), which separates back-to-back calls exactly; without it a
call is a maximal run of output items.

What a rollout does not hold comes from the profile of its CLI version
(`codex_profiles.py`): the tool schemas, `tool_choice` / `parallel_tool_calls` / `reasoning`
/ `store` / `include`, and the sections Codex cuts from its base instructions before sending
them. A version without a profile is rebuilt with the nearest one, with a warning, and its
requests are marked approximate. Rollouts our generator writes carry their tools in
`session_meta.payload.ft_tools` (no profile needed); the `tools` argument overrides both.
`client_metadata` gets the ids the rollout has (session, thread, turn, root turn), not the
installation id or the turn-metadata header; the base-instructions item goes without its `id`.
Codex sends the base instructions as the first `developer` message (no `instructions` field);
`instructions_field=True` uses the field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from adapters.readers.codex_profiles import CodexProfile, nearest_profile, profiles
from adapters.readers.common import (
    Problems,
    TraceError,
    iter_jsonl,
    join_texts,
    log,
    parse_arguments,
    parse_ts,
)
from adapters.trace import AssistantOutput, ToolCall, Trace, TraceRequest, is_tool_result_last

OUTPUT_TYPES = {"reasoning", "function_call", "custom_tool_call", "local_shell_call", "web_search_call"}
INPUT_TYPES = {"message", "function_call_output", "custom_tool_call_output"}
PRIVATE_KEYS = ("internal_chat_message_metadata_passthrough",)
DEFAULT_PARAMS = {
    "reasoning": {"summary": "auto"},
    "store": False,
    "include": ["reasoning.encrypted_content"],
}


class _ModelCall:
    """One model call being assembled: its input snapshot, the turn it belongs to and the
    output items it produced."""

    def __init__(
        self, items: list[dict[str, Any]], sampled: Any, ts: float | None, turn: dict[str, Any]
    ) -> None:
        self.input = list(items)
        self.sampled = sampled
        self.ts = ts
        self.output_ts = ts
        self.turn = turn
        self.outputs: list[dict[str, Any]] = []


def is_output_item(item: dict[str, Any]) -> bool:
    """Whether a history item was produced by the model (as opposed to sent to it)."""
    if item.get("type") == "message":
        return item.get("role") == "assistant"
    return item.get("type") in OUTPUT_TYPES


def output_of(items: list[dict[str, Any]]) -> AssistantOutput:
    """The protocol-neutral assistant message of one call's output items."""
    reasoning: list[str] = []
    content: list[str] = []
    calls: list[ToolCall] = []
    for item in items:
        kind = item.get("type")
        if kind == "reasoning":
            texts = [c.get("text", "") for c in item.get("content") or [] if isinstance(c, dict)]
            if not any(texts):
                texts = [s.get("text", "") for s in item.get("summary") or [] if isinstance(s, dict)]
            reasoning.extend(texts)
        elif kind == "message":
            content.extend(c.get("text", "") for c in item.get("content") or [] if isinstance(c, dict))
        elif kind == "function_call":
            calls.append(ToolCall(item["name"], parse_arguments(item.get("arguments"))))
        elif kind == "custom_tool_call":
            calls.append(ToolCall(item["name"], {"input": item.get("input", "")}))
        elif kind == "local_shell_call":
            calls.append(ToolCall("local_shell", parse_arguments(item.get("action"))))
    return AssistantOutput(join_texts(reasoning), join_texts(content), calls)


def wire_item(payload: dict[str, Any]) -> dict[str, Any]:
    """A rollout item as Codex sends it: private bookkeeping keys removed."""
    return {k: v for k, v in payload.items() if k not in PRIVATE_KEYS}


def build_body(
    meta: dict[str, Any],
    items: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    instructions_field: bool,
    profile: CodexProfile | None = None,
    turn: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The Responses API body Codex sends for one call whose history is `items`; `profile`
    trims the base instructions and gives the parameters, `turn` the ids of `client_metadata`."""
    base = meta.get("base_instructions")
    if base and profile is not None:
        base = profile.instructions(base)
    body: dict[str, Any] = {"model": meta.get("model") or "codex", "stream": True}
    if base and instructions_field:
        body["instructions"] = base
        body["input"] = items
    elif base:
        developer = {
            "type": "message",
            "role": "developer",
            "content": [{"type": "input_text", "text": base}],
        }
        body["input"] = [developer, *items]
    else:
        body["input"] = items
    if tools:
        body.update(tools=tools, tool_choice="auto", parallel_tool_calls=True)
    body.update(profile.params if profile is not None else DEFAULT_PARAMS)
    if meta.get("session_id"):
        body["prompt_cache_key"] = meta["session_id"]
    if turn and meta.get("session_id"):
        ids = {"session_id": meta["session_id"], "thread_id": meta.get("thread_id") or meta["session_id"]}
        body["client_metadata"] = {**ids, **turn}
    return body


class _Rollout:
    """The history as it grows line by line, and the model calls cut from it."""

    def __init__(self) -> None:
        self.meta: dict[str, Any] = {}
        self.items: list[dict[str, Any]] = []
        self.calls: list[_ModelCall] = []
        self.current: _ModelCall | None = None  # the call still collecting output items
        self.last_ts: float | None = None
        self.turn: dict[str, Any] = {}  # ids of the current turn (from turn_context)

    def add_line(self, line: dict[str, Any]) -> None:
        kind, payload = line["type"], line.get("payload")
        if not isinstance(payload, dict):
            raise TypeError("payload is not an object")
        if kind == "session_meta":
            self._read_meta(payload)
        elif kind == "turn_context":
            self.meta["model"] = payload.get("model") or self.meta.get("model")
            self.turn = {
                k: payload[k] for k in ("turn_id", "root_turn_id") if isinstance(payload.get(k), str)
            }
        elif kind == "compacted" and isinstance(payload.get("replacement_history"), list):
            self.items, self.current = [wire_item(i) for i in payload["replacement_history"]], None
        elif kind == "response_item":
            self._add_item(payload, line)

    def _read_meta(self, payload: dict[str, Any]) -> None:
        base = payload.get("base_instructions")
        self.meta["base_instructions"] = base.get("text") if isinstance(base, dict) else base
        self.meta["session_id"] = payload.get("session_id") or payload.get("id")
        self.meta["thread_id"] = payload.get("id")
        for key in ("cli_version", "cwd", "originator", "model_provider", "ft_tools"):
            if payload.get(key) is not None:
                self.meta[key] = payload[key]

    def _add_item(self, payload: dict[str, Any], line: dict[str, Any]) -> None:
        kind = payload["type"]
        if kind not in OUTPUT_TYPES and kind not in INPUT_TYPES:
            return  # items Codex keeps for itself (ghost snapshots, ...)
        item = wire_item(payload)
        ts = parse_ts(line.get("timestamp"))
        if not is_output_item(item):
            self.items.append(item)
            self.current, self.last_ts = None, ts
            return
        sampled = (line.get("metadata") or {}).get("sampled_through_sequence")
        if self.current is None or (sampled is not None and sampled != self.current.sampled):
            # the request left when its last input was logged
            self.current = _ModelCall(self.items, sampled, self.last_ts or ts, self.turn)
            self.calls.append(self.current)
        self.current.outputs.append(item)
        self.current.output_ts = ts or self.current.output_ts
        self.items.append(item)
        self.last_ts = ts


def read_codex(
    path: str | Path,
    *,
    strict: bool = False,
    problems: list[TraceError] | None = None,
    tools: list[dict[str, Any]] | None = None,
    instructions_field: bool = False,
) -> list[Trace]:
    """Read one Codex rollout file into a single Responses-protocol `Trace`.

    Malformed lines are reported with file and line number: skipped (appended to
    `problems` and logged) or, when `strict`, raised as `TraceError`.
    """
    path = Path(path)
    report = Problems(strict, problems)
    rollout = _Rollout()
    for number, line in iter_jsonl(path, report):
        try:
            rollout.add_line(line)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            report.report(path, number, f"malformed {line.get('type', 'line')} line: {exc!r}")
    meta = rollout.meta
    generated_tools = meta.pop("ft_tools", None)
    profile, why = None, None
    if generated_tools is None:
        profile, why = _profile_for(meta, path)
        generated_tools = profile.tools
    tools = tools if tools is not None else generated_tools
    requests = []
    for call in rollout.calls:
        turn = call.turn if profile is not None else None  # generated rollouts: the generator's body
        body = build_body(meta, call.input, tools, instructions_field, profile, turn)
        after_tool = is_tool_result_last("responses", body)
        output = output_of(call.outputs)
        fidelity = "approximate" if why else "identical"
        requests.append(
            TraceRequest("responses", body, output, after_tool, call.ts, call.output_ts, fidelity, why)
        )
    meta.pop("base_instructions", None)
    meta.pop("thread_id", None)
    return [Trace(meta.get("session_id") or path.stem, "codex", str(path), requests, meta)]


def _profile_for(meta: dict[str, Any], path: Path) -> tuple[CodexProfile, str | None]:
    """The profile of the rollout's CLI version, and why the rebuild is approximate (None if not)."""
    version, originator = meta.get("cli_version"), meta.get("originator")
    profile = nearest_profile(version)
    if version not in profiles():
        why = (
            f"Codex {version or '(no cli_version)'} has no profile (known: {', '.join(profiles())}): "
            f"tools, parameters and instruction trimming of {profile.version} used"
        )
        log.warning("%s: %s", path, why)
        return profile, why
    if originator and originator != profile.originator:
        why = f"profile captured from {profile.originator}, rollout written by {originator}: tools may differ"
        return profile, why
    return profile, None
