"""The generation endpoint shared by the three protocols: read and parse the body, plan
off the event loop, run the generation on the engine worker, and answer with SSE or JSON.

Headers are sent once the first token is ready, so every response carries what was
restored and computed: `x-cached-tokens`, `x-prefill-tokens`, why those were not restored
(`x-prefill-reasons`: tokens per reason, `new=120, edited=4096`; with `edited`,
`x-prefill-edited-at`: the index and kind of the prompt's first segment that differs, see
gateway/prefill_reasons.py), `x-server-ttft-ms`, and where
the time to the first token went (`server-timing`: plan, queue, restore, prefill, in ms); on a
GPU or under a memory budget, `x-link-bytes`: the bytes copied host -> device meanwhile (restored
checkpoints, offloaded experts; every sequence's in the steps it shared), from which a slower
link's TTFT is projected."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from functools import partial

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from gateway.conversation import AssistantOutput, ToolCall
from gateway.dialect import ApiDialect, call_ids
from gateway.drain import Drain
from gateway.errors import BadRequest, ClientGone, PayloadTooLarge, error_event, typed
from gateway.events import Event, collect
from gateway.generation import Answered, Generation, Started
from gateway.memo import TokenMemo
from gateway.record import RecordLine, Timings
from gateway.service import Service
from gateway.sse import SSE_HEADERS, SSE_MEDIA_TYPE, encode_stream

MAX_JSON_DEPTH = 100  # deeper bodies are refused before anything recurses over them
BODY_BYTES_PER_TOKEN = 32  # a body longer than this many bytes per context token cannot fit the context
MIN_BODY_LIMIT = 1 << 20


class _Done(msgspec.Struct):
    error: BaseException | None = None


class _Interrupt(msgspec.Struct):
    """The request must end now: its client left (`ClientGone`) or the server is stopping."""

    error: BaseException


def body_limit(rt: Service) -> int:
    """The largest body accepted: the configured cap, and no more than a prompt that could fit the
    model's context (so an over-long prompt is refused before it is decoded and tokenized)."""
    return min(rt.config.max_body_bytes, max(MIN_BODY_LIMIT, BODY_BYTES_PER_TOKEN * rt.engine.max_context))


async def read_json(request: Request, limit: int) -> dict:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(int(declared), limit)
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > limit:
            raise PayloadTooLarge(len(raw), limit)
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise BadRequest("body", f"invalid JSON: {exc}") from None
    except RecursionError:
        body = None
    if body is None or too_deep(body, MAX_JSON_DEPTH):
        raise BadRequest("body", f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
    if not isinstance(body, dict):
        raise BadRequest("body", "expected a JSON object")
    return body


def too_deep(value: object, limit: int) -> bool:
    """Whether arrays and objects nest deeper than `limit` (iterative: any depth is safe to ask)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        for child in children:
            if isinstance(child, dict | list):
                if depth + 1 > limit:
                    return True
                stack.append((child, depth + 1))
    return False


MAX_TOKENS_FIELDS = ("max_completion_tokens", "max_output_tokens", "max_tokens")  # as the protocols read them


def check_max_tokens(body: dict, max_tokens: int | None, max_context: int) -> None:
    """A limit above the most output the context allows (one prompt token) is a 400 naming its field, as
    OpenAI and Anthropic answer a `max_tokens` above a model's output limit; a smaller one that the
    prompt leaves no room for is clamped to what remains (the plan's limits)."""
    most = max_context - 1
    if max_tokens is None or max_tokens <= most:
        return
    field = next((f for f in MAX_TOKENS_FIELDS if f in body), "max_tokens")
    raise BadRequest(field, f"is too large: this model's context allows at most {most} output tokens")


async def generate(request: Request, protocol: ApiDialect) -> Response:
    """A raised error becomes the protocol's error JSON (gateway/errors.py `handle_error`)."""
    rt: Service = request.app.state.runtime
    drain: Drain = request.app.state.drain
    received = time.perf_counter()
    request.state.count_status = partial(rt.metrics.request, protocol.name)
    drain.check()
    body = await read_json(request, body_limit(rt))
    conv = protocol.parse(body)
    check_max_tokens(body, conv.params.max_tokens, rt.engine.max_context)
    tenant = request.state.tenant  # the API key's (gateway/app.py ApiKey), never the client's say
    plan = await anyio.to_thread.run_sync(rt.planner.plan, conv, tenant.namespace, tenant.memo)
    run = _Run(rt, plan, protocol, received, drain, request, tenant.memo, session_id(request, body))
    first = await run.first()
    headers = {
        "x-cached-tokens": str(first.cached_tokens),
        "x-prefill-tokens": str(first.prefill_tokens),
        "x-prefill-reasons": first.prefill_reasons.header(),
        "x-server-ttft-ms": f"{1000 * first.ttft_s:.1f}",
        "server-timing": ", ".join(f"{name};dur={1000 * s:.1f}" for name, s in first.phases.items()),
    }
    if first.link_bytes is not None:
        headers["x-link-bytes"] = str(first.link_bytes)
    if (edited_at := first.prefill_reasons.edited_at) is not None:
        headers["x-prefill-edited-at"] = f"{edited_at[0]} {edited_at[1]}"
    model = rt.model_id  # the served name, never the client's text (any name the client sends is served)
    if conv.params.stream:
        run.stop_watching()  # the streaming response listens for the disconnect itself
        rt.metrics.request(protocol.name, 200)
        encoder = protocol.stream(model, plan.memo_handle, body, conv)
        return StreamingResponse(
            encode_stream(encoder, run.events(request, body)), media_type=SSE_MEDIA_TYPE,
            headers={**SSE_HEADERS, **headers},
        )
    events = [ev async for ev in run.events(request, body)]
    if run.error is not None:
        raise run.error
    rt.metrics.request(protocol.name, 200)
    return JSONResponse(protocol.body(collect(events), model, plan.memo_handle, body), headers=headers)


class _Run:
    """One generation on the worker, its events relayed to this request's task. Until its answer
    is streamed, a task watches for the client leaving (the cancel flag then stops the generation
    at its next step); `interrupt` ends it early (gateway/drain.py)."""

    def __init__(self, rt: Service, plan, protocol: ApiDialect, received: float, drain: Drain, request: Request,
                 memo: TokenMemo, session: str | None):
        self.rt, self.plan, self.protocol, self.received, self.drain = rt, plan, protocol, received, drain
        planned = time.perf_counter()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancel = threading.Event()
        self.started: Started | None = None
        self.error: BaseException | None = None  # a failure after the first token
        loop = asyncio.get_running_loop()

        def emit(item: object) -> None:
            loop.call_soon_threadsafe(self.queue.put_nowait, item)

        self.generation = Generation(
            plan, rt.checkpoints, rt.renderer, memo, rt.metrics, device=rt.engine.device,
            forced_decode=rt.config.forced_decode, emit=emit, cancel=self.cancel, received_at=received,
            planned_at=planned, call_id=call_ids(protocol), session=session)
        drain.check()
        future = rt.scheduler.start(self.generation.steps(), self.cancel, lambda: self.generation.answered,
                                    ready=self.generation.ready, prompt=plan.chain)
        future.add_done_callback(lambda f: emit(_Done(None if (e := f.exception()) is None else typed(e))))
        drain.add(self)
        self._watch = asyncio.create_task(self._watch_disconnect(request))

    @property
    def has_started(self) -> bool:
        return self.started is not None

    def interrupt(self, error: BaseException) -> None:
        self.queue.put_nowait(_Interrupt(error))

    def stop_watching(self) -> None:
        self._watch.cancel()

    async def _watch_disconnect(self, request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.interrupt(ClientGone())

    def _stop(self) -> None:
        """The answer will not be read to its end: the generation stops at its next step (never
        once its answer is complete: what remains then checkpoints the generation's end)."""
        if not self.generation.answered:
            self.cancel.set()

    def _close(self) -> None:
        self.stop_watching()
        self.drain.discard(self)

    async def first(self) -> Started:
        try:
            item = await self.queue.get()
            if isinstance(item, _Interrupt):
                raise item.error
            if isinstance(item, _Done):
                raise item.error or RuntimeError("generation ended before its first token")
        except BaseException:
            self._stop()
            self._close()
            raise
        self.started = item
        return item

    async def events(self, request: Request, body: dict) -> AsyncIterator[Event]:
        events: list[Event] = []
        finished = False
        try:
            while not isinstance(item := await self.queue.get(), _Done | Answered | _Interrupt):
                events.append(item)
                yield item
            if isinstance(item, _Interrupt):
                self._stop()
                self.error = item.error
                if not isinstance(item.error, ClientGone):
                    yield error_event(self.protocol.error_style, item.error)
                return
            finished = True
            if isinstance(item, _Done) and item.error is not None:
                self.error = item.error
                yield error_event(self.protocol.error_style, item.error)
            elif (written := self.generation.memo_written) is not None:
                await asyncio.wrap_future(written)  # the answer ends once its ids are on disk (kill -9 keeps them)
        finally:
            if not finished:  # a client that went away stops the generation at its next step
                self._stop()
            self._close()
        self._record(request, body, events)

    def _record(self, request: Request, body: dict, events: list[Event]) -> None:
        if self.rt.recorder is None or self.started is None:
            return
        collected = collect(events)
        output = AssistantOutput(
            reasoning=collected.reasoning or None, content=collected.text or None,
            tool_calls=[ToolCall(c.name, c.arguments if c.input is None else {"input": c.input})
                        for c in collected.tool_calls],
        )
        timings = Timings(
            ttft_ms=1000 * self.started.ttft_s, total_ms=1000 * (time.perf_counter() - self.received),
            prefill_tokens=self.started.prefill_tokens, cached_tokens=self.started.cached_tokens,
            output_tokens=collected.usage.output_tokens,
        )
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        self.rt.recorder.write(RecordLine(self.protocol.name, path, body, output, timings, ts=time.time(),
                                          session=session_id(request, body)))


SESSION_HEADERS = ("x-claude-code-session-id", "session-id", "x-session-id")


def session_id(request: Request, body: dict) -> str | None:
    """The client's session id where it sends one (Claude Code, Codex, OpenCode headers; Codex's
    `prompt_cache_key`), so interleaved sessions in one recording can be told apart and a session's
    tool times drawn on for its pins (gateway/pins.py)."""
    for name in SESSION_HEADERS:
        if value := request.headers.get(name):
            return value
    key = body.get("prompt_cache_key")
    return key if isinstance(key, str) else None
