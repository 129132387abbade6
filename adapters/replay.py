"""`ft replay`: send recorded agent sessions to a server, request by request, and report TTFT,
tokens re-prefilled and the suffix floor for each capture policy.

Each request is sent as recorded, streaming, with its recorded answer teacher-forced
(`ft_forced_output`), so the server checkpoints the same decode-time states as in real use.
Requests the reader could only rebuild approximately (see adapters/trace.py: fidelity) are
replayed like the rest, counted apart in the report and listed with the reason.
Client TTFT is the time to the first SSE event carrying model output. Before each request the
replay waits until the server's worker is idle (the time a tool or the user would take), so
background precompute finishes as it would between real turns.

With `--preset` the server runs in this process, once per policy of `--compare`, each on a fresh
store; with `--server URL` the replay runs once against that server, whatever its policy.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from adapters.client import (
    FLOOR_PATH,
    ReplayError,
    floor_ms,
    http_wait_idle,
    prefilled_counter,
    send,
)
from adapters.replay_rows import PolicyRun, Row
from adapters.trace import Trace

POLICY_ORDER = ("anchor", "prefix", "user", "none")


# -- in-process server ---------------------------------------------------------------------------


def serve_in_thread(config: Any, engine: Any = None) -> Any:
    """The real server in this process (see gateway/embedded.py); a start failure is a ReplayError."""
    from gateway.embedded import serve_in_thread as serve  # noqa: PLC0415

    try:
        return serve(config, engine)
    except RuntimeError as exc:
        raise ReplayError(str(exc)) from None


# -- sessions and policies -----------------------------------------------------------------------


def replay_trace(
    client: httpx.Client,
    trace: Trace,
    limit: int | None,
    wait_idle: Callable[[], None],
    advance: Callable[[], None] = lambda: None,
) -> list[Row]:
    rows: list[Row] = []
    context = 0
    for index, req in enumerate(trace.requests[:limit]):
        wait_idle()
        m = send(client, req)
        prompt = m.prefilled + m.cached
        rows.append(
            Row(
                session=trace.session_id,
                index=index,
                protocol=req.protocol,
                after_tool_result=req.after_tool_result,
                prompt_tokens=prompt,
                output_tokens=m.output_tokens,
                context_tokens=context,
                new_tokens=prompt - context,
                prefilled_tokens=m.prefilled,
                cached_tokens=m.cached,
                client_ttft_ms=round(m.client_ttft_ms, 2),
                server_ttft_ms=m.server_ttft_ms,
                total_ms=round(m.total_ms, 2),
                server_timing=m.server_timing,
                fidelity=req.fidelity,
                link_bytes=m.link_bytes,
                prefill_reasons=m.prefill_reasons,
            )
        )
        context = prompt + m.output_tokens
        advance()
    return rows


def floor_query(row: Row) -> tuple[int, int] | None:
    """(context, new) of a row's suffix floor; None where the prompt rewrote history (new <= 0:
    how much of it is new is not known from token counts)."""
    return (row.context_tokens, row.new_tokens) if row.new_tokens > 0 else None


def run_policy(
    url: str,
    policy: str,
    traces: list[Trace],
    limit: int | None,
    wait_idle: Callable[[], None],
    with_floor: bool,
    advance: Callable[[], None],
) -> PolicyRun:
    started = time.monotonic()
    with httpx.Client(base_url=url, timeout=httpx.Timeout(3600, connect=30)) as client:
        before = prefilled_counter(client)
        rows = [row for trace in traces for row in replay_trace(client, trace, limit, wait_idle, advance)]
        wait_idle()
        after = prefilled_counter(client)
        if with_floor:
            for row in rows:
                if (query := floor_query(row)) is not None:
                    row.floor_ms = floor_ms(client, *query)
    delta = after - before if before is not None and after is not None else None
    return PolicyRun(policy, rows, delta, round(time.monotonic() - started, 2))


def copy_floors(source: PolicyRun, runs: list[PolicyRun]) -> None:
    """The floor depends on the model and the token counts, not the policy: measure it once."""
    floors = {(r.session, r.index, floor_query(r)): r.floor_ms for r in source.rows}
    for run in runs:
        for row in run.rows:
            row.floor_ms = floors.get((row.session, row.index, floor_query(row)), row.floor_ms)


# -- command line --------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = __doc__
    parser.epilog = (
        "measures: client and server TTFT per request; worst TTFT after a tool result\n"
        "(the headline) beside the suffix floor of the same requests (measured by the server's\n"
        f"{FLOOR_PATH}); re-prefill ratio = tokens prefilled / tokens new (1.0 is ideal).\n\n"
        "with --server the replay can only wait for the server's queue to empty between requests (a\n"
        "precompute already running is not visible over HTTP); --preset waits for the worker itself.\n\n"
        "example: ft replay traces/sessions/small-bugfix.codex.jsonl --preset tiny --json out.json --plot out.png"
    )
    parser.add_argument(
        "traces",
        nargs="+",
        type=Path,
        metavar="TRACE",
        help="trace files or folders (Codex, Claude Code, SWE-agent, ft recordings)",
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--server", metavar="URL", help="replay against a running ft server (its own policy)")
    where.add_argument(
        "--preset",
        metavar="NAME",
        help="serve this preset in-process, once per policy, fresh store each (default: tiny)",
    )
    parser.add_argument(
        "--compare",
        metavar="POLICIES",
        help=f"comma-separated policies for --preset (default: {','.join(POLICY_ORDER)})",
    )
    parser.add_argument("--json", type=Path, metavar="OUT", help="write every row and summary as JSON")
    parser.add_argument("--plot", type=Path, metavar="OUT.png", help="plot TTFT per request for each policy")
    parser.add_argument(
        "--limit", type=int, metavar="N", help="replay only the first N requests of each session"
    )
    parser.add_argument("--device", default="cpu", help="torch device for --preset (default cpu)")
    parser.add_argument(
        "--ram-cache",
        type=float,
        default=4.0,
        metavar="GiB",
        help="checkpoint RAM budget of each in-process server (default 4)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="torch CPU threads for --preset (default: torch's; 1 is fastest on a busy machine)",
    )
    parser.add_argument("--no-floor", action="store_true", help="skip the suffix floor measurement")
    parser.add_argument("--quiet", action="store_true", help="no per-request table")


def parse_policies(text: str | None) -> list[str]:
    names = [p.strip() for p in (text or ",".join(POLICY_ORDER)).split(",") if p.strip()]
    unknown = [p for p in names if p not in POLICY_ORDER]
    if unknown or not names:
        raise ReplayError(
            f"--compare: unknown policy {', '.join(unknown) or '(none)'} (from {', '.join(POLICY_ORDER)})"
        )
    return list(dict.fromkeys(names))


def load_traces(paths: list[Path]) -> list[Trace]:
    from adapters.readers import TraceError, read_trace  # noqa: PLC0415

    traces: list[Trace] = []
    for path in paths:
        try:
            found = read_trace(path, strict=True)
        except TraceError as exc:
            raise ReplayError(str(exc)) from None
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ReplayError(f"{path}: unreadable trace ({type(exc).__name__}: {exc})") from None
        traces.extend(t for t in found if t.requests)
    if not traces:
        raise ReplayError(f"no requests in {', '.join(map(str, paths))}")
    return traces


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except ReplayError as exc:
        print(f"ft replay: {exc}", file=sys.stderr)
        return 2
    except httpx.HTTPError as exc:
        print(f"ft replay: server: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    from rich.console import Console  # noqa: PLC0415
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn  # noqa: PLC0415

    from adapters import replay_report as report  # noqa: PLC0415
    from gateway.service import load_engine  # noqa: PLC0415

    if args.server and args.compare:
        raise ReplayError("--compare needs --preset (a --server runs whatever policy it was started with)")
    if args.limit is not None and args.limit < 1:
        raise ReplayError("--limit must be at least 1")
    policies = ["server"] if args.server else parse_policies(args.compare)
    traces = load_traces(args.traces)
    console = Console() if sys.stdout.isatty() else Console(width=200)
    report.print_fidelity(console, traces, args.limit)
    if args.threads is not None:
        import torch  # noqa: PLC0415

        torch.set_num_threads(max(1, args.threads))
    total = sum(len(t.requests[: args.limit]) for t in traces) * len(policies)
    runs: list[PolicyRun] = []
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    # one model for every policy
    engine = None if args.server else load_engine(_serve_config(args, policies[0]))
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("replay", total=total)
        advance = lambda: progress.advance(task)  # noqa: E731
        for policy in policies:
            progress.update(task, description=f"replay [{policy}]")
            with_floor = not args.no_floor and not runs
            if args.server:
                url = args.server.rstrip("/")
                runs.append(
                    run_policy(url, policy, traces, args.limit, http_wait_idle(url), with_floor, advance)
                )
                continue
            with serve_in_thread(_serve_config(args, policy), engine) as server:
                runs.append(
                    run_policy(server.url, policy, traces, args.limit, server.wait_idle, with_floor, advance)
                )
    if not args.no_floor:
        copy_floors(runs[0], runs[1:])
    summaries = [report.summarize(r) for r in runs]
    report.print_report(console, runs, summaries, rows=not args.quiet)
    meta = {
        "traces": [str(p) for p in args.traces],
        "sessions": [t.session_id for t in traces],
        "server": args.server,
        "preset": None if args.server else (args.preset or "tiny"),
        "device": args.device,
        "limit": args.limit,
        "threads": args.threads,
        "fidelity": report.fidelity_json(traces, args.limit),
    }
    if args.json:
        args.json.write_bytes(report.report_json(runs, summaries, meta))
        console.print(f"wrote {args.json}")
    if args.plot:
        title = (
            f"{', '.join(t.session_id for t in traces)}: TTFT per request ({meta['preset'] or args.server})"
        )
        report.plot(runs, args.plot, title)
        console.print(f"wrote {args.plot}")
    return 0


def _serve_config(args: argparse.Namespace, policy: str) -> Any:
    from engine.engine_config import EngineConfig  # noqa: PLC0415
    from gateway.service import ServeConfig  # noqa: PLC0415

    return ServeConfig(
        preset=args.preset or "tiny", engine=EngineConfig(device=args.device), policy=policy,
        ram_cache_gib=args.ram_cache,
    )
