"""Anchor behaviour on the live server, asserted on the gateway's own prefilled/cached
counts (response headers), with outputs teacher-forced so every request is deterministic."""

from __future__ import annotations

import json
import threading

import pytest

from adapters.client import http_wait_idle
from gateway.protocols import chat
from gateway.render import segment_ids
from tests.conftest import start_server

SYSTEM = "You are a careful coding agent. " * 40
TOOLS = [{"type": "function", "function": {
    "name": "bash", "description": "Run a shell command",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]


def tokens(metrics, kind: str) -> int:
    """The server's count of prompt tokens of `kind` so far (its ft_tokens_total counter)."""
    return int(metrics.registry.get_sample_value("ft_tokens_total", {"kind": kind}))


def call(client, messages, forced, tools=TOOLS):
    body = {"model": "tiny", "messages": messages, "tools": tools, "ft_forced_output": forced}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert int(r.headers["x-cached-tokens"]) == usage["prompt_tokens_details"]["cached_tokens"]
    assert int(r.headers["x-prefill-tokens"]) + int(r.headers["x-cached-tokens"]) == usage["prompt_tokens"]
    phases = dict(item.split(";dur=") for item in r.headers["server-timing"].split(", "))
    assert list(phases) == ["plan", "queue", "restore", "prefill"]
    assert all(float(ms) >= 0 for ms in phases.values())
    assert abs(sum(map(float, phases.values())) - float(r.headers["x-server-ttft-ms"])) <= 0.3  # rounding
    return r.json(), int(r.headers["x-cached-tokens"]), int(r.headers["x-prefill-tokens"])


def assistant_turn(response, reasoning):
    msg = response["choices"][0]["message"]
    out = {"role": "assistant", "content": msg.get("content"), "reasoning_content": reasoning}
    if msg.get("tool_calls"):
        out["tool_calls"] = msg["tool_calls"]
    return out


def tool_round(command):
    return {"reasoning": f"I will run {command}.", "tool_calls": [{"name": "bash", "arguments": {"command": command}}]}


def prompt_segments(server, messages):
    conv = chat.parse_request({"model": "tiny", "messages": messages, "tools": TOOLS})
    return server.runtime.renderer.render(conv, server.runtime.memo)


@pytest.fixture(scope="module")
def server():
    s = start_server(preset="tiny", policy="anchor")
    yield s
    s.stop()


def run_tool_loop(server, client, user_text, commands, final="All done.", output_lines=20):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user_text}]
    counts = []
    for i, command in enumerate([*commands, None]):
        forced = tool_round(command) if command else {"reasoning": "Summarise.", "content": final}
        response, cached, prefilled = call(client, messages, forced)
        counts.append((cached, prefilled, response["usage"]["prompt_tokens"], response["usage"]["completion_tokens"]))
        messages.append(assistant_turn(response, forced["reasoning"]))
        if command:
            tool_id = response["choices"][0]["message"]["tool_calls"][0]["id"]
            messages.append({"role": "tool", "tool_call_id": tool_id, "content": f"output of {command} #{i}\n" * output_lines})
    return messages, counts


def test_appending_a_tool_result_reprefills_only_the_new_tokens(server):
    with server.client() as client:
        _, counts = run_tool_loop(server, client, "Fix the failing test.", ["ls", "pytest -x"])
    for (_, _, prompt, generated), (cached, prefilled, next_prompt, _) in zip(counts, counts[1:], strict=False):
        assert cached == prompt + generated  # the whole previous prompt and generation restored
        assert prefilled == next_prompt - cached  # only the tool result and the generation prompt


@pytest.mark.parametrize("wait", ["in process", "over HTTP"])
def test_new_user_message_after_tool_loop_pays_only_for_itself_once_precomputed(server, wait):
    with server.client() as client:
        # a long tool result: the precompute takes long enough to still run when a careless wait returns
        messages, _ = run_tool_loop(
            server, client, f"Rename the helper ({wait}).", ["grep -r helper ."], output_lines=1500
        )
        # precompute of the next turn's history (reasoning dropped) has run; over HTTP, /health
        # says when the worker is idle (what `ft replay` and bench/llamacpp.py wait on)
        server.wait_idle() if wait == "in process" else http_wait_idle(server.url)()
        messages.append({"role": "user", "content": "Thanks. Now add a test for it."})
        continued = tokens(server.runtime.metrics, "continued")
        _, cached, prefilled = call(client, messages, {"reasoning": "ok", "content": "Sure."})
    assert tokens(server.runtime.metrics, "continued") - continued == cached  # the precomputed sequence, in place
    segments = prompt_segments(server, messages)
    new_tail = segments[-2:]  # the new user message and the generation prompt
    assert [s.kind for s in new_tail] == ["user", "generation_prompt"]
    assert prefilled == len(segment_ids(new_tail))


def test_editing_a_middle_tool_result_reprefills_from_that_result_on(server):
    with server.client() as client:
        messages, _ = run_tool_loop(server, client, "Profile the build.", ["make", "make test", "make bench"])
        tool_positions = [i for i, m in enumerate(messages) if m["role"] == "tool"]
        edited = json.loads(json.dumps(messages[:-1]))  # resend the last request, with its second result edited
        edited[tool_positions[1]]["content"] = "a different output\n" * 20
        _, cached, prefilled = call(client, edited, {"reasoning": "again", "content": "Done."})
    segments = prompt_segments(server, edited)
    edited_index = tool_positions[1] - 1  # the leading system message is not in Conversation.messages
    first_changed = next(i for i, s in enumerate(segments) if s.message_index == edited_index)
    assert segments[first_changed].kind == "tool_result"
    assert cached == len(segment_ids(segments[:first_changed]))
    assert prefilled == len(segment_ids(segments[first_changed:]))


def test_a_second_session_reuses_the_shared_system_prompt_and_tools(server):
    with server.client() as client:
        run_tool_loop(server, client, "First session task.", ["ls"])
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "A different task entirely."}]
        _, cached, prefilled = call(client, messages, {"reasoning": "hm", "content": "ok"})
    segments = prompt_segments(server, messages)
    shared = [s for s in segments if s.kind in ("system", "tools")]
    assert shared and cached == len(segment_ids(shared))


def test_policies_rank_anchor_below_prefix_below_none_on_a_new_user_turn():
    totals = {}
    for policy in ("anchor", "prefix", "none"):
        s = start_server(preset="tiny", policy=policy)
        try:
            with s.client() as client:
                messages, counts = run_tool_loop(s, client, "Investigate the crash.", ["ls", "cat log"])
                s.wait_idle()
                messages.append({"role": "user", "content": "Now fix it."})
                _, _, prefilled = call(client, messages, {"reasoning": "fixing", "content": "Fixed."})
            totals[policy] = sum(c[1] for c in counts) + prefilled
        finally:
            s.stop()
    assert totals["anchor"] < totals["prefix"] < totals["none"]


def continuation_answers(server) -> list[tuple[dict, int, int]]:
    """A tool round trip, then the same greedy follow-up twice: first continuing the live sequence,
    then (it moved on) restored from the store. (answer message, cached tokens, continued tokens)"""
    metrics = server.runtime.metrics
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Count the files."}]
    with server.client() as client:
        response, _, _ = call(client, messages, tool_round("ls | wc -l"))
        tool_id = response["choices"][0]["message"]["tool_calls"][0]["id"]
        messages += [
            assistant_turn(response, "I will run ls | wc -l."),
            {"role": "tool", "tool_call_id": tool_id, "content": "42\n"},
        ]
        body = {"model": "tiny", "messages": messages, "tools": TOOLS, "max_tokens": 24, "temperature": 0}
        answers = []
        for _ in range(2):
            before = tokens(metrics, "continued")
            r = client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            answers.append((r.json()["choices"][0]["message"], int(r.headers["x-cached-tokens"]),
                            tokens(metrics, "continued") - before))
    return answers


def assert_continuation_is_exact(answers: list[tuple[dict, int, int]]) -> None:
    (first, cached_first, continued_first), (second, cached_second, continued_second) = answers
    assert continued_first == cached_first > 0
    assert continued_second == 0 and cached_second >= cached_first  # the first stored its prompt's checkpoints
    assert first == second


def test_a_request_extending_the_last_answer_continues_it_in_place_exactly(server):
    """The previous answer's end is the live sequence: the next request continues it with no
    restore copy, and answers exactly as a restore from the store does."""
    assert_continuation_is_exact(continuation_answers(server))


def test_a_new_user_turn_rewinds_the_answer_to_its_prompt_and_answers_as_a_restore():
    """Qwen's template drops an answer's reasoning once a new user message follows, so the next
    request shares the answer's sequence only up to the user message before it. With no precompute
    (the `user` policy: states at client messages) the kept sequence is rewound there, its KV in
    place and only the DeltaNet states copied in: the same greedy answer as a restore from the
    store (live sequences off), the prefix counted as continued."""
    results = []
    for live_sequences in (4, 0):
        s = start_server(preset="tiny", policy="user", live_sequences=live_sequences)
        try:
            with s.client() as client:
                messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Explain the bug."}]
                forced = {"reasoning": "Think it over first.", "content": "It is an off-by-one."}
                response, _, _ = call(client, messages, forced)
                messages += [assistant_turn(response, forced["reasoning"]), {"role": "user", "content": "Fix it."}]
                s.wait_idle()
                before = tokens(s.runtime.metrics, "continued")
                body = {"model": "tiny", "messages": messages, "tools": TOOLS, "max_tokens": 24, "temperature": 0}
                r = client.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                results.append((r.json()["choices"][0]["message"], int(r.headers["x-cached-tokens"]),
                                tokens(s.runtime.metrics, "continued") - before))
        finally:
            s.stop()
    (rewound, cached, continued), (restored, cached_restored, continued_restored) = results
    assert cached == cached_restored > 0
    assert continued == cached and continued_restored == 0
    assert rewound == restored


def test_precompute_leaves_the_answers_own_sequence_live():
    """Precompute restores its prefix by a copy (in the gaps, off any request's path), not by
    rewinding the answer's sequence, which stays kept beside the precomputed history for a request
    that extends the answer as it was generated."""
    s = start_server(preset="tiny", policy="anchor")
    try:
        with s.client() as client:
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Summarise the repo."}]
            call(client, messages, {"reasoning": "Look first.", "content": "It is small."})
        s.wait_idle()
        assert tokens(s.runtime.metrics, "precomputed") > 0
        assert len(s.runtime.live) == 2
    finally:
        s.stop()


@pytest.mark.parametrize("live_sequences", [0, 1, 2])
def test_interleaved_sessions_each_continue_in_place_while_kept(live_sequences):
    """Two sessions take turns (as a client's side requests interleave with its main loop): with
    room for two live sequences each follow-up continues its own; with one, each answer replaces
    the other session's and every follow-up restores from the store; with none, nothing continues."""
    s = start_server(preset="tiny", policy="anchor", live_sequences=live_sequences)
    metrics = s.runtime.metrics
    sessions = {name: [{"role": "system", "content": f"{name}: " + SYSTEM}, {"role": "user", "content": "Go."}]
                for name in ("main", "side")}
    try:
        with s.client() as client:
            for name, messages in sessions.items():
                response, _, _ = call(client, messages, tool_round(f"ls {name}"))
                tool_id = response["choices"][0]["message"]["tool_calls"][0]["id"]
                messages += [assistant_turn(response, f"I will run ls {name}."),
                             {"role": "tool", "tool_call_id": tool_id, "content": f"{name}.txt\n"}]
            continued = {}
            for name, messages in sessions.items():
                before = tokens(metrics, "continued")
                _, cached, _ = call(client, messages, {"reasoning": "ok", "content": "Done."})
                continued[name] = (tokens(metrics, "continued") - before, cached)
        if live_sequences == 2:
            assert all(n == cached > 0 for n, cached in continued.values())
        else:
            assert all(n == 0 < cached for n, cached in continued.values())
    finally:
        s.stop()


def test_the_answer_is_sent_before_its_checkpoints_are_stored():
    """The response ends once the answer is complete; storing the prompt's checkpoints (and the
    generation end, and scheduling precompute) happens after, off the client's wait. The store is
    held shut by the test until the response has arrived."""
    s = start_server(preset="tiny", policy="anchor")
    gate = threading.Event()
    put = s.runtime.store.put

    def held_put(*args, **kwargs):
        assert gate.wait(60), "the response never arrived while the store was held"
        return put(*args, **kwargs)

    s.runtime.store.put = held_put
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Say hi."}]
    try:
        with s.client() as client:
            _, cached, _ = call(client, messages, {"reasoning": "hi", "content": "Hi."})
            assert cached == 0 and not s.runtime.scheduler.idle  # answered; the worker is still storing
            gate.set()
            s.wait_idle()
            _, cached, _ = call(client, messages, {"reasoning": "hi", "content": "Hi."})
        assert cached > 0  # and what it stored afterwards is used
    finally:
        gate.set()
        s.stop()
