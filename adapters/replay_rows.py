"""What a replay measured: a row per request, a run per capture policy (written by adapters/replay.py,
summarised by adapters/replay_report.py)."""

from __future__ import annotations

import msgspec


class Row(msgspec.Struct):
    """What one request measured. Times in milliseconds; `context_tokens` is the previous
    request's prompt + output, `new_tokens` this prompt minus that (the suffix an ideal cache
    prefills; negative where the prompt rewrote history, e.g. Qwen dropping earlier reasoning at
    a new user turn)."""

    session: str
    index: int
    protocol: str
    after_tool_result: bool
    prompt_tokens: int
    output_tokens: int
    context_tokens: int
    new_tokens: int
    prefilled_tokens: int
    cached_tokens: int
    client_ttft_ms: float
    server_ttft_ms: float
    total_ms: float
    floor_ms: float | None = None
    server_timing: dict[str, float] | None = None  # the server's time to first token by phase (ms)
    fidelity: str = "identical"  # of the rebuilt request body (adapters/trace.py)
    link_bytes: int | None = None  # host -> device until the first token (the server's `x-link-bytes`)
    prefill_reasons: dict[str, int] | None = None  # prefilled tokens by why not restored (`x-prefill-reasons`)


class PolicyRun(msgspec.Struct):
    """One pass over every trace against one server."""

    policy: str
    rows: list[Row]
    server_prefilled: int | None = None  # the server's own ft_tokens_total{kind="prefilled"} delta
    seconds: float = 0.0
