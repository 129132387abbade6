"""One answer over the four tiers that may hold a prefix of a request's anchor chain: the deepest
restorable anchor, and where it is.

From the top: a **live** sequence the worker left at a checkpoint (continued in place, no copy), the
checkpoints still **queued** on their way into the store (wait for them, then ask again), and the
store's **RAM** and **disk** tiers (copied in). The live tier holds engine states, so this lives in
the gateway; the store below stays bytes in, bytes out. Engine worker only.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from checkpoint_store import CheckpointStore, Snapshot
from engine import SequenceState
from gateway.live import LiveSequences
from gateway.store_queue import StoreQueue

LOAD_ATTEMPTS = 3  # the disk writer may evict between the match and the load: retry shorter


class Tier(enum.Enum):
    LIVE = "live"
    QUEUED = "queued"
    RAM = "ram"
    DISK = "disk"


@dataclass(frozen=True)
class Hit:
    """The deepest restorable anchor of a chain: `depth` leading anchors (0: none), the last of them
    held in `tier` (None when `depth` is 0 and nothing of the chain is queued). `QUEUED`: some of the
    chain is still on its way into the store; `depth` is what the store restores before it lands."""

    depth: int
    tier: Tier | None


class PrefixCache:
    """The live, queued, RAM and disk tiers asked as one. Each method says what it changes and what
    it raises; none blocks but `settle`."""

    def __init__(self, live: LiveSequences, queue: StoreQueue, store: CheckpointStore):
        self.live, self.queue, self.store = live, queue, store

    def find(self, chain: Sequence[bytes], ends: Sequence[int]) -> Hit:
        """The deepest restorable anchor of `chain` (its anchors' token ends `ends`) and its tier: a
        live sequence as deep as the store's match or deeper wins; else `QUEUED` if any of `chain` is
        still queued (checked before the store's match: only the worker queues checkpoints, so with
        none queued then, the match is final); else the tier the store reads the state from.
        Changes nothing. Raises nothing."""
        queued = self.queue.holds(chain)
        depth = self.store.longest_restorable(list(chain))
        live = self.live.deepest(chain, ends, depth)
        if live:
            return Hit(live, Tier.LIVE)
        if queued:
            return Hit(depth, Tier.QUEUED)
        return self._stored(chain, depth)

    def ready(self, chain: Sequence[bytes], ends: Sequence[int]) -> bool:
        """Whether taking `chain`'s prefix waits for nothing: none of `chain` is queued, or a live
        sequence of it (at any depth) is continued in place. Changes nothing. Raises nothing."""
        return not self.queue.holds(chain) or self.live.deepest(chain, ends) > 0

    def settle(self, chain: Sequence[bytes], stop: Callable[[], bool] | None = None) -> Hit | None:
        """Wait until none of `chain` is queued, then the deepest anchor the store restores (RAM or
        disk; the live tier is not asked). With `stop`: None as soon as it returns True while some of
        `chain` is still queued. Changes nothing. Raises nothing."""
        if not self.queue.wait_for(chain, stop=stop):
            return None
        return self._stored(chain, self.store.longest_restorable(list(chain)))

    def take_live(self, chain: Sequence[bytes], hit: Hit) -> SequenceState:
        """The live sequence at `chain[hit.depth - 1]`, handed over: removed from the live tier, the
        caller moves it on. Raises KeyError when no live sequence is kept there (a `hit` not of
        `Tier.LIVE`, or one already taken)."""
        return self.live.take(chain[hit.depth - 1])

    def take_rewind(self, anchor: bytes) -> SequenceState | None:
        """The newest live sequence whose tokens run through `anchor`, handed over to be rewound there
        (`LiveSequences.take_rewind`): removed from the live tier. None if there is none. Raises
        nothing."""
        return self.live.take_rewind(anchor)

    def load(self, chain: Sequence[bytes], depth: int) -> tuple[int, list[Snapshot]]:
        """The records of `chain`'s first `depth` anchors (KV deltas, the last one's state), unjoined:
        copied into place once. A record evicted between the match and the load makes it match and
        load again, shorter, at most LOAD_ATTEMPTS times: (depth loaded, records), or (0, []).
        Changes the store's hit counters and its eviction clock. Raises nothing (a corrupt or
        missing record is a miss)."""
        for _ in range(LOAD_ATTEMPTS):
            if depth == 0:
                break
            records = self.store.load_records(list(chain[:depth]))
            if records is not None:
                return depth, records
            depth = self.store.longest_restorable(list(chain))
        return 0, []

    def _stored(self, chain: Sequence[bytes], depth: int) -> Hit:
        if depth == 0:
            return Hit(0, None)
        in_ram = self.store.state_tier(chain[depth - 1]) == "ram"
        return Hit(depth, Tier.RAM if in_ram else Tier.DISK)
