"""Replay recorded sessions against llama-server and our gateway, side by side.

Neither side can be handed the recorded answer in the same way (llama-server cannot force an
output), so both get each recorded request as it was, with `max_tokens: 1`: what is measured
is prompt processing. The next recorded request carries the recorded assistant message, not the
one token either server produced, so both see exactly the same sequence of prompts. Our gateway
can also be run as the agent's session ran (`gateway_forced_sample`): the recorded answer
teacher-forced, streamed, so its generation-end checkpoints and precompute take part.

Per request: client TTFT (wall time of the 1-token request), the server's own prompt time,
prompt tokens, tokens processed and tokens reused from a cache. llama-server reports the last
three in `timings` (`prompt_n`, `cache_n`, `prompt_ms`); our gateway in response headers
(`x-prefill-tokens`, `x-cached-tokens`, `x-server-ttft-ms`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
import msgspec

from adapters.client import parse_server_timing
from adapters.trace import Trace, TraceRequest


class Sample(msgspec.Struct):
    """One request as one server handled it."""

    index: int
    after_tool_result: bool
    ttft_ms: float  # client side: request sent -> the 1-token answer received
    server_ms: float  # server side: prompt processing (llama: prompt_ms; ours: x-server-ttft-ms)
    prompt_tokens: int
    processed: int  # prompt tokens computed
    reused: int  # prompt tokens restored from a cache
    phases: dict[str, float] | None = None  # ours: the server-timing header (ms by phase)


class Summary(msgspec.Struct):
    requests: int
    total_ttft_ms: float
    worst_ttft_after_tool_ms: float
    mean_ttft_after_tool_ms: float
    prompt_tokens: int
    processed: int
    reused: int
    # From token counts alone (the client sees no ids): a request's new tokens are its prompt's growth
    # over the previous prompt (0 when the prompt shrank, as when Qwen's template drops reasoning);
    # whatever else it processed had been in an earlier prompt.
    reprocessed: int
    new_tokens: int


def probe_body(request: TraceRequest, model: str) -> dict[str, Any]:
    """The recorded chat body, asking for one greedy token without streaming."""
    body = {
        k: v for k, v in request.body.items() if k not in ("stream", "stream_options", "ft_forced_output")
    }
    return {**body, "model": model, "max_tokens": 1, "temperature": 0, "stream": False}


def llama_sample(url: str, index: int, request: TraceRequest, client: httpx.Client) -> Sample:
    t0 = time.perf_counter()
    r = client.post(url + "/v1/chat/completions", json=probe_body(request, "peer"))
    ttft = 1000 * (time.perf_counter() - t0)
    r.raise_for_status()
    t = r.json()["timings"]
    return Sample(
        index,
        request.after_tool_result,
        ttft,
        t["prompt_ms"],
        t["prompt_n"] + t["cache_n"],
        t["prompt_n"],
        t["cache_n"],
    )


def header_sample(index: int, request: TraceRequest, ttft: float, h: httpx.Headers) -> Sample:
    """A sample from our gateway's response headers."""
    processed, reused = int(h["x-prefill-tokens"]), int(h["x-cached-tokens"])
    return Sample(
        index,
        request.after_tool_result,
        ttft,
        float(h["x-server-ttft-ms"]),
        processed + reused,
        processed,
        reused,
        parse_server_timing(h.get("server-timing", "")),
    )


def gateway_sample(url: str, index: int, request: TraceRequest, client: httpx.Client) -> Sample:
    t0 = time.perf_counter()
    r = client.post(url + "/v1/chat/completions", json=probe_body(request, "ft"))
    ttft = 1000 * (time.perf_counter() - t0)
    r.raise_for_status()
    return header_sample(index, request, ttft, r.headers)


def gateway_forced_sample(url: str, index: int, request: TraceRequest, client: httpx.Client) -> Sample:
    """The request as an agent's turn runs on our gateway: streamed, with the recorded answer
    teacher-forced (`ft_forced_output`), so the server holds the same tokens the real session
    produced and precomputes the next turn's history from them. TTFT is the wall time to the
    response headers, which our gateway sends with the first token; the rest is drained."""
    body = {**request.replay_body(), "model": "ft", "stream": True}
    t0 = time.perf_counter()
    with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        ttft = 1000 * (time.perf_counter() - t0)
        r.raise_for_status()
        for _ in r.iter_bytes():
            pass
    return header_sample(index, request, ttft, r.headers)


Prober = Callable[[str, int, TraceRequest, httpx.Client], Sample]


def replay(
    url: str,
    trace: Trace,
    probe: Prober,
    on_sample: Callable[[Sample], None] | None = None,
    between: Callable[[], None] | None = None,
) -> list[Sample]:
    """Send the session's chat requests in order, one at a time (calling `between` after each,
    e.g. to let the server's background work finish as a tool or user would)."""
    if trace.protocol != "chat":
        raise ValueError(
            f"{trace.session_id}: {trace.protocol} requests; llama-server is driven over chat completions"
        )
    samples = []
    with httpx.Client(timeout=3600) as client:
        for i, request in enumerate(trace.requests):
            samples.append(probe(url, i, request, client))
            if on_sample:
                on_sample(samples[-1])
            if between:
                between()
    return samples


def summarise(samples: list[Sample]) -> Summary:
    after_tool = [s.ttft_ms for s in samples if s.after_tool_result]
    reprocessed = new = 0
    prev_prompt = 0
    for s in samples:
        # tokens beyond the previous prompt's length are new; what was computed below it was seen before
        new += max(s.prompt_tokens - prev_prompt, 0) if prev_prompt else s.prompt_tokens
        reprocessed += max(s.processed - max(s.prompt_tokens - prev_prompt, 0), 0) if prev_prompt else 0
        prev_prompt = s.prompt_tokens
    return Summary(
        requests=len(samples),
        total_ttft_ms=sum(s.ttft_ms for s in samples),
        worst_ttft_after_tool_ms=max(after_tool, default=0.0),
        mean_ttft_after_tool_ms=sum(after_tool) / len(after_tool) if after_tool else 0.0,
        prompt_tokens=sum(s.prompt_tokens for s in samples),
        processed=sum(s.processed for s in samples),
        reused=sum(s.reused for s in samples),
        reprocessed=reprocessed,
        new_tokens=new,
    )
