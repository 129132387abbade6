"""What one tier holds, by anchor: chain metadata, part sizes, recency and byte count.

Both tiers keep one ``TierIndex`` in memory (the disk tier rebuilds it from the frame
headers when it opens) and ask it for eviction victims (see ``eviction``).
"""

from __future__ import annotations

from .eviction import ORDERS, Children, Entry, pick_victim
from .record import RecordMeta


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
        self.used_bytes = 0

    def __contains__(self, anchor: bytes) -> bool:
        return anchor in self.metas

    def __len__(self) -> int:
        return len(self.metas)

    def add(self, meta: RecordMeta, kv_bytes: int, state_bytes: int, last_used: int) -> None:
        """Add a record, replacing any record of the same anchor."""
        self.remove(meta.anchor)
        self.metas[meta.anchor] = meta
        self.entries[meta.anchor] = Entry(meta.parent, kv_bytes, state_bytes, last_used)
        self.children.add(meta.parent)
        self.used_bytes += kv_bytes + state_bytes

    def set_state(self, anchor: bytes, state_bytes: int) -> None:
        entry = self.entries[anchor]
        self.used_bytes += state_bytes - entry.state_bytes
        entry.state_bytes = state_bytes

    def remove(self, anchor: bytes) -> None:
        meta = self.metas.pop(anchor, None)
        if meta is None:
            return
        self.used_bytes -= self.entries.pop(anchor).nbytes
        self.children.remove(meta.parent)

    def has_state(self, anchor: bytes) -> bool:
        entry = self.entries.get(anchor)
        return entry is not None and entry.has_state

    def touch(self, anchor: bytes, clock: int) -> None:
        entry = self.entries.get(anchor)
        if entry is not None:
            entry.last_used = max(entry.last_used, clock)

    def victim(self, keep: tuple[bytes, ...] = ()) -> tuple[bytes, str] | None:
        return pick_victim(self.entries, self.children.counts, keep, self.order)
