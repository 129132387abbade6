"""Live sequences: states the worker left at a checkpoint, continued in place by the request that
extends them: the top tier of `gateway.prefix_cache.PrefixCache`."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine import SequenceState
from gateway.pins import Pins


@dataclass(frozen=True)
class Kept:
    """A kept sequence: its state, the anchors of its tokens (its own last) with their token ends,
    and the earlier anchors it may be rewound to."""

    state: SequenceState
    chain: tuple[bytes, ...]
    ends: tuple[int, ...]
    rewinds: frozenset[bytes]


class LiveSequences:
    """Sequences the worker left at a state checkpoint (an answer's end, a precompute's end),
    oldest first, at most `limit`: each is exactly what restoring its anchor's record gives, so
    a request that extends one continues it in place. Several are kept because clients interleave
    sessions (a title or sub-agent request between two turns of the main loop).

    Beyond `limit` the oldest goes, a sequence `pins` holds last: only for the sequence a live
    request leaves (`keep(..., for_request=True)`), counted as a broken pin. Every sequence dropped
    (not handed to a request) is given to `spill`, which stores what the store no longer holds of it:
    its state goes down a tier, never lost while the store has room. Worker thread only, but for
    `states()`."""

    def __init__(self, limit: int, pins: Pins | None = None, spill: Callable[[Kept], None] = lambda kept: None):
        self.limit, self.pins, self.spill = limit, pins, spill
        self._by_anchor: OrderedDict[bytes, Kept] = OrderedDict()

    def keep(self, chain: Sequence[bytes], ends: Sequence[int], state: SequenceState, rewinds: Sequence[bytes] = (),
             for_request: bool = False) -> None:
        """Call right after a checkpoint with a state was captured at `state`'s current position, the
        end of `chain` (`ends`: its anchors' token ends). `rewinds`: earlier anchors of the sequence's
        own tokens (its last turn's: what a client that edits that turn still shares) where
        `take_rewind` may hand it over. `for_request`: a live request's, for which a pin may break."""
        kept = Kept(state, tuple(chain), tuple(ends), frozenset(rewinds))
        anchor = kept.chain[-1]
        self._by_anchor[anchor] = kept
        self._by_anchor.move_to_end(anchor)
        while len(self._by_anchor) > max(self.limit, 0):
            self.drop(self._victim(anchor, for_request))

    def drop(self, anchor: bytes) -> None:
        """Let the sequence at `anchor` go (if one is kept there), down to the store (`spill`)."""
        kept = self._by_anchor.pop(anchor, None)
        if kept is not None:
            self.spill(kept)

    def yield_memory(self) -> bool:
        """Let one kept sequence go for a forward that needs its device memory (`Engine.relieve`):
        the oldest unpinned, else the oldest pinned (a broken pin). False when none is kept."""
        if not self._by_anchor:
            return False
        self.drop(self._victim(None, for_request=True))
        return True

    def deepest(self, chain: Sequence[bytes], ends: Sequence[int], deeper_than: int = 0) -> int:
        """How many leading anchors of `chain` reach the deepest kept sequence at an anchor of
        `chain` past its first `deeper_than - 1`, at that anchor's end (0: none). Changes nothing."""
        for i in range(len(chain) - 1, max(deeper_than - 1, 0) - 1, -1):
            kept = self._by_anchor.get(chain[i])
            if kept is not None and kept.state.length == ends[i]:
                return i + 1
        return 0

    def take(self, anchor: bytes) -> SequenceState:
        """The sequence kept at `anchor`, handed over: the request moves it on. Raises KeyError when
        none is kept there."""
        return self._by_anchor.pop(anchor).state

    def take_rewind(self, anchor: bytes) -> SequenceState | None:
        """The newest kept sequence that may be rewound to `anchor` (its tokens run through it),
        handed over: the caller puts it back there (`Engine.rewind`). E.g. Qwen's template drops
        an answer's reasoning once a new user message follows: the next request shares the answer's
        sequence up to the message before it, where its KV still lies in place."""
        for key in reversed(self._by_anchor):
            kept = self._by_anchor[key]
            if anchor in kept.rewinds:
                del self._by_anchor[key]
                return kept.state
        return None

    def states(self) -> list[SequenceState]:
        """The kept states (a copy of the list: any thread may ask, e.g. for the memory report)."""
        return [kept.state for kept in list(self._by_anchor.values())]

    def __contains__(self, anchor: bytes) -> bool:
        return anchor in self._by_anchor

    def __len__(self) -> int:
        return len(self._by_anchor)

    def _victim(self, newest: bytes | None, for_request: bool) -> bytes:
        """The oldest unpinned sequence but `newest`; else, for a request, the oldest pinned one (a
        broken pin); else `newest` itself (None: there is always another)."""
        others = [a for a in self._by_anchor if a != newest]
        pinned = {a for a in others if self.pins is not None and self.pins.holds_live(a)}
        victim = next((a for a in others if a not in pinned), None)
        if victim is None and for_request and others and self.pins is not None:
            victim = others[0]
            self.pins.broke(victim)
        return newest if victim is None else victim
