"""The RAM tier: packed record parts under a byte budget.

Parts are private copies (``record.Packed``), so nothing the engine does later to its
own tensors can change a stored checkpoint. Eviction follows ``eviction``; with a disk tier
every record is also written through to disk, so what RAM gives up is still restorable.
"""

from __future__ import annotations

from dataclasses import dataclass

from .index import TierIndex
from .record import KV_PART, Packed, RecordMeta


@dataclass
class RamRecord:
    meta: RecordMeta
    kv: Packed
    state: Packed | None


class RamTier:
    """Records by anchor, never holding more than ``budget`` payload bytes, evicted in ``eviction``'s
    order (``eviction.ORDERS``)."""

    def __init__(self, budget: int, eviction: str = "anchor") -> None:
        self.budget = budget
        self.index = TierIndex(eviction)
        self.records: dict[bytes, RamRecord] = {}
        self.evictions = 0
        self.states_dropped = 0
        self.rejected = 0  # records (or states) larger than what eviction could free

    @property
    def used_bytes(self) -> int:
        return self.index.used_bytes

    def get(self, anchor: bytes) -> RamRecord | None:
        return self.records.get(anchor)

    def put(self, meta: RecordMeta, kv: Packed, state: Packed | None, clock: int) -> None:
        """Hold ``kv`` (and ``state`` if it fits); evicts others to make room."""
        old = self.records.get(meta.anchor)
        if old is not None and old.meta == meta and (old.state is not None or state is None):
            self.index.touch(meta.anchor, clock)
            return
        self.remove(meta.anchor)
        state_bytes = state.nbytes if state else 0
        if kv.nbytes + state_bytes > self.budget:
            self.rejected += 1
            state, state_bytes = None, 0
            if kv.nbytes > self.budget:
                return
        if not self._make_room(kv.nbytes + state_bytes):
            self.rejected += 1
            return
        self.records[meta.anchor] = RamRecord(meta, kv, state)
        self.index.add(meta, kv.nbytes, state_bytes, clock)

    def touch(self, anchor: bytes, clock: int) -> None:
        self.index.touch(anchor, clock)

    def remove(self, anchor: bytes) -> None:
        self.records.pop(anchor, None)
        self.index.remove(anchor)

    def _make_room(self, nbytes: int) -> bool:
        while self.used_bytes + nbytes > self.budget:
            victim = self.index.victim()
            if victim is None:
                return False
            self._evict(*victim)
        return True

    def _evict(self, anchor: bytes, part: str) -> None:
        if part == KV_PART:
            self.remove(anchor)
            self.evictions += 1
        else:
            self.records[anchor].state = None
            self.index.set_state(anchor, 0)
            self.states_dropped += 1
