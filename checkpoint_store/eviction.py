"""Which bytes a full tier gives up first: the eviction order shared by both tiers.

A tier holds records, each a KV part (small, needed by every later record of its chain)
and optionally a state part (about 61 MiB for the 35B-A3B shape, needed only to *end* a
chain there). Eviction keeps what restores best:

1. **States go before KV.** A state part may be dropped from any record; the record's KV
   stays, so chains through it still restore (at a later state).
2. **KV goes leaf-first.** A record's KV is evicted only once it holds no state and no
   record in the same tier names it as parent, so eviction never opens a hole inside a
   chain the tier still holds.
3. **Among candidates, the lowest score goes first**, where a score is the record's last
   use on the tier's logical clock (one tick per put or restore) plus bonuses:
   ``TIP_BONUS`` for the state of a chain tip (the next turn of a session resumes
   there), and ``SHARE_BONUS * log2(children)`` for a record that two or more records
   extend (a system prompt and tool schema shared by every session and sub-agent). A
   restore touches every record of its chain, so recently used chains stay as a whole.

``lru`` is the plain order to compare against: the least recently used record goes whole
(KV and state), whatever it holds or extends; a parent's KV may go before its children's, so
chains through it no longer restore from that tier.

The scan is linear in the number of records; tiers hold thousands, not millions.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .record import KV_PART, STATE_PART

TIP_BONUS = 32
SHARE_BONUS = 64
ORDERS = ("anchor", "lru")  # the order above; plain least recently used


@dataclass
class Entry:
    """What eviction knows of one record in one tier."""

    parent: bytes | None
    kv_bytes: int
    state_bytes: int  # 0 when the tier holds no state for this record
    last_used: int

    @property
    def has_state(self) -> bool:
        return self.state_bytes > 0

    @property
    def nbytes(self) -> int:
        return self.kv_bytes + self.state_bytes


def state_score(entry: Entry, num_children: int) -> float:
    bonus = float(TIP_BONUS if num_children == 0 else 0)
    if num_children >= 2:
        bonus += SHARE_BONUS * math.log2(num_children)
    return entry.last_used + bonus


def pick_victim(
    entries: Mapping[bytes, Entry],
    children: Mapping[bytes, int],
    keep: Iterable[bytes] = (),
    order: str = "anchor",
) -> tuple[bytes, str] | None:
    """The (anchor, part) to evict next in ``order`` (one of ORDERS), or None when nothing may go;
    ``keep`` is spared."""
    spared = set(keep)
    if order == "lru":
        return least_recent(entries, spared)
    best: tuple[float, bytes, str] | None = None
    for anchor, entry in entries.items():
        if anchor in spared:
            continue
        num_children = children.get(anchor, 0)
        if entry.has_state:
            candidate = (state_score(entry, num_children), anchor, STATE_PART)
        elif num_children == 0:
            candidate = (float(entry.last_used), anchor, KV_PART)
        else:
            continue
        if best is None or candidate[0] < best[0]:
            best = candidate
    return None if best is None else (best[1], best[2])


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
