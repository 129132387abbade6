"""Checkpoints on their way into the store, put by a thread of their own so that no request waits
for them: the engine worker hands over the snapshots a feed captured and moves on to its next
step. A restore waits only for the queued checkpoints of its own chain (the previous answer of
the same session), never for other sessions'. A put that fails loses its checkpoints (a later
miss), is counted with the store's write errors and never reaches a request: a restore waiting
for it goes on with what the store holds."""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Callable, Sequence

from checkpoint_store import CheckpointStore, Snapshot

STOP_POLL = 0.002  # seconds between a waiter's `stop` checks (background work waiting while a request arrives)


class StoreQueue:
    def __init__(self, store: CheckpointStore):
        self.store = store
        self._items: deque[tuple[list[bytes], bytes | None, list[Snapshot], Callable[[], None], list[str]]] = deque()
        self._queued: Counter[bytes] = Counter()  # anchor -> puts queued or running
        self._cond = threading.Condition()
        self._closing = False
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="store-writer", daemon=True)
        self._thread.start()

    def put(self, anchors: Sequence[bytes], parent: bytes | None, snapshots: list[Snapshot],
            ready: Callable[[], None] = lambda: None, kinds: Sequence[str] = ()) -> None:
        """Store `snapshots` under `anchors`, a chain after `parent`, once `ready()` returns
        (their host copies are complete); `kinds`: each record's (`CheckpointStore.put`)."""
        if not snapshots:
            return
        with self._cond:
            self._items.append((list(anchors), parent, snapshots, ready, list(kinds) or [""] * len(snapshots)))
            self._queued.update(anchors)
            self._cond.notify_all()

    def holds(self, chain: Sequence[bytes]) -> bool:
        """Whether a checkpoint of `chain` is still queued or being stored."""
        with self._cond:
            return any(a in self._queued for a in chain)

    def wait_for(self, chain: Sequence[bytes], stop: Callable[[], bool] | None = None) -> bool:
        """Return once no checkpoint of `chain` is still queued (or the thread has stopped): True; or,
        with `stop`, as soon as it returns True (asked every STOP_POLL seconds meanwhile): False
        while some of `chain` is still queued."""
        with self._cond:
            while not self._stopped and self.holds(chain):
                if stop is not None and stop():
                    return False
                self._cond.wait(STOP_POLL if stop is not None else None)
            return True

    @property
    def idle(self) -> bool:
        return not self._queued

    def close(self, timeout: float = 60.0) -> None:
        """Store everything queued, then stop."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            self._loop()
        finally:  # even on a BaseException: no restore may wait for a thread that is gone
            with self._cond:
                self._stopped = True
                self._cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._items or self._closing)
                if not self._items:
                    return
                anchors, parent, snapshots, ready, kinds = self._items[0]
            try:
                ready()
                for anchor, snapshot, kind in zip(anchors, snapshots, kinds, strict=True):
                    self.store.put(anchor, parent, snapshot, kind)
                    parent = anchor
            except Exception as exc:  # noqa: BLE001 (a lost checkpoint is a later miss, never a failed answer)
                self.store.write_errors.record(exc, f"storing {len(anchors)} checkpoints", trace=True)
            with self._cond:
                self._items.popleft()
                self._queued -= Counter(anchors)  # keeps positive counts only
                self._cond.notify_all()
