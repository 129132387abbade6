"""The Starlette app: routes, API-key check, and the small non-generation endpoints."""

from __future__ import annotations

import time
from contextlib import asynccontextmanager

import anyio
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.endpoint import generate, read_json
from gateway.errors import NotFound, Unauthorized, error_response
from gateway.errors import Protocol as ErrorStyle
from gateway.protocol import ANTHROPIC, CHAT, RESPONSES
from gateway.render import segment_ids
from gateway.runtime import Runtime
from gateway.suffix_floor import suffix_floor
from gateway.volatile import normalize

OPEN_PATHS = ("/health", "/metrics")


def error_style(path: str) -> ErrorStyle:
    """Errors outside a generation (auth, unknown routes) in the protocol the path belongs to."""
    return "anthropic" if path.startswith("/v1/messages") else "openai"


class ApiKey:
    """With a key configured, every API path needs `Authorization: Bearer KEY` or `x-api-key`."""

    def __init__(self, app: ASGIApp, key: str | None):
        self.app, self.key = app, key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.key is None or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        given = headers.get("x-api-key") or headers.get("authorization", "").removeprefix("Bearer ").strip()
        if given != self.key:
            return await error_response(error_style(scope["path"]), Unauthorized())(scope, receive, send)
        return await self.app(scope, receive, send)


async def messages(request: Request) -> Response:
    return await generate(request, ANTHROPIC)


async def responses(request: Request) -> Response:
    return await generate(request, RESPONSES)


async def chat_completions(request: Request) -> Response:
    return await generate(request, CHAT)


async def count_tokens(request: Request) -> Response:
    rt: Runtime = request.app.state.runtime
    try:
        conv = normalize(ANTHROPIC.parse(await read_json(request, rt.config.max_body_bytes)), rt.volatile_rules)
        segments = await anyio.to_thread.run_sync(rt.renderer.render, conv, rt.memo)
    except Exception as exc:  # noqa: BLE001
        return error_response("anthropic", exc)
    return JSONResponse({"input_tokens": len(segment_ids(segments))})


async def models(request: Request) -> Response:
    rt: Runtime = request.app.state.runtime
    context = rt.engine.max_context
    entry = {
        "id": rt.model_id, "object": "model", "type": "model", "display_name": rt.model_id,
        "created": int(rt.started_at), "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(rt.started_at)),
        "owned_by": "ft", "context_length": context, "max_model_len": context,
    }
    return JSONResponse({"object": "list", "data": [entry], "has_more": False, "first_id": rt.model_id,
                         "last_id": rt.model_id})


async def health(request: Request) -> Response:
    rt: Runtime = request.app.state.runtime
    scheduler = rt.scheduler
    return JSONResponse({"status": "ok", "model": rt.model_id, "queue_depth": scheduler.queue_depth,
                         "running": scheduler.running, "idle": rt.idle})


async def metrics(request: Request) -> Response:
    rt: Runtime = request.app.state.runtime
    return PlainTextResponse(rt.metrics.render(rt.store.stats(), rt.scheduler.stats()),
                             media_type="text/plain; version=0.0.4")


async def not_found(request: Request, exc: Exception) -> Response:
    return error_response(error_style(request.url.path), NotFound(f"{request.method} {request.url.path}"))


def create_app(rt: Runtime) -> Starlette:
    @asynccontextmanager
    async def lifespan(app: Starlette):
        yield
        await anyio.to_thread.run_sync(rt.close)

    routes = [
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
        Route("/v1/responses", responses, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/ft/suffix_floor", suffix_floor, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, middleware=[Middleware(ApiKey, key=rt.config.api_key)],
                    exception_handlers={404: not_found, 405: not_found})
    app.state.runtime = rt
    return app
