"""The HTTP client of `ft replay`, the benches and the tests: a streaming request sent and timed
(the time to the first SSE event carrying model output, every event, the headers), our server's
own headers and endpoints read (`x-prefill-tokens`, `x-prefill-reasons`, `server-timing`, the suffix floor, the
prefilled-tokens counter, /health's idle flag), for the three protocols."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx

from adapters.trace import TraceRequest

FLOOR_PATH = "/v1/ft/suffix_floor"


class ReplayError(Exception):
    """A failure worth one line: a server that refused a request (`ft replay` raises it for bad
    arguments and traces too)."""


@dataclass(frozen=True)
class Measured:
    client_ttft_ms: float
    server_ttft_ms: float
    total_ms: float
    prefilled: int
    cached: int
    output_tokens: int
    server_timing: dict[str, float]
    link_bytes: int | None = None  # host -> device until the first token (`x-link-bytes`; a GPU's only)
    prefill_reasons: dict[str, int] | None = None  # tokens prefilled by why not restored (`x-prefill-reasons`)


def parse_prefill_reasons(header: str) -> dict[str, int]:
    """`new=120, edited=4096` -> {"new": 120, "edited": 4096} (entries without a count skipped)."""
    reasons = {}
    for item in header.split(","):
        name, _, count = item.strip().partition("=")
        if name and count.isdigit():
            reasons[name] = int(count)
    return reasons


def parse_server_timing(header: str) -> dict[str, float]:
    """`plan;dur=1.2, restore;dur=30.5` -> {"plan": 1.2, "restore": 30.5} (entries without a duration skipped)."""
    phases = {}
    for item in header.split(","):
        name, _, dur = item.strip().partition(";dur=")
        if name and dur:
            phases[name] = float(dur)
    return phases


def stream_body(req: TraceRequest) -> dict[str, Any]:
    body = req.replay_body()
    body["stream"] = True
    if req.protocol == "chat":
        body["stream_options"] = {"include_usage": True}
    return body


def is_output_delta(protocol: str, event: dict[str, Any]) -> bool:
    """Whether an SSE data event carries model output (reasoning, text or a tool call)."""
    kind = event.get("type")
    if protocol == "anthropic":
        return kind == "content_block_delta"
    if protocol == "responses":
        return isinstance(kind, str) and kind.startswith("response.") and kind.endswith(".delta")
    for choice in event.get("choices") or []:
        delta = choice.get("delta") or {}
        if any(delta.get(k) for k in ("content", "reasoning_content", "reasoning", "tool_calls")):
            return True
    return False


def output_tokens_of(protocol: str, event: dict[str, Any]) -> int | None:
    if protocol == "anthropic" and event.get("type") == "message_delta":
        return (event.get("usage") or {}).get("output_tokens")
    if protocol == "responses" and event.get("type") in ("response.completed", "response.incomplete"):
        return ((event.get("response") or {}).get("usage") or {}).get("output_tokens")
    if protocol == "chat" and event.get("usage"):
        return event["usage"].get("completion_tokens")
    return None


def stream_error(protocol: str, event: dict[str, Any]) -> str | None:
    kind = event.get("type")
    if kind in ("error", "response.failed") or (protocol == "chat" and "error" in event):
        error = event.get("error") or (event.get("response") or {}).get("error") or event
        return str(error.get("message", error)) if isinstance(error, dict) else str(error)
    return None


def sse_data(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    for line in lines:
        if line.startswith("data:"):
            data = line[5:].strip()
            if data and data != "[DONE]":
                yield json.loads(data)


@dataclass(frozen=True)
class Streamed:
    ttft_ms: float  # to the first SSE event carrying model output
    total_ms: float
    events: list[dict[str, Any]]
    headers: httpx.Headers


def stream(client: httpx.Client, path: str, body: dict[str, Any], protocol: str) -> Streamed:
    """POST a streaming request (to the client's base URL): the time to the first output delta and
    to the end, every SSE event and the response's headers. A refusal or an error event raises."""
    started = time.perf_counter()
    first: float | None = None
    events = []
    with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            text = response.read().decode(errors="replace")
            raise ReplayError(f"{path}: HTTP {response.status_code}: {text[:300]}")
        for event in sse_data(response.iter_lines()):
            if first is None and is_output_delta(protocol, event):
                first = time.perf_counter()
            if (message := stream_error(protocol, event)) is not None:
                raise ReplayError(f"{path}: stream error: {message}")
            events.append(event)
        headers = response.headers
    ended = time.perf_counter()
    return Streamed(1000 * ((first or ended) - started), 1000 * (ended - started), events, headers)


def send(client: httpx.Client, req: TraceRequest) -> Measured:
    """Send one recorded request (streaming) to our server and measure it (its phases and token
    counts from our headers)."""
    s = stream(client, req.path, stream_body(req), req.protocol)
    if "x-prefill-tokens" not in s.headers:
        raise ReplayError(f"{req.path}: the server sent no x-prefill-tokens header (not an ft server?)")
    counts = [n for event in s.events if (n := output_tokens_of(req.protocol, event))]
    return Measured(
        client_ttft_ms=s.ttft_ms,
        server_ttft_ms=float(s.headers["x-server-ttft-ms"]),
        total_ms=s.total_ms,
        prefilled=int(s.headers["x-prefill-tokens"]),
        cached=int(s.headers["x-cached-tokens"]),
        output_tokens=counts[-1] if counts else 0,
        server_timing=parse_server_timing(s.headers.get("server-timing", "")),
        link_bytes=int(s.headers["x-link-bytes"]) if "x-link-bytes" in s.headers else None,
        prefill_reasons=parse_prefill_reasons(s.headers["x-prefill-reasons"]) if "x-prefill-reasons" in s.headers
        else None,
    )


def floor_ms(client: httpx.Client, context: int, new: int) -> float:
    response = client.post(FLOOR_PATH, json={"context": context, "new": new})
    if response.status_code != 200:
        raise ReplayError(f"{FLOOR_PATH}: HTTP {response.status_code}: {response.text[:300]}")
    return float(response.json()["ms"])


def prefilled_counter(client: httpx.Client) -> int | None:
    response = client.get("/metrics")
    for line in response.text.splitlines() if response.status_code == 200 else []:
        if line.startswith('ft_tokens_total{kind="prefilled"}'):
            return int(float(line.split()[-1]))
    return None


def http_wait_idle(url: str) -> Callable[[], None]:
    """For a server in another process: wait until /health reports its worker idle (no job
    queued or running; a server without that field: an empty queue)."""

    def wait() -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                health = httpx.get(f"{url}/health", timeout=10).json()
                if health.get("idle", health.get("queue_depth", 0) == 0):
                    return
            except (httpx.HTTPError, ValueError):
                return
            time.sleep(0.05)

    return wait
