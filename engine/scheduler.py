"""Which tokens one engine step runs, and how: a pure plan, made without the model or a device.

A step serves several sequences, each with one `Feed` pending: a decode token (one token, only
its logits wanted) or a prompt still being prefilled. `Scheduler.schedule` picks how many tokens
of each run now (every decode token, then prefill chunks within the step's token budget) and
`Scheduler.plan` lays those parts out over the engine's three ways to run them:

- `decode`: the decode tokens as one runner step on their slots (a CUDA graph on a GPU);
- `slotted`: the last chunk of a short prefill on its sequence's slot, padded to a token bucket
  (a graph per bucket), where the engine can run such prefills;
- `forward`: the other prefill chunks in one forward over their own states, which also takes
  the decode tokens (`riding`, the weights read once) where the engine mixes them in.

The engine runs a `StepPlan` (`Engine.run`); the gateway's worker asks for one per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

BACKGROUND_STEP_TOKENS = 1024  # tokens of a step of background work alone: bounds the wait of a new request
OLDEST_SHARE = 4  # the oldest prefill is first given 1 / OLDEST_SHARE of each step's prefill budget
# A prefill alone in its step runs on its slot in pieces of the largest bucket up to this many
# tokens: a replay per piece beats one eager forward (its launches alone cost ~100 ms on a GPU)
# up to a few thousand tokens. With several prefills in the step, one eager forward over all of
# their chunks wins sooner: there only a chunk that fits one bucket runs on its slot.
SLOT_PREFILL_ALONE = 2048


class Work(Protocol):
    """What the scheduler reads of a sequence's pending feed (`engine.feed.Feed`)."""

    @property
    def remaining(self) -> int: ...  # tokens not yet run

    @property
    def is_prefill(self) -> bool: ...  # False for one decode token

    @property
    def all_logits(self) -> bool: ...  # every position's logits wanted, not only the last


W = TypeVar("W", bound=Work)


@dataclass(frozen=True)
class Limits:
    """What one step may hold.

    - `step_tokens`: tokens of one forward (`EngineConfig.chunk_tokens`).
    - `decode_step_prefill`: prefill tokens a step with decode rows may carry; None: no cap.
    - `background_tokens`: tokens of a step that runs background work alone.
    - `slot_tokens`: the largest prefill that runs on a slot in one replay (the runner's
      largest prefill bucket).
    - `slot_tokens_alone`: the longest prefill run on its slot, in pieces, when it is the
      step's only prefill.
    """

    step_tokens: int
    decode_step_prefill: int | None = None
    background_tokens: int = BACKGROUND_STEP_TOKENS
    slot_tokens: int = 512
    slot_tokens_alone: int = SLOT_PREFILL_ALONE


@dataclass
class StepPlan:
    """One step's parts by how they run (a `Feed`, or any `Work`, with its token count)."""

    decode: list = field(default_factory=list)  # decode feeds run apart, as one runner step
    slotted: list[tuple] = field(default_factory=list)  # (feed, count): last chunks on their slots
    forward: list[tuple] = field(default_factory=list)  # (feed, count): chunks of one forward
    riding: list = field(default_factory=list)  # decode feeds whose token runs in that forward

    @property
    def parts(self) -> list[tuple]:
        """Every (feed, count) of the step: decode tokens first, then prefill chunks."""
        return [*((f, 1) for f in self.decode), *((f, 1) for f in self.riding), *self.slotted, *self.forward]

    @property
    def tokens(self) -> int:
        return sum(count for _, count in self.parts)

    @property
    def empty(self) -> bool:
        return not (self.decode or self.slotted or self.forward)


class Scheduler:
    """Plans steps within `limits`. `slot_prefill`: short prefills may run on their slots (the
    engine turns it off when its graphs can no longer hold them). `mixes`: decode tokens may
    ride in a prefill forward (not under a memory budget, where a forward that ran out of
    memory is undone and run again, and decode rows' slot states, updated in place, could not
    be undone)."""

    def __init__(self, limits: Limits, slot_prefill: bool = False, mixes: bool = True):
        self.limits, self.slot_prefill, self.mixes = limits, slot_prefill, mixes

    def schedule(self, feeds: Sequence[W], background: bool = False) -> StepPlan:
        """The next step for these sequences' pending feeds (one each): `plan` of `parts`."""
        return self.plan(self.parts(feeds, background))

    def parts(self, feeds: Sequence[W], background: bool = False) -> list[tuple[W, int]]:
        """Every decode token, then prefill chunks within the token budget, the fewest remaining
        tokens first (the given order among equals): a tool result's few hundred tokens join the
        next step beside another session's long prompt rather than wait for all of it. The first
        prefill in the given order (the oldest: feeds come in admission order) is first given
        `1 / OLDEST_SHARE` of the budget, so a stream of short prompts cannot starve a long one:
        it prefills at least at that share of its own pace. A step with decode rows carries at
        most `decode_step_prefill` prefill tokens, so decoding sequences get their tokens at a
        short step's pace while long prompts prefill; `background` work runs in short steps, so a
        request that arrives waits little."""
        parts = [(feed, 1) for feed in feeds if not feed.is_prefill]
        budget = self.limits.step_tokens - len(parts)
        if parts and self.limits.decode_step_prefill:
            budget = min(budget, self.limits.decode_step_prefill)
        if background:
            budget = min(budget, self.limits.background_tokens)
        prefills = [f for f in feeds if f.is_prefill]
        if not prefills or budget <= 0:
            return parts
        oldest = prefills[0]
        kept = min(oldest.remaining, budget // OLDEST_SHARE)  # the oldest's share, taken first
        budget -= kept
        for feed in sorted(prefills, key=lambda f: f.remaining):
            ahead = kept if feed is oldest else 0
            count = ahead + min(budget, feed.remaining - ahead)
            if count > 0:
                parts.append((feed, count))
                budget -= count - ahead
        return parts

    def plan(self, parts: Sequence[tuple[W, int]]) -> StepPlan:
        """How the step runs `parts` (one per sequence): short last chunks on their slots; the
        other chunks in one forward, which takes the decode tokens too where the engine mixes
        them; otherwise the decode tokens as one runner step of their own."""
        decodes = [feed for feed, _ in parts if not feed.is_prefill]
        prefills = [(feed, count) for feed, count in parts if feed.is_prefill]
        limit = self.limits.slot_tokens_alone if len(prefills) == 1 else self.limits.slot_tokens
        slotted = [(feed, count) for feed, count in prefills if self._fits_slot(feed, count, limit)]
        forward = [(feed, count) for feed, count in prefills if not self._fits_slot(feed, count, limit)]
        if forward and self.mixes:
            return StepPlan(slotted=slotted, forward=forward, riding=decodes)
        return StepPlan(decode=decodes, slotted=slotted, forward=forward)

    def _fits_slot(self, feed: Work, count: int, limit: int) -> bool:
        """Whether a feed's last `count` tokens run on its slot: at most `limit`, and only the last
        position's logits wanted."""
        return self.slot_prefill and count == feed.remaining and count <= limit and not feed.all_logits
