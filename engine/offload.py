"""Expert offload: the routed experts live in host memory, a few per layer on the device.

With a device memory budget (`ft serve --gpu-memory GiB`), everything but the routed experts (the
dense parts: embeddings, attention, Gated DeltaNet, shared experts, routers, norms, lm_head), the
decode slots of the running sequences and a forward's workspace are placed first (`plan`); the
rest becomes `slots` expert slots per MoE layer, each layer's `ExpertCache` (engine/expert_cache.py)
with every expert in pinned host memory. Experts run on the slots, copied in on a side stream.

What a forward does with the link (`Policy`, chosen per forward by its token count; `stream_tokens`
starts where a chunk routes to 90% of the experts and, on a GPU, warm-up moves it to where fetching a
chunk's experts was measured to cost as much as streaming them all, `calibrate_stream`):
- A chunk of at least `stream_tokens` tokens routes to most experts of every layer. Where
  fewer than half a layer's experts have slots, the plan sets aside a few buffers and such a chunk
  streams every layer's experts whole, in pieces of consecutive experts, whatever the routing
  (`ExpertStream`, engine/expert_stream.py): one copy per part at the link's rate, no host sync;
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
(`Plan.small`); before each prefill forward, what the device holds plus its chunk's workspace
(`Plan.workspace_for`) plus the KV its sequences grow by must fit (`fit`), and as the decode slots
grow (engine/runner.py doubles KV capacity) `make_room` does the same: the expert slots shrink
first, never below top_k.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from engine.config import ModelConfig
from engine.expert_cache import IN_PLACE_ROWS, ExpertCache, Lane, Parts, host_experts
from engine.expert_stream import ExpertStream, stream_bytes

if TYPE_CHECKING:
    from engine.model import DecoderLayer, HybridForCausalLM

log = logging.getLogger(__name__)
GiB = 1 << 30
EXPERT_PARAMS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
SWAPS_PER_STEP = 1  # experts a layer may copy into its slots after each decode step (mapped)


class BudgetError(ValueError):
    """The device memory budget cannot hold the dense parts, the decode slots and top_k experts per layer."""


def _size(n: int) -> str:
    return f"{n / GiB:.3f} GiB ({n:,} bytes)"


@dataclass(frozen=True)
class Plan:
    """How a device budget is spent (bytes): dense weights, decode slots, a forward's workspace
    (with `rows` staging rows of experts a decode step reads from host memory, `stages`), and
    `slots` experts of `expert_bytes` in each of `layers` MoE layers. `workspace` is a full chunk's
    (`chunk` tokens), `small` what the shortest chunks allocate (0 until measured)."""

    budget: int
    dense: int
    states: int
    workspace: int
    expert_bytes: int
    layers: int
    slots: int
    rows: int
    stream: int = 0  # bytes of the buffers long chunks stream experts through (engine/expert_stream.py), or 0
    chunk: int = 1
    small: int = 0

    def workspace_for(self, tokens: int) -> int:
        """A `tokens`-token forward's workspace: the shortest chunks' plus the full chunk's pro rata,
        at most the full chunk's. Where what a forward allocates is affine in its tokens (its
        activations per token, fixed buffers beside them) this bounds it: a 9-token suffix after
        a tool call does not keep a whole chunk's room free (the expert slots would pay for it)."""
        if not self.small:
            return self.workspace
        return min(self.workspace, self.small + self.workspace * tokens // self.chunk)

    @property
    def expert_cache(self) -> int:
        return self.slots * self.expert_bytes * self.layers

    def budget_for(self, slots: int) -> int:
        """The smallest budget that leaves `slots` experts per layer with the same other parts."""
        return (
            self.dense + self.states + self.workspace + self.stream + slots * self.expert_bytes * self.layers
        )


def state_bytes(c: ModelConfig, dtype: torch.dtype, sequences: int, capacity: int) -> int:
    """Bytes of the runner's slot buffers (engine/runner.py) for `sequences` slots (+ its scratch
    slot) of `capacity` tokens: KV per attention layer, conv and fp32 recurrent state per DeltaNet layer."""
    return (sequences + 1) * (kv_bytes(c, dtype, capacity) + recurrent_bytes(c, dtype))


def kv_bytes(c: ModelConfig, dtype: torch.dtype, tokens: int) -> int:
    """Bytes of `tokens` tokens' keys and values in every attention layer."""
    size = torch.empty(0, dtype=dtype).element_size()
    return 2 * tokens * c.num_key_value_heads * c.head_dim * size * len(c.attention_layers)


def recurrent_bytes(c: ModelConfig, dtype: torch.dtype, layers: int | None = None) -> int:
    """Bytes of one sequence's DeltaNet states (conv in `dtype`, recurrent in fp32) in `layers`
    layers (default: every DeltaNet layer): also what a prefill forward captures at each point."""
    size = torch.empty(0, dtype=dtype).element_size()
    conv = c.conv_dim * (c.linear_conv_kernel_dim - 1) * size
    rec = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
    return (conv + rec) * (len(c.deltanet_layers) if layers is None else layers)


def workspace_bytes(c: ModelConfig, dtype: torch.dtype, tokens: int, rows: int) -> int:
    """An estimate of one forward's transient tensors for a chunk of `tokens`: the residual stream
    and norms, the widest fused projection, the experts' rows (top_k per token) and `rows` logits;
    plus the chunk's own KV, which a sequence being prefilled holds outside the decode slots."""
    size = torch.empty(0, dtype=dtype).element_size()
    kv = tokens * 2 * c.num_key_value_heads * c.head_dim * size * len(c.attention_layers)
    widest = max(
        c.conv_dim + 2 * c.linear_value_dim + 2 * c.linear_num_value_heads,
        (2 * c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim,
        c.num_experts + 2 * c.shared_expert_intermediate_size + 1,
    )
    experts = c.num_experts_per_tok * (2 * c.hidden_size + 3 * c.moe_intermediate_size)
    return tokens * size * (6 * c.hidden_size + 2 * widest + experts) + rows * c.vocab_size * 4 + kv


def dense_bytes(model: HybridForCausalLM) -> int:
    """Bytes of every parameter and buffer but the routed experts: each storage once (fused
    projections are views of one tensor) less the routed stacks (with the shared expert folded into
    their storage, `SparseMoe.fold_shared`, it stays counted)."""
    named = [*model.named_parameters(), *model.named_buffers()]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for _, t in named}
    routed = sum(t.nbytes for name, t in named if any(e in name for e in EXPERT_PARAMS))  # stacks, or their parts
    return sum(storages.values()) - routed


def streams(c: ModelConfig, slots: int) -> bool:
    """Whether `plan` streams long chunks' experts with `slots` resident a layer: most of a layer's experts
    are not resident, so long chunks stream them whole, through buffers that cost a few slots
    (engine/expert_stream.py)."""
    return c.num_experts_per_tok <= slots < c.num_experts // 2


def budget_for(c: ModelConfig, p: Plan, slots: int) -> int:
    """The smallest budget `plan` splits into `slots` experts per layer with p's other parts (dense
    weights, decode slots, workspace), the stream buffers it reserves at that many included."""
    stream = stream_bytes(c.num_experts, p.expert_bytes) if streams(c, slots) else 0
    return dataclasses.replace(p, stream=stream).budget_for(slots)


def plan(
    c: ModelConfig,
    dense: int,
    budget: int,
    dtype: torch.dtype,
    sequences: int,
    capacity: int,
    tokens: int,
    expert_bytes: int | None = None,
) -> Plan:
    """Split `budget` bytes: the dense parts, the decode slots of `sequences` sequences of
    `capacity` tokens, the workspace of a `tokens`-token chunk, and the rest as expert slots of
    `expert_bytes` (default: a `dtype` expert; quantized experts pass their own size), evenly per
    MoE layer (at most every expert). Raises `BudgetError` naming the numbers when the rest is not
    top_k experts per layer."""
    layers = c.num_hidden_layers
    size = torch.empty(0, dtype=dtype).element_size()
    expert = expert_bytes or 3 * c.moe_intermediate_size * c.hidden_size * size
    states = state_bytes(c, dtype, sequences, capacity)
    # and the rows a decode step of `sequences` gathers the experts it reads from host memory into
    rows = min(IN_PLACE_ROWS, max(sequences, 1) * c.num_experts_per_tok)
    workspace = workspace_bytes(c, dtype, tokens, max(sequences, 1)) + rows * expert
    if budget < dense:
        raise BudgetError(
            f"--gpu-memory {_size(budget)} is below the dense weights alone ({_size(dense)}: "
            "embeddings, attention, DeltaNet, shared experts, routers, norms, lm_head)"
        )
    rest = budget - dense - states - workspace
    slots = min(c.num_experts, max(rest, 0) // (expert * layers))
    stream = stream_bytes(c.num_experts, expert)
    streamed = max(rest - stream, 0) // (expert * layers)
    if streams(c, streamed):
        slots = streamed
    else:
        stream = 0
    if slots < c.num_experts_per_tok:
        need = dense + states + workspace + c.num_experts_per_tok * expert * layers
        raise BudgetError(
            f"--gpu-memory {_size(budget)} leaves room for {slots} experts per layer, fewer than top_k = "
            f"{c.num_experts_per_tok}: dense weights {_size(dense)} + decode slots {_size(states)} ({sequences} "
            f"sequences x {capacity} tokens) + workspace {_size(workspace)} + {c.num_experts_per_tok} x {layers} "
            f"experts of {expert:,} bytes need {_size(need)}"
        )
    return Plan(budget, dense, states, workspace, expert, layers, slots, rows, stream, chunk=tokens)


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


@dataclass(frozen=True)
class Link:
    """Measured at start: host -> device bytes/s (pinned), and the host's seconds for one expert
    on one row and for each further row (`host_experts`)."""

    h2d_bytes_per_s: float
    host_expert_s: float
    host_row_s: float


@dataclass(frozen=True)
class Policy:
    """Per forward: chunks of at least `stream_tokens` tokens prefetch the next layer's experts
    before its routing is known. In shorter ones, misses routed to at most `cpu_rows` rows may be
    computed on the host: all of them without `costs`, else as many as balance the two sides
    (`ExpertCache.split`), from `costs` = (seconds to copy an expert, host seconds for an expert
    on one row, for each further row)."""

    stream_tokens: int
    cpu_rows: int = 0
    costs: tuple[float, float, float] | None = None

    @staticmethod
    def coverage_tokens(c: ModelConfig, share: float = 0.9) -> int:
        """Tokens after which a chunk routes to `share` of the experts (uniform routing:
        1 - (1 - k/E)^T of them)."""
        if c.num_experts_per_tok >= c.num_experts:
            return 1
        return math.ceil(math.log(1 - share) / math.log(1 - c.num_experts_per_tok / c.num_experts))

    @staticmethod
    def coverage(c: ModelConfig, tokens: int) -> float:
        """The share of a layer's experts a chunk of `tokens` tokens routes to (uniform routing)."""
        return 1 - (1 - min(c.num_experts_per_tok / c.num_experts, 1.0)) ** tokens

    def crossover(self, c: ModelConfig, tokens: int, fetched_s: float, streamed_s: float) -> Policy:
        """This policy with `stream_tokens` where fetching a chunk's routed experts (`fetched_s`
        measured on `tokens` tokens, taken to grow with the share of experts routed to) costs as
        much as streaming them all (`streamed_s`, which the link bounds whatever the length);
        never below the chunks that read in place (`IN_PLACE_ROWS`), never above `coverage_tokens`."""
        low, high = IN_PLACE_ROWS // c.num_experts_per_tok + 1, self.coverage_tokens(c)
        share = self.coverage(c, tokens) * streamed_s / max(fetched_s, 1e-9)  # where the two meet
        at = high if share >= self.coverage(c, high) else self.coverage_tokens(c, share) if share > 0 else low
        return dataclasses.replace(self, stream_tokens=min(max(at, low), high))

    @classmethod
    def measured(cls, c: ModelConfig, link: Link, expert_bytes: int) -> Policy:
        """The costs of `link` for experts of `expert_bytes`; any miss may go to the host, the
        balance decides (myopic: a copied expert may also hit in later steps)."""
        costs = (expert_bytes / link.h2d_bytes_per_s, link.host_expert_s, link.host_row_s)
        return cls(cls.coverage_tokens(c), cpu_rows=1 << 16, costs=costs)


def measure_link(cache: ExpertCache, repeat: int = 5) -> Link:
    """Time one expert's host -> device copy and its host compute on 1 and 16 rows (medians)."""

    def median(fn) -> float:
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]

    scratch = tuple(torch.empty_like(p[0]) for p in cache.parts)
    sync = torch.cuda.synchronize if cache.device.type == "cuda" else (lambda: None)

    def copy() -> None:
        for dst, src in zip(scratch, cache.host, strict=True):
            dst.copy_(src[0], non_blocking=True)
        sync()

    x = torch.randn(16, cache.host_weights(0)[0].shape[1], dtype=torch.float32)
    ones = torch.ones(16)
    # as the host path runs an expert: its weights fetched (a packed expert dequantized) every time
    one = median(lambda: host_experts(x[:1], ones[:1], *cache.host_weights(0)))
    sixteen = median(lambda: host_experts(x, ones, *cache.host_weights(0)))
    seconds = median(copy)
    return Link(cache.expert_bytes / max(seconds, 1e-9), one, max(sixteen - one, 0.0) / 15)


class ExpertOffload:
    """Every MoE layer's `ExpertCache`, their shared counters, copy lane and policy."""

    def __init__(self, caches: dict[int, ExpertCache], stats: OffloadStats, plan: Plan, config: ModelConfig,
                 outside: int = 0):  # fmt: skip
        self.caches, self.stats, self.plan, self.config = caches, stats, plan, config
        self.order = order = [caches[i] for i in sorted(caches)]  # by layer, as the counters' rows
        for cache, following in zip(order, [*order[1:], None], strict=True):
            cache.next = following
        self.device = order[0].device
        self.peak_before = 0  # peak reserved bytes before the calibration reset the allocator's peaks
        # device memory the process held before this engine's (another engine in the same process,
        # as in the tests): the budget is this engine's, on top of it
        self.outside = outside
        # the engine's, after the slots shrank or decode's reads changed: the graphs over the old go
        self.on_change: Callable[[], None] = lambda: None
        self.capped = False  # `cap`
        self.link: Link | None = None
        self.policy = Policy(Policy.coverage_tokens(config))
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
        return self.plan.slots >= self.config.num_experts

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

    def calibrate(self) -> Policy:
        """Measure the link on the first layer's experts and choose the policy from it."""
        first = self.caches[min(self.caches)]
        self.link = measure_link(first)
        self.policy = Policy.measured(self.config, self.link, first.expert_bytes)
        return self.policy

    def calibrate_stream(self, prefill: Callable[[int], None], tokens: int = 24) -> Policy:
        """Where a chunk stops fetching the experts it routes to and takes the long chunks' path
        instead (the stream; where half a layer's experts have slots, prefetching the next layer's)
        (`Policy.crossover`), from one `tokens`-token `prefill` timed each way, each after an
        untimed run (kernel specialisations, host threads: a first short request paid 2-3 s for
        them on the H200). The estimate from the link's figures alone put the crossover at 73
        tokens at 8 GiB; measured there, 21 routed tokens took 0.94 s fetched and any chunk
        0.33-0.47 s streamed. On a GPU the untimed runs measure what a short chunk allocates on
        either path (`Plan.small`; one run where every expert has a slot)."""
        cuda = self.device.type == "cuda"
        small: list[int] = []  # what each path's chunk allocates (`Plan.small`), on a GPU

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
        CUDA graph's pool cannot serve a large tensor (a streamed forward at 8 GiB on the H200
        ran out of memory with 0.46 GiB of them). When holdings plus `extra` pass the budget, the
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
        if slots < self.config.num_experts_per_tok:
            raise BudgetError(
                f"--gpu-memory {_size(self.plan.budget)}: {why} leave room for {max(slots, 0)} experts per "
                f"layer, fewer than top_k = {self.config.num_experts_per_tok}"
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


def expert_store(model: HybridForCausalLM, layer: int) -> tuple[tuple[torch.Tensor, ...], Callable]:
    """One layer's routed experts as (stacked parts, leading dim the expert; their `assemble`):
    the bf16 pair itself, or the parts of quantized stacks (`quantized_store`)."""
    experts = cast("DecoderLayer", model.model.layers[layer]).mlp.experts
    assert experts is not None
    gate_up, down = experts.gate_up_proj, experts.down_proj
    if hasattr(gate_up, "parts"):
        return quantized_store(gate_up, down)
    return (gate_up.detach(), down.detach()), tuple


def expert_bytes(model: HybridForCausalLM) -> int:
    """Bytes of one routed expert (every part's row)."""
    return sum(p[0].nbytes for p in expert_store(model, 0)[0])


def quantized_store(gate_up: Any, down: Any) -> tuple[tuple[torch.Tensor, ...], Callable]:
    """Quantized stacks (`QuantWeight`s of engine/ops/gpu/quant.py, whose `parts` lead with the
    expert) as one expert store for `ExpertCache`: every part in one tuple, and the `assemble`
    that makes them `QuantWeight`s again over any number of experts (the slots, or one expert on
    the host, where `dequantize` gives the host path its weights)."""
    split = len(gate_up.parts)

    def like(w: Any, parts: tuple[torch.Tensor, ...]) -> Any:
        return type(w)(w.fmt, (parts[0].shape[0], *w.shape[1:]), parts, w.dtype, w.columns)

    def assemble(parts: tuple[torch.Tensor, ...]) -> tuple[Any, Any]:
        return like(gate_up, parts[:split]), like(down, parts[split:])

    return (*gate_up.parts, *down.parts), assemble


class _Pinned:
    """Pinned host memory described to torch as device memory (`__cuda_array_interface__`)."""

    def __init__(self, t: torch.Tensor):
        self.t = t  # kept alive by the device tensor, which keeps this object
        self.__cuda_array_interface__ = {
            "shape": (t.nbytes,),
            "typestr": "|u1",
            "data": (t.data_ptr(), False),
            "version": 3,
        }


def in_place(parts: Parts, device: torch.device) -> Parts | None:
    """The host `parts` as tensors `device` reads in place: on the CPU the parts themselves; on
    CUDA, device tensors over their pinned memory (unified addressing maps it into the device's
    address space: a kernel's loads cross the link), checked once by a kernel reading the last
    expert back; None where the device cannot (then experts are copied in before use)."""
    if device.type != "cuda":
        return parts
    try:
        views = tuple(torch.as_tensor(_Pinned(p), device=device).view(p.dtype).view(p.shape) for p in parts)
        for view, p in zip(views, parts, strict=True):
            read, want = (t.view(torch.uint8)[-1].sum(dtype=torch.long).item() for t in (view, p))
            if read != want:
                return None
    except (RuntimeError, TypeError, ValueError):
        return None
    return views


def stages(mapped: Parts) -> bool:
    """Whether decode gathers the experts it reads from host memory into device rows before running
    them (engine/ops/gpu/gather.py: whole words, long runs), rather than their kernels reading them
    where they lie."""
    if mapped[0].device.type != "cuda":
        return True
    from engine.ops.gpu.gather import gather_fits  # noqa: PLC0415 (Triton)

    return gather_fits(mapped)


def expandable_segments() -> None:
    """Within a budget the allocator must not fragment: transient tensors of varying sizes (a
    streamed piece's dequantized experts, live sequences' KV) left 0.8 GiB reserved but unusable
    at 8 GiB (measured on the H200), and a forward ran out of memory. Expandable segments map and
    unmap pages instead of holding whole segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True);
    set here unless the environment configures the allocator itself."""
    if "PYTORCH_CUDA_ALLOC_CONF" in os.environ:
        return
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    try:
        if setter is None:
            torch.cuda.memory._set_allocator_settings("expandable_segments:True")
        else:
            setter("expandable_segments:True")
    except (RuntimeError, AttributeError):  # not on this platform: the cap still holds, less tightly
        pass


def install(
    model: HybridForCausalLM, device: torch.device, plan: Plan, mapped: bool = True, staged: bool = True
) -> ExpertOffload:
    """Move each MoE layer's routed experts out of `model` (still on the host) into host tensors,
    pinned when `device` is CUDA, and give the layer an `ExpertCache` of `plan.slots` slots on
    `device` (with `mapped`, reading the host tensors in place for decode where the device can:
    `in_place`; without, decode copies the experts it needs into the slots first; with `staged`,
    gathering them into staging rows first where `stages` allows, else reading them where they lie).
    The model then holds only the dense parts, to be moved to `device` as usual."""
    stats, lane = OffloadStats(), Lane(device)
    outside = 0  # what the process holds on the device before this engine's parts
    if device.type == "cuda":
        expandable_segments()
        torch.cuda.empty_cache()
        outside = torch.cuda.memory_reserved(device)
    caches: dict[int, ExpertCache] = {}
    staging: dict[tuple, Parts] = {}  # by the parts' layout: the layers share their staging rows
    for layer in cast("list[DecoderLayer]", model.model.layers):
        parts, assemble = expert_store(model, layer.layer)
        if device.type == "cuda":
            parts = tuple(p.pin_memory() for p in parts)
        reads = in_place(parts, device) if mapped else None
        stage = None
        if reads is not None and staged and stages(reads):
            layout = tuple((p.shape[1:], p.dtype) for p in parts)
            if layout not in staging:
                staging[layout] = tuple(
                    torch.empty((plan.rows, *p.shape[1:]), dtype=p.dtype, device=device) for p in parts
                )
            stage = staging[layout]
        cache = ExpertCache(parts, plan.slots, device, stats, lane, assemble, reads, stage)
        layer.mlp.offload = caches[layer.layer] = cache
        layer.mlp.experts = None
    offload = ExpertOffload(caches, stats, plan, model.config, outside)
    offload.cap()
    return offload
