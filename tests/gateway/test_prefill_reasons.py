"""Why prefilled tokens were not restored, on the live server: each reason produced by a constructed
case, read from the `x-prefill-reasons` header and from `ft_prefill_tokens_by_reason_total`, whose
counts sum to the tokens prefilled. Outputs are teacher-forced, so every request is deterministic."""

from __future__ import annotations

import json

import pytest

from gateway.anchors import anchor_chain
from gateway.prefill_reasons import REASONS
from gateway.protocols import chat
from gateway.render import segment_ids
from tests.conftest import start_server

SYSTEM = "You are a careful coding agent. " * 40
TOOLS = [{"type": "function", "function": {
    "name": "bash", "description": "Run a shell command",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]


def parse_reasons(header: str) -> dict[str, int]:
    return {name: int(n) for name, _, n in (item.partition("=") for item in header.split(", ")) if name}


def counted(server) -> dict[str, int]:
    """The server's prefilled tokens by reason so far (ft_prefill_tokens_by_reason_total)."""
    registry = server.runtime.metrics.registry
    return {r: int(registry.get_sample_value("ft_prefill_tokens_by_reason_total", {"reason": r})) for r in REASONS}


class Answer:
    """One answered request: its body, token counts and reasons, each reason's count checked against
    the metric's growth and their sum against the tokens prefilled."""

    def __init__(self, server, path: str, body: dict):
        before = counted(server)
        with server.client() as client:
            if body.get("stream"):
                with client.stream("POST", path, json=body) as r:
                    assert r.status_code == 200, r.read()
                    r.read()
                self.json = None
            else:
                r = client.post(path, json=body)
                assert r.status_code == 200, r.text
                self.json = r.json()
        self.cached, self.prefilled = int(r.headers["x-cached-tokens"]), int(r.headers["x-prefill-tokens"])
        self.reasons = parse_reasons(r.headers["x-prefill-reasons"])
        self.edited_at = r.headers.get("x-prefill-edited-at")
        assert set(self.reasons) <= set(REASONS) and all(n > 0 for n in self.reasons.values())
        assert sum(self.reasons.values()) == self.prefilled
        after = counted(server)
        assert {r: after[r] - before[r] for r in REASONS} == {r: self.reasons.get(r, 0) for r in REASONS}

    @property
    def completion_tokens(self) -> int:
        return self.json["usage"]["completion_tokens"]

    @property
    def prompt_tokens(self) -> int:
        return self.cached + self.prefilled


def chat_call(server, messages, forced, tools=TOOLS) -> Answer:
    body = {"model": "tiny", "messages": messages, "ft_forced_output": forced}
    if tools:
        body["tools"] = tools
    return Answer(server, "/v1/chat/completions", body)


def assistant_turn(answer: Answer, reasoning: str) -> dict:
    msg = answer.json["choices"][0]["message"]
    out = {"role": "assistant", "content": msg.get("content"), "reasoning_content": reasoning}
    if msg.get("tool_calls"):
        out["tool_calls"] = msg["tool_calls"]
    return out


def run_tool_loop(server, user_text, commands, final="All done.", output=None):
    """A session: one tool call per command (its result `output`, else one of its own), then a final
    answer. Returns its messages and answers."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user_text}]
    answers = []
    for i, command in enumerate([*commands, None]):
        reasoning = f"I will run {command}." if command else "Summarise."
        forced = ({"reasoning": reasoning, "tool_calls": [{"name": "bash", "arguments": {"command": command}}]}
                  if command else {"reasoning": reasoning, "content": final})
        answer = chat_call(server, messages, forced)
        answers.append(answer)
        messages.append(assistant_turn(answer, reasoning))
        if command:
            call_id = answer.json["choices"][0]["message"]["tool_calls"][0]["id"]
            result = output or f"output of {command} #{i}\n" * 20
            messages.append({"role": "tool", "tool_call_id": call_id, "content": result})
    return messages, answers


def prompt_segments(server, messages, tools=TOOLS):
    body = {"model": "tiny", "messages": messages, **({"tools": tools} if tools else {})}
    return server.runtime.renderer.render(chat.parse_request(body), server.runtime.memo)


@pytest.fixture(scope="module")
def server():
    s = start_server(preset="tiny", policy="anchor")
    yield s
    s.stop()


def _request(protocol: str, text: str, stream: bool) -> tuple[str, dict]:
    common = {"model": "tiny", "stream": stream, "ft_forced_output": {"content": "Fine."}}
    if protocol == "chat":
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": text}]}
    if protocol == "responses":
        return "/v1/responses", {**common, "input": text}
    return "/v1/messages", {**common, "max_tokens": 64, "messages": [{"role": "user", "content": text}]}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("protocol", ["chat", "responses", "anthropic"])
def test_a_prompt_never_sent_is_all_new_on_every_protocol(server, protocol, stream):
    path, body = _request(protocol, f"A question never asked before, by {protocol} ({stream}).", stream)
    answer = Answer(server, path, body)
    assert answer.reasons == {"new": answer.prefilled}


def test_appending_a_tool_result_prefills_only_new_tokens(server):
    _, answers = run_tool_loop(server, "Fix the failing test.", ["ls", "pytest -x"])
    for answer in answers[1:]:
        assert answer.cached > 0 and answer.reasons == {"new": answer.prefilled}


def test_a_tool_result_repeating_an_earlier_one_is_new_not_edited(server):
    _, answers = run_tool_loop(server, "Run the tests until they pass.", ["pytest", "pytest"], output="3 failed\n" * 20)
    assert answers[2].cached > 0 and answers[2].reasons == {"new": answers[2].prefilled}


def test_a_second_session_under_the_same_system_prompt_is_new_not_edited(server):
    run_tool_loop(server, "First session task.", ["ls"])
    answer = chat_call(server, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Another task."}],
                       {"reasoning": "hm", "content": "ok"})
    assert answer.cached > 0 and answer.reasons == {"new": answer.prefilled}
    assert answer.edited_at is None


def test_editing_a_middle_tool_result_is_edited_from_that_result_to_the_end_of_the_chain_it_left(server):
    messages, answers = run_tool_loop(server, "Profile the build.", ["make", "make test", "make bench"])
    tool_positions = [i for i, m in enumerate(messages) if m["role"] == "tool"]
    edited = json.loads(json.dumps(messages[:-1]))  # the last request again, its second result edited
    edited[tool_positions[1]]["content"] = "a different output\n" * 20
    answer = chat_call(server, edited, {"reasoning": "again", "content": "Done."})
    segments = prompt_segments(server, edited)
    first_changed = next(i for i, s in enumerate(segments) if s.message_index == tool_positions[1] - 1)
    assert answer.cached == len(segment_ids(segments[:first_changed]))  # restored up to the edit
    assert answer.edited_at == f"{first_changed} tool_result"
    left = answers[-1].prompt_tokens + answers[-1].completion_tokens  # the chain it left: last prompt + answer
    assert answer.reasons["edited"] == min(left, answer.prompt_tokens) - answer.cached
    assert answer.reasons.get("new", 0) == max(0, answer.prompt_tokens - left)


def test_a_state_evicted_from_the_store_is_evicted():
    """RAM only, a budget of a few records, no live sequences: a second session's checkpoints evict the
    first's oldest state (its user message), which the first session's next request then misses."""
    s = start_server(preset="tiny", policy="user", live_sequences=0, ram_cache_gib=120_000 / 2**30)
    try:
        user = {"role": "user", "content": "Describe the layout of this repository in a few words."}
        chat_call(s, [user], {"content": "It has src and tests."}, tools=None)
        user_segment = prompt_segments(s, [user], tools=None)[0]
        anchor = anchor_chain([user_segment], s.runtime.root)[0]
        s.wait_idle()
        assert s.runtime.store.state_tier(anchor) == "ram"
        other = chat_call(s, [{"role": "user", "content": "Something else entirely, " * 40}], {"content": "Fine."},
                          tools=None)
        assert other.reasons == {"new": other.prefilled}
        s.wait_idle()
        assert s.runtime.store.state_tier(anchor) is None  # the construction: that state is gone
        answer = chat_call(s, [user, {"role": "assistant", "content": "Another answer."},
                               {"role": "user", "content": "And the tests?"}], {"content": "pytest"}, tools=None)
    finally:
        s.stop()
    assert answer.cached == 0
    assert answer.reasons == {"evicted": len(user_segment.token_ids), "new": answer.prefilled - len(user_segment.token_ids)}


def test_boundaries_the_policy_did_not_capture_are_no_anchor():
    """`prefix` keeps a state only at each prompt's and answer's end: the same prompt again restores
    nothing (its last segment is never restored), and a new user turn after a tool loop (Qwen's template
    then drops the earlier reasoning) restores nothing of the system prompt and task it shares, then
    re-sends history that differs from the chain computed (edited) and new tokens past its end."""
    s = start_server(preset="tiny", policy="prefix")
    try:
        first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Say hello."}]
        once = chat_call(s, first, {"reasoning": "Easy.", "content": "Hello."})
        again = chat_call(s, first, {"reasoning": "Easy.", "content": "Hello."})
        messages, answers = run_tool_loop(s, "Investigate the crash.", ["cat log"])
        messages.append({"role": "user", "content": "Now fix it, and explain the cause in detail. " * 20})
        turn = chat_call(s, messages, {"reasoning": "ok", "content": "Fixed."})
    finally:
        s.stop()
    assert once.reasons == {"new": once.prefilled}
    assert again.cached == 0 and again.reasons == {"no_anchor": again.prefilled}
    segments = prompt_segments(s, messages)
    assert [seg.kind for seg in segments[:3]] == ["tools", "system", "user"]
    head = len(segment_ids(segments[:3]))  # shared with the chain computed, no state taken there
    left = answers[-1].prompt_tokens + answers[-1].completion_tokens
    assert turn.cached == 0
    assert turn.reasons == {"no_anchor": head, "edited": left - head, "new": turn.prompt_tokens - left}
    assert turn.edited_at == "3 tool_call"  # the first assistant message, rendered without its reasoning
