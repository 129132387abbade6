"""What `ft replay` reports: a summary per policy (TTFT percentiles, the worst TTFT after a tool
result beside its suffix floor, the re-prefill ratio), rich tables, the JSON file and the TTFT
plot; and how faithful the replayed requests are to what the client sent (identical, or rebuilt
approximately and why)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgspec
from rich.console import Console
from rich.table import Table

from adapters.replay_rows import PolicyRun
from adapters.trace import Trace


class Summary(msgspec.Struct):
    """Per policy. TTFT is client side unless named `server_`; the headline is
    `worst_after_tool_ms` (max TTFT over requests whose last message is a tool result), beside
    `floor_after_tool_ms` (the max suffix floor over those same requests) and their ratio."""

    requests: int
    p50_ttft_ms: float
    p95_ttft_ms: float
    max_ttft_ms: float
    worst_after_tool_ms: float | None
    server_worst_after_tool_ms: float | None
    floor_after_tool_ms: float | None
    worst_over_floor: float | None
    reprefill_ratio: float | None  # tokens prefilled / tokens new (negative rows count 0), summed
    prefilled_tokens: int
    new_tokens: int
    server_prefilled_tokens: int | None
    seconds: float
    identical: int = 0  # requests whose body is what the client sent (adapters/trace.py)
    approximate: int = 0
    prefill_reasons: dict[str, int] = msgspec.field(default_factory=dict)  # prefilled tokens by why not restored


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


def summarize(run: PolicyRun) -> Summary:
    rows = run.rows
    ttfts = [r.client_ttft_ms for r in rows]
    after = [r for r in rows if r.after_tool_result]
    worst = max((r.client_ttft_ms for r in after), default=None)
    floors = [r.floor_ms for r in after if r.floor_ms is not None]
    floor = max(floors) if floors and len(floors) == len(after) else None
    new = sum(max(r.new_tokens, 0) for r in rows)
    prefilled = sum(r.prefilled_tokens for r in rows)
    return Summary(
        requests=len(rows),
        p50_ttft_ms=percentile(ttfts, 50),
        p95_ttft_ms=percentile(ttfts, 95),
        max_ttft_ms=max(ttfts, default=0.0),
        worst_after_tool_ms=worst,
        server_worst_after_tool_ms=max((r.server_ttft_ms for r in after), default=None),
        floor_after_tool_ms=floor,
        worst_over_floor=round(worst / floor, 2) if worst and floor else None,
        reprefill_ratio=round(prefilled / new, 3) if new else None,
        prefilled_tokens=prefilled,
        new_tokens=new,
        server_prefilled_tokens=run.server_prefilled,
        seconds=run.seconds,
        identical=sum(r.fidelity == "identical" for r in rows),
        approximate=sum(r.fidelity != "identical" for r in rows),
        prefill_reasons=sum_reasons(r.prefill_reasons for r in rows),
    )


def sum_reasons(per_request: Iterable[dict[str, int] | None]) -> dict[str, int]:
    """Tokens per reason over requests, in the order the reasons first appear."""
    total: dict[str, int] = {}
    for reasons in per_request:
        for name, n in (reasons or {}).items():
            total[name] = total.get(name, 0) + n
    return total


def why(reasons: dict[str, int] | None) -> str:
    """`edited 4,000 · new 96`: the tokens prefilled by reason (the server's `x-prefill-reasons`)."""
    return " · ".join(f"{name} {n:,}" for name, n in reasons.items() if n) if reasons else "–"


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value:,.0f}"


def request_table(runs: list[PolicyRun]) -> Table:
    """A row per request: per policy its client TTFT (tokens prefilled), then why those were prefilled."""
    table = Table(title="Requests: client TTFT ms (tokens prefilled); why prefilled")
    sessions = len({r.session for r in runs[0].rows}) > 1
    for name in ("#", "session", "tool", "≈", "prompt", "new", "floor ms"):
        if name != "session" or sessions:
            table.add_column(name, justify="left" if name == "session" else "right")
    for run in runs:
        table.add_column(run.policy, justify="right")
        table.add_column(f"{run.policy} why", justify="left")
    for i, row in enumerate(runs[0].rows):
        cells = [
            str(row.index),
            *([row.session[:12]] if sessions else []),
            "✓" if row.after_tool_result else "",
            "" if row.fidelity == "identical" else "≈",
            f"{row.prompt_tokens:,}",
            f"{row.new_tokens:,}",
            _ms(row.floor_ms),
        ]
        for r in runs:
            cells += [f"{r.rows[i].client_ttft_ms:,.0f} ({r.rows[i].prefilled_tokens:,})", why(r.rows[i].prefill_reasons)]
        table.add_row(*cells)
    return table


def summary_table(runs: list[PolicyRun], summaries: list[Summary]) -> Table:
    table = Table(title="Summary per policy (client TTFT, ms)")
    columns = (
        "policy",
        "p50",
        "p95",
        "max",
        "worst after tool",
        "floor (same)",
        "× floor",
        "server worst",
        "re-prefill ratio",
        "prefilled",
        "why prefilled",
        "new",
        "identical",
        "time s",
    )
    for name in columns:
        table.add_column(name, justify="left" if name in ("policy", "why prefilled") else "right")
    for run, s in zip(runs, summaries, strict=True):
        table.add_row(
            run.policy,
            _ms(s.p50_ttft_ms),
            _ms(s.p95_ttft_ms),
            _ms(s.max_ttft_ms),
            _ms(s.worst_after_tool_ms),
            _ms(s.floor_after_tool_ms),
            "–" if s.worst_over_floor is None else f"{s.worst_over_floor:.1f}×",
            _ms(s.server_worst_after_tool_ms),
            "–" if s.reprefill_ratio is None else f"{s.reprefill_ratio:.2f}",
            f"{s.prefilled_tokens:,}",
            why(s.prefill_reasons),
            f"{s.new_tokens:,}",
            f"{s.identical}/{s.requests}",
            f"{s.seconds:.0f}",
        )
    return table


def print_report(
    console: Console, runs: list[PolicyRun], summaries: list[Summary], rows: bool = True
) -> None:
    if rows and runs and runs[0].rows:
        console.print(request_table(runs))
    console.print(summary_table(runs, summaries))


def approximate_requests(traces: list[Trace], limit: int | None) -> list[tuple[str, int, str]]:
    """(session, index, why) of every replayed request rebuilt approximately."""
    return [
        (trace.session_id, index, request.why or "")
        for trace in traces
        for index, request in enumerate(trace.requests[:limit])
        if request.fidelity != "identical"
    ]


def print_fidelity(console: Console, traces: list[Trace], limit: int | None) -> None:
    """One line per session with approximate requests: how many, and the first reason."""
    approximate = approximate_requests(traces, limit)
    for trace in traces:
        mine = [(index, why) for session, index, why in approximate if session == trace.session_id]
        if mine:
            total = len(trace.requests[:limit])
            index, why = mine[0]
            console.print(
                f"[yellow]{trace.session_id}: {len(mine)} of {total} requests rebuilt approximately "
                f"(≈ in the table); request {index}: {why}[/yellow]",
                highlight=False,
                soft_wrap=True,
            )


def fidelity_json(traces: list[Trace], limit: int | None) -> dict[str, Any]:
    approximate = approximate_requests(traces, limit)
    total = sum(len(t.requests[:limit]) for t in traces)
    return {
        "identical": total - len(approximate),
        "approximate": len(approximate),
        "approximate_requests": [{"session": s, "index": i, "why": w} for s, i, w in approximate],
    }


def report_json(runs: list[PolicyRun], summaries: list[Summary], meta: dict[str, Any]) -> bytes:
    policies = {
        run.policy: {
            "summary": summary,
            "server_prefilled_tokens": run.server_prefilled,
            "seconds": run.seconds,
            "rows": run.rows,
        }
        for run, summary in zip(runs, summaries, strict=True)
    }
    return msgspec.json.format(msgspec.json.encode({**meta, "policies": policies}), indent=2)


def plot(runs: list[PolicyRun], out: Path, title: str) -> None:
    """TTFT per request for each policy; the suffix floor dashed; tool-result requests marked."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(10, 5), dpi=120)
    xs = list(range(len(runs[0].rows)))
    for run in runs:
        ax.plot(xs, [r.client_ttft_ms for r in run.rows], marker="o", markersize=3, label=run.policy)
    floors = [float("nan") if r.floor_ms is None else r.floor_ms for r in runs[0].rows]
    if any(r.floor_ms is not None for r in runs[0].rows):
        ax.plot(xs, floors, linestyle="--", color="black", label="suffix floor")
    for x, row in zip(xs, runs[0].rows, strict=True):
        if not row.after_tool_result:
            ax.axvline(x, color="grey", alpha=0.2, linewidth=4)
    ax.set_xlabel("request (shaded: not after a tool result)")
    ax.set_ylabel("client TTFT (ms)")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
