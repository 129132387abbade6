"""Expert offload: the routed experts live in host memory, a few per layer on the device.

With a device memory budget (`ft serve --gpu-memory GiB`), everything but the routed experts (the
dense parts: embeddings, attention, Gated DeltaNet, shared experts, routers, norms, lm_head), the
decode slots of the running sequences and a forward's workspace are placed first (`plan`); the
rest becomes `slots` expert slots per MoE layer, each layer's `ExpertCache` (engine/offload/cache.py)
with every expert in pinned host memory. Experts run on the slots, copied in on a side stream.

What a forward does with the link (`ExpertCachePolicy`, chosen per forward by its token count; `stream_tokens`
starts where a chunk routes to 90% of the experts and, on a GPU, warm-up moves it to where fetching a
chunk's experts was measured to cost as much as streaming them all, `calibrate_stream`):
- A chunk of at least `stream_tokens` tokens routes to most experts of every layer. Where
  fewer than half a layer's experts have slots, the plan sets aside a few buffers and such a chunk
  streams every layer's experts whole, in pieces of consecutive experts, whatever the routing
  (`ExpertStream`, engine/offload/stream.py): one copy per part at the link's rate, no host sync;
  only the slots left empty are filled, from the pieces as they pass. Otherwise, the routing of
  layer L+1 is not known before layer L ends, but nearly all of its experts will be needed, so
  when layer L's experts start, half of layer L+1's slots are filled with experts it does not
  hold (`ExpertCache.prefetch`): those copies overlap layer L's experts and layer L+1's
  attention. After its routing, layer L+1 runs its experts in groups of half its slots, the copy
  of each group overlapping the compute of the one before (double buffering within the layer).
- A shorter chunk (decode, a short suffix) fetches only the experts it routes to, after routing,
  and may compute some of its misses on the host from their host copies meanwhile: as many as
  balance the host's time against the remaining copies' (`Link`: measured at start on CUDA, the
  link's bandwidth against the host's time per expert and row; none on the CPU, where the split
  is only simulated).
Where the device can read pinned host memory in place (`in_place`: CUDA's unified addressing; on
the CPU, trivially), decode does not fetch at all: a step's resident experts run from their slots,
the others are read where they lie over the link by the same kernels, and nothing is decided on
the host mid-step, so decode steps are CUDA graphs again. After each forward the device's
per-expert counts are read back (`settle`, one step late, without waiting) for the figures, and
after a decode step each layer may swap its hottest experts into its slots (`ExpertCache.refresh`)
on the copy stream. Without in-place reads (or with `install(..., mapped=False)`) decode fetches like a short
chunk and runs eagerly (`ExpertCache.run` refuses to run under capture rather than read stale
slots). A budget with a slot for every expert (`holds_all`) copies them in once.

How the budget holds on a GPU: the caching allocator is capped at it (`cap`: past it, it frees its
cached blocks and retries, then raises rather than reserve more); warm-up measures what a full
prefill chunk allocates (`calibrate_workspace`, giving up slots while it does not fit) and the plan
keeps that much free; `calibrate_stream`'s short chunks measure what any chunk allocates at least
(`OffloadPlan.small`); before each prefill forward, what the device holds plus its chunk's workspace
(`OffloadPlan.workspace_for`) plus the KV its sequences grow by must fit (`fit`), and as the decode slots
grow (engine/runner.py doubles KV capacity) `make_room` does the same: the expert slots shrink
first, never below top_k.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine.config import ModelConfig
from engine.offload.cache import IN_PLACE_ROWS, ExpertCache
from engine.offload.plan import BudgetError, OffloadPlan, _size, least_slots
from engine.offload.policy import ExpertCachePolicy, Link, measure_link
from engine.offload.stats import OffloadStats
from engine.offload.stream import ExpertStream

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)


SWAPS_PER_STEP = 1  # experts a layer may copy into its slots after each decode step (mapped)


class ExpertOffload:
    """Every MoE layer's `ExpertCache`, their shared counters, copy lane and policy."""

    def __init__(self, caches: dict[int, ExpertCache], stats: OffloadStats, plan: OffloadPlan, config: ModelConfig,
                 outside: int = 0):
        self.caches, self.stats, self.plan, self.config = caches, stats, plan, config
        self.order = order = [caches[i] for i in sorted(caches)]  # by layer, as the counters' rows
        for cache, following in zip(order, [*order[1:], None], strict=True):
            cache.next = following
        self.device = order[0].device
        self.experts = order[0].num_experts  # a layer's: all the model's, or an expert-parallel rank's share
        self.peak_before = 0  # peak reserved bytes before the calibration reset the allocator's peaks
        # device memory the process held before this engine's (another engine in the same process,
        # as in the tests): the budget is this engine's, on top of it
        self.outside = outside
        # the engine's, after the slots shrank or decode's reads changed: the graphs over the old go
        self.on_change: Callable[[], None] = lambda: None
        self.capped = False  # `cap`
        self.link: Link | None = None
        self.policy = ExpertCachePolicy(ExpertCachePolicy.coverage_tokens(config))
        self.mapped = all(c.mapped_weights is not None for c in order)
        self.stream: ExpertStream | None = None
        if plan.stream and not self.holds_all:  # long chunks stream every layer's experts whole
            self.stream = ExpertStream(order, order[0].lane, stats)
            for cache in order:
                cache.stream = self.stream
        # every layer's device counters in one tensor (ExpertCache.counters are its rows), copied
        # back after each forward and read at the next (`settle`)
        self.counters = torch.stack([c.counters for c in order])  # [L, 2, E]
        for i, cache in enumerate(order):
            cache.counters = self.counters[i]
        self.seen = np.zeros(tuple(self.counters.shape), dtype=np.int64)
        # their host copy (pinned on CUDA: copied behind the forward without a wait), and while a
        # copy is queued, (its event, the phase it counts for)
        self.counted = torch.empty(
            self.counters.shape, dtype=torch.long, pin_memory=self.device.type == "cuda"
        )
        self.reading: tuple[Any, str] | None = None
        if self.holds_all:  # the budget holds every expert: copied in once, then never chosen
            for cache in order:
                cache.hold_all()

    @property
    def nbytes(self) -> int:
        """Device bytes of the expert slots."""
        return sum(c.nbytes for c in self.caches.values())

    @property
    def host_bytes(self) -> int:
        return sum(c.host_bytes for c in self.caches.values())

    @property
    def staging_bytes(self) -> int:
        """Device bytes of the rows decode gathers experts into (shared by the layers of one layout)."""
        rows = {id(c.staging): c.staging for c in self.order if c.staging is not None}
        return sum(p.nbytes for parts in rows.values() for p in parts)

    @property
    def holds_all(self) -> bool:
        """Whether every expert has a slot: nothing is fetched, so decode may be graph-captured."""
        return self.plan.slots >= self.experts

    @property
    def graph_rows(self) -> int | None:
        """The most decode rows a CUDA graph may hold: any number with every expert resident, else as
        many as read their experts in place (`IN_PLACE_ROWS` assignments: wider steps fetch them)."""
        return None if self.holds_all else IN_PLACE_ROWS // self.config.num_experts_per_tok

    def stage_reads(self, on: bool) -> None:
        """Whether decode gathers the experts it reads from host memory into the staging rows
        first (where there are any) or reads them where they lie: the bench's same-run baseline.
        The graphs captured over the other path go (captured again on use)."""
        for cache in self.order:
            cache.stage_reads = on and cache.staging is not None
        self.on_change()

    def calibrate(self) -> ExpertCachePolicy:
        """Measure the link on the first layer's experts and choose the policy from it."""
        first = self.caches[min(self.caches)]
        self.link = measure_link(first)
        self.policy = ExpertCachePolicy.measured(self.config, self.link, first.expert_bytes)
        return self.policy

    def calibrate_stream(self, prefill: Callable[[int], None], tokens: int = 24) -> ExpertCachePolicy:
        """Where a chunk stops fetching the experts it routes to and takes the long chunks' path
        instead (the stream; where half a layer's experts have slots, prefetching the next layer's)
        (`ExpertCachePolicy.crossover`), from one `tokens`-token `prefill` timed each way, each after an
        untimed run (kernel specialisations, host threads: a first short request pays seconds for
        them). The link's figures alone put the crossover far too late: they leave out the host sync
        and the scattered copies a fetching chunk pays per layer. On a GPU the untimed runs measure
        what a short chunk allocates on either path (`OffloadPlan.small`; one run where every expert
        has a slot)."""
        cuda = self.device.type == "cuda"
        small: list[int] = []  # what each path's chunk allocates (`OffloadPlan.small`), on a GPU

        def untimed() -> None:
            if cuda:
                small.append(self.allocates(lambda: prefill(tokens)))
            else:
                prefill(tokens)

        def timed(stream_tokens: int) -> float:
            self.policy = dataclasses.replace(measured, stream_tokens=stream_tokens)
            untimed()  # what a first run of this path compiles or starts
            start = time.perf_counter()
            prefill(tokens)
            if cuda:
                torch.cuda.synchronize(self.device)
            return time.perf_counter() - start

        measured = self.policy
        if self.holds_all:
            untimed()
        else:
            fetched, streamed = timed(tokens + 1), timed(tokens)
            self.policy = measured.crossover(self.config, tokens, fetched, streamed)
            log.info("a %d-token chunk: %.0f ms fetching its experts, %.0f ms streaming them: chunks of %d "
                     "tokens or more stream", tokens, fetched * 1e3, streamed * 1e3, self.policy.stream_tokens)
        if small:
            self.plan = dataclasses.replace(self.plan, small=max(small))
        return self.policy

    @contextlib.contextmanager
    def phase(self, name: str, tokens: int) -> Iterator[None]:
        """One forward of `tokens` tokens under `name` ("prefill" or "decode"): its copies are
        counted there, and the policy set for its token count (see the module docstring)."""
        self.stats.phase = name
        long = tokens >= self.policy.stream_tokens and not self.holds_all
        whole = long and self.stream is not None  # every layer's experts streamed (`ExpertStream`)
        for cache in self.caches.values():
            cache.prefetch_next = cache.slots // 2 if long and not whole else 0
            cache.cpu_rows, cache.costs = (0, None) if long else (self.policy.cpu_rows, self.policy.costs)
        if whole:
            assert self.stream is not None
            self.stream.begin()  # its first pieces overlap the embedding and the first layer's attention
        elif long:
            first = self.caches[min(self.caches)]
            first.prefetch(first.slots // 2)  # overlaps the embedding and the first layer's attention
        try:
            yield
            self.stats.tokens[name] += tokens  # once it completed: a forward undone and run again counts once
            self.stats.forwards[name] += 1
        finally:
            if self.stream is not None:
                self.stream.end()
            if self.mapped and not self.holds_all:
                self.settle(refresh=name == "decode")
            self.stats.phase = "prefill"
            for cache in self.caches.values():
                cache.prefetch_next = 0

    def settle(self, refresh: bool = False) -> None:
        """After a forward (mapped): count what the forward before it did in place (hits, experts
        read from host memory, their bytes) from the device counters, whose copy that forward's
        `settle` queued (its step has long finished: the sampling after it waited for it); with
        `refresh`, each layer then swaps hot experts into its slots (`ExpertCache.refresh`), all
        while this forward runs. Then queue the copy of the counters as they will be after it."""
        self.flush(refresh)  # the host copy is free again
        self.counted.copy_(self.counters, non_blocking=True)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        self.reading = (event, self.stats.phase)

    def flush(self, refresh: bool = False) -> None:
        """Count the last queued copy of the device counters (waiting for it if need be): before
        the stats are read, and by `settle`."""
        if self.reading is None:
            return
        event, phase = self.reading
        self.reading = None
        if event is not None:
            event.synchronize()
        counts = self.counted.numpy()
        delta, self.seen = counts - self.seen, counts.copy()
        uses, hits = delta[:, 0].sum(), delta[:, 1].sum()
        s = self.stats
        s.count(int(hits), mapped=int(uses - hits), phase=phase)
        s.bytes_in[phase] += int(uses - hits) * self.plan.expert_bytes
        if refresh:
            for cache, uses_of in zip(self.order, delta[:, 0], strict=True):
                cache.refresh(uses_of, SWAPS_PER_STEP)

    def make_room(self, states: int) -> None:
        """Decode slots grow to `states` bytes: when the plan's other parts no longer leave its
        expert slots within the budget, every layer gets fewer slots (their memory freed before
        the slots grow). Raises `BudgetError` below top_k slots per layer."""
        p = self.plan
        if states <= p.states:
            return
        self.fit(p.budget_for(p.slots) - p.states + states, f"decode slots of {_size(states)}")
        self.plan = dataclasses.replace(self.plan, states=states)

    def fit_forward(self, extra: int) -> None:
        """Room for a prefill forward that allocates `extra` bytes beyond what the device holds
        (its workspace, the KV its sequences grow by, the states it captures). What the allocator
        holds counts, not only what tensors use: free blocks inside partly used segments or a
        CUDA graph's pool cannot serve a large tensor (a streamed forward at a tight budget can run
        out of memory with a fair share of them). When holdings plus `extra` pass the budget, the
        allocator's wholly free segments are released first, then the expert slots give up what
        still does not fit (`fit`)."""
        if self.held() + extra > self.plan.budget:
            torch.cuda.empty_cache()
        held = self.held()
        why = f"the {_size(held)} held and a forward's {_size(extra)} (KV growth, workspace, captures)"
        self.fit(held + extra, why)

    def give_up_slots(self, why: str) -> None:
        """An eighth of every layer's expert slots (at least one) go: after a forward that ran out
        of device memory all the same (what it allocates was measured on another kind of chunk)."""
        self._shrink(self.plan.slots - max(1, self.plan.slots // 8), why)

    def fit(self, need: int, why: str) -> None:
        """`need` bytes (what the device holds now plus what the next forward will allocate) must
        stay within the budget: when they do not, every layer gives up as many expert slots as
        cover the excess (`why` names the need in the error below top_k slots)."""
        over = need - self.plan.budget
        if over > 0:
            per_slot = self.plan.expert_bytes * self.plan.layers
            self._shrink(self.plan.slots - math.ceil(over / per_slot), why)

    def _shrink(self, slots: int, why: str) -> None:
        if slots < (least := least_slots(self.config, self.experts)):
            raise BudgetError(
                f"--gpu-memory {_size(self.plan.budget)}: {why} leave room for {max(slots, 0)} experts per "
                f"layer, fewer than top_k = {least}"
            )
        if slots >= self.plan.slots:
            return
        for cache in self.caches.values():
            cache.resize(slots)
        self.plan = dataclasses.replace(self.plan, slots=slots)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the freed slots leave the reserved memory before anything grows
        self.on_change()

    def cap(self) -> None:
        """Hold the CUDA caching allocator to the budget: past it, the allocator frees its cached
        blocks and retries, then raises out-of-memory rather than reserve more (on a GPU). From
        `install` on: moving the dense parts in (and fusing their projections there) must not
        reserve past the budget either."""
        if self.device.type == "cuda" and not self.capped:
            self.capped = True
            torch.cuda.empty_cache()
            index = torch.cuda.current_device() if self.device.index is None else self.device.index
            total = torch.cuda.get_device_properties(index).total_memory
            torch.cuda.set_per_process_memory_fraction(
                min((self.plan.budget + self.outside) / total, 1.0), index
            )
            # lifted when this offload goes (a test may load other engines in the same process)
            weakref.finalize(self, torch.cuda.set_per_process_memory_fraction, 1.0, index)

    def calibrate_workspace(self, forward: Callable[[], None]) -> int:
        """With the allocator capped at the budget (`cap`), measure what one forward of a full chunk
        allocates beyond what the device holds (`forward` runs it on a throwaway state, and
        captures the decode graphs, whose memory stays): while it
        runs out of memory, every layer gives up an eighth of its expert slots and it runs again. The plan's
        workspace becomes the measured figure and the slots shrink to keep it; returns it. On the
        CPU (no device memory to measure) the estimate stays."""
        if self.device.type != "cuda":
            return self.plan.workspace
        while True:
            try:
                workspace = self.allocates(forward)
                break
            except torch.OutOfMemoryError:
                pass  # the failed forward's tensors (its frames still hold the slots) go with the exception
            self.give_up_slots("a full prefill chunk's workspace")
        self.plan = dataclasses.replace(self.plan, workspace=workspace)
        # as each forward will find it: what the device holds now (the decode graphs' pools included) and
        # the workspace again, so a budget too small fails at start, not at the first request
        self.fit_forward(workspace)
        return workspace

    def allocates(self, run: Callable[[], None]) -> int:
        """Device bytes `run` allocates at its peak beyond what this engine's tensors held before it
        (the allocator's peaks reset for it; the reserved peak before is kept for `peak_reserved`)."""
        torch.cuda.synchronize(self.device)
        base = self.allocated()
        self.peak_before = max(self.peak_before, torch.cuda.max_memory_reserved(self.device))
        torch.cuda.reset_peak_memory_stats(self.device)
        run()
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - self.outside - base

    def peak_reserved(self) -> int:
        """The process's peak reserved device memory (what the budget bounds), its part before
        `calibrate_workspace` reset the allocator's peaks included."""
        return max(self.peak_before, torch.cuda.max_memory_reserved(self.device)) - self.outside

    def held(self) -> int:
        """Device bytes the allocator holds for this engine now (its tensors and its cached blocks)."""
        return torch.cuda.memory_reserved(self.device) - self.outside

    def allocated(self) -> int:
        """Device bytes this engine's tensors hold now (what the process holds beyond `outside`)."""
        return torch.cuda.memory_allocated(self.device) - self.outside

    def reset_stats(self) -> None:
        """Zero the counters (the cache contents stay): after warm-up, so metrics count requests only."""
        self.flush()
        fresh = OffloadStats()
        self.stats.__dict__.update(fresh.__dict__)
