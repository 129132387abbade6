"""The capture server: a loopback HTTP server that answers Claude Code (Anthropic Messages) and
Codex (Responses) from a scripted model and keeps every request it received.

The scripted model follows a session plan: for each user turn, the tool calls of that turn in
order (one model call per step; a step may hold parallel calls), then a text answer. Which
step a request is at is read from the request itself (the last turn prompt it holds and the
tool results after it), so a re-run answers identically. Streams carry what the clients need:
a thinking block with its signature (Anthropic), a reasoning item with `encrypted_content`
(Responses). Used by traces/capture_clients.py.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MODEL = "m"
REDACTED = ("authorization", "x-api-key")


@dataclass(frozen=True)
class Turn:
    """One user turn: the prompt, then one model call per step (each a list of shell commands,
    run in parallel when more than one), then the text answer."""

    prompt: str
    steps: tuple[tuple[str, ...], ...]
    answer: str


# -- the scripted model ------------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    reasoning: str
    text: str | None
    commands: tuple[str, ...]


def plan_answer(turns: tuple[Turn, ...], history: list[tuple[str, str]]) -> Answer:
    """The answer to a request whose history is `history`: (kind, text) pairs in order, kind
    "user" for user text and "tool" for one tool result. The turn is the last user text that
    holds a turn's prompt; the step is how many tool-calling answers followed it."""
    turn_at, turn = None, None
    for i, (kind, text) in enumerate(history):
        for candidate in turns:
            if kind == "user" and candidate.prompt in text:
                turn_at, turn = i, candidate
    if turn is None:
        return Answer("Nothing to do.", "OK.", ())
    results = sum(kind == "tool" for kind, _ in history[turn_at + 1 :])
    step, done = 0, 0
    while step < len(turn.steps) and done + len(turn.steps[step]) <= results:
        done += len(turn.steps[step])
        step += 1
    if step < len(turn.steps):
        commands = turn.steps[step]
        return Answer(f"I will run {' and '.join(commands)}.", None, commands)
    return Answer("All steps are done; time to answer.", turn.answer, ())


def anthropic_history(body: dict[str, Any]) -> list[tuple[str, str]]:
    out = []
    for message in body.get("messages") or []:
        content = message.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content or []
        for block in blocks:
            if message.get("role") == "user" and block.get("type") == "text":
                out.append(("user", block["text"]))
            elif block.get("type") == "tool_result":
                out.append(("tool", json.dumps(block.get("content"))))
    return out


def responses_history(body: dict[str, Any]) -> list[tuple[str, str]]:
    out = []
    for item in body.get("input") or []:
        if item.get("type") == "message" and item.get("role") == "user":
            out += [("user", c.get("text", "")) for c in item.get("content") or []]
        elif item.get("type") == "function_call_output":
            out.append(("tool", json.dumps(item.get("output"))))
    return out


# -- protocol streams --------------------------------------------------------------------------


def sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()


def anthropic_stream(answer: Answer, n: int) -> Iterator[bytes]:
    """An Anthropic Messages stream: a thinking block (with signature), text, tool_use blocks."""
    usage = {"input_tokens": 10, "output_tokens": 1}
    message = {
        "id": f"msg_{n}",
        "type": "message",
        "role": "assistant",
        "model": MODEL,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage,
    }
    yield sse("message_start", {"type": "message_start", "message": message})
    blocks: list[tuple[dict[str, Any], list[dict[str, Any]]]] = [
        (
            {"type": "thinking", "thinking": "", "signature": ""},
            [
                {"type": "thinking_delta", "thinking": answer.reasoning},
                {"type": "signature_delta", "signature": f"sig-{n}"},
            ],
        )
    ]
    if answer.text:
        blocks.append(({"type": "text", "text": ""}, [{"type": "text_delta", "text": answer.text}]))
    for j, command in enumerate(answer.commands):
        arguments = json.dumps({"command": command, "description": f"Run {command}"})
        blocks.append(
            (
                {"type": "tool_use", "id": f"toolu_{n}_{j}", "name": "Bash", "input": {}},
                [{"type": "input_json_delta", "partial_json": arguments}],
            )
        )
    for index, (start, deltas) in enumerate(blocks):
        yield sse(
            "content_block_start", {"type": "content_block_start", "index": index, "content_block": start}
        )
        for delta in deltas:
            yield sse("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})
        yield sse("content_block_stop", {"type": "content_block_stop", "index": index})
    stop = "tool_use" if answer.commands else "end_turn"
    yield sse(
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": stop, "stop_sequence": None},
            "usage": {"output_tokens": 5},
        },
    )
    yield sse("message_stop", {"type": "message_stop"})


def responses_stream(answer: Answer, n: int) -> Iterator[bytes]:
    """A Responses stream: a reasoning item (summary + encrypted_content), function calls, a message."""
    response = {
        "id": f"resp_{n}",
        "object": "response",
        "model": MODEL,
        "status": "in_progress",
        "output": [],
    }
    seq = iter(range(1_000_000))

    def event(kind: str, **fields: Any) -> bytes:
        return sse(kind, {"type": kind, "sequence_number": next(seq), **fields})

    yield event("response.created", response=response)
    items: list[dict[str, Any]] = [
        {
            "type": "reasoning",
            "id": f"rs_{n}",
            "summary": [{"type": "summary_text", "text": answer.reasoning}],
            "encrypted_content": f"opaque-{n}",
        }
    ]
    for j, command in enumerate(answer.commands):
        items.append(
            {
                "type": "function_call",
                "id": f"fc_{n}_{j}",
                "call_id": f"call_{n}_{j}",
                "name": "exec_command",
                "arguments": json.dumps({"cmd": command}),
                "status": "completed",
            }
        )
    if answer.text:
        part = {"type": "output_text", "text": answer.text, "annotations": []}
        items.append(
            {
                "type": "message",
                "id": f"msg_{n}",
                "role": "assistant",
                "status": "completed",
                "content": [part],
            }
        )
    for index, item in enumerate(items):
        yield event("response.output_item.added", output_index=index, item=item)
        if item["type"] == "message":
            yield event(
                "response.output_text.delta",
                output_index=index,
                item_id=item["id"],
                content_index=0,
                delta=answer.text,
            )
        yield event("response.output_item.done", output_index=index, item=item)
    usage = {
        "input_tokens": 10,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 5,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 15,
    }
    yield event(
        "response.completed", response={**response, "status": "completed", "output": items, "usage": usage}
    )


# -- the capture server ------------------------------------------------------------------------


class CaptureServer:
    """A loopback HTTP server that records every request and answers from a session plan."""

    def __init__(self, turns: tuple[Turn, ...]) -> None:
        self.turns = turns
        self.captured: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def answer(
        self, method: str, path: str, headers: dict[str, str], raw: bytes
    ) -> tuple[int, str, Iterator[bytes]]:
        body = json.loads(raw) if raw else None
        with self.lock:
            n = len(self.captured)
            redacted = {k: ("<redacted>" if k.lower() in REDACTED else v) for k, v in headers.items()}
            self.captured.append({"method": method, "path": path, "headers": redacted, "body": body})
        route = path.split("?")[0]
        if method == "POST" and route.endswith("/messages"):
            answer = plan_answer(self.turns, anthropic_history(body))
            return 200, "text/event-stream", anthropic_stream(answer, n)
        if method == "POST" and route.endswith("/responses"):
            answer = plan_answer(self.turns, responses_history(body))
            return 200, "text/event-stream", responses_stream(answer, n)
        if route.endswith("/models"):
            return (
                200,
                "application/json",
                iter([json.dumps({"object": "list", "data": [{"id": MODEL}]}).encode()]),
            )
        return 404, "application/json", iter([b'{"error": {"message": "not here"}}'])

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def _serve(self) -> None:
                raw = self.rfile.read(int(self.headers.get("content-length") or 0))
                status, kind, chunks = server.answer(self.command, self.path, dict(self.headers), raw)
                self.send_response(status)
                self.send_header("content-type", kind)
                self.send_header("connection", "close")
                self.end_headers()
                for chunk in chunks:
                    self.wfile.write(chunk)
                    self.wfile.flush()
                self.close_connection = True

            do_GET = do_POST = do_HEAD = _serve  # noqa: N815

            def log_message(self, *args: Any) -> None:
                pass

        return Handler
