"""Readers of recorded agent sessions into `Trace`s, one module per format.

`read_trace(path)` detects the format of a file (or of every file under a folder):
Codex rollouts, Claude Code transcripts, SWE-agent trajectories, or the gateway's own
recordings; each may be compressed (`.xz`, `.gz`). Malformed input is reported with its file and line number and skipped, or
raised as `TraceError` with `strict=True`; never an unhandled exception for bad data.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from adapters.readers.claude import read_claude
from adapters.readers.codex import read_codex
from adapters.readers.common import Problems, TraceError, head_lines, inner_suffix
from adapters.readers.recording import read_recording
from adapters.readers.swe_agent import read_swe_agent
from adapters.trace import Trace

__all__ = [
    "TraceError",
    "detect_format",
    "read_claude",
    "read_codex",
    "read_recording",
    "read_swe_agent",
    "read_trace",
]

Reader = Callable[..., list[Trace]]
READERS: dict[str, Reader] = {
    "codex": read_codex,
    "claude": read_claude,
    "swe-agent": read_swe_agent,
    "recording": read_recording,
}
CODEX_LINE_TYPES = {"session_meta", "response_item", "turn_context", "event_msg", "compacted"}
CLAUDE_LINE_TYPES = {"user", "assistant", "attachment", "summary", "system", "queue-operation", "api-request"}
TRACE_SUFFIXES = (".jsonl", ".traj")


def detect_format(path: str | Path) -> str | None:
    """The format of a trace file ("codex", "claude", "swe-agent", "recording"); None if unrecognised."""
    path = Path(path)
    if inner_suffix(path) == ".traj":
        return "swe-agent"
    try:
        head = head_lines(path, 50)
    except OSError:
        return None
    for raw in head:
        kind = _line_format(raw)
        if kind:
            return kind
    return "swe-agent" if inner_suffix(path) == ".json" else None


def _line_format(raw: str) -> str | None:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError:
        return "swe-agent" if raw.lstrip().startswith("{") and '"history"' in raw else None
    if not isinstance(obj, dict):
        return None
    if "protocol" in obj and "body" in obj:
        return "recording"
    if "history" in obj:
        return "swe-agent"
    if obj.get("type") in CODEX_LINE_TYPES and "payload" in obj:
        return "codex"
    if obj.get("type") in CLAUDE_LINE_TYPES or "parentUuid" in obj:
        return "claude"
    return None


def read_trace(
    path: str | Path,
    *,
    strict: bool = False,
    problems: list[TraceError] | None = None,
    fmt: str | None = None,
) -> list[Trace]:
    """Every session in a trace file, or in every `.jsonl`/`.traj` file under a folder.

    `fmt` forces a format (a key of `READERS`). An unrecognised file is a `TraceError` when
    `strict` (or when it is the single file asked for); inside a folder it is reported and skipped.
    """
    path = Path(path)
    report = Problems(strict, problems)
    if path.is_dir():
        traces: list[Trace] = []
        for file in sorted(p for p in path.rglob("*") if p.is_file() and inner_suffix(p) in TRACE_SUFFIXES):
            traces.extend(_read_file(file, report, fmt, strict))
        return traces
    if not path.exists():
        raise TraceError(path, None, "no such file or folder")
    if (fmt or detect_format(path)) is None:
        raise TraceError(
            path,
            None,
            "unrecognised trace format (expected a Codex rollout, Claude Code transcript, SWE-agent .traj or ft recording)",
        )
    return _read_file(path, report, fmt, strict)


def _read_file(path: Path, report: Problems, fmt: str | None, strict: bool) -> list[Trace]:
    kind = fmt or detect_format(path)
    if kind is None:
        report.report(path, None, "unrecognised trace format")
        return []
    if kind not in READERS:
        raise TraceError(path, None, f"unknown format {kind!r} (one of {', '.join(READERS)})")
    return READERS[kind](path, strict=strict, problems=report.found)
