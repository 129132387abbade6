"""The engine's one worker thread: live requests first (in arrival order), background work
(precompute) only when no live request waits, and yielding to one that arrives.

Only this thread touches the engine and the store's write path; the event loop never blocks
on model work. Jobs are plain callables run on the worker; `run` awaits one from async code.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

log = logging.getLogger("gateway.scheduler")

LIVE, BACKGROUND = 0, 1


class Scheduler:
    def __init__(self) -> None:
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()
        self._live_waiting = 0
        self._lock = threading.Lock()
        self._pending = 0
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="engine-worker", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any], priority: int = LIVE) -> Future:
        future: Future = Future()
        with self._lock:
            self._pending += 1
            self._live_waiting += priority == LIVE
        self._queue.put((priority, next(self._order), fn, future))
        return future

    async def run(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the worker as live work and await its result."""
        return await asyncio.wrap_future(self.submit(fn, LIVE))

    def live_waiting(self) -> bool:
        """True when a live request waits (or the server is closing): background work should
        stop at its next boundary."""
        return self._live_waiting > 0 or self._closing

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    @property
    def idle(self) -> bool:
        """No job queued or running."""
        return self._pending == 0

    def close(self, timeout: float = 30.0) -> None:
        """Finish queued live work, cut background work short, stop the thread."""
        self._closing = True
        self._queue.put((2, next(self._order), None, None))
        self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            priority, _, fn, future = self._queue.get()
            if fn is None:
                return
            if priority == LIVE:
                with self._lock:
                    self._live_waiting -= 1
            try:
                if not future.set_running_or_notify_cancel():
                    continue
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 (delivered to the awaiting request)
                if priority != LIVE:
                    log.exception("background job failed")
                future.set_exception(exc)
            finally:
                with self._lock:
                    self._pending -= 1
