"""Loopback server for the encoder tests: serves canned event scripts through the
output encoders so the official SDKs can judge them. No tests here."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from gateway.errors import error_response
from gateway.events import Event, Finish, Usage, collect
from gateway.parsers import QwenParser, new_call_id
from gateway.protocols import anthropic_out, chat_out, responses_out
from gateway.sse import SSE_HEADERS, SSE_MEDIA_TYPE, encode_stream

HANDLE = "memo-7f3a"
MODEL = "qwen-test"
TOOLS = {
    "Bash": {"type": "object", "properties": {"command": {"type": "string"}, "timeout": {"type": "integer"}}}
}
QWEN_TEXT = (
    'The user wants "echo".\nI\'ll run it.\n</think>\n\nRunning it now.\n\n<tool_call>\n<function=Bash>\n'
    "<parameter=command>\necho 'hi' \"there\"\n</parameter>\n<parameter=timeout>\n30\n</parameter>\n"
    "</function>\n</tool_call>"
)


def qwen_events(
    text: str = QWEN_TEXT, prefix: str = "call_", chunk: int = 3, custom: tuple = ()
) -> list[Event]:
    """Parse `text` as the model's output in `chunk`-character pieces, framed by usage."""
    parser = QwenParser(TOOLS, custom_tools=custom, call_id=lambda: new_call_id(prefix))
    events: list[Event] = [Usage(100, cached_tokens=60, prefill_tokens=40)]
    for i in range(0, len(text), chunk):
        events += parser.feed(text[i : i + chunk])
    events += parser.close()
    return events + [Finish("stop"), Usage(100, 60, 40, output_tokens=25, reasoning_tokens=10)]


class Script:
    """What the next request is answered with."""

    events: list[Event] = []
    error: Exception | None = None
    reasoning_mode: responses_out.ReasoningMode = "summary"


def _respond(protocol: str, make_stream: Callable, make_body: Callable):
    async def endpoint(request: Request) -> Response:
        if Script.error is not None:
            return error_response("anthropic" if protocol == "anthropic" else "openai", Script.error)
        body = await request.json()
        if body.get("stream"):
            frames = encode_stream(make_stream(body), list(Script.events))
            return StreamingResponse(frames, media_type=SSE_MEDIA_TYPE, headers=SSE_HEADERS)
        return JSONResponse(make_body(collect(Script.events)))

    return endpoint


def make_app() -> Starlette:
    anthropic = _respond(
        "anthropic",
        lambda body: anthropic_out.AnthropicStream(MODEL, HANDLE),
        lambda c: anthropic_out.message_body(c, MODEL, HANDLE),
    )
    responses = _respond(
        "openai",
        lambda body: responses_out.ResponsesStream(MODEL, HANDLE, reasoning_mode=Script.reasoning_mode),
        lambda c: responses_out.response_body(c, MODEL, HANDLE, reasoning_mode=Script.reasoning_mode),
    )
    chat = _respond(
        "openai",
        lambda body: chat_out.ChatStream(
            MODEL, include_usage=bool((body.get("stream_options") or {}).get("include_usage"))
        ),
        lambda c: chat_out.completion_body(c, MODEL),
    )
    return Starlette(
        routes=[
            Route("/v1/messages", anthropic, methods=["POST"]),
            Route("/v1/responses", responses, methods=["POST"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
        ]
    )


class LoopbackServer:
    """uvicorn on 127.0.0.1 with an ephemeral port, in a daemon thread."""

    def __init__(self, app: Starlette):
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
