"""One generation on the engine worker: restore the longest checkpointed prefix, prefill the
rest while capturing checkpoints, decode (or teacher-force) and parse the output into
protocol-neutral events, then checkpoint the generation's end and precompute the next
turn's history. Events go to the request's async side through `emit`."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import cast

from engine import Decoding, Feed, PrefillResult, SequenceState
from gateway import checkpoints
from gateway.conversation import Message, ToolCall
from gateway.events import Event, Finish, FinishReason, Usage, collect
from gateway.parsers import QwenParser
from gateway.parsers.stop import StopMatcher
from gateway.plan import Plan
from gateway.policy import keeps_generation_end, precomputes
from gateway.runtime import Runtime
from gateway.tokenizer import IncrementalDetokenizer

log = logging.getLogger("gateway.generation")


class Answered:
    """Sent once the answer is complete: the response can end while the worker checkpoints."""


ANSWERED = Answered()


@dataclass(frozen=True)
class Started:
    """Sent once the first token is ready: what was restored and what was computed."""

    cached_tokens: int
    prefill_tokens: int
    ttft_s: float
    phases: dict[str, float]  # seconds from request to first token, by phase (the Server-Timing header)


class Generation:
    """One request's work on the engine worker, driven step by step by the scheduler: restore
    the longest checkpointed prefix, prefill the rest (checkpoints go to the store queue), decode
    or teacher-force with every token batched among the other running requests, then checkpoint
    the generation's end. `steps()` yields each feed it needs run; events go to the request's
    async side through `emit`. `received_at`, `planned_at`: perf_counter times of the request's
    arrival and of its plan."""

    def __init__(self, rt: Runtime, plan: Plan, emit: Callable[[Started | Event | Answered], None],
                 cancel: threading.Event, received_at: float, planned_at: float, call_id: Callable[[], str]):
        self.rt, self.plan, self.emit, self.cancel = rt, plan, emit, cancel
        self.received_at, self.planned_at, self.call_id = received_at, planned_at, call_id
        self.events: list[Event] = []
        self.answered = False  # the answer is sent; what remains checkpoints its end

    def steps(self) -> Generator[Feed, None, list[Event]]:
        """Returns every event emitted (for the recorder)."""
        rt, plan = self.rt, self.plan
        t_start = time.perf_counter()
        state, cached = checkpoints.restore(rt, plan.chain[:-1], plan.ends)
        t_restored = time.perf_counter()
        result = yield from checkpoints.prefill(rt, state, plan.segments, plan.chain, plan.ends, cached)
        t_first = time.perf_counter()
        phases = {"plan": self.planned_at - self.received_at, "queue": t_start - self.planned_at,
                  "restore": t_restored - t_start, "prefill": t_first - t_restored}
        started = Started(cached, plan.prompt_len - cached, t_first - self.received_at, phases)
        rt.metrics.observe_ttft(started.ttft_s)
        rt.metrics.add_tokens(prefilled=started.prefill_tokens, reused=cached)
        self.emit(started)
        self._send([Usage(plan.prompt_len, cached, started.prefill_tokens)])
        stops = StopMatcher(plan.conv.params.stop)
        generated, finish = yield from self._decode(state, result.logits, stops)
        reasoning_tokens = _reasoning_tokens(rt, generated)
        self._send([Finish(finish, stops.hit),
                    Usage(plan.prompt_len, cached, started.prefill_tokens, len(generated), reasoning_tokens)])
        rt.metrics.add_tokens(generated=len(generated))
        message = _remember(rt, plan, generated, self.events) if finish != "cancelled" else None
        self.emit(ANSWERED)  # the client has its whole answer; what follows only prepares the next request
        self.answered = True
        if message is not None:
            if keeps_generation_end(rt.config.policy):
                yield from checkpoints.generation_end(rt, plan, state, generated)
            if precomputes(rt.config.policy) and not message.tool_calls:
                checkpoints.schedule_precompute(rt, plan.conv, message)
        return self.events

    def _send(self, events: list[Event]) -> None:
        self.events.extend(events)
        for ev in events:
            self.emit(ev)

    def _decode(self, state: SequenceState, logits, stops: StopMatcher) -> Generator[Feed, None, tuple[list[int], FinishReason]]:
        """Sampled tokens, or the forced ones. Forced tokens after the first are fed in one feed
        (`--forced-decode prefill`, the default: same state, no per-token decode cost) or one
        decode step each (`steps`: what generating them would have cost)."""
        rt, plan, conv = self.rt, self.plan, self.plan.conv
        tools = {t.name: t.parameters for t in conv.tools if t.kind == "function"}
        custom = [t.name for t in conv.tools if t.kind == "custom"]
        parser = QwenParser(tools, custom_tools=custom, reasoning=conv.params.enable_thinking, call_id=self.call_id)
        eos = set(rt.renderer.tokenizer.eos_ids)
        detok = IncrementalDetokenizer(rt.renderer.tokenizer, skip_ids=frozenset(eos))
        forced = plan.forced_ids
        decoding = Decoding(plan.sampling, rt.engine.device, forced)
        forced_in_one_feed = bool(forced) and rt.config.forced_decode == "prefill"
        generated: list[int] = []
        while True:
            ev = decoding.next(logits)
            generated.append(ev.token_id)
            self._send(stops.filter(parser.feed(detok.feed(ev.token_id))))
            if self.cancel.is_set():
                return generated, "cancelled"
            if stops.hit is not None:
                return generated, "stop"
            if ev.finish_reason is not None:
                break
            if forced_in_one_feed:
                if ev.index == 0:
                    yield Feed(state, cast(list[int], forced)[:-1])
                continue
            feed = Feed(state, [ev.token_id])
            yield feed
            logits = cast(PrefillResult, feed.result).logits
        self._send(stops.filter(parser.feed(detok.flush()) + parser.close()) + stops.flush())
        return generated, "stop" if ev.token_id in eos or ev.finish_reason == "stop" else "length"


def _reasoning_tokens(rt: Runtime, generated: list[int]) -> int:
    think_end = rt.renderer.tokenizer.special_ids.get("</think>")
    return generated.index(think_end) if think_end in generated else 0


def assistant_message(events: list[Event]) -> Message:
    """The assistant message a client will send back for these events."""
    collected = collect(events)
    calls = []
    for call in collected.tool_calls:
        args = call.arguments
        calls.append(ToolCall(id=call.call_id, name=call.name, arguments=args if isinstance(args, dict) else None,
                              input=args if isinstance(args, str) else None))
    return Message(role="assistant", reasoning=collected.reasoning, content=collected.text, tool_calls=tuple(calls))


def _remember(rt: Runtime, plan: Plan, generated: list[int], events) -> Message | None:
    """The complete assistant message, its tokens remembered before the client can send it back
    (None when truncated: not a message the client will send back as it is)."""
    eos = rt.renderer.tokenizer.eos_ids
    if not generated or generated[-1] != eos[0]:
        return None
    message = assistant_message(events)
    rt.memo.remember(message, generated, plan.memo_handle)
    return message
