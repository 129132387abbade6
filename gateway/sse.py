"""Server-sent event framing with msgspec JSON, and the loop that drives an encoder."""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Iterable
from typing import Any, Protocol

import msgspec

from gateway.events import Event

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


class StreamEncoder(Protocol):
    """What every protocol's stream encoder offers (see gateway/protocols/*_out.py)."""

    def start(self) -> list[bytes]: ...
    def feed(self, ev: Event) -> list[bytes]: ...
    def end(self) -> list[bytes]: ...


async def encode_stream(
    encoder: StreamEncoder, events: AsyncIterable[Event] | Iterable[Event]
) -> AsyncIterator[bytes]:
    """Drive `encoder` over `events` (sync or async), yielding SSE frames as they form.

    An `ErrorEvent` in `events` ends the stream in the protocol's in-stream error form."""
    for frame in encoder.start():
        yield frame
    if isinstance(events, AsyncIterable):
        async for ev in events:
            for frame in encoder.feed(ev):
                yield frame
    else:
        for ev in events:
            for frame in encoder.feed(ev):
                yield frame
    for frame in encoder.end():
        yield frame
