"""Live sequences: states the engine worker left at a checkpoint, continued in place by the
request that extends them: the top tier of `gateway.prefix_cache.PrefixCache`."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from engine import SequenceState


class LiveSequences:
    """Sequences the worker left at a state checkpoint (an answer's end, a precompute's end),
    oldest first, at most `limit`: each is exactly what restoring its anchor's record gives, so
    a request that extends one continues it in place. Several are kept because clients interleave
    sessions (a title or sub-agent request between two turns of the main loop). Worker thread only,
    but for `states()`."""

    def __init__(self, limit: int):
        self.limit = limit
        # each kept state with the anchors before its own that a request may rewind it to
        self._by_anchor: OrderedDict[bytes, tuple[SequenceState, frozenset[bytes]]] = OrderedDict()

    def keep(self, anchor: bytes, state: SequenceState, rewinds: Sequence[bytes] = ()) -> None:
        """Call right after a checkpoint with a state was captured at `state`'s current position.
        `rewinds`: earlier anchors of the sequence's own tokens (its last turn's: what a client
        that edits that turn still shares) where `take_rewind` may hand it over."""
        if self.limit <= 0:
            return
        self._by_anchor[anchor] = (state, frozenset(rewinds))
        self._by_anchor.move_to_end(anchor)
        while len(self._by_anchor) > self.limit:
            self._by_anchor.popitem(last=False)

    def deepest(self, chain: Sequence[bytes], ends: Sequence[int], deeper_than: int = 0) -> int:
        """How many leading anchors of `chain` reach the deepest kept sequence at an anchor of
        `chain` past its first `deeper_than - 1`, at that anchor's end (0: none). Changes nothing."""
        for i in range(len(chain) - 1, max(deeper_than - 1, 0) - 1, -1):
            kept = self._by_anchor.get(chain[i])
            if kept is not None and kept[0].length == ends[i]:
                return i + 1
        return 0

    def take(self, anchor: bytes) -> SequenceState:
        """The sequence kept at `anchor`, handed over: the request moves it on. Raises KeyError when
        none is kept there."""
        return self._by_anchor.pop(anchor)[0]

    def take_rewind(self, anchor: bytes) -> SequenceState | None:
        """The newest kept sequence that may be rewound to `anchor` (its tokens run through it),
        handed over: the caller puts it back there (`Engine.rewind`). E.g. Qwen's template drops
        an answer's reasoning once a new user message follows: the next request shares the answer's
        sequence up to the message before it, where its KV still lies in place."""
        for key in reversed(self._by_anchor):
            state, rewinds = self._by_anchor[key]
            if anchor in rewinds:
                del self._by_anchor[key]
                return state
        return None

    def states(self) -> list[SequenceState]:
        """The kept states (a copy of the list: any thread may ask, e.g. for the memory report)."""
        return [state for state, _ in self._by_anchor.values()]

    def __len__(self) -> int:
        return len(self._by_anchor)
