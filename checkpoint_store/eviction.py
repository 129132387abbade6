"""Which bytes a full tier gives up first: the eviction order shared by both tiers.

A tier holds records, each a KV part (small, needed by every later record of its chain)
and optionally a state part (about 61 MiB for the 35B-A3B shape, needed only to *end* a
chain there). Eviction keeps what restores best:

1. **KV goes leaf-first.** A record's KV is evicted only once it holds no state and no
   record in the same tier names it as parent, so eviction never opens a hole inside a
   chain the tier still holds. A state part may go from any record; the record's KV stays,
   so chains through it still restore (at a later state).
2. **Among those candidates, the part least likely to be read again per byte goes first:** the
   lowest hit density (``hit_density``) for its class (KV or state, of a chain's tip, an inner
   record or a shared prefix, by the children it has had: a shared prefix whose sessions have all
   gone is still one) at its age (ticks of the tier's clock, one per put or restore,
   since its last use), learned from the hits and evictions the tier has seen. A restore
   touches every record of its chain, so a chain ages and is kept as a whole; ties go to the
   least recently used.

``lru`` is the plain order to compare against: the least recently used record goes whole
(KV and state), whatever it holds or extends; a parent's KV may go before its children's, so
chains through it no longer restore from that tier.

The scan is linear in the number of records; tiers hold thousands, not millions.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .hit_density import HitDensity, role
from .record import KV_PART, STATE_PART

ORDERS = ("anchor", "lru")  # the order above; plain least recently used


@dataclass
class Entry:
    """What eviction knows of one record in one tier."""

    parent: bytes | None
    kv_bytes: int
    state_bytes: int  # 0 when the tier holds no state for this record
    last_used: int
    fanout: int = 0  # the most records of the tier that named it as parent at once

    @property
    def role(self) -> str:
        """Its place in its chains (``hit_density.role``), by the children it has had, not those left."""
        return role(self.fanout)

    @property
    def has_state(self) -> bool:
        return self.state_bytes > 0

    @property
    def nbytes(self) -> int:
        return self.kv_bytes + self.state_bytes


def pick_victim(
    entries: Mapping[bytes, Entry],
    children: Mapping[bytes, int],
    density: HitDensity,
    clock: int,
    keep: Iterable[bytes] = (),
    order: str = "anchor",
) -> tuple[bytes, str] | None:
    """The (anchor, part) to evict next in ``order`` (one of ORDERS) at ``clock``, or None when nothing
    may go; ``keep`` is spared."""
    spared = set(keep)
    if order == "lru":
        return least_recent(entries, spared)
    best: tuple[float, int, bytes, str] | None = None
    for anchor, entry in entries.items():
        if anchor in spared:
            continue
        num_children = children.get(anchor, 0)
        if entry.has_state:
            part = STATE_PART
        elif num_children == 0:
            part = KV_PART
        else:
            continue
        score = density.density((part, entry.role), clock - entry.last_used)
        candidate = (score, entry.last_used, anchor, part)
        if best is None or candidate[:2] < best[:2]:
            best = candidate
    return None if best is None else (best[2], best[3])


def least_recent(entries: Mapping[bytes, Entry], spared: set[bytes]) -> tuple[bytes, str] | None:
    """The whole record (its KV part: the state goes with it) used least recently."""
    candidates = ((entry.last_used, anchor) for anchor, entry in entries.items() if anchor not in spared)
    oldest = min(candidates, default=None)
    return None if oldest is None else (oldest[1], KV_PART)


class Children:
    """Counts, per anchor, the records of one tier that name it as parent."""

    def __init__(self) -> None:
        self.counts: dict[bytes, int] = {}

    def add(self, parent: bytes | None) -> None:
        if parent is not None:
            self.counts[parent] = self.counts.get(parent, 0) + 1

    def remove(self, parent: bytes | None) -> None:
        if parent is None:
            return
        left = self.counts.get(parent, 0) - 1
        if left > 0:
            self.counts[parent] = left
        else:
            self.counts.pop(parent, None)
