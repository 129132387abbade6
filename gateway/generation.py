"""One generation on the engine worker: restore the longest checkpointed prefix, prefill the
rest while capturing checkpoints, decode (or teacher-force) and parse the output into
protocol-neutral events, then checkpoint the generation's end and precompute the next
turn's history. Events go to the request's async side through `emit`."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Generator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import msgspec

from engine import Decoding, Feed, PrefillResult, SequenceState
from gateway.capture_policy import keeps_generation_end, precomputes
from gateway.checkpoints import Checkpoints
from gateway.conversation import Message
from gateway.events import Event, Finish, FinishReason, Usage, collect
from gateway.memo import TokenMemo
from gateway.metrics import Metrics
from gateway.parsers import QwenParser
from gateway.parsers.stop import StopMatcher
from gateway.plan import RestorePlan
from gateway.prefill_reasons import PrefillReasons
from gateway.render import Renderer, Segment
from gateway.tokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    import torch

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
    link_bytes: int | None  # moved host -> device from the restore to the first token (Engine.link_bytes)
    prefill_reasons: PrefillReasons  # why the prefilled tokens were not restored


class Generation:
    """One request's work on the engine worker, driven step by step by the scheduler: restore
    the longest checkpointed prefix, prefill the rest (checkpoints go to the store queue), decode
    or teacher-force with every token batched among the other running requests, then checkpoint
    the generation's end and schedule the next turn's precompute. `steps()` yields each feed it
    needs run; events go to the request's async side through `emit`. `received_at`, `planned_at`:
    perf_counter times of the request's arrival and of its plan.

    It is given exactly what it reads of the server, so its dependencies show: `checkpoints` (the
    steps that touch the store), the `renderer` and `memo` (parsing the output, rendering the next
    turn), the `metrics`, the engine's `device` (sampling) and `forced_decode` (see `_decode`). `session`:
    the client's session id, where it sends one (the session of an answer's pin, gateway/pins.py)."""

    def __init__(self, plan: RestorePlan, checkpoints: Checkpoints, renderer: Renderer, memo: TokenMemo, metrics: Metrics,
                 *, device: torch.device, forced_decode: str, emit: Callable[[Started | Event | Answered], None],
                 cancel: threading.Event, received_at: float, planned_at: float, call_id: Callable[[], str],
                 session: str | None = None):
        self.plan, self.checkpoints, self.renderer, self.memo, self.metrics = plan, checkpoints, renderer, memo, metrics
        self.device, self.forced_decode = device, forced_decode
        self.emit, self.cancel = emit, cancel
        self.received_at, self.planned_at, self.call_id = received_at, planned_at, call_id
        self.session = session  # the client's id for it, where it sends one
        self.events: list[Event] = []
        self.answered = False  # the answer is sent; what remains checkpoints its end
        self.memo_written: Future | None = None  # the memo's disk write of this answer's ids

    def ready(self) -> bool:
        """Whether `steps()` starts without waiting for the store (`Checkpoints.ready`): the scheduler
        admits it only then, so the wait blocks no other request's steps."""
        return self.checkpoints.ready(self.plan.chain[:-1], self.plan.ends)

    def steps(self) -> Generator[Feed, None, list[Event]]:
        """Returns every event emitted (for the recorder)."""
        plan, checkpoints = self.plan, self.checkpoints
        t_start = time.perf_counter()
        linked = checkpoints.engine.link_bytes()
        session = checkpoints.arrive(plan.chain[:-1], self.session)
        state, cached = checkpoints.restore(plan.chain[:-1], plan.ends)
        t_restored = time.perf_counter()
        reasons = checkpoints.explain(plan.segments, plan.chain, plan.ends, cached, plan.namespace)
        result = yield from checkpoints.prefill(state, plan.segments, plan.chain, plan.ends, cached, plan.namespace)
        t_first = time.perf_counter()
        phases = {"plan": self.planned_at - self.received_at, "queue": t_start - self.planned_at,
                  "restore": t_restored - t_start, "prefill": t_first - t_restored}
        moved = None if linked is None else cast(int, checkpoints.engine.link_bytes()) - linked
        started = Started(cached, plan.prompt_len - cached, t_first - self.received_at, phases, moved, reasons)
        self.metrics.observe_ttft(started.ttft_s, started.phases, cached, started.prefill_tokens)
        self.metrics.add_tokens(prefilled=started.prefill_tokens, reused=cached)
        self.metrics.add_prefill_reasons(reasons.tokens)
        self.emit(started)
        self._send([Usage(plan.prompt_len, cached, started.prefill_tokens)])
        stops = StopMatcher(plan.conv.params.stop)
        generated, finish = yield from self._decode(state, result.logits, stops)
        reasoning_tokens = self._reasoning_tokens(generated)
        self._send([Finish(finish, stops.hit),
                    Usage(plan.prompt_len, cached, started.prefill_tokens, len(generated), reasoning_tokens)])
        self.metrics.add_tokens(generated=len(generated))
        message = self._remember(generated) if finish != "cancelled" else None
        self.emit(ANSWERED)  # the client has its whole answer; what follows only prepares the next request
        self.answered = True
        if message is not None:
            if keeps_generation_end(checkpoints.policy):
                segments = self.renderer.generation_segments(generated, len(plan.conv.messages))
                yield from checkpoints.save_generation_end(
                    state, segments, plan.chain, plan.ends, generated, plan.namespace,
                    pin_session=session if message.tool_calls else None)  # pinned while its tool runs
            if precomputes(checkpoints.policy) and not message.tool_calls:
                checkpoints.schedule_precompute(self._next_turn_segments(message), plan.namespace)
        return self.events

    def _send(self, events: list[Event]) -> None:
        self.events.extend(events)
        for ev in events:
            self.emit(ev)

    def _decode(self, state: SequenceState, logits, stops: StopMatcher) -> Generator[Feed, None, tuple[list[int], FinishReason]]:
        """Sampled tokens, or the forced ones. Forced tokens after the first are fed in one feed
        (`--forced-decode prefill`, the default: same state, no per-token decode cost) or one
        decode step each (`steps`: what generating them would have cost). In one feed, every
        forced token is known at the first: the whole answer's events are sent in that step, and
        the feed that moves the state over it follows."""
        plan, conv, tokenizer = self.plan, self.plan.conv, self.renderer.tokenizer
        tools = {t.name: t.parameters for t in conv.tools if t.kind == "function"}
        custom = [t.name for t in conv.tools if t.kind == "custom"]
        parser = QwenParser(tools, custom_tools=custom, reasoning=conv.params.enable_thinking, call_id=self.call_id)
        eos = set(tokenizer.eos_ids)
        detok = IncrementalDetokenizer(tokenizer, skip_ids=frozenset(eos))
        forced = plan.forced_ids
        decoding = Decoding(plan.sampling, self.device, forced)
        forced_in_one_feed = bool(forced) and self.forced_decode == "prefill"
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
                continue
            feed = Feed(state, [ev.token_id])
            yield feed
            logits = cast(PrefillResult, feed.result).logits
        self._send(stops.filter(parser.feed(detok.flush()) + parser.close()) + stops.flush())
        self.metrics.count_tool_markup(parser.recovered, parser.kept_as_text)
        if forced_in_one_feed and len(generated) > 1:
            yield Feed(state, generated[:-1])
        return generated, "stop" if ev.token_id in eos or ev.finish_reason == "stop" else "length"

    def _reasoning_tokens(self, generated: list[int]) -> int:
        think_end = self.renderer.tokenizer.special_ids.get("</think>")
        return generated.index(think_end) if think_end in generated else 0

    def _remember(self, generated: list[int]) -> Message | None:
        """The complete assistant message, its tokens remembered before the client can send it back
        (None when truncated: not a message the client will send back as it is)."""
        eos = self.renderer.tokenizer.eos_ids
        if not generated or generated[-1] != eos[0]:
            return None
        message = assistant_message(self.events)
        self.memo.remember(message, generated, self.plan.memo_handle)
        self.memo_written = self.memo.written()  # the answer's end waits for it, this worker does not
        return message

    def _next_turn_segments(self, reply: Message) -> list[Segment]:
        """The history as the next request (a new user message after `reply`) will render it:
        Qwen's template then drops the reasoning of this turn."""
        conv = self.plan.conv
        probe = Message(role="user", content="\u2063")
        future = msgspec.structs.replace(conv, messages=(*conv.messages, reply, probe), forced_output=None)
        segments = self.renderer.render(future, self.memo)
        probe_index = len(conv.messages) + 1
        return [s for s in segments if (s.message_index is None and s.kind in ("system", "tools"))
                or (s.message_index is not None and s.message_index < probe_index)]


def assistant_message(events: list[Event]) -> Message:
    """The assistant message a client will send back for these events."""
    collected = collect(events)
    return Message(role="assistant", reasoning=collected.reasoning, content=collected.text,
                   tool_calls=tuple(collected.tool_calls))
