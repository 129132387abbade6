"""Pins: a session's continuation kept while its tool runs.

When an answer ends in a tool call, the session will send its next request once the tool is done,
restoring the answer's tip anchor. The tip is pinned for a TTL drawn from that session's own tool
times (the time from an answer ending in a tool call to its next request): their `quantile`, at
least TTL_FLOOR_S, capped at `ttl_max_s`; `ttl_default_s` before any is known. A pin ends when a
request restores through its tip (`resume`) or its TTL runs out (`expire`); a pin of the live tier
may yield to a live request earlier (`broke`, counted). Pure bookkeeping on an injectable clock: what pinning keeps where
is `LiveSequences`'s and the store's (gateway/retention.py ties them together). Any thread.

A request's session is the client's where it sends one (gateway/endpoint.py `session_id`), else the
session of the pin whose tip its chain runs through, else a new one named by its chain.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

TOOL_TIMES_KEPT = 32  # a session's latest tool times, what its TTL is drawn from
SESSIONS_KEPT = 4096  # sessions whose tool times are remembered (the least recently seen forgotten first)
TTL_FLOOR_S = 5.0  # a session of quick tools still keeps its pin until a request a little slower than those comes
ENDED_KEPT = 4096  # expired pins remembered, to time a tool that outlived its TTL when its session comes back


@dataclass(frozen=True)
class PinConfig:
    """`ttl_max_s`: the longest pin (0: no pins, no prefetch). `ttl_default_s`: a session's pin before
    any tool time of its own is known. `quantile`: of a session's tool times, its TTL. `prefetch`:
    bring a pinned session's restore chain up from disk into RAM while its tool runs."""

    ttl_max_s: float = 300.0
    ttl_default_s: float = 60.0
    quantile: float = 0.9
    prefetch: bool = True

    @property
    def enabled(self) -> bool:
        return self.ttl_max_s > 0


@dataclass
class Pin:
    session: str
    chain: tuple[bytes, ...]  # the anchors of the session's tokens, its tip last: what its next request restores
    since: float
    deadline: float
    live: bool = True  # its live sequence is still pinned (none broke it)

    @property
    def tip(self) -> bytes:
        return self.chain[-1]


class Pins:
    def __init__(self, config: PinConfig = PinConfig(), clock: Callable[[], float] = time.monotonic):
        self.config, self.clock = config, clock
        self._lock = threading.Lock()
        self._pins: dict[bytes, Pin] = {}  # by tip
        self._ended: OrderedDict[bytes, Pin] = OrderedDict()  # expired, by tip
        self._tool_times: OrderedDict[str, deque[float]] = OrderedDict()
        self.broken_live = 0  # live sequences dropped while pinned, for a live request's

    def ttl(self, session: str) -> float:
        """The pin a session's next tool call gets: the `quantile` of its tool times, capped."""
        config = self.config
        with self._lock:
            times = sorted(self._tool_times.get(session, ()))
        if not times:
            return min(config.ttl_default_s, config.ttl_max_s)
        rank = max(1, math.ceil(config.quantile * len(times)))  # nearest rank
        return min(max(times[rank - 1], TTL_FLOOR_S), config.ttl_max_s)

    def pin(self, chain: Sequence[bytes], session: str) -> Pin | None:
        """Pin `chain`'s tip (an answer that ended in a tool call) for `session`'s TTL; None when pins
        are off."""
        if not self.config.enabled or not chain:
            return None
        now, ttl = self.clock(), self.ttl(session)
        pin = Pin(session, tuple(chain), now, now + ttl)
        with self._lock:
            self._pins[pin.tip] = pin
            self._ended.pop(pin.tip, None)
        return pin

    def resume(self, chain: Sequence[bytes], session: str | None = None) -> tuple[str, Pin | None]:
        """A request restoring `chain` has arrived: the pin (live or expired) whose tip is the deepest of
        `chain` ends, and the time since it was set is a tool time of its session. Returns the request's
        session and the pin that ended while still held (None: none, or it had expired)."""
        now = self.clock()
        with self._lock:
            tip = next((a for a in reversed(chain) if a in self._pins or a in self._ended), None)
            held = self._pins.pop(tip, None) if tip is not None else None
            ended = held or (self._ended.pop(tip, None) if tip is not None else None)
            if ended is not None:
                self._observe(ended.session, now - ended.since)
        name = session or (ended.session if ended else None) or (chain[-1].hex() if chain else "")
        return name, held

    def holds(self, anchor: bytes) -> bool:
        """Whether a pin is held at `anchor` and its TTL has not run out."""
        with self._lock:
            pin = self._pins.get(anchor)
            return pin is not None and self.clock() < pin.deadline

    def holds_live(self, anchor: bytes) -> bool:
        """Whether the live sequence at `anchor` is pinned (`holds`, and no live request broke it)."""
        with self._lock:
            pin = self._pins.get(anchor)
            return pin is not None and pin.live and self.clock() < pin.deadline

    def broke(self, anchor: bytes) -> None:
        """The live sequence pinned at `anchor` was dropped for a live request: counted. Its pin in the
        store's RAM tier holds on."""
        with self._lock:
            pin = self._pins.get(anchor)
            if pin is not None and pin.live:
                pin.live = False
                self.broken_live += 1

    def expire(self) -> list[Pin]:
        """The pins whose TTL has run out, ended (remembered to time their tool)."""
        now = self.clock()
        with self._lock:
            due = [pin for pin in self._pins.values() if now >= pin.deadline]
            for pin in due:
                del self._pins[pin.tip]
                self._ended[pin.tip] = pin
            while len(self._ended) > ENDED_KEPT:
                self._ended.popitem(last=False)
        return due

    def held(self) -> list[Pin]:
        """The pins held (their TTL may have run out since the last `expire`)."""
        with self._lock:
            return list(self._pins.values())

    def next_deadline(self) -> float | None:
        with self._lock:
            return min((pin.deadline for pin in self._pins.values()), default=None)

    @property
    def active(self) -> int:
        """Pins held now (their TTL not run out)."""
        now = self.clock()
        with self._lock:
            return sum(now < pin.deadline for pin in self._pins.values())

    def _observe(self, session: str, seconds: float) -> None:
        times = self._tool_times.pop(session, None) or deque(maxlen=TOOL_TIMES_KEPT)
        times.append(seconds)
        self._tool_times[session] = times  # most recently seen last
        while len(self._tool_times) > SESSIONS_KEPT:
            self._tool_times.popitem(last=False)
