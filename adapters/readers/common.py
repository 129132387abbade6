"""What every reader shares: malformed-input reporting, JSONL iteration, small converters."""

from __future__ import annotations

import gzip
import json
import logging
import lzma
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

log = logging.getLogger("ft.adapters.readers")
COMPRESSED = {".xz": lzma.open, ".gz": gzip.open}


def read_bytes(path: Path) -> bytes:
    """The file's bytes; `.xz` and `.gz` files decompressed (committed test data is kept small so)."""
    opener = COMPRESSED.get(path.suffix)
    if opener is None:
        return path.read_bytes()
    try:
        with opener(path, "rb") as handle:
            return handle.read()
    except (EOFError, lzma.LZMAError) as exc:
        raise OSError(f"corrupt {path.suffix} file ({exc})") from None


def head_lines(path: Path, count: int) -> list[str]:
    """The first `count` lines of a (possibly compressed) text file, read lazily."""
    opener = COMPRESSED.get(path.suffix, open)
    try:
        with opener(path, "rt", encoding="utf-8") as handle:
            return [handle.readline() for _ in range(count)]
    except (EOFError, lzma.LZMAError, UnicodeDecodeError) as exc:
        raise OSError(f"unreadable {path.name} ({exc})") from None


def inner_suffix(path: Path) -> str:
    """The suffix that names the format: `.jsonl` for both `a.jsonl` and `a.jsonl.xz`."""
    return Path(path.stem).suffix if path.suffix in COMPRESSED else path.suffix


class TraceError(ValueError):
    """Malformed trace input, located by file and (where it applies) 1-based line number."""

    def __init__(self, path: str | Path, line: int | None, reason: str) -> None:
        self.path = str(path)
        self.line = line
        self.reason = reason
        super().__init__(str(self))

    def __str__(self) -> str:
        where = f"{self.path}:{self.line}" if self.line is not None else self.path
        return f"{where}: {self.reason}"


class Problems:
    """Where a reader reports malformed input: raised at once when strict, else logged and kept."""

    def __init__(self, strict: bool = False, sink: list[TraceError] | None = None) -> None:
        self.strict = strict
        self.found: list[TraceError] = sink if sink is not None else []

    def report(self, path: str | Path, line: int | None, reason: str) -> None:
        error = TraceError(path, line, reason)
        if self.strict:
            raise error
        log.warning("%s (skipped)", error)
        self.found.append(error)


def iter_jsonl(path: Path, problems: Problems) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for each non-blank line that is a JSON object; others are reported."""
    try:
        text = read_bytes(path).decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        problems.report(path, None, f"cannot read: {exc}")
        return
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as exc:
            problems.report(path, number, f"not valid JSON ({exc.msg} at column {exc.colno})")
            continue
        if not isinstance(obj, dict):
            problems.report(path, number, f"expected a JSON object, got {type(obj).__name__}")
            continue
        yield number, obj


def parse_ts(value: Any) -> float | None:
    """Unix seconds from an ISO-8601 string ("...Z" allowed) or a number; None if absent or bad."""
    if isinstance(value, int | float):
        return float(value) / 1000.0 if value > 1e11 else float(value)
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def parse_arguments(raw: Any) -> dict[str, Any]:
    """Tool-call arguments as a dict: JSON strings are decoded; anything not an object is wrapped."""
    if isinstance(raw, dict):
        return raw
    if isinstance(raw, str):
        try:
            value = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError:
            return {"_raw": raw}
        return value if isinstance(value, dict) else {"_value": value}
    return {} if raw is None else {"_value": raw}


def join_texts(parts: list[str]) -> str | None:
    """Texts joined by blank lines; None when there are none."""
    kept = [p for p in parts if p]
    return "\n\n".join(kept) if kept else None
