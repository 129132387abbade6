"""The offline optimum of a RAM tier over a run's access log: Belady, by bytes, fractional.

The log is every record part offered to the RAM tier (`put`), brought up into it by a prefetch
(`promote`) and read by a restore (`get`), in order (`CheckpointStore.on_access`). A cache of
`budget` bytes that may take in a part at any access of it and give up any bytes at any time keeps,
after each access, the bytes whose next use comes soonest: parts are split into bytes, each a unit
item sharing its part's accesses, and for unit items farthest-next-use is optimal (Belady). A use
is a get: a part whose next access is a put or a promotion comes in again there, so until then it is
worth nothing held. The bytes of gets it holds, over all get bytes, bound the byte hit ratio of any
eviction order at that budget on that log: a real tier takes parts in only when they are put or
promoted, whole, so what it holds at each get is one of the choices this cache had.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from checkpoint_store.store import Access

Key = tuple[bytes, str]


def part_sizes(log: Sequence[Access]) -> dict[Key, int]:
    """Each part's packed size, as put (a get from disk reports none)."""
    return {(a.anchor, a.part): a.nbytes for a in log if a.kind == "put"}


def belady_hits(log: Sequence[Access], budget: int) -> tuple[float, int]:
    """(bytes of gets held, bytes of gets) of the optimal `budget`-byte cache over `log` (its puts,
    promotions and gets; pins bind only a real tier)."""
    log = [a for a in log if a.kind in ("put", "promote", "get")]
    sizes = part_sizes(log)
    keys = [(a.anchor, a.part) for a in log]
    next_use = _next_needs(keys, [a.kind == "get" for a in log])
    held: dict[Key, float] = {}  # bytes held of each part
    when: dict[Key, float] = {}  # its next use
    farthest: list[tuple[float, Key]] = []  # (-next use, part), stale entries skipped
    used, hit, wanted = 0.0, 0.0, 0
    for i, (access, key) in enumerate(zip(log, keys, strict=True)):
        size = sizes.get(key, 0)
        if access.kind == "get":
            wanted += size
            hit += held.get(key, 0.0)
        used += size - held.get(key, 0.0)
        held[key], when[key] = float(size), next_use[i]
        heapq.heappush(farthest, (-next_use[i], key))
        while used > budget and farthest:
            at, victim = farthest[0]
            if -at != when.get(victim) or held.get(victim, 0.0) == 0.0:
                heapq.heappop(farthest)
                continue
            given = min(held[victim], used - budget)
            held[victim] -= given
            used -= given
            if held[victim] == 0.0:
                heapq.heappop(farthest)
    return hit, wanted


def _next_needs(keys: Sequence[Key], is_get: Sequence[bool]) -> list[float]:
    """For each access, the index of the next access of the same part if that one is a get; inf where
    it is a put or a promotion (the part comes in again there, whatever was held) or there is none."""
    out = [math.inf] * len(keys)
    seen: dict[Key, int] = {}
    for i in range(len(keys) - 1, -1, -1):
        following = seen.get(keys[i])
        out[i] = following if following is not None and is_get[following] else math.inf
        seen[keys[i]] = i
    return out
