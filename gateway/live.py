"""Live sequences: states the engine worker left at a checkpoint, continued in place by the
request that extends them (see `gateway.checkpoints.Checkpoints.restore`)."""

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
        self._by_anchor: OrderedDict[bytes, SequenceState] = OrderedDict()

    def keep(self, anchor: bytes, state: SequenceState) -> None:
        """Call right after a checkpoint with a state was captured at `state`'s current position."""
        if self.limit <= 0:
            return
        self._by_anchor[anchor] = state
        self._by_anchor.move_to_end(anchor)
        while len(self._by_anchor) > self.limit:
            self._by_anchor.popitem(last=False)

    def take(self, chain: Sequence[bytes], ends: Sequence[int], deeper_than: int) -> SequenceState | None:
        """The deepest kept sequence at an anchor of `chain` past its first `deeper_than - 1`
        (as deep as what the store can restore, or deeper), handed over: the request moves it on."""
        for i in range(len(chain) - 1, max(deeper_than - 1, 0) - 1, -1):
            state = self._by_anchor.get(chain[i])
            if state is not None and state.length == ends[i]:
                del self._by_anchor[chain[i]]
                return state
        return None

    def states(self) -> list[SequenceState]:
        """The kept states (a copy of the list: any thread may ask, e.g. for the memory report)."""
        return list(self._by_anchor.values())

    def __len__(self) -> int:
        return len(self._by_anchor)
