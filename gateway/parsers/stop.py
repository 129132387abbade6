"""Client stop strings (`stop`, `stop_sequences`) over the answer text: text that could still
be the start of a stop string is held back, and the answer ends just before a match."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.events import Event, TextDelta


class StopMatcher:
    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.hit: str | None = None
        self._held = ""

    def filter(self, events: list[Event]) -> list[Event]:
        """Pass events through, holding back answer text near a possible stop string."""
        if not self.stops:
            return events
        out: list[Event] = []
        for ev in events:
            if self.hit is not None:
                break
            if isinstance(ev, TextDelta):
                out += self._text(ev.text)
            else:
                out += self.flush() + [ev]
        return out

    def flush(self) -> list[Event]:
        text, self._held = self._held, ""
        return [TextDelta(text)] if text and self.hit is None else []

    def _text(self, text: str) -> list[Event]:
        buf = self._held + text
        found = [(buf.find(s), s) for s in self.stops if s in buf]
        if found:
            index, self.hit = min(found)
            self._held = ""
            return [TextDelta(buf[:index])] if index else []
        keep = max((k for s in self.stops for k in range(1, len(s)) if buf.endswith(s[:k])), default=0)
        self._held = buf[len(buf) - keep :] if keep else ""
        emit = buf[: len(buf) - keep]
        return [TextDelta(emit)] if emit else []
