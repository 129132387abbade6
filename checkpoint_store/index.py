"""What one tier holds, by anchor: chain metadata, part sizes, recency and byte count.

Both tiers keep one ``TierIndex`` in memory (the disk tier rebuilds it from the frame
headers when it opens) and ask it for eviction victims (see ``eviction``). It tells its
``HitDensity`` each use of a held part (``touch``) and each part it gives up (``victim``), with
the part's class and age, so the order learns how soon each kind of part is read again.
"""

from __future__ import annotations

from .eviction import ORDERS, Children, Entry, pick_victim
from .hit_density import HitDensity
from .record import KV_PART, STATE_PART, RecordMeta


class TierIndex:
    """Records of one tier, evicted in ``order`` (``eviction.ORDERS``); not thread-safe (the store's
    lock guards it)."""

    def __init__(self, order: str = "anchor") -> None:
        if order not in ORDERS:
            raise ValueError(f"eviction order {order!r} is not one of {', '.join(ORDERS)}")
        self.order = order
        self.metas: dict[bytes, RecordMeta] = {}
        self.entries: dict[bytes, Entry] = {}
        self.children = Children()
        self.density = HitDensity()
        self.clock = 0  # the latest tick seen (puts and uses): ages are counted to it
        self.used_bytes = 0

    def __contains__(self, anchor: bytes) -> bool:
        return anchor in self.metas

    def __len__(self) -> int:
        return len(self.metas)

    def add(self, meta: RecordMeta, kv_bytes: int, state_bytes: int, last_used: int) -> None:
        """Add a record, replacing any record of the same anchor."""
        self.remove(meta.anchor)
        self.clock = max(self.clock, last_used)
        self.metas[meta.anchor] = meta
        fanout = self.children.counts.get(meta.anchor, 0)
        self.entries[meta.anchor] = Entry(meta.parent, kv_bytes, state_bytes, last_used, fanout)
        self.children.add(meta.parent)
        parent = self.entries.get(meta.parent) if meta.parent is not None else None
        if parent is not None:
            parent.fanout = max(parent.fanout, self.children.counts[meta.parent])
        self.used_bytes += kv_bytes + state_bytes

    def set_state(self, anchor: bytes, state_bytes: int, clock: int | None = None) -> None:
        """Hold ``state_bytes`` of state for the record (0: none); a state put at ``clock`` makes the
        record that recent (not a use: no hit)."""
        entry = self.entries[anchor]
        self.used_bytes += state_bytes - entry.state_bytes
        entry.state_bytes = state_bytes
        if clock is not None:
            self.clock = max(self.clock, clock)
            entry.last_used = max(entry.last_used, clock)

    def remove(self, anchor: bytes) -> None:
        meta = self.metas.pop(anchor, None)
        if meta is None:
            return
        self.used_bytes -= self.entries.pop(anchor).nbytes
        self.children.remove(meta.parent)

    def has_state(self, anchor: bytes) -> bool:
        entry = self.entries.get(anchor)
        return entry is not None and entry.has_state

    def touch(self, anchor: bytes, clock: int, with_state: bool = False) -> None:
        """A use of the record at ``clock``: its KV, and its state too ``with_state`` (a restore that
        ends there); each held part used is a hit at its age."""
        self.clock = max(self.clock, clock)
        entry = self.entries.get(anchor)
        if entry is None:
            return
        age = clock - entry.last_used
        self.density.hit((KV_PART, entry.role), age)
        if with_state and entry.has_state:
            self.density.hit((STATE_PART, entry.role), age)
        entry.last_used = max(entry.last_used, clock)

    def victim(self, keep: tuple[bytes, ...] = ()) -> tuple[bytes, str] | None:
        """The part to evict next (see ``eviction``); the caller evicts it, and it counts as evicted."""
        victim = pick_victim(self.entries, self.children.counts, self.density, self.clock, keep, self.order)
        if victim is not None:
            entry = self.entries[victim[0]]
            self.density.evicted((victim[1], entry.role), self.clock - entry.last_used)
        return victim
