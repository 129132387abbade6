"""The RAM tier: packed record parts under a byte budget.

Parts are private copies (``record.Packed``), so nothing the engine does later to its
own tensors can change a stored checkpoint. Eviction follows ``eviction``; with a disk tier
every record is also written through to disk, so what RAM gives up is still restorable.

A pinned record (a session's continuation while its tool runs) is evicted only when nothing
else can make room for a put that may break pins (``put(..., break_pins=True)``, what live
requests store); each such eviction unpins it and counts in ``pins_broken``.
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
        self.pinned: set[bytes] = set()
        self.pins_broken = 0

    @property
    def used_bytes(self) -> int:
        return self.index.used_bytes

    def get(self, anchor: bytes) -> RamRecord | None:
        return self.records.get(anchor)

    def put(self, meta: RecordMeta, kv: Packed, state: Packed | None, clock: int, break_pins: bool = True) -> bool:
        """Hold ``kv`` (and ``state`` if it fits); evicts others to make room, pinned records last and
        only with ``break_pins``. True when the record (with ``state``, if given) is held."""
        old = self.records.get(meta.anchor)
        if old is not None and old.meta == meta and (old.state is not None or state is None):
            self.index.touch(meta.anchor, clock)
            return True
        self.remove(meta.anchor)
        state_bytes = state.nbytes if state else 0
        if kv.nbytes + state_bytes > self.budget:
            self.rejected += 1
            state, state_bytes = None, 0
            if kv.nbytes > self.budget:
                return False
        if not self._make_room(kv.nbytes + state_bytes, break_pins):
            self.rejected += 1
            return False
        self.records[meta.anchor] = RamRecord(meta, kv, state)
        self.index.add(meta, kv.nbytes, state_bytes, clock)
        return state_bytes > 0 or state is None

    def touch(self, anchor: bytes, clock: int, with_state: bool = False) -> None:
        self.index.touch(anchor, clock, with_state)

    def remove(self, anchor: bytes) -> None:
        self.records.pop(anchor, None)
        self.index.remove(anchor)

    def _make_room(self, nbytes: int, break_pins: bool) -> bool:
        while self.used_bytes + nbytes > self.budget:
            victim = self.index.victim(tuple(self.pinned)) if self.pinned else self.index.victim()
            if victim is None and break_pins and self.pinned:
                victim = self.index.victim()
                if victim is not None and victim[0] in self.pinned:
                    self.pinned.discard(victim[0])
                    self.pins_broken += 1
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
