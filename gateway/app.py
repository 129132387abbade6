"""The Starlette app: routes, API-key check, and the small non-generation endpoints. Endpoints
raise typed errors; the handlers of gateway/errors.py answer them in the path's protocol."""

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

from gateway.dialect import ANTHROPIC, CHAT, RESPONSES
from gateway.drain import Drain
from gateway.endpoint import body_limit, generate, read_json
from gateway.errors import EXCEPTION_HANDLERS, BadRequest, Unauthorized, error_response, error_style
from gateway.render import segment_ids
from gateway.service import Service
from gateway.suffix_floor import suffix_floor
from gateway.tenants import Tenant, Tenants
from gateway.volatile import normalize

OPEN_PATHS = ("/health", "/metrics")
KEY_HEADERS = (b"x-api-key", b"authorization")


class ApiKey:
    """With keys configured, every API path needs `Authorization: Bearer KEY` or `x-api-key`, compared
    with every key in constant time (raw bytes: a header that is not UTF-8 is a wrong key, not a crash).
    The key's tenant (gateway/tenants.py) is the request's `state.tenant`: the server's own without keys.
    Nothing else the client sends chooses it."""

    def __init__(self, app: ASGIApp, tenants: Tenants):
        self.app, self.tenants = app, tenants

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        if not self.tenants.keyed:
            return await self.app(_with_tenant(scope, self.tenants.default), receive, send)
        try:
            given = self.given(scope["headers"])
        except BadRequest as exc:
            return await error_response(error_style(scope["path"]), exc)(scope, receive, send)
        if (tenant := self.tenants.find(given)) is None:
            return await error_response(error_style(scope["path"]), Unauthorized())(scope, receive, send)
        return await self.app(_with_tenant(scope, tenant), receive, send)

    @staticmethod
    def given(headers: list[tuple[bytes, bytes]]) -> bytes:
        """The key the client sent (`x-api-key`, else the bearer token), or b""."""
        found = {name.lower(): value for name, value in headers if name.lower() in KEY_HEADERS}
        for name, value in found.items():
            try:
                value.decode()
            except UnicodeDecodeError:
                raise BadRequest(f"headers.{name.decode()}", "is not valid UTF-8") from None
        if key := found.get(b"x-api-key"):
            return key
        token = found.get(b"authorization", b"")
        return token[7:].strip() if token[:7].lower() == b"bearer " else token.strip()


def _with_tenant(scope: Scope, tenant: Tenant) -> Scope:
    return {**scope, "state": {**scope.get("state", {}), "tenant": tenant}}


async def messages(request: Request) -> Response:
    return await generate(request, ANTHROPIC)


async def responses(request: Request) -> Response:
    return await generate(request, RESPONSES)


async def chat_completions(request: Request) -> Response:
    return await generate(request, CHAT)


async def count_tokens(request: Request) -> Response:
    rt: Service = request.app.state.runtime
    tenant: Tenant = request.state.tenant
    conv = normalize(ANTHROPIC.parse(await read_json(request, body_limit(rt))), rt.volatile_rules)
    segments = await anyio.to_thread.run_sync(rt.renderer.render, conv, tenant.memo)
    return JSONResponse({"input_tokens": len(segment_ids(segments))})


async def models(request: Request) -> Response:
    rt: Service = request.app.state.runtime
    context = rt.engine.max_context
    entry = {
        "id": rt.model_id, "object": "model", "type": "model", "display_name": rt.model_id,
        "created": int(rt.started_at), "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(rt.started_at)),
        "owned_by": "ft", "context_length": context, "max_model_len": context,
    }
    return JSONResponse({"object": "list", "data": [entry], "has_more": False, "first_id": rt.model_id,
                         "last_id": rt.model_id})


async def health(request: Request) -> Response:
    """`status` is "draining" (and the code 503) once the server is shutting down."""
    rt: Service = request.app.state.runtime
    scheduler = rt.scheduler
    draining = request.app.state.drain.draining
    return JSONResponse({"status": "draining" if draining else "ok", "model": rt.model_id,
                         "queue_depth": scheduler.queue_depth, "running": scheduler.running, "idle": rt.idle},
                        status_code=503 if draining else 200)


async def metrics(request: Request) -> Response:
    rt: Service = request.app.state.runtime
    text = rt.metrics.render(rt.store.stats(), rt.scheduler.stats(), rt.memory(), rt.engine.offload_stats(),
                             live_sequences=len(rt.live), pins=rt.pin_counts())
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


async def recent(request: Request) -> Response:
    """The last requests' starts (TTFT, tokens restored and prefilled, phases), for `ft top`."""
    rt: Service = request.app.state.runtime
    return JSONResponse({"requests": rt.metrics.recent(), "started_at": rt.started_at})


def create_app(rt: Service) -> Starlette:
    """The app; `app.state.drain` is what the HTTP server calls when it starts shutting down."""
    folder = rt.config.disk_cache if rt.store.has_disk else None
    tenants = Tenants.build(rt.config.api_key, rt.root, rt.memo, folder, rt.store.write_errors)

    @asynccontextmanager
    async def lifespan(app: Starlette):
        yield
        await anyio.to_thread.run_sync(rt.close)
        tenants.close()

    routes = [
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
        Route("/v1/responses", responses, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/ft/suffix_floor", suffix_floor, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/ft/recent", recent, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, middleware=[Middleware(ApiKey, tenants=tenants)],
                    exception_handlers=EXCEPTION_HANDLERS)
    app.state.runtime = rt
    app.state.drain = Drain()
    return app
