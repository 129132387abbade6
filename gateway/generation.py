"""One generation on the engine worker: restore the longest checkpointed prefix, prefill the
rest while capturing checkpoints, decode (or teacher-force) and parse the output into
protocol-neutral events, then checkpoint the generation's end and precompute the next
turn's history. Events go to the request's async side through `emit`."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from engine import SequenceState, TokenEvent
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


def run_generation(
    rt: Runtime, plan: Plan, emit: Callable[[Started | Event | Answered], None], cancel: threading.Event,
    received_at: float, call_id: Callable[[], str], planned_at: float,
) -> list[Event]:
    """Runs on the worker; returns every event emitted (for the recorder). `received_at` and
    `planned_at`: when the request arrived and when its plan was ready (perf_counter)."""
    t_start = time.perf_counter()
    state, cached = checkpoints.restore(rt, plan.chain[:-1], plan.ends)
    t_restored = time.perf_counter()
    pending = checkpoints.Pending()
    result = checkpoints.prefill(rt, state, plan.segments, plan.chain, plan.ends, cached, pending)
    t_first = time.perf_counter()
    phases = {"plan": planned_at - received_at, "queue": t_start - planned_at, "restore": t_restored - t_start,
              "prefill": t_first - t_restored}
    started = Started(cached, plan.prompt_len - cached, t_first - received_at, phases)
    rt.metrics.observe_ttft(started.ttft_s)
    rt.metrics.add_tokens(prefilled=started.prefill_tokens, reused=cached)
    emit(started)
    events: list[Event] = []

    def send(evs: list[Event]) -> None:
        events.extend(evs)
        for ev in evs:
            emit(ev)

    send([Usage(plan.prompt_len, cached, started.prefill_tokens)])
    stops = StopMatcher(plan.conv.params.stop)
    try:
        generated, finish = _decode(rt, plan, state, result.logits, send, cancel, call_id, stops)
    except BaseException:
        pending.store(rt)
        raise
    reasoning_tokens = _reasoning_tokens(rt, generated)
    send([Finish(finish, stops.hit), Usage(plan.prompt_len, cached, started.prefill_tokens, len(generated), reasoning_tokens)])
    rt.metrics.add_tokens(generated=len(generated))
    message = _remember(rt, plan, generated, events) if finish != "cancelled" else None
    emit(ANSWERED)  # the client has its whole answer; what follows only prepares the next request
    try:
        pending.store(rt)  # the prompt's checkpoints
        if message is not None:
            _after_answer(rt, plan, state, generated, message)
    except Exception:
        log.exception("checkpointing after the answer failed (the answer was sent)")
        raise
    return events


def _decode(rt, plan, state, logits, send, cancel, call_id, stops: StopMatcher) -> tuple[list[int], FinishReason]:
    conv = plan.conv
    tools = {t.name: t.parameters for t in conv.tools if t.kind == "function"}
    custom = [t.name for t in conv.tools if t.kind == "custom"]
    parser = QwenParser(tools, custom_tools=custom, reasoning=conv.params.enable_thinking, call_id=call_id)
    eos = set(rt.renderer.tokenizer.eos_ids)
    detok = IncrementalDetokenizer(rt.renderer.tokenizer, skip_ids=frozenset(eos))
    generated: list[int] = []
    finish: FinishReason = "length"
    for ev in _tokens(rt, plan, state, logits):
        generated.append(ev.token_id)
        send(stops.filter(parser.feed(detok.feed(ev.token_id))))
        if cancel.is_set():
            return generated, "cancelled"
        if stops.hit is not None:
            return generated, "stop"
        if ev.finish_reason is not None:
            finish = "stop" if ev.token_id in eos or ev.finish_reason == "stop" else "length"
    send(stops.filter(parser.feed(detok.flush()) + parser.close()) + stops.flush())
    return generated, finish


def _tokens(rt: Runtime, plan: Plan, state: SequenceState, logits) -> Iterator[TokenEvent]:
    """Sampled tokens, or the forced ones. Forced tokens after the first are fed in one prefill
    pass (`--forced-decode prefill`, the default: same state, no per-token decode cost) or one
    decode step each (`steps`: what generating them would have cost)."""
    forced = plan.forced_ids
    if not forced or rt.config.forced_decode == "steps":
        yield from rt.engine.generate(state, logits, plan.sampling, forced=forced)
        return
    last = len(forced) - 1
    yield TokenEvent(forced[0], 0, "stop" if last == 0 else None)
    if last:
        rt.engine.prefill(state, forced[:-1])
    for index in range(1, last + 1):
        yield TokenEvent(forced[index], index, "stop" if index == last else None)


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


def _after_answer(rt: Runtime, plan: Plan, state: SequenceState, generated: list[int], message: Message) -> None:
    if keeps_generation_end(rt.config.policy):
        checkpoints.generation_end(rt, plan, state, generated)
    if precomputes(rt.config.policy) and not message.tool_calls:
        checkpoints.schedule_precompute(rt, plan.conv, message)

