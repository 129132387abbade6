"""The gateway's own `--record DIR` output (JSONL of `RecordLine`) -> traces, one per session."""

from __future__ import annotations

from pathlib import Path

import msgspec

from adapters.readers.common import Problems, TraceError, read_bytes
from adapters.trace import RecordLine, Trace, TraceRequest, is_tool_result_last

_decoder = msgspec.json.Decoder(RecordLine)


def read_recording(
    path: str | Path, *, strict: bool = False, problems: list[TraceError] | None = None
) -> list[Trace]:
    """Read one recording file; lines are grouped by their `session` (file stem when absent).

    A line that is not a valid `RecordLine` is reported with file and line number: skipped,
    or raised as `TraceError` when `strict`.
    """
    path = Path(path)
    report = Problems(strict, problems)
    try:
        text = read_bytes(path)
    except OSError as exc:
        report.report(path, None, f"cannot read: {exc}")
        return []
    sessions: dict[str, list[TraceRequest]] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            line = _decoder.decode(raw)
        except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
            report.report(path, number, f"not a record line: {exc}")
            continue
        output_ts = line.ts + line.timings.total_ms / 1000 if line.ts and line.timings.total_ms else None
        after_tool = is_tool_result_last(line.protocol, line.body)
        request = TraceRequest(line.protocol, line.body, line.output, after_tool, line.ts, output_ts)
        sessions.setdefault(line.session or path.stem, []).append(request)
    return [Trace(session, "recording", str(path), requests) for session, requests in sessions.items()]
