"""Typed gateway errors and their JSON in each protocol (by exception type, never text).

Endpoints raise; `EXCEPTION_HANDLERS`, registered on the app, answer a raised error with
the protocol's error JSON, chosen by the request's path (`error_style`). `error_response`
builds that response; `error_event(protocol, exc)` turns a failure after the stream started
into an `ErrorEvent`, which each protocol's stream encoder renders in its in-stream form
(Anthropic ``event: error``, Responses ``response.failed``, Chat a ``data: {"error"}``).
"""

from __future__ import annotations

from typing import Literal

import msgspec
import torch
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from engine.offload import BudgetError
from gateway.events import ErrorEvent, ErrorKind

ErrorStyle = Literal["anthropic", "openai"]  # whose error JSON a path answers with
CLIENT_CLOSED = 499  # nginx's status for "the client left first": counted, never seen by anyone


class GatewayError(Exception):
    """Base of every error the gateway answers by type; `message` is what the client sees.
    Each subclass has its status and error types per protocol in `SPECS` (its nearest base's
    where it has none)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class BadRequest(GatewayError):
    """The request body is invalid; `field` is a JSON path into the body (a 400)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


class RenderError(BadRequest):
    """The conversation cannot be rendered in this chat format (a 400)."""

    def __init__(self, message: str):
        super().__init__("messages", message)


class ContextLengthExceeded(GatewayError):
    def __init__(self, prompt_tokens: int, max_context: int):
        super().__init__(f"prompt of {prompt_tokens} tokens exceeds the context of {max_context}")
        self.prompt_tokens, self.max_context = prompt_tokens, max_context


class PayloadTooLarge(GatewayError):
    def __init__(self, size: int, limit: int):
        super().__init__(f"request body of {size} bytes exceeds the limit of {limit} bytes")
        self.size, self.limit = size, limit


class Unauthorized(GatewayError):
    def __init__(self, message: str = "invalid or missing API key"):
        super().__init__(message)


class NotFound(GatewayError):
    def __init__(self, what: str):
        super().__init__(f"not found: {what}")
        self.what = what


class MethodNotAllowed(GatewayError):
    """A known path asked with a method it does not take; `allow` lists those it does."""

    def __init__(self, method: str, path: str, allow: str):
        super().__init__(f"method {method} not allowed for {path}; allowed: {allow}")
        self.allow = allow


class Overloaded(GatewayError):
    def __init__(self, message: str = "the server is busy; retry shortly"):
        super().__init__(message)


class ShuttingDown(GatewayError):
    """The server is stopping: a queued request, or an answer still running at the end of the grace period."""

    def __init__(self, message: str = "the server is shutting down; retry shortly"):
        super().__init__(message)


class ClientGone(GatewayError):
    """The client closed its connection before its answer was complete."""

    def __init__(self, message: str = "the client closed the connection"):
        super().__init__(message)


OUT_OF_DEVICE_MEMORY = (
    "the GPU ran out of memory for this request; retry, or start the server with fewer running "
    "sequences (--max-running) or, under --gpu-memory, a larger budget"
)


class OutOfDeviceMemory(GatewayError):
    """The GPU ran out of memory in this request's engine step (its requests fail; the server
    goes on serving): answered as a busy server, retryable, with what to change."""

    def __init__(self, message: str = OUT_OF_DEVICE_MEMORY):
        super().__init__(message)


class InternalError(GatewayError):
    """A failure inside the server (the engine, a bug), already logged with its traceback where it
    happened; the client sees only its type."""

    def __init__(self, cause: BaseException):
        super().__init__(f"internal error ({type(cause).__name__})")


def is_typed(exc: BaseException) -> bool:
    """Whether `exc` is one of the errors the handlers answer by type (anything else is a bug)."""
    return isinstance(exc, GatewayError)


def typed(exc: BaseException) -> BaseException:
    """`exc` as one of the gateway's typed errors (answered by the handlers, never re-raised)."""
    if is_typed(exc):
        return exc
    if isinstance(exc, torch.OutOfMemoryError):
        error: GatewayError = OutOfDeviceMemory()
    elif isinstance(exc, BudgetError):  # a forward the memory budget cannot hold, even with top_k experts a layer
        error = OutOfDeviceMemory(f"{OUT_OF_DEVICE_MEMORY} ({exc})")
    else:
        error = InternalError(exc)
    error.__cause__ = exc
    return error


class Spec(msgspec.Struct, frozen=True):
    """How one exception type looks on the wire."""

    status: int
    anthropic_type: str
    openai_type: str
    openai_code: str | None
    kind: ErrorKind
    anthropic_status: int | None = None


SPECS: dict[type[Exception], Spec] = {
    BadRequest: Spec(400, "invalid_request_error", "invalid_request_error", None, "invalid_request"),
    ContextLengthExceeded: Spec(
        400,
        "invalid_request_error",
        "invalid_request_error",
        "context_length_exceeded",
        "context_length_exceeded",
    ),
    PayloadTooLarge: Spec(
        413, "request_too_large", "invalid_request_error", "request_too_large", "invalid_request"
    ),
    Unauthorized: Spec(
        401, "authentication_error", "invalid_request_error", "invalid_api_key", "invalid_request"
    ),
    NotFound: Spec(404, "not_found_error", "invalid_request_error", "not_found", "invalid_request"),
    MethodNotAllowed: Spec(
        405, "invalid_request_error", "invalid_request_error", "method_not_allowed", "invalid_request"
    ),
    Overloaded: Spec(429, "overloaded_error", "server_error", "server_is_overloaded", "overloaded", 529),
    ShuttingDown: Spec(503, "overloaded_error", "server_error", "server_shutting_down", "overloaded"),
    OutOfDeviceMemory: Spec(503, "overloaded_error", "server_error", "out_of_device_memory", "overloaded"),
    ClientGone: Spec(
        CLIENT_CLOSED, "invalid_request_error", "invalid_request_error", None, "invalid_request"
    ),
}
INTERNAL = Spec(500, "api_error", "server_error", None, "server_error")


def spec_of(exc: BaseException) -> Spec:
    for cls in type(exc).__mro__:
        if cls in SPECS:
            return SPECS[cls]
    return INTERNAL


def message_of(protocol: ErrorStyle, exc: BaseException) -> str:
    """The client-facing message, in the wording each client family recognises."""
    if isinstance(exc, ContextLengthExceeded):
        if protocol == "anthropic":  # Claude Code compacts on this wording
            return f"prompt is too long: {exc.prompt_tokens} tokens > {exc.max_context} maximum"
        return (
            f"This model's maximum context length is {exc.max_context} tokens. "
            f"However, your messages resulted in {exc.prompt_tokens} tokens."
        )
    if isinstance(exc, BadRequest):
        return f"{exc.field}: {exc.message}"
    if isinstance(exc, GatewayError):
        return exc.message
    return f"internal error ({type(exc).__name__})"


def status_of(protocol: ErrorStyle, exc: BaseException) -> int:
    spec = spec_of(exc)
    if protocol == "anthropic" and spec.anthropic_status is not None:
        return spec.anthropic_status
    return spec.status


def error_body(protocol: ErrorStyle, exc: BaseException) -> dict:
    """The protocol's error JSON for `exc`."""
    spec, message = spec_of(exc), message_of(protocol, exc)
    if protocol == "anthropic":
        return {"type": "error", "error": {"type": spec.anthropic_type, "message": message}}
    param = exc.field if isinstance(exc, BadRequest) else None
    return {"error": {"message": message, "type": spec.openai_type, "param": param, "code": spec.openai_code}}


RETRY_AFTER_S = 1  # an overloaded or stopping server: seconds a client waits before it retries


def error_headers(exc: BaseException) -> dict[str, str]:
    """`Retry-After` on the answers a client should retry; `Allow` on a 405."""
    if spec_of(exc).kind == "overloaded":
        return {"retry-after": str(RETRY_AFTER_S)}
    if isinstance(exc, MethodNotAllowed):
        return {"allow": exc.allow}
    return {}


def error_response(protocol: ErrorStyle, exc: BaseException) -> Response:
    """A complete JSON error response with the right status code and headers."""
    body = msgspec.json.encode(error_body(protocol, exc))
    return Response(
        body, status_code=status_of(protocol, exc), media_type="application/json", headers=error_headers(exc)
    )


def error_event(protocol: ErrorStyle, exc: BaseException) -> ErrorEvent:
    """An in-stream failure, to feed to the protocol's stream encoder."""
    return ErrorEvent(spec_of(exc).kind, message_of(protocol, exc))


def error_style(path: str) -> ErrorStyle:
    """Errors in the protocol the path belongs to (OpenAI's shape for everything but Anthropic's)."""
    return "anthropic" if path.startswith("/v1/messages") else "openai"


async def handle_error(request: Request, exc: Exception) -> Response:
    """Starlette exception handler: a raised typed error (or, registered for `Exception`, any
    failure, which Starlette then re-raises for uvicorn to log) becomes the error JSON of the
    request's protocol. An endpoint that counts its answers leaves `request.state.count_status`."""
    if isinstance(exc, ClientDisconnect):
        exc = ClientGone()
    elif isinstance(exc, HTTPException) and exc.status_code == 405:
        methods = (exc.headers or {}).get("Allow", "").split(", ")  # Starlette's order is a set's
        exc = MethodNotAllowed(request.method, request.url.path, ", ".join(sorted(methods)))
    elif isinstance(exc, HTTPException):
        exc = NotFound(f"{request.method} {request.url.path}")
    response = error_response(error_style(request.url.path), exc)
    if (count := getattr(request.state, "count_status", None)) is not None:
        count(response.status_code)
    return response


EXCEPTION_HANDLERS = {
    GatewayError: handle_error,
    ClientDisconnect: handle_error,
    404: handle_error,
    405: handle_error,
    Exception: handle_error,
}
