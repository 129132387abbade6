"""The first output event of a streamed answer is written in the engine step that took the token
it shows: the first token of text or reasoning, the token that completes a tool call's name. Counted
in engine steps, never in time: the real server (tiny preset, loopback port) on all three protocols,
answers teacher-forced one decode step a token (`--forced-decode steps`) and in one feed (`prefill`,
where every forced token is known at the first).

The probe counts the scheduler's steps and holds the worker before each step until the stream's
encoder has taken every event the generation sent, so the step read when a frame is encoded is the
step whose tokens produced it."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

import gateway.endpoint
from gateway.events import ToolCallArgsDelta, ToolCallStart
from gateway.generation import Generation
from gateway.parsers import QwenParser
from gateway.sse import encode_stream
from tests.conftest import start_server

SCHEMA = {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]}
# each forced answer, and the text whose completion is its first output
ANSWERS = {
    "text": ({"content": "Hello, it is Monday."}, "H"),
    "thinking": ({"reasoning": "Let me look at the clock.", "content": "Monday."}, "L"),
    "tool call": ({"tool_calls": [{"name": "get_date", "arguments": {"timezone": "UTC"}}]}, "<function=get_date>"),
}
KINDS = {"text": "text", "thinking": "reasoning", "tool call": "tool"}
GATE_TIMEOUT_S = 60


def request(protocol: str, forced: dict) -> tuple[str, dict]:
    question = "What's the date?"
    if protocol == "anthropic":
        return "/v1/messages", {
            "model": "tiny", "max_tokens": 64, "stream": True, "ft_forced_output": forced,
            "messages": [{"role": "user", "content": question}],
            "tools": [{"name": "get_date", "description": "today's date", "input_schema": SCHEMA}]}
    if protocol == "responses":
        return "/v1/responses", {
            "model": "tiny", "max_output_tokens": 64, "stream": True, "ft_forced_output": forced, "input": question,
            "tools": [{"type": "function", "name": "get_date", "description": "today's date", "parameters": SCHEMA}]}
    return "/v1/chat/completions", {
        "model": "tiny", "max_tokens": 64, "stream": True, "ft_forced_output": forced,
        "messages": [{"role": "user", "content": question}],
        "tools": [{"type": "function", "function": {"name": "get_date", "parameters": SCHEMA}}]}


def output_kind(protocol: str, frame: bytes) -> str | None:
    """What output a frame opens or carries (reasoning, text, tool), None for the others."""
    data = next((line[5:].strip() for line in frame.split(b"\n") if line.startswith(b"data:")), b"")
    if not data or data == b"[DONE]":
        return None
    event = json.loads(data)
    if protocol == "anthropic":
        kinds = {"thinking": "reasoning", "text": "text", "tool_use": "tool"}
        opened = event.get("content_block", {}).get("type")
        return kinds[opened] if event["type"] == "content_block_start" else None
    if protocol == "responses":
        kinds = {"reasoning": "reasoning", "message": "text", "function_call": "tool"}
        return kinds[event["item"]["type"]] if event["type"] == "response.output_item.added" else None
    delta = (event.get("choices") or [{}])[0].get("delta") or {}
    if delta.get("reasoning_content"):
        return "reasoning"
    return "text" if delta.get("content") else "tool" if delta.get("tool_calls") else None


@dataclass
class Answer:
    """One streamed answer as the probe saw it: the step of its first token, its forced ids, and
    each frame with the step at which it was encoded."""

    first_token_step: int
    forced_ids: list[int]
    tokenizer: object
    frames: list[tuple[int, bytes]] = field(default_factory=list)


class StepProbe:
    """Counts what the server's generations send and what its stream encoders take, and holds the
    engine worker before each step until the encoders have taken everything sent."""

    def __init__(self, server):
        self.scheduler = server.runtime.scheduler
        self.sent = self.taken = 0
        self.answers: list[Answer] = []
        self.gate = threading.Condition()
        self.stuck = False
        run = server.runtime.engine.run

        def gated_run(plan):
            with self.gate:
                if not self.gate.wait_for(lambda: self.taken >= self.sent, GATE_TIMEOUT_S):
                    self.stuck = True
            return run(plan)

        server.runtime.engine.run = gated_run

    def send(self, generation: Generation, events: list) -> None:
        if not generation.events:  # the prompt's Usage, sent with the first token
            self.answers.append(Answer(self.scheduler.steps_total, list(generation.plan.forced_ids or []),
                                       generation.renderer.tokenizer))
        with self.gate:
            self.sent += len(events)

    def encoder(self, encoder):
        """`encoder`, its frames recorded with the step of each; its first event (the prompt's Usage)
        is fed after `send` saw it, so its answer is the last one begun by then."""
        feed = encoder.feed
        answers: list[Answer] = []

        def taking(ev):
            answers[:] = answers or self.answers[-1:]
            frames = feed(ev)
            answers[0].frames += [(self.scheduler.steps_total, frame) for frame in frames]
            with self.gate:
                self.taken += 1
                self.gate.notify_all()
            return frames

        encoder.feed = taking
        return encoder


@pytest.fixture(scope="module", params=["steps", "prefill"])
def probed(request) -> Iterator[tuple[object, StepProbe, str]]:
    server = start_server(preset="tiny", forced_decode=request.param)
    probe = StepProbe(server)
    send = Generation._send

    def probed_send(self, events):
        probe.send(self, events)
        send(self, events)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Generation, "_send", probed_send)
        patch.setattr(gateway.endpoint, "encode_stream", lambda encoder, events: encode_stream(
            probe.encoder(encoder), events))
        yield server, probe, request.param
    server.stop()


def completing_index(answer: Answer, marker: str) -> int:
    """The index of the forced token with which the answer's text first holds `marker`."""
    ids = answer.forced_ids
    return next(k for k in range(len(ids)) if marker in answer.tokenizer.decode(ids[: k + 1]))


@pytest.mark.parametrize("case", sorted(ANSWERS))
@pytest.mark.parametrize("protocol", ["anthropic", "responses", "chat"])
def test_the_first_output_is_written_in_the_step_of_its_token(probed, protocol, case):
    server, probe, forced_decode = probed
    forced, marker = ANSWERS[case]
    path, body = request(protocol, forced)
    with server.client() as client, client.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        response.read()
    server.wait_idle()
    assert not probe.stuck
    answer = probe.answers[-1]
    outputs = [(step, kind) for step, frame in answer.frames if (kind := output_kind(protocol, frame))]
    token = completing_index(answer, marker)
    assert forced_decode == "prefill" or token > 0 or case == "thinking"  # text and calls open with markup
    expected_step = answer.first_token_step + (token if forced_decode == "steps" else 0)
    assert outputs[0] == (expected_step, KINDS[case])


def feed_tokens(parser: QwenParser, tokens: list[str]) -> list[list]:
    return [parser.feed(t) for t in tokens]


def test_a_call_starts_and_its_arguments_open_with_the_token_that_closes_each_tag():
    """Qwen's tokens of a call: its start goes out with the '>' of ``<function=NAME>``, a
    parameter's key with the '>' of ``<parameter=P>``, and its value as it comes."""
    parser = QwenParser({"get_date": SCHEMA}, reasoning=False, call_id=lambda: "call_0")
    call = feed_tokens(parser, ["<tool_call>", "\n", "<", "function", "=get", "_date", ">"])
    assert call[:-1] == [[]] * 6 and call[-1] == [ToolCallStart(0, "call_0", "get_date"), ToolCallArgsDelta(0, "{")]
    param = feed_tokens(parser, ["\n", "<", "parameter", "=", "timezone", ">"])
    assert param[:-1] == [[]] * 5 and param[-1] == [ToolCallArgsDelta(0, '"timezone":"')]
    assert feed_tokens(parser, ["\n", "UT", "C"]) == [[], [ToolCallArgsDelta(0, "UT")], [ToolCallArgsDelta(0, "C")]]


@pytest.mark.parametrize("reasoning", [True, False])
def test_plain_text_is_held_back_by_no_token(reasoning):
    """Text that can begin no tag and ends in no newline leaves the parser with the token that brought it."""
    parser = QwenParser(reasoning=reasoning)
    kind = "ReasoningDelta" if reasoning else "TextDelta"
    for token in ["Hello", ",", " it", " is", " Monday", "."]:
        assert [(type(e).__name__, e.text) for e in parser.feed(token)] == [(kind, token)]
