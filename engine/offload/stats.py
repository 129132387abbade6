"""What the expert caches did: hits, copies, host computations and in-place reads, per phase."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)


@dataclass
class OffloadStats:
    """Counters over every layer: experts a forward needed and found resident (hits), needed and
    brought over the link for it (fetched: copied on demand, or streamed with a long chunk's
    layer), computed on the host instead (on_host) or read in place from host memory (mapped: per
    assignment); experts copied into slots or stream buffers for any reason (misses: prefetches,
    refreshes and whole stream pieces included), experts evicted, and bytes moved host -> device
    (copied or read in place) with the tokens and forwards of each phase. A hit ratio is hits over
    hits + fetched + on_host + mapped (`hit_ratio`), overall or of one phase (`count` keeps the
    hits and the experts needed per phase: a streamed prefill counts every resident expert as a
    hit, so decode's ratio, the cache's measure, is apart)."""

    fetched: int = 0
    misses: int = 0
    on_host: int = 0
    mapped: int = 0
    evictions: int = 0
    bytes_in: dict[str, int] = field(default_factory=lambda: {"prefill": 0, "decode": 0})
    tokens: dict[str, int] = field(default_factory=lambda: {"prefill": 0, "decode": 0})
    forwards: dict[str, int] = field(default_factory=lambda: {"prefill": 0, "decode": 0})
    phase_hits: dict[str, int] = field(default_factory=lambda: {"prefill": 0, "decode": 0})
    phase_needed: dict[str, int] = field(default_factory=lambda: {"prefill": 0, "decode": 0})
    phase: str = "prefill"

    @property
    def hits(self) -> int:
        return sum(self.phase_hits.values())

    def count(self, hits: int, fetched: int = 0, on_host: int = 0, mapped: int = 0, phase: str | None = None) -> None:
        """Experts a layer needed: `hits` found resident, the others fetched for it, computed on the
        host or read in place; counted for `phase` (default: the current one) too."""
        self.fetched += fetched
        self.on_host += on_host
        self.mapped += mapped
        phase = phase or self.phase
        self.phase_hits[phase] += hits
        self.phase_needed[phase] += hits + fetched + on_host + mapped

    def as_dict(self) -> dict[str, int]:
        out = {
            "hits": self.hits,
            "fetched": self.fetched,
            "misses": self.misses,
            "on_host": self.on_host,
            "mapped": self.mapped,
            "evictions": self.evictions,
        }
        for name in ("bytes_in", "tokens", "forwards", "phase_hits", "phase_needed"):
            out.update({f"{name}_{phase}": n for phase, n in getattr(self, name).items()})
        return out


def hit_ratio(counts: dict[str, int], phase: str | None = None) -> float | None:
    """Of every expert a forward needed (`OffloadStats.as_dict`'s counts, or differences of them),
    in every phase or in `phase` ("prefill", "decode"), the share found resident; None when none
    was needed."""
    if phase is not None:
        hits, needed = counts[f"phase_hits_{phase}"], counts[f"phase_needed_{phase}"]
    else:
        hits, needed = counts["hits"], sum(counts[k] for k in ("hits", "fetched", "on_host", "mapped"))
    return hits / needed if needed else None
