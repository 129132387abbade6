"""The gateway's half of a graceful stop (SIGTERM, Ctrl-C): the HTTP server stops accepting and
calls `Drain.begin`; from then on a new request gets the protocol's `ShuttingDown` error (503),
a request still waiting for its first token gets it at once, and an answer already running has
`grace_s` seconds to finish before it is ended with the protocol's error (an in-stream error
event for a stream). The engine then stops and the store is flushed (the app's lifespan end).

Runs on the event loop only."""

from __future__ import annotations

import asyncio
from typing import Protocol

from gateway.errors import ShuttingDown


class Interruptible(Protocol):
    """A running request (gateway/endpoint.py `_Run`)."""

    @property
    def has_started(self) -> bool: ...

    def interrupt(self, error: BaseException) -> None: ...


class Drain:
    def __init__(self) -> None:
        self.draining = False
        self._runs: set[Interruptible] = set()

    def check(self) -> None:
        """Refuse new work once the server is stopping."""
        if self.draining:
            raise ShuttingDown()

    def add(self, run: Interruptible) -> None:
        self._runs.add(run)

    def discard(self, run: Interruptible) -> None:
        self._runs.discard(run)

    def begin(self, grace_s: float) -> None:
        """Fail what has not started; give what has `grace_s` seconds, then end it."""
        if self.draining:
            return
        self.draining = True
        for run in [r for r in self._runs if not r.has_started]:
            run.interrupt(ShuttingDown())
        asyncio.get_running_loop().call_later(grace_s, self.expire)

    def expire(self) -> None:
        for run in list(self._runs):
            run.interrupt(ShuttingDown("the server shut down before this answer was complete"))
