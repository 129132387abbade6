"""No growth or warm-up in a request's own steps: the real server (tiny preset, loopback port),
after warm-up, runs an agent's tool loop whose context crosses the decode slots' capacity at
warm-up and twice it. The worker grows the slots in its idle gaps (`Engine.grow_ahead`), so no
request that continues the session counts a growth event (`ft_growth_events` on /metrics: slot
growth, KV growth, graph captures, pinned slabs, allocator retries) between its start and its
first token (its prefill), each finds room for its whole answer, and the growth did happen: after
one request's prefill, before the next one. Counted in events, never in time.

The counters are read while the worker can grow nothing ahead: before a request with the server
idle, and at its first token (the response's headers go out with it) while its task still runs."""

from __future__ import annotations

import json

from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import start_server
from tests.gateway.test_server_anchors import TOOLS, tool_round

SYSTEM = "You are a careful coding agent."
OUTPUT_LINES = 40  # lines of each tool result: some 300 tokens, over half the slots' capacity after warm-up
COMMANDS = ["ls", "pytest -x", "cat log", "git diff", "make"]


def growth_events(client) -> dict[str, int]:
    """The server's growth events by kind, as /metrics exposes them."""
    text = client.get("/metrics").text
    family = next(f for f in text_string_to_metric_families(text) if f.name == "ft_growth_events")
    return {s.labels["kind"]: int(s.value) for s in family.samples if s.name == "ft_growth_events_total"}


def since(later: dict[str, int], earlier: dict[str, int]) -> dict[str, int]:
    return {kind: n - earlier[kind] for kind, n in later.items() if n != earlier[kind]}


def streamed(client, messages: list[dict], forced: dict) -> tuple[dict, dict, dict]:
    """One streamed request: the growth events at its first token, and its usage."""
    body = {"model": "tiny", "messages": messages, "tools": TOOLS, "ft_forced_output": forced, "stream": True,
            "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        first = growth_events(client)
        chunks = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:") and "[DONE]" not in line]
    usage = next(c["usage"] for c in chunks if c.get("usage"))
    return first, usage


def tool_turn(i: int, command: str, reasoning: str) -> list[dict]:
    """The assistant's call of `command` as the client sends it back, and its result."""
    call_id = f"call_{i}"
    call = {"id": call_id, "type": "function", "function": {"name": "bash", "arguments": json.dumps({"command": command})}}
    return [{"role": "assistant", "content": None, "reasoning_content": reasoning, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call_id, "content": f"output of {command} #{i}\n" * OUTPUT_LINES}]


def test_a_request_that_crosses_the_slot_capacity_grows_nothing_in_its_prefill():
    server = start_server(preset="tiny", policy="anchor")
    try:
        runner = server.runtime.engine.runner
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Fix the failing test."}]
        warm, gaps, contexts, first = runner.capacity, {}, [], None
        with server.client() as client:
            for i, command in enumerate(COMMANDS):
                server.wait_idle()  # the worker grew what it grows ahead
                capacity, before = runner.capacity, growth_events(client)
                if first is not None:  # since the last request's first token: its decode, end and the idle gap
                    for kind, n in since(before, first).items():
                        gaps[kind] = gaps.get(kind, 0) + n
                forced = tool_round(command)
                first, usage = streamed(client, messages, forced)
                contexts.append(usage["prompt_tokens"])
                if i:  # the first request starts the session: its fresh sequence's KV is its own
                    assert since(first, before) == {}, f"request {i} grew in its prefill ({contexts[-1]} tokens)"
                    assert usage["prompt_tokens"] + usage["completion_tokens"] <= capacity  # and needs no more
                messages += tool_turn(i, command, forced["reasoning"])
    finally:
        server.stop()
    assert contexts[0] < warm and contexts[-1] > 2 * warm, contexts  # crossed the capacity at warm-up and twice it
    assert gaps.get("slot_growth", 0) >= 2, gaps  # the slots grew ahead, outside the requests' prefills
