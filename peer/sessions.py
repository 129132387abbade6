"""K recorded sessions at once against one server: what several agents sharing a server see.

Each session is one thread sending its trace's chat requests in order, streaming, waiting for
the whole answer and then a tool gap (the time a tool would take) before its next request.
Answers are decoded step by step at their recorded lengths on both servers, so decode steps of
one session and prefills of another compete as they would in real use:

- ours: the recorded answer teacher-forced (`ft_forced_output`), which `ft serve
  --forced-decode steps` decodes one token per step; `max_tokens` = its length.
- llama-server: `max_tokens` = the recorded answer's length in tokens with `ignore_eos`, so it
  decodes that many (sampled) tokens whatever they are.

The answer's length is the token count of the recorded message rendered as the model's reply
(`Renderer.render_generation`: what our engine forces, end-of-turn included).

When there are fewer distinct traces than sessions, a trace is reused with a per-session nonce at
the start of its first user message, so neither server can share one session's cache with
another's beyond the system prompt and tools (which real sessions share too).

Client TTFT is the time from sending a request to the first streamed delta of output (reasoning,
text or a tool call). Rows carry the server's own view: our `x-server-ttft-ms`, `server-timing`
phases, `x-prefill-tokens` / `x-cached-tokens` and (on a GPU) `x-link-bytes`; llama-server's
`timings` (`prompt_ms`, `prompt_n`, `cache_n`, `predicted_n`).
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import msgspec

from adapters.client import send as replay_send
from adapters.client import stream
from adapters.replay_report import percentile
from adapters.trace import Trace, TraceRequest
from gateway.plan import forced_message
from gateway.protocols.chat import parse_request
from gateway.render import Renderer


class Session(msgspec.Struct):
    """One of the K sessions: a trace's requests (nonce applied), with their answers' lengths."""

    number: int
    trace: str  # the trace's session id
    requests: list[TraceRequest]
    answer_tokens: list[int]  # the recorded answer of each request, in tokens
    nonce: str | None = None  # prepended to the first user message when the trace is reused


class Turn(msgspec.Struct):
    """One request of one session as one server handled it (times in ms)."""

    session: int
    index: int
    after_tool_result: bool
    start_ms: float  # when it was sent, since the run started
    ttft_ms: float  # client side: sent -> first output delta
    total_ms: float  # client side: sent -> end of the stream
    server_ms: float  # ours: x-server-ttft-ms; llama-server: prompt_ms
    prompt_tokens: int
    processed: int  # prompt tokens computed
    reused: int  # prompt tokens taken from a cache
    output_tokens: int
    answer_tokens: int  # what was asked for: the recorded answer's length
    phases: dict[str, float] | None = None  # ours: server-timing (plan, queue, restore, prefill)
    link_bytes: int | None = None  # ours on a GPU: copied host -> device until the first token (x-link-bytes)


class RunSummary(msgspec.Struct):
    """One server, K sessions at once."""

    sessions: int
    requests: int
    p50_ttft_ms: float
    p95_ttft_ms: float
    worst_ttft_after_tool_ms: float
    wall_s: float  # first request sent -> last answer ended
    output_tokens: int
    output_tokens_per_s: float  # aggregate: all sessions' output tokens / wall time
    processed: int
    reused: int


def with_nonce(body: dict[str, Any], nonce: str) -> dict[str, Any]:
    """A copy of a chat body whose first user message starts with `nonce`."""
    body = copy.deepcopy(body)
    for message in body.get("messages") or []:
        if message.get("role") != "user":
            continue
        content = message.get("content")
        if isinstance(content, str):
            message["content"] = nonce + content
        else:  # a list of parts: prefix the first text part, or add one
            texts = [p for p in content or [] if isinstance(p, dict) and p.get("type") == "text"]
            if texts:
                texts[0]["text"] = nonce + texts[0]["text"]
            else:
                message["content"] = [{"type": "text", "text": nonce}, *(content or [])]
        break
    return body


def answer_tokens(request: TraceRequest, renderer: Renderer) -> int:
    """The recorded answer's length in tokens, as the model's reply to this request."""
    conv = parse_request(request.replay_body())
    message = forced_message(conv)
    assert message is not None  # replay_body always carries ft_forced_output
    return len(renderer.render_generation(conv, message))


def plan_sessions(traces: list[Trace], k: int, renderer: Renderer) -> list[Session]:
    """K sessions over `traces` in turn; every reuse of a trace gets a nonce of its own."""
    if not traces:
        raise ValueError("no chat traces to replay")
    # a nonce never changes an answer
    lengths = [[answer_tokens(r, renderer) for r in t.requests] for t in traces]
    sessions = []
    for number in range(k):
        trace = traces[number % len(traces)]
        nonce = f"[session {number}] " if number >= len(traces) else None
        requests = [
            msgspec.structs.replace(r, body=with_nonce(r.body, nonce)) if nonce else r for r in trace.requests
        ]
        sessions.append(Session(number, trace.session_id, requests, lengths[number % len(traces)], nonce))
    return sessions


# -- one request, streamed ------------------------------------------------------------------------


def usage_of(events: list[dict[str, Any]]) -> dict[str, Any]:
    return next((e["usage"] for e in reversed(events) if e.get("usage")), {})


def stream_body(request: TraceRequest, n: int, model: str) -> dict[str, Any]:
    body = {
        k: v for k, v in request.body.items() if k not in ("stream", "stream_options", "ft_forced_output")
    }
    return {
        **body,
        "model": model,
        "max_tokens": n,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


Sender = Callable[[httpx.Client, TraceRequest, int], dict[str, Any]]  # -> Turn fields after answer_tokens


def ft_send(client: httpx.Client, request: TraceRequest, n: int) -> dict[str, Any]:
    """Ours: the recorded answer teacher-forced, streamed (the replay's own client, `replay.send`)."""
    m = replay_send(
        client, msgspec.structs.replace(request, body={**request.body, "model": "ft", "max_tokens": n})
    )
    return dict(
        ttft_ms=m.client_ttft_ms,
        total_ms=m.total_ms,
        server_ms=m.server_ttft_ms,
        prompt_tokens=m.prefilled + m.cached,
        processed=m.prefilled,
        reused=m.cached,
        output_tokens=m.output_tokens,
        phases=m.server_timing,
        link_bytes=m.link_bytes,
    )


def llama_send(client: httpx.Client, request: TraceRequest, n: int) -> dict[str, Any]:
    """llama-server: `n` tokens decoded whatever they are (`ignore_eos`), its prompt cache on."""
    body = {**stream_body(request, n, "peer"), "temperature": 0, "ignore_eos": True, "cache_prompt": True}
    s = stream(client, "/v1/chat/completions", body, "chat")
    t = next((e["timings"] for e in reversed(s.events) if e.get("timings")), None)
    if t is None:
        raise RuntimeError("llama-server sent no timings")
    return dict(
        ttft_ms=s.ttft_ms,
        total_ms=s.total_ms,
        server_ms=t["prompt_ms"],
        prompt_tokens=t["prompt_n"] + t["cache_n"],
        processed=t["prompt_n"],
        reused=t["cache_n"],
        output_tokens=t.get("predicted_n") or usage_of(s.events).get("completion_tokens", 0),
    )


# -- K sessions at once ---------------------------------------------------------------------------


def run_sessions(
    url: str, sessions: list[Session], send: Sender, tool_gap: float
) -> tuple[list[Turn], float]:
    """Run every session in a thread of its own, all started together; returns the turns (in
    session, then request order) and the wall time in seconds."""
    start = threading.Barrier(len(sessions) + 1, timeout=600)  # a session that cannot start breaks it
    t0 = 0.0

    def one(session: Session) -> list[Turn]:
        turns = []
        with httpx.Client(base_url=url, timeout=3600) as client:
            start.wait()
            for i, (request, n) in enumerate(zip(session.requests, session.answer_tokens, strict=True)):
                if i:
                    time.sleep(tool_gap)
                sent = 1000 * (time.perf_counter() - t0)
                fields = send(client, request, n)
                turns.append(
                    Turn(session.number, i, request.after_tool_result, sent, answer_tokens=n, **fields)
                )
        return turns

    with ThreadPoolExecutor(len(sessions)) as pool:
        futures = [pool.submit(one, s) for s in sessions]
        t0 = time.perf_counter()
        start.wait()
        turns = [t for f in futures for t in f.result()]
    return turns, time.perf_counter() - t0


def summarise_run(turns: list[Turn], wall_s: float) -> RunSummary:
    ttfts = [t.ttft_ms for t in turns]
    output = sum(t.output_tokens for t in turns)
    return RunSummary(
        sessions=len({t.session for t in turns}),
        requests=len(turns),
        p50_ttft_ms=percentile(ttfts, 50),
        p95_ttft_ms=percentile(ttfts, 95),
        worst_ttft_after_tool_ms=max((t.ttft_ms for t in turns if t.after_tool_result), default=0.0),
        wall_s=wall_s,
        output_tokens=output,
        output_tokens_per_s=output / wall_s if wall_s > 0 else 0.0,
        processed=sum(t.processed for t in turns),
        reused=sum(t.reused for t in turns),
    )
