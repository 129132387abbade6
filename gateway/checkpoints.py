"""Checkpoint traffic between a request and the store, on the engine worker: restore the
longest restorable prefix of an anchor chain, prefill the rest capturing a snapshot at every
segment boundary (a state where the policy wants one), save the end of a generation, and
precompute the history the next request will send."""

from __future__ import annotations

import logging
from collections.abc import Generator, Sequence
from typing import cast

import msgspec

from engine import Feed, PrefillResult, SequenceState
from gateway.anchors import anchor_chain, boundaries
from gateway.conversation import Conversation, Message
from gateway.policy import state_positions
from gateway.render import Segment
from gateway.runtime import Runtime

log = logging.getLogger("gateway.checkpoints")
PRECOMPUTE_STEP = 2048  # tokens per background pass: big enough for the GPU, small enough to yield soon


def restore(rt: Runtime, chain: Sequence[bytes], ends: Sequence[int]) -> tuple[SequenceState, int]:
    """A state at the end of the longest restorable prefix of `chain` (a fresh state when none)
    and the number of tokens it covers. When a live sequence sits at that prefix's end or deeper
    (the previous answer, or the precomputed history, that this request extends), it is continued
    in place: the same state with no copy (on a GPU: no host-to-device transfer of the prefix).
    Checkpoints of `chain` still on their way into the store are waited for, no others."""
    if rt.config.policy == "none" or not chain:
        return rt.engine.new_state(), 0
    count = rt.store.longest_restorable(list(chain))
    live = rt.live.take(chain, ends, count)
    if live is not None:
        rt.metrics.add_tokens(continued=live.length)
        return live, live.length
    rt.store_queue.wait_for(chain)
    for _ in range(3):  # the disk writer may evict between the match and the load: retry shorter
        count = rt.store.longest_restorable(list(chain))
        if count == 0:
            break
        records = rt.store.load_records(list(chain[:count]))  # deltas, not joined: copied into place once
        if records is not None:
            return rt.engine.restore(records), ends[count - 1]
    return rt.engine.new_state(), 0


def prefill(
    rt: Runtime, state: SequenceState, segments: Sequence[Segment], chain: Sequence[bytes], ends: Sequence[int],
    start: int,
) -> Generator[Feed, None, PrefillResult]:
    """Prefill the tokens of `segments` after position `start` (where `state` is), capturing a
    checkpoint at each boundary after `start`; the checkpoints go to the store queue."""
    ids = [t for s in segments for t in s.token_ids][start:]
    if rt.config.policy == "none":
        feed = Feed(state, ids)
        yield feed
        return cast(PrefillResult, feed.result)
    first = next(i for i, end in enumerate(ends) if end > start)
    feed = Feed(state, ids, capture_at=ends[first:], state_at=state_positions(rt.config.policy, segments, ends))
    yield feed
    result = cast(PrefillResult, feed.result)
    rt.store_queue.put(chain[first:], chain[first - 1] if first else None, result.snapshots, result.ready)
    return result


def generation_end(rt: Runtime, plan, state: SequenceState, generated: list[int]) -> Generator[Feed, None, None]:
    """Checkpoint the generated message as the next request will render it (memo hit): KV
    deltas per generated segment, the state after the end-of-turn token."""
    segments = rt.renderer.generation_segments(generated, len(plan.conv.messages))
    ends = [plan.prompt_len + e for e in boundaries(segments)]
    if not ends or ends[-1] != state.length + 1:
        log.debug("generation end not checkpointed: %s != %s", ends[-1:] or None, state.length + 1)
        return
    chain = anchor_chain(segments, plan.chain[-1])
    starts = [plan.prompt_len, *ends[:-1]]
    snapshots = [rt.engine.kv_delta(state, a, b) for a, b in zip(starts[:-1], ends[:-1], strict=True)]
    feed = Feed(state, generated[-1:], capture_at=[ends[-1]], kv_start=starts[-1])
    yield feed
    tail = cast(PrefillResult, feed.result)
    rt.store_queue.put(chain, plan.chain[-1], [*snapshots, *tail.snapshots], tail.ready)
    rt.live.keep(chain[-1], state)


def next_turn_segments(rt: Runtime, conv: Conversation, reply: Message) -> list[Segment]:
    """The history as the next request (a new user message after `reply`) will render it:
    Qwen's template then drops the reasoning of this turn."""
    probe = Message(role="user", content="\u2063")
    future = msgspec.structs.replace(conv, messages=(*conv.messages, reply, probe), forced_output=None)
    segments = rt.renderer.render(future, rt.memo)
    probe_index = len(conv.messages) + 1
    return [s for s in segments if (s.message_index is None and s.kind in ("system", "tools"))
            or (s.message_index is not None and s.message_index < probe_index)]


def schedule_precompute(rt: Runtime, conv: Conversation, reply: Message) -> None:
    segments = next_turn_segments(rt, conv, reply)
    rt.scheduler.background(precompute(rt, segments))


def precompute(rt: Runtime, segments: list[Segment]) -> Generator[Feed, None, int]:
    """Prefill `segments` from the longest checkpointed prefix in passes of about
    PRECOMPUTE_STEP tokens (whole segments, a checkpoint at every boundary), stopping between
    passes as soon as live work waits (the scheduler runs it only in steps with no live work).
    Returns the tokens computed."""
    chain, ends = anchor_chain(segments, rt.root), boundaries(segments)
    rt.store_queue.wait_for(chain)
    if rt.store.longest_restorable(chain) == len(chain):
        return 0
    state, done = restore(rt, chain, ends)
    computed, at_state = 0, None
    for i, end in enumerate(ends):
        if end <= done or (end - done < PRECOMPUTE_STEP and i + 1 < len(ends)):
            continue  # extend this pass to the next boundary
        if rt.scheduler.live_waiting():
            log.info("precompute yielded to a live request at %d/%d tokens", done, ends[-1])
            break
        result = yield from prefill(rt, state, segments[: i + 1], chain[: i + 1], ends[: i + 1], done)
        computed, done = computed + end - done, end
        at_state = chain[i] if result.snapshots and result.snapshots[-1].has_state else None
    if at_state is not None:  # the last pass ended on a state checkpoint: continue from here
        rt.live.keep(at_state, state)
    rt.metrics.add_tokens(precomputed=computed)
    return computed
