"""The disk tier's writer thread: a queue of operations applied off the request path.

Operations are applied in batches (group commit: one fsynced LMDB transaction for all
operations queued at that moment, up to ``max_batch_bytes``). ``flush`` blocks until all
operations submitted before it have been applied; ``submit`` blocks while more than
``max_queue_bytes`` wait (backpressure instead of unbounded memory).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from .record import Packed, RecordMeta

log = logging.getLogger("checkpoint_store")


@dataclass(frozen=True)
class PutOp:
    meta: RecordMeta
    kv: Packed
    state: Packed | None
    clock: int

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + (self.state.nbytes if self.state else 0)


@dataclass(frozen=True)
class DeleteOp:
    anchor: bytes
    part: str | None  # None: the whole record
    reason: str

    nbytes = 0


Op = PutOp | DeleteOp


class Writer:
    """One daemon thread applying ``Op`` batches with ``apply``; exceptions are logged."""

    def __init__(self, apply: Callable[[list[Op]], None], max_batch_bytes: int, max_queue_bytes: int) -> None:
        self._apply = apply
        self._max_batch_bytes = max_batch_bytes
        self._max_queue_bytes = max_queue_bytes
        self._cond = threading.Condition()
        self._queue: deque[Op] = deque()
        self._queued_bytes = 0
        self._submitted = 0
        self._applied = 0
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="checkpoint-store-writer", daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        return len(self._queue)

    @property
    def queued_bytes(self) -> int:
        return self._queued_bytes

    def submit(self, op: Op) -> None:
        with self._cond:
            if self._closing:
                raise RuntimeError("checkpoint store writer is closed")
            self._cond.wait_for(
                lambda: (
                    not op.nbytes
                    or not self._queue
                    or self._queued_bytes + op.nbytes <= self._max_queue_bytes
                )
            )
            self._queue.append(op)
            self._queued_bytes += op.nbytes
            self._submitted += 1
            self._cond.notify_all()

    def flush(self) -> None:
        """Block until every operation submitted so far has been applied (committed)."""
        with self._cond:
            target = self._submitted
            self._cond.wait_for(lambda: self._applied >= target or not self._thread.is_alive())

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()

    def _run(self) -> None:
        while True:
            batch = self._take()
            if batch is None:
                return
            try:
                self._apply(batch)
            except Exception:
                log.exception("checkpoint store: a write batch of %d operations failed", len(batch))
            with self._cond:
                self._applied += len(batch)
                self._queued_bytes -= sum(op.nbytes for op in batch)
                self._cond.notify_all()

    def _take(self) -> list[Op] | None:
        with self._cond:
            self._cond.wait_for(lambda: self._queue or self._closing)
            if not self._queue:
                return None
            batch, nbytes = [self._queue.popleft()], 0
            nbytes = batch[0].nbytes
            while self._queue and nbytes + self._queue[0].nbytes <= self._max_batch_bytes:
                nbytes += self._queue[0].nbytes
                batch.append(self._queue.popleft())
            return batch
