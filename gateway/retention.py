"""What pins keep, and their upkeep off the engine worker.

When an answer ends in a tool call (`pin`, on the worker) its tip is pinned (gateway/pins.py) in
the live tier (`LiveSequences` drops a pinned sequence last) and in the store's RAM tier
(`CheckpointStore.pin`), and, while the tool runs, a thread of its own brings the session's restore
chain up from disk into RAM (`CheckpointStore.promote`, never breaking a pin), so the next request
restores without reading the disk. The same thread ends pins whose TTL ran out: the store unpins the
record (an ordinary record again, evicted to disk, its write-through copy, in the eviction order)
and the live sequence is dropped on the worker (`LiveSequences.drop`: its state goes down to the
store). A prefetch stops as soon as its session's next request arrives (`resume` ends the pin) or the
server closes; it never runs on the worker, and takes the store's lock only between disk reads, so
no request's step waits for it.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import Future

from checkpoint_store import CheckpointStore
from gateway.live import LiveSequences
from gateway.pins import Pin, Pins
from gateway.scheduler import Scheduler
from gateway.store_queue import StoreQueue

log = logging.getLogger("gateway.retention")
MAX_WAIT = 30.0  # seconds the thread sleeps at most between looks at the pins' deadlines


class Retention:
    def __init__(self, pins: Pins, store: CheckpointStore, queue: StoreQueue, live: LiveSequences,
                 scheduler: Scheduler):
        self.pins, self.store, self.queue, self.live, self.scheduler = pins, store, queue, live, scheduler
        self._prefetches: deque[Pin] = deque()
        self._cond = threading.Condition()
        self._sweeping = threading.Lock()  # one sweep at a time: its drops are queued on the worker in order
        self._busy = False
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="retention", daemon=True)
        self._thread.start()

    def pin(self, chain: list[bytes], session: str) -> None:
        """An answer ended in a tool call: its tip (`chain[-1]`, `chain` the anchors of the session's
        tokens) is pinned for `session`'s TTL and its chain prefetched. Worker thread."""
        pin = self.pins.pin(chain, session)
        if pin is None:
            return
        self.store.pin(pin.tip)
        with self._cond:
            if self.pins.config.prefetch:
                self._prefetches.append(pin)
            self._cond.notify_all()

    def resume(self, chain: list[bytes], session: str | None) -> str:
        """A request restoring `chain` has arrived: the pin it restores ends. Returns its session
        (`Pins.resume`). Worker thread."""
        name, held = self.pins.resume(chain, session)
        if held is not None:
            self.store.unpin(held.tip)
        return name

    def sweep(self) -> list[Future]:
        """End the pins whose TTL has run out: unpinned in the store, their live sequences dropped on
        the worker (the futures of those jobs). Any thread; the retention thread calls it at each
        deadline."""
        with self._sweeping:
            dropped = []
            for pin in self.pins.expire():
                self.store.unpin(pin.tip)
                if pin.live:
                    dropped.append(self.scheduler.submit(lambda tip=pin.tip: self.live.drop(tip)))
            return dropped

    def wait_prefetched(self, timeout: float | None = None) -> bool:
        """Wait until no prefetch is queued or running: True, or False after `timeout` seconds."""
        with self._cond:
            return self._cond.wait_for(lambda: not (self._prefetches or self._busy), timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Stop the thread, cutting a prefetch short."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._closing or self._prefetches or self._due()):
                    self._cond.wait(self._wait())
                if self._closing:
                    return
                pin = self._prefetches.popleft() if self._prefetches else None
                self._busy = pin is not None
            try:
                self.sweep()
                if pin is not None:
                    self._prefetch(pin)
            except Exception:  # noqa: BLE001 (a failed prefetch is a later disk read, never a failed answer)
                log.exception("pin upkeep failed")
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _prefetch(self, pin: Pin) -> None:
        def stop() -> bool:
            return self._closing or not self.pins.holds(pin.tip)

        chain = list(pin.chain)
        if self.queue.wait_for(chain, stop=stop):  # the answer's own checkpoints land first
            moved = self.store.promote(chain, stop=stop)
            log.debug("prefetched %d parts of session %s", moved, pin.session)

    def _due(self) -> bool:
        deadline = self.pins.next_deadline()
        return deadline is not None and self.pins.clock() >= deadline

    def _wait(self) -> float:
        deadline = self.pins.next_deadline()
        return MAX_WAIT if deadline is None else min(MAX_WAIT, max(deadline - self.pins.clock(), 0.0))
