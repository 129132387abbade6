"""How likely a record part is to be read again, learned from the tier's own history: hits per tick
of residence by part class and age (LHD, Beckmann et al., NSDI 2018: "maximizing hit density").

A part's *age* is the ticks of the tier's clock since its last use. Each class counts, per age bucket,
the uses that found a part of it resident (hits) and the parts that left it by eviction at that age.
A part of class ``c`` at age ``a`` that stays in the tier until its next use or its eviction then
expects

    density(c, a) = hits at ages >= a / sum over those events of (their age - a)

hits per tick it occupies: the expected reuse per byte of tier per tick, the same for every byte
of the part, since a hit saves reading each of its bytes from a slower tier. Eviction gives up the
part of lowest density. What the counts learn follows the workload: when sessions take turns, a
chain is reused about one round later, so a chain used a moment ago has the lowest density (it
waits longest); when reuse is heavy-tailed, the oldest one has.

Classes are the part (KV or state) and its record's place in its chain, read from the tier's
parent links: ``tip`` (no child: a session resumes at its last answer), ``inner`` (one child: an
old turn, its state needed only by a request that edits the history there) and ``shared`` (two or
more children: a system prompt and tools every session and sub-agent extend). Until a class has
seen an event (every class, until the tier has seen a hit), its density is its ``PRIOR`` (relative
to the tier's overall density); then its counts alone. Counts halve every ``HALF_LIFE`` events, so
the estimate follows a change of workload.
"""

from __future__ import annotations

import math

from .record import KV_PART, STATE_PART

BUCKETS_PER_OCTAVE = 8
NUM_BUCKETS = 8 * BUCKETS_PER_OCTAVE  # ages up to 2**31 ticks; older ones share the last bucket
HALF_LIFE = 4096  # events (hits and evictions) after which the counts weigh half
PRIOR = {  # a class's density relative to the tier's, before its own events say otherwise
    (KV_PART, "tip"): 1.0,
    (KV_PART, "inner"): 1.0,
    (KV_PART, "shared"): 2.0,
    (STATE_PART, "tip"): 1.0,
    (STATE_PART, "inner"): 0.125,
    (STATE_PART, "shared"): 2.0,
}
Class = tuple[str, str]


def role(num_children: int) -> str:
    return "tip" if num_children == 0 else "inner" if num_children == 1 else "shared"


def bucket(age: int) -> int:
    return min(NUM_BUCKETS - 1, int(BUCKETS_PER_OCTAVE * math.log2(1 + max(age, 0))))


def bucket_age(b: float) -> float:
    """The smallest age of bucket ``b`` (a fraction of a bucket: further in)."""
    return 2.0 ** (b / BUCKETS_PER_OCTAVE) - 1


class HitDensity:
    """Per-class hit and eviction counts by age bucket, and the density table they give."""

    def __init__(self) -> None:
        self.hits = {c: [0.0] * NUM_BUCKETS for c in PRIOR}
        self.evictions = {c: [0.0] * NUM_BUCKETS for c in PRIOR}
        self.events = 0
        self._table: dict[Class, list[float]] | None = None

    def hit(self, cls: Class, age: int) -> None:
        self._count(self.hits[cls], age)

    def evicted(self, cls: Class, age: int) -> None:
        self._count(self.evictions[cls], age)

    def density(self, cls: Class, age: int) -> float:
        if self._table is None:
            self._table = self._compute()
        return self._table[cls][bucket(age)]

    def _count(self, counts: list[float], age: int) -> None:
        counts[bucket(age)] += 1.0
        self.events += 1
        self._table = None
        if self.events % HALF_LIFE == 0:
            for table in (*self.hits.values(), *self.evictions.values()):
                table[:] = [n / 2 for n in table]

    def _compute(self) -> dict[Class, list[float]]:
        """Each class's density at each bucket: its hits from that age on over the ticks those events
        spend past it; 0 past its oldest event (nothing seen lasts that long); a class that has seen
        no event yet, or any class while the tier has seen no hit, has its prior."""
        ages = [bucket_age(b) for b in range(NUM_BUCKETS)]
        middles = [bucket_age(b + 0.5) for b in range(NUM_BUCKETS)]  # an event's age within its bucket
        total_hits = sum(sum(h) for h in self.hits.values())
        total_life = sum(
            age * (self.hits[c][b] + self.evictions[c][b]) for c in PRIOR for b, age in enumerate(middles)
        )
        overall = total_hits / total_life if total_hits and total_life else 1.0
        table = {}
        for cls, prior in PRIOR.items():
            if not total_hits or not any(self.hits[cls]) and not any(self.evictions[cls]):
                table[cls] = [prior * overall] * NUM_BUCKETS
                continue
            row, hits, events, weighted = [0.0] * NUM_BUCKETS, 0.0, 0.0, 0.0
            for b in range(NUM_BUCKETS - 1, -1, -1):  # suffix sums: events at ages >= ages[b]
                hits += self.hits[cls][b]
                n = self.hits[cls][b] + self.evictions[cls][b]
                events += n
                weighted += n * middles[b]
                life = weighted - events * ages[b]
                row[b] = hits / life if hits else 0.0
            table[cls] = row
        return table
