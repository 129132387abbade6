"""Server-sent event framing with msgspec JSON."""

from __future__ import annotations

from typing import Any

import msgspec

_encoder = msgspec.json.Encoder()


def sse_event(event: str | None, data: Any) -> bytes:
    """Frame one SSE event: ``event: X\\ndata: {json}\\n\\n`` (no event line if None).

    `data` is encoded as JSON unless it is already `bytes` (sent verbatim)."""
    body = data if isinstance(data, bytes) else _encoder.encode(data)
    head = b"event: " + event.encode() + b"\n" if event else b""
    return head + b"data: " + body + b"\n\n"


def sse_comment(text: str = "") -> bytes:
    """A comment line (keep-alive)."""
    return b": " + text.encode() + b"\n\n"


SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
SSE_MEDIA_TYPE = "text/event-stream"
