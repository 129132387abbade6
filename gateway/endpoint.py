"""The generation endpoint shared by the three protocols: read and parse the body, plan
off the event loop, run the generation on the engine worker, and answer with SSE or JSON.

Headers are sent once the first token is ready, so every response carries what was
restored and computed: `x-cached-tokens`, `x-prefill-tokens`, `x-server-ttft-ms`, and where
the time to the first token went (`server-timing`: plan, queue, restore, prefill, in ms)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from gateway.errors import GatewayError, PayloadTooLarge, error_event, error_response
from gateway.events import Event, collect
from gateway.generation import Answered, Generation, Started
from gateway.plan import make_plan
from gateway.protocol import Protocol, call_ids
from gateway.protocols import BadRequest
from gateway.record import AssistantOutput, RecordLine, Timings
from gateway.record import ToolCall as RecordedCall
from gateway.runtime import Runtime
from gateway.sse import SSE_HEADERS, SSE_MEDIA_TYPE, encode_stream

log = logging.getLogger("gateway")


class _Done(msgspec.Struct):
    error: BaseException | None = None


def log_unexpected(exc: BaseException) -> None:
    """A failure that is not the client's (not a typed gateway error) is a bug: log its traceback."""
    if not isinstance(exc, GatewayError | BadRequest):
        log.error("request failed", exc_info=exc)


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
        body = msgspec.json.decode(bytes(raw))
    except msgspec.DecodeError as exc:
        raise BadRequest("body", f"invalid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("body", "expected a JSON object")
    return body


async def generate(request: Request, protocol: Protocol) -> Response:
    rt: Runtime = request.app.state.runtime
    received = time.perf_counter()
    status = 200
    try:
        body = await read_json(request, rt.config.max_body_bytes)
        conv = protocol.parse(body)
        plan = await anyio.to_thread.run_sync(make_plan, rt, conv)
        run = _Run(rt, plan, protocol, received)
        first = await run.first()
        if isinstance(first, _Done):
            raise first.error or RuntimeError("generation ended before its first token")
    except Exception as exc:  # noqa: BLE001 (every failure becomes the protocol's error JSON)
        log_unexpected(exc)
        response = error_response(protocol.error_style, exc)
        rt.metrics.request(protocol.name, response.status_code)
        return response
    headers = {
        "x-cached-tokens": str(first.cached_tokens),
        "x-prefill-tokens": str(first.prefill_tokens),
        "x-server-ttft-ms": f"{1000 * first.ttft_s:.1f}",
        "server-timing": ", ".join(f"{name};dur={1000 * s:.1f}" for name, s in first.phases.items()),
    }
    rt.metrics.request(protocol.name, status)
    model = conv.model or rt.model_id
    if conv.params.stream:
        encoder = protocol.stream(model, plan.memo_handle, body, conv)
        return StreamingResponse(
            encode_stream(encoder, run.events(request, body)), media_type=SSE_MEDIA_TYPE,
            headers={**SSE_HEADERS, **headers},
        )
    events = [ev async for ev in run.events(request, body)]
    if run.error is not None:
        log_unexpected(run.error)
        return error_response(protocol.error_style, run.error)
    collected = collect(events)
    return JSONResponse(protocol.body(collected, model, plan.memo_handle, body), headers=headers)


class _Run:
    """One generation on the worker, its events relayed to this request's task."""

    def __init__(self, rt: Runtime, plan, protocol: Protocol, received: float):
        self.rt, self.plan, self.protocol, self.received = rt, plan, protocol, received
        planned = time.perf_counter()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancel = threading.Event()
        self.started: Started | None = None
        self.error: BaseException | None = None  # a failure after the first token
        loop = asyncio.get_running_loop()

        def emit(item: object) -> None:
            loop.call_soon_threadsafe(self.queue.put_nowait, item)

        generation = Generation(rt, plan, emit, self.cancel, received, planned, call_ids(protocol))
        future = rt.scheduler.start(generation.steps(), self.cancel, lambda: generation.answered)
        future.add_done_callback(lambda f: emit(_Done(f.exception())))

    async def first(self) -> Started | _Done:
        item = await self.queue.get()
        if isinstance(item, Started):
            self.started = item
        return item

    async def events(self, request: Request, body: dict) -> AsyncIterator[Event]:
        events: list[Event] = []
        answered = False
        try:
            while not isinstance(item := await self.queue.get(), _Done | Answered):
                events.append(item)
                yield item
            answered = True
            if isinstance(item, _Done) and item.error is not None:
                self.error = item.error
                yield error_event(self.protocol.error_style, item.error)
        finally:
            if not answered:  # a client that went away stops the generation at its next step
                self.cancel.set()
        self._record(request, body, events)

    def _record(self, request: Request, body: dict, events: list[Event]) -> None:
        if self.rt.recorder is None or self.started is None:
            return
        collected = collect(events)
        output = AssistantOutput(
            reasoning=collected.reasoning or None, content=collected.text or None,
            tool_calls=[RecordedCall(c.name, c.arguments if isinstance(c.arguments, dict) else {"input": c.arguments})
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
    `prompt_cache_key`), so interleaved sessions in one recording can be told apart."""
    for name in SESSION_HEADERS:
        if value := request.headers.get(name):
            return value
    key = body.get("prompt_cache_key")
    return key if isinstance(key, str) else None
