"""Checkpoint traffic between the requests and the store, on the engine worker: restore the deepest
restorable anchor of a chain (found by `PrefixCache` over the live, queued, RAM and disk tiers),
prefill the rest capturing a snapshot at every segment boundary (a state where the policy wants
one), save the end of a generation (pinned while the tool it calls runs: gateway/retention.py),
precompute the history the next request will send, store what a dropped live sequence holds that
the store lost (`spill`), and say why a request's prefilled tokens were not restored
(`gateway.prefill_reasons`)."""

from __future__ import annotations

import logging
from collections.abc import Generator, Sequence
from concurrent.futures import Future
from typing import cast

from checkpoint_store import CheckpointStore, kinds
from engine import Engine, Feed, PrefillResult, SequenceState
from gateway.anchors import Namespace, anchor_chain, boundaries
from gateway.capture_policy import state_positions
from gateway.live import Kept, LiveSequences
from gateway.metrics import Metrics
from gateway.prefill_reasons import PrefillReasons, SeenChains
from gateway.prefix_cache import PrefixCache, Tier
from gateway.render import Segment
from gateway.retention import Retention
from gateway.scheduler import Scheduler
from gateway.store_queue import StoreQueue

log = logging.getLogger("gateway.checkpoints")
PRECOMPUTE_STEP = 2048  # tokens per background pass: big enough for the GPU, small enough to yield soon


class Checkpoints:
    """The checkpoint steps of every request, built once per server from exactly what they touch:
    the engine, the store and its write queue, the live sequences, the metrics, the capture
    policy, the root anchor (what a precomputed history's chain hangs from), the scheduler
    (precompute runs in its gaps and yields to its live work) and the pins' `retention`. A generation asks it for steps
    instead of passing the whole server around. The steps that remember or chain take the
    request's tenant `namespace` (gateway/tenants.py), by default the server's own. Engine worker only."""

    def __init__(self, engine: Engine, store: CheckpointStore, store_queue: StoreQueue, live: LiveSequences,
                 metrics: Metrics, policy: str, root: bytes, scheduler: Scheduler, retention: Retention):
        self.engine, self.store, self.store_queue, self.live = engine, store, store_queue, live
        self.metrics, self.policy, self.root, self.scheduler = metrics, policy, root, scheduler
        self.retention = retention
        self.cache = PrefixCache(live, store_queue, store)
        self.seen = SeenChains()  # what was computed: why a later prompt was not restored
        self.home = Namespace(root)  # the server's own tenant: no key, or one unnamed key

    def arrive(self, chain: Sequence[bytes], session: str | None = None) -> str:
        """A request that restores `chain` starts: the pin of the answer it continues ends (its tool
        time observed). Returns its session: the client's `session`, else the pinned answer's, else
        one named by `chain` (gateway/pins.py)."""
        return self.retention.resume(list(chain), session)

    def restore(self, chain: Sequence[bytes], ends: Sequence[int], rewind: bool = True) -> tuple[SequenceState, int]:
        """A state at the end of the longest restorable prefix of `chain` (a fresh state when none)
        and the number of tokens it covers. When a live sequence sits at that prefix's end or deeper
        (the previous answer, or the precomputed history, that this request extends), it is continued
        in place: the same state with no copy (on a GPU: no host-to-device transfer of the prefix).
        Checkpoints of `chain` still on their way into the store are waited for, no others, and the
        match is then asked again (`PrefixCache.find`, `settle`). With `rewind`, a live sequence that
        ran through the restored prefix's end (`LiveSequences.take_rewind`) is put back there instead
        (`Engine.rewind`)."""
        if self.policy == "none" or not chain:
            return self.engine.new_state(), 0
        hit = self.cache.find(chain, ends)
        if hit.tier is Tier.LIVE:
            live = self.cache.take_live(chain, hit)
            self.metrics.add_tokens(continued=live.length)
            return live, live.length
        if hit.tier is Tier.QUEUED:
            hit = self.cache.settle(chain) or hit
        depth, records = self.cache.load(chain, hit.depth)
        if not records:
            return self.engine.new_state(), 0
        kept = self.cache.take_rewind(chain[depth - 1]) if rewind else None
        if kept is None:
            return self.engine.restore(records), ends[depth - 1]
        self.metrics.add_tokens(continued=ends[depth - 1])  # its KV in place: only the states copied in
        return self.engine.rewind(kept, records[-1]), ends[depth - 1]

    def explain(self, segments: Sequence[Segment], chain: Sequence[bytes], ends: Sequence[int],
                restored: int, namespace: Namespace | None = None) -> PrefillReasons:
        """Why the tokens of `segments` after the first `restored` (what `restore` gave) are prefilled:
        asked before `prefill` computes them."""
        return self.seen.explain(segments, chain, ends, restored, (namespace or self.home).scope)

    def ready(self, chain: Sequence[bytes], ends: Sequence[int]) -> bool:
        """Whether `restore(chain, ends)` runs without waiting for the store queue: nothing of `chain`
        is on its way into the store, or a live sequence of it is continued in place (taken first)."""
        return self.policy == "none" or self.cache.ready(chain, ends)

    def prefill(
        self, state: SequenceState, segments: Sequence[Segment], chain: Sequence[bytes], ends: Sequence[int],
        start: int, namespace: Namespace | None = None, resumes_at_end: bool = False,
    ) -> Generator[Feed, None, PrefillResult]:
        """Prefill the tokens of `segments` after position `start` (where `state` is), capturing a
        checkpoint at each boundary after `start`; the checkpoints go to the store queue.
        `resumes_at_end`: the next request resumes at its end once the user writes (a precomputed
        history), not after an answer to it."""
        scope = (namespace or self.home).scope
        ids = [t for s in segments for t in s.token_ids][start:]
        first = next(i for i, end in enumerate(ends) if end > start)
        if self.policy == "none":
            feed = Feed(state, ids)
            yield feed
            self.seen.add(chain, ends[-1], contents=segments[first:], scope=scope)
            return cast(PrefillResult, feed.result)
        feed = Feed(state, ids, capture_at=ends[first:], state_at=state_positions(self.policy, segments, ends))
        yield feed
        result = cast(PrefillResult, feed.result)
        self.store_queue.put(chain[first:], chain[first - 1] if first else None, result.snapshots, result.ready,
                             record_kinds(segments[first:], kinds.IDLE if resumes_at_end else None))
        states = [a for a, s in zip(chain[first:], result.snapshots, strict=True) if s.has_state]
        self.seen.add(chain, ends[-1], states, contents=segments[first:], scope=scope)
        return result

    def save_generation_end(
        self, state: SequenceState, segments: Sequence[Segment], prompt: Sequence[bytes], prompt_ends: Sequence[int],
        generated: list[int], namespace: Namespace | None = None, pin_session: str | None = None,
    ) -> Generator[Feed, None, None]:
        """Checkpoint a generation as the next request will render it (`segments`, a memo hit),
        after its prompt (its chain `prompt`, its anchors' token ends `prompt_ends`): KV deltas per
        generated segment, the state after the end-of-turn token (fed here). The sequence stays live
        there, and may be rewound to its prompt's last message or its end by a request that shares no
        more of it (the answer rendered otherwise, e.g. its reasoning dropped; the same prompt sent
        again). With `pin_session` (an answer that ends in a tool call: its session), its end is pinned
        while the tool runs (`Retention.pin`)."""
        start = prompt_ends[-1]
        ends = [start + e for e in boundaries(segments)]
        if not ends or ends[-1] != state.length + 1:
            log.debug("generation end not checkpointed: %s != %s", ends[-1:] or None, state.length + 1)
            return
        parent = prompt[-1]
        chain = anchor_chain(segments, parent)
        starts = [start, *ends[:-1]]
        snapshots = [self.engine.kv_delta(state, a, b) for a, b in zip(starts[:-1], ends[:-1], strict=True)]
        feed = Feed(state, generated[-1:], capture_at=[ends[-1]], kv_start=starts[-1])
        yield feed
        tail = cast(PrefillResult, feed.result)
        self.store_queue.put(chain, parent, [*snapshots, *tail.snapshots], tail.ready,
                             record_kinds(segments, kinds.TIP if pin_session is not None else kinds.IDLE))
        states = [a for a, s in zip(chain, [*snapshots, *tail.snapshots], strict=True) if s.has_state]
        self.seen.add([*prompt, *chain], ends[-1], states, contents=segments, scope=(namespace or self.home).scope)
        whole = [*prompt, *chain]
        if pin_session is not None:
            self.retention.pin(whole, pin_session)
        # rewinds: a re-rendered answer; a retried prompt
        self.live.keep(whole, [*prompt_ends, *ends], state, rewinds=prompt[-2:], for_request=True)

    def schedule_precompute(self, segments: list[Segment], namespace: Namespace | None = None) -> Future:
        """Precompute `segments` in the scheduler's gaps (a background task); its future gives
        the tokens computed."""
        return self.scheduler.background(self.precompute(segments, namespace))

    def precompute(self, segments: list[Segment], namespace: Namespace | None = None) -> Generator[Feed, None, int]:
        """Prefill `segments` from the longest checkpointed prefix in passes of about
        PRECOMPUTE_STEP tokens (whole segments, a checkpoint at every boundary), stopping between
        passes as soon as live work waits (the scheduler runs it only in steps with no live work),
        and before the first while its prefix is still being stored. Returns the tokens computed."""
        namespace = namespace or self.home
        chain, ends = namespace.chain(segments), boundaries(segments)
        # its prefix (the answer just given) may still be on its way into the store: waited for on
        # this thread, the only engine worker, but never in front of a request that arrives meanwhile
        stored = self.cache.settle(chain, stop=self.scheduler.live_waiting)
        if stored is None:
            log.info("precompute yielded to a live request while its prefix was being stored")
            return 0
        if stored.depth == len(chain):
            return 0
        # a copy off any request's path: the answer's own sequence stays live for one that extends it
        state, done = self.restore(chain, ends, rewind=False)
        computed, at_state = 0, None
        for i, end in enumerate(ends):
            if end <= done or (end - done < PRECOMPUTE_STEP and i + 1 < len(ends)):
                continue  # extend this pass to the next boundary
            if self.scheduler.live_waiting():
                log.info("precompute yielded to a live request at %d/%d tokens", done, ends[-1])
                break
            result = yield from self.prefill(state, segments[: i + 1], chain[: i + 1], ends[: i + 1], done, namespace,
                                             resumes_at_end=True)
            computed, done = computed + end - done, end
            at_state = i if result.snapshots and result.snapshots[-1].has_state else None
        if at_state is not None:  # the last pass ended on a state checkpoint: continue from here
            self.live.keep(chain[:at_state + 1], ends[:at_state + 1], state)
        self.metrics.add_tokens(precomputed=computed)
        return computed

    def spill(self, kept: Kept) -> None:
        """A live sequence dropped (not handed to a request): what the store no longer holds of its
        chain (evicted from a RAM-only store, or from the disk; a put that failed) is stored from the
        sequence first, so its state goes down a tier instead of being lost: the KV deltas from the
        first record the store lacks, and the state at its end. Nothing when the store restores the
        whole chain or some of it is still queued. Engine worker only (`LiveSequences.spill`)."""
        chain, ends = list(kept.chain), list(kept.ends)
        if self.policy == "none" or self.store_queue.holds(chain) or self.store.longest_restorable(chain) == len(chain):
            return
        self.store.touch(chain)  # used until now, in place: what it keeps is not the next to go
        first = next((i for i, a in enumerate(chain) if not self.store.has_kv(a)), len(chain) - 1)
        starts = [0, *ends[:-1]]
        snapshots = [self.engine.kv_delta(kept.state, starts[i], ends[i]) for i in range(first, len(chain) - 1)]
        snapshots.append(self.engine.snapshot(kept.state, starts[-1]))  # the KV and the state at its end
        for i in reversed(range(first, len(chain))):  # deepest first: a record whose child is held is no eviction leaf
            self.store_queue.put(chain[i:i + 1], chain[i - 1] if i else None, snapshots[i - first:i - first + 1])
        log.info("a dropped live sequence stored %d records the store had lost", len(snapshots))


def record_kinds(segments: Sequence[Segment], end: str | None = None) -> list[str]:
    """Each segment's record kind for the store (`checkpoint_store.kinds`): a system prompt or tool
    list is a shared prefix, any other message a turn; with `end`, the last one's kind (where its
    session resumes: `kinds.TIP` after a tool, `kinds.IDLE` after its user)."""
    out = [kinds.PREFIX if s.kind in ("system", "tools") else kinds.TURN for s in segments]
    if end is not None and out:
        out[-1] = end
    return out
