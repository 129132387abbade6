"""The sessions `bench/pressure.py` runs at once: committed traces, told apart, some spawning subagents.

A session is one trace's requests from its first, its first user message tagged with the session's
name (two sessions of one trace are two users' tasks: they share the system prompt and tools, not
the history). A subagent is a session copy on its parent's prefix: another trace's requests of the
same protocol with the parent's system prompt and tools, started once its parent's `SPAWN_AFTER`-th
answer is in. Before each request a session waits the tool (or user) time its trace recorded
(`ts` minus the previous `output_ts`), or where the trace has none, a seeded lognormal draw; either
times `time_scale`.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass
from typing import Any

from adapters.trace import Trace, TraceRequest

SPAWN_AFTER = 1  # a subagent starts after its parent's first answer
LOGNORMAL = (0.5, 1.2)  # mu, sigma of a drawn tool time in seconds: median 1.6 s, a heavy tail


@dataclass(frozen=True)
class Session:
    name: str
    protocol: str
    requests: list[TraceRequest]
    waits_s: list[float]  # before each request (the first: 0)
    trace: str  # the file its turns come from
    parent: str | None = None  # a subagent's parent session


def build_sessions(traces: list[Trace], n: int, subagent_share: float, turns: int, time_scale: float,
                   seed: int, draw_all: bool = False) -> list[Session]:
    """`n` sessions: round(n * share) subagents of the others (each of a parent whose protocol has a
    second trace to take turns from), the rest round-robin over `traces`, each `turns` requests at most."""
    rng = random.Random(seed)
    num_subagents = min(round(n * subagent_share), n - 1)
    roots = [_session(f"s{i}", traces[i % len(traces)], turns, time_scale, rng, draw_all) for i in range(n - num_subagents)]
    sessions = list(roots)
    parents = [r for r in roots if _donors(traces, r)]
    for j in range(num_subagents if parents else 0):
        parent = parents[j % len(parents)]
        donors = _donors(traces, parent)
        donor = _session(f"{parent.name}.a{j}", donors[j % len(donors)], turns, time_scale, rng, draw_all)
        requests = [_on_prefix(r, parent.requests[0]) for r in donor.requests]
        sessions.append(Session(donor.name, donor.protocol, requests, donor.waits_s, donor.trace, parent.name))
    return sessions


def _donors(traces: list[Trace], session: Session) -> list[Trace]:
    """Other traces of the session's protocol, to take a subagent's turns from."""
    return [t for t in traces if t.protocol == session.protocol and t.requests and t.path != session.trace]


def _session(name: str, trace: Trace, turns: int, time_scale: float, rng: random.Random,
             draw_all: bool) -> Session:
    requests = [_tagged(r, name) for r in trace.requests[:turns]]
    waits = [0.0]
    for before, after in zip(trace.requests, trace.requests[1:turns], strict=False):
        recorded = after.ts - before.output_ts if after.ts and before.output_ts else None
        gap = recorded if recorded is not None and recorded >= 0 and not draw_all else rng.lognormvariate(*LOGNORMAL)
        waits.append(gap * time_scale)
    return Session(name, trace.protocol or "", requests, waits, trace.path)


# -- request bodies ------------------------------------------------------------------------------


def _tagged(req: TraceRequest, tag: str) -> TraceRequest:
    """The request with `[tag] ` before the text of its first user message."""
    body = copy.deepcopy(req.body)
    for message in _history(req.protocol, body):
        if message.get("role") == "user":
            _prepend(message, f"[{tag}] ")
            break
    return TraceRequest(req.protocol, body, req.output, req.after_tool_result, req.ts, req.output_ts,
                        req.fidelity, req.why)


def _prepend(message: dict[str, Any], text: str) -> None:
    content = message.get("content")
    if isinstance(content, str) or content is None:
        message["content"] = text + (content or "")
        return
    for block in content:
        if isinstance(block, dict) and block.get("type") in ("text", "input_text"):
            block["text"] = text + block.get("text", "")
            return
    content.insert(0, {"type": "input_text" if "input" in str(content) else "text", "text": text})


def _on_prefix(req: TraceRequest, parent: TraceRequest) -> TraceRequest:
    """`req` under `parent`'s system prompt and tools (the subagent's turns are `req`'s own)."""
    body, source = copy.deepcopy(req.body), parent.body
    for key in ("system", "instructions", "tools"):
        body.pop(key, None)
        if key in source:
            body[key] = copy.deepcopy(source[key])
    history, theirs = _history(req.protocol, body), _history(req.protocol, source)
    history[: _leading_system(history)] = copy.deepcopy(theirs[: _leading_system(theirs)])
    return TraceRequest(req.protocol, body, req.output, req.after_tool_result, req.ts, req.output_ts,
                        req.fidelity, req.why)


def _history(protocol: str | None, body: dict[str, Any]) -> list[dict[str, Any]]:
    items = body.get("input") if protocol == "responses" else body.get("messages")
    return items if isinstance(items, list) else []


def _leading_system(history: list[dict[str, Any]]) -> int:
    """How many system or developer messages open the history (chat's and Responses' system prompt)."""
    n = 0
    while n < len(history) and history[n].get("role") in ("system", "developer"):
        n += 1
    return n
