"""The engine: load a model, prefill with captures, restore, snapshot, decode.

A step is schedule -> run -> postprocess: the scheduler (`engine.scheduler`) lays the step's parts
out, `run` executes them (decode tokens on their slots, short prefills on their slots, the rest
in one forward) and every feed whose last token ran gets its result. State copies to and from
host memory live in `engine.copies`, the slow-forward log in `engine.step_log`."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from checkpoint_store.snapshot import Snapshot
from engine import offload as expert_offload
from engine import presets
from engine.batch import Mixed, Span, Spans
from engine.config import ModelConfig
from engine.copies import StateCopies
from engine.engine_config import EngineConfig
from engine.feed import Feed, PrefillResult
from engine.head_split import HeadShard
from engine.load import load_folder
from engine.loader import EXPERT_STACK, build_model, fingerprint, place
from engine.model import HybridForCausalLM
from engine.ops import Kernels, kernels_for
from engine.parallel import ExpertParallel
from engine.runner import GRAPH_CAPACITY, PREFILL_BUCKETS, Runner, starting_capacity
from engine.sampling import Decoding, SamplingParams, TokenEvent
from engine.scheduler import SLOT_PREFILL_ALONE, Limits, Scheduler, StepPlan
from engine.state import SequenceState
from engine.step_log import StepTimer
from ft import env

log = logging.getLogger(__name__)


class Engine:
    """One model on one device. Not thread-safe: the scheduler runs one call at a time."""

    def __init__(self, model: HybridForCausalLM, fingerprint: str, model_dir: Path | None = None,
                 offload: expert_offload.ExpertOffload | None = None, config: EngineConfig | None = None):
        """`offload`: the routed experts' host copies and device slots (`offload.install`). Decode
        steps stay CUDA graphs where the device reads the host copies in place (`offload.mapped`)
        or every expert has a slot; otherwise a step fetches experts between layers and runs
        eagerly. Short prefills then never run as slot graphs (their chunks fetch), and the decode
        slots make room for their growth in the expert cache. `config`: how to run the model
        (default: on the model's device)."""
        model.fold_shared_experts()  # before any forward or graph (a no-op for offloaded experts)
        self.model = model
        self.offload = offload
        self.config: ModelConfig = model.config
        self.fingerprint = fingerprint
        self.model_dir = model_dir
        self.device = model.lm_head.weight.device
        self.dtype = model.lm_head.weight.dtype
        self.engine_config = config or EngineConfig(device=str(self.device))
        self.kernels: Kernels = kernels_for(self.device)
        self.runtime = host_transfers(self.config, self.device, self.dtype)
        graphs = self.engine_config.graphs
        self.runner = Runner(
            model, self.kernels,
            use_graph=graphs and (offload is None or offload.holds_all or offload.mapped),
            before_overwrite=self.runtime.wait_copies if self.runtime is not None else None,
            before_allocate=self._make_room if offload is not None else None,
            capacity=GRAPH_CAPACITY if graphs and offload is None else None, max_context=self.max_context,
            graph_rows=offload.graph_rows if offload is not None else None,
        )
        self.copies = StateCopies(self.config, self.device, self.dtype, self.runner, self.runtime, model.heads)
        self.states: weakref.WeakValueDictionary[int, SequenceState] = weakref.WeakValueDictionary()  # by id
        self.kv_growth = 0  # sequences' own KV buffers regrown (`growth_events`)
        # under a memory budget, the owner lets go of one sequence it keeps between requests (True) or
        # has none (False): their KV lies outside the decode slots, and a forward's need comes first
        self.relieve: Callable[[], bool] = lambda: False
        self.scheduler = Scheduler(
            Limits(self.engine_config.chunk_tokens, self.engine_config.decode_step_prefill,
                   slot_tokens=PREFILL_BUCKETS[-1], slot_tokens_alone=SLOT_PREFILL_ALONE),
            slot_prefill=self.runner.use_graph and (offload is None or offload.holds_all),  # a graph per bucket
            mixes=offload is None,
        )
        if offload is not None:
            offload.on_change = self._after_offload_change

    # -- loading

    @classmethod
    def load(cls, model_dir: str | Path, config: EngineConfig | None = None, **choices: Any) -> Engine:
        """The model in `model_dir` (an HF folder or a GGUF file), run as `config` says; `choices`
        are `EngineConfig` fields that replace `config`'s (`Engine.load(path, dtype=torch.float32)`).
        Under a memory budget (`gpu_memory_gib`) the routed experts stay in host memory
        (`engine.offload`); a budget that cannot hold the rest is a `BudgetError`."""
        config = configured(config, choices)
        target = config.torch_device
        if not config.offloaded:
            model, fp = load_folder(model_dir, target, config.dtype, config.keep_quantized, config.expert_parallel,
                                    config.head_split)
            return cls(model, fp, Path(model_dir), config=config)
        from engine.gguf_loader import is_gguf  # noqa: PLC0415 (it imports the loader)

        dtype = config.dtype
        if dtype is None and target.type != "cpu" and is_gguf(model_dir):
            dtype = torch.bfloat16  # what a GGUF dequantizes to on a GPU (load_gguf's default there)
        model, fp = load_folder(model_dir, torch.device("cpu"), dtype, config.quantized_on_load, config.expert_parallel)
        return cls.offloaded(model, fp, config, Path(model_dir))

    @classmethod
    def offloaded(cls, model: HybridForCausalLM, fp: str, config: EngineConfig, model_dir: Path | None = None) -> Engine:
        """An engine for `model` (on the host) with its routed experts offloaded within
        `config.gpu_memory_gib`: those it holds (under expert parallel, its rank's share)."""
        assert config.gpu_memory_gib is not None
        device = config.torch_device
        plan = expert_offload.plan(
            model.config, expert_offload.dense_bytes(model), int(config.gpu_memory_gib * expert_offload.GiB),
            model.lm_head.weight.dtype, sequences=config.decode_slots, capacity=starting_capacity(device),
            tokens=config.chunk_tokens, expert_bytes=expert_offload.expert_bytes(model),
            experts=expert_offload.held_experts(model))
        offload = expert_offload.install(model, device, plan)
        if device.type == "cuda":
            offload.calibrate()
        return cls(place(model, device), fp, model_dir, offload, config)

    @classmethod
    def from_preset(cls, name: str, config: EngineConfig | None = None, **choices: Any) -> Engine:
        """Load preset `name`, writing it under FT_HOME first if needed. With FT_MATERIALISE=1
        its weights are generated in memory instead (on the device, or on the host under a memory
        budget; used for the 35B shape)."""
        config = configured(config, choices)
        if not env.materialise():
            return cls.load(ensure_preset(name), config)
        build_on = "cpu" if config.offloaded else config.device
        if config.expert_parallel is not None:
            parallel = config.expert_parallel
            model, fp = materialised_shard(name, build_on, config.dtype, parallel, config.head_split)
            return cls.offloaded(model, fp, config) if config.offloaded else cls(model, fp, config=config)
        model_config, _, state_dict = presets.materialise(name, build_on, config.dtype)
        model, fp = build_model(model_config, state_dict), fingerprint(model_config, state_dict)
        del state_dict  # the model holds the tensors: an offload frees each layer's stacks once pinned
        if config.offloaded:
            return cls.offloaded(model, fp, config)
        return cls(model, fp, config=config)

    # -- what it holds

    @property
    def max_context(self) -> int:
        """Tokens a sequence may reach: the model's context, or less where `EngineConfig.max_context` says."""
        model = self.config.max_position_embeddings
        return min(model, self.engine_config.max_context or model)

    @property
    def step_tokens(self) -> int:
        """Tokens per prefill forward."""
        return self.engine_config.chunk_tokens

    def memory(self) -> dict[str, int]:
        """Resident bytes on the engine's device: the weights (each storage once: fused projections
        are views; weights kept quantized count their packed arrays, `QuantWeight.nbytes`) and the
        decode slots (KV and states of the sequences being decoded); on a GPU also all that torch's
        allocator holds there (`device_reserved`: those parts and everything else) and the most it has
        held since the process started (`device_peak_reserved`)."""
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in [*self.model.parameters(), *self.model.buffers()]}
        memory = {"weights": sum(storages.values()), "decode_slots": self.runner.nbytes}
        if self.offload is not None:  # the routed experts: slots on the device, all of them on the host
            memory.update(
                expert_cache=self.offload.nbytes,
                expert_staging=self.offload.staging_bytes,
                expert_stream=self.offload.stream.nbytes if self.offload.stream is not None else 0,
                experts_host=self.offload.host_bytes,
            )
        if self.device.type == "cuda":
            memory["device_reserved"] = torch.cuda.memory_reserved(self.device)
            memory["device_peak_reserved"] = torch.cuda.max_memory_reserved(self.device)
        return memory

    def held_bytes(self, states: Iterable[SequenceState]) -> int:
        """Bytes `states` hold on the engine's device beyond the decode slots (each storage once,
        KV buffers at their capacity): what sequences kept between requests cost."""
        slots, held = self.runner.storages(), {}
        for state in states:
            caches = list(state.kv.values())
            tensors = [*(c.k for c in caches), *(c.v for c in caches), *state.conv.values(), *state.rec.values()]
            for t in tensors:
                storage = t.untyped_storage()
                if storage.data_ptr() not in slots:
                    held[storage.data_ptr()] = storage.nbytes()
        return sum(held.values())

    def offload_stats(self) -> dict[str, int] | None:
        """The expert cache's counters (`OffloadStats.as_dict`), None without offload."""
        if self.offload is None:
            return None
        self.offload.flush()
        return self.offload.stats.as_dict()

    def link_bytes(self, counted: bool = True) -> int | None:
        """Bytes moved host -> device so far: restored checkpoints (on a GPU) and offloaded experts
        (copied or read in place; the host/device split simulated on a CPU too). None where neither
        moves any (a CPU without offload). Differences of it give a request's link traffic.
        `counted=False`: as the host has counted them, without waiting for the device counters of
        the reads in place (whose flush would also take a decode's refresh from its own settle)."""
        restored = self.runtime.restored_bytes if self.runtime is not None else None
        if self.offload is None:
            return restored
        if counted:
            self.offload.flush()
        return (restored or 0) + sum(self.offload.stats.bytes_in.values())

    # -- sequences and their checkpoints

    def new_state(self) -> SequenceState:
        return self._held(self.copies.new_state())

    def kv_delta(self, state: SequenceState, start: int, end: int) -> Snapshot:
        """A KV-only snapshot of positions [start, end) of `state` (no DeltaNet state)."""
        return self.copies.kv_delta(state, start, end)

    def snapshot(self, state: SequenceState, start: int) -> Snapshot:
        """KV of [start, state.length) and the current DeltaNet states."""
        return self.copies.snapshot(state, start)

    def restore(self, snapshot: Snapshot | Sequence[Snapshot]) -> SequenceState:
        """A state at the chain's end from a chain snapshot starting at 0 (see concat_chain), or
        from the chain itself (a list of consecutive snapshots: each KV delta is copied into place,
        never concatenated on the host). On a GPU the copies overlap the next prefill."""
        return self._held(self.copies.restore([snapshot] if isinstance(snapshot, Snapshot) else list(snapshot)))

    def _held(self, state: SequenceState) -> SequenceState:
        self.states[id(state)] = state  # growth ahead reads the lengths of those still alive
        return state

    def rewind(self, state: SequenceState, record: Snapshot) -> SequenceState:
        """`state` put back at `record.end`, where its tokens so far ran through the chain that
        `record` ends (its KV caches cut there; its DeltaNet states `record`'s, copied in as a
        restore copies them): what restoring that chain gives, for the states' bytes alone."""
        return self.copies.rewind(state, record)

    # -- prefill and decode

    def prefill(
        self,
        state: SequenceState,
        token_ids: Sequence[int],
        capture_at: Sequence[int] = (),
        state_at: set[int] | None = None,
        kv_start: int | None = None,
        all_logits: bool = False,
    ) -> PrefillResult:
        """`Feed`'s contract, run to completion alone; the snapshots are complete on return."""
        feed = Feed(state, token_ids, capture_at, state_at, kv_start, all_logits)
        while feed.result is None:
            self.run(self.scheduler.schedule([feed]))
        feed.result.ready()
        return feed.result

    def decode(self, state: SequenceState, token: int) -> torch.Tensor:
        """One decode step: `token` into `state`; the logits [V] after it."""
        feed = Feed(state, [token])
        self.run(self.scheduler.schedule([feed]))
        assert feed.result is not None
        return feed.result.logits

    @torch.no_grad()
    def feed(self, state: SequenceState, token_ids: Sequence[int]) -> torch.Tensor:
        """Teacher-force `token_ids` one decode step at a time; returns the logits after each [T, V]."""
        return torch.stack([self.decode(state, token) for token in token_ids])

    @torch.no_grad()
    def generate(
        self, state: SequenceState, logits: torch.Tensor, params: SamplingParams, forced: Sequence[int] | None = None
    ) -> Iterator[TokenEvent]:
        """Decode from the logits of the last prefilled position. With `forced`, those tokens are
        emitted (teacher forcing) while every step is computed exactly as in sampling. Every
        yielded token but the last is fed into `state` before the next one is chosen."""
        decoding = Decoding(params, self.device, forced)
        while True:
            event = decoding.next(logits)
            yield event
            if event.finish_reason is not None:
                return
            logits = self.decode(state, event.token_id)

    # -- the step

    def step(self, parts: Sequence[tuple[Feed, int]]) -> StepPlan:
        """One step over the next `count` tokens of each feed (one part per sequence), laid out by
        the scheduler (`Scheduler.plan`) and run; returns the plan."""
        plan = self.scheduler.plan(parts)
        self.run(plan)
        return plan

    @torch.no_grad()
    def run(self, plan: StepPlan) -> None:
        """Run a step's plan: the decode tokens as one runner step, the short prefills on their
        slots, the other chunks (and the decode tokens riding with them: `Mixed`, the weights read
        once) in one forward over their own states. A feed whose last token ran gets its `result`;
        its snapshots' host copies may still be running on a GPU until `result.ready()` returns."""
        if plan.decode:
            with self._phase("decode", len(plan.decode)):
                logits = self.runner.decode([f.state for f in plan.decode], [f.token_ids[0] for f in plan.decode])
            _decoded(plan.decode, logits)
        for feed, count in plan.slotted:
            self._slot_prefill(feed, count)
        if plan.forward:
            self._forward_step(plan.forward, plan.riding)

    def _forward_step(self, parts: Sequence[tuple[Feed, int]], decodes: Sequence[Feed]) -> None:
        """The prefill chunks `parts`, with `decodes`' tokens in the first rows, in one forward."""
        spans = [feed.span(count) for feed, count in parts]
        threshold = self.engine_config.step_log_ms
        timer = StepTimer(self, threshold) if threshold is not None else None
        self.kv_growth += sum(any(c.growth(count) for c in feed.state.kv.values()) for feed, count in parts)
        self._fit_budget(parts, spans)
        if timer is not None:
            timer.mark("fit")
        ids = torch.as_tensor([t for feed, count in parts for t in feed.next_ids(count)], dtype=torch.long,
                              device=self.device)
        batch: Spans | Mixed = Spans(spans)
        if decodes:
            decode_ids, rows = self.runner.slot_batch([f.state for f in decodes], [f.token_ids[0] for f in decodes])
            ids, batch = torch.cat([decode_ids, ids]), Mixed(rows, batch)
        hidden, captures = self._prefill_forward(ids, batch)  # [T, H]
        if timer is not None:
            timer.mark("queue")
            timer.done(len(ids), len(parts), sum(len(span.capture_at) for span in spans))
        self.runner.commit([f.state for f in decodes])
        self._postprocess(parts, spans, captures, hidden, decodes)

    def _postprocess(self, parts: Sequence[tuple[Feed, int]], spans: Sequence[Span], captures: list[list[dict]],
                     hidden: torch.Tensor, decodes: Sequence[Feed]) -> None:
        """After a forward: each feed keeps its captured states and the hidden rows it needs; the
        decode rows and every finished feed get their logits."""
        lo, finished = len(decodes), []
        for (feed, count), span, caps in zip(parts, spans, captures, strict=True):
            base = feed.start + feed.done
            # copied out as made (`keep`)
            feed.captured.update(dict(zip((base + off for off in span.capture_at), caps, strict=True)))
            if feed.all_logits:
                feed.hidden.append(hidden[lo : lo + count])
            else:  # only the last position's logits are wanted
                feed.hidden = [hidden[lo + count - 1 : lo + count]]
            feed.done, lo = feed.done + count, lo + count
            if feed.remaining == 0:
                finished.append(feed)
        last = [f for f in finished if not f.all_logits]
        if decodes or last:  # one lm_head GEMM for the decode rows and every feed that needs only its last position
            logits = self.model.logits(torch.cat([hidden[: len(decodes)], *(f.hidden[-1] for f in last)]))  # [n, V]
            _decoded(decodes, logits[: len(decodes)])
            for feed, row in zip(last, logits[len(decodes) :], strict=True):
                self._finish(feed, row)
        for feed in finished:
            if feed.all_logits:
                self._finish(feed, self.model.logits(torch.cat(feed.hidden)))

    def _prefill_forward(self, ids: torch.Tensor, batch: Spans | Mixed) -> tuple[torch.Tensor, list[list[dict]]]:
        """The model's forward over the batch. Under a memory budget, a forward that runs out of
        device memory is undone (every sequence back where it was: `SequenceState.rewinder`) and
        run once more with an eighth fewer expert slots; a second failure is raised."""
        def forward() -> tuple[torch.Tensor, list[list[dict]]]:
            with self._phase("prefill", len(ids)):
                return self.model(ids, batch, self.kernels, keep=self.copies.to_host_many)

        rewinds = [span.state.rewinder() for span in batch.spans] if self.offload is not None else []
        try:
            return forward()
        except torch.OutOfMemoryError:
            if self.offload is None:
                raise
        # out of the handler: the failed forward's tensors went with its exception
        log.warning("a prefill forward of %d tokens ran out of device memory: run again with fewer expert slots", len(ids))
        for rewind in rewinds:
            rewind()
        self.offload.give_up_slots("a prefill forward that ran out of device memory")
        return forward()

    def _slot_prefill(self, feed: Feed, count: int) -> None:
        """The feed's last `count` tokens on its slot: one graph replay per piece of at most the
        largest bucket, cut where DeltaNet states are captured (a KV-only capture is read from the
        slot afterwards)."""
        base, end = feed.start + feed.done, feed.start + feed.done + count
        cuts = {p for p in feed.capture_at if p > base and (feed.state_at is None or p in feed.state_at)}
        with self._phase("prefill", count):
            while feed.start + feed.done < end:
                at = feed.start + feed.done
                stop = min([p for p in cuts if p > at] + [at + PREFILL_BUCKETS[-1], end])
                logits = self.runner.prefill(feed.state, feed.token_ids[feed.done : stop - feed.start])
                feed.done = stop - feed.start
                if stop in cuts:
                    feed.captured[stop] = self.copies.to_host(self.copies.states(feed.state))
        self._finish(feed, logits)

    def _finish(self, feed: Feed, logits: torch.Tensor) -> None:
        kv_start = feed.start if feed.kv_start is None else feed.kv_start
        snapshots = self.copies.snapshots(feed.state, feed.capture_at, feed.captured, kv_start, feed.state_at)
        feed.hidden = []
        feed.result = PrefillResult(logits, snapshots)
        if self.runtime is not None and snapshots:
            feed.result.ready = self.runtime.fence().synchronize

    # -- growth ahead of need

    @property
    def growth_events(self) -> dict[str, int]:
        """Buffers grown and graphs captured so far, by kind: the decode slots reallocated
        (`slot_growth`), a sequence's own KV buffer regrown (`kv_growth`: by a prefill forward that
        outgrew it, or ahead of one), CUDA graphs captured (`graph_capture`), and on a GPU the
        pinned slabs captures are cut from (`slab_growth`) and the allocator's retries
        (`allocator_retry`: each frees its cached blocks, synchronising the device). Warm-up makes
        the first of them; a request's own steps should add none after it (`grow_ahead`)."""
        events = {**self.runner.events, "kv_growth": self.kv_growth, "slab_growth": 0, "allocator_retry": 0}
        if self.runtime is not None:
            events["slab_growth"] = self.runtime.capture_slabs
            events["allocator_retry"] = torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0)
        return events

    def grow_ahead(self) -> bool:
        """One bounded piece of growth ahead of need, for the sequences still held (kept live
        between requests: the next request may extend any of them), run by the worker while no
        step is due: the decode slots' capacity for the longest plus the runner's `headroom`, or
        one graph a growth dropped, or (without offload, whose budget counts a forward's KV growth)
        the KV buffer of one sequence outside the slots, with as much headroom (at least doubled,
        as a forward grows it: a precompute between its steps regrows it rarely). False when
        there was nothing to do."""
        states = list(self.states.values())
        if self.runner.grow_ahead([s.length for s in states]):
            return True
        if self.offload is not None:
            return False
        for state in states:
            room = min(state.length + self.runner.headroom, self.max_context)
            caches = list(state.kv.values())
            if self.runner.bound(state) or all(cache.k.shape[0] >= room for cache in caches):
                continue
            state.wait_all()  # a restore's copies into the buffer land first
            for cache in caches:
                cache.reserve(min(max(room, 2 * cache.k.shape[0]), self.max_context))
            self.kv_growth += 1
            return True
        return False

    # -- the expert offload's budget

    def _phase(self, name: str, tokens: int) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if self.offload is None else self.offload.phase(name, tokens)

    def _make_room(self, slots: int, capacity: int) -> None:
        assert self.offload is not None
        self.offload.make_room(expert_offload.state_bytes(self.config, self.dtype, slots, capacity))

    def _after_offload_change(self) -> None:
        """After the expert slots shrank (new slot tensors) or decode changed how it reads host
        memory: the graphs are captured again where steps read experts in place, else no graph may
        hold a step (experts are fetched)."""
        assert self.offload is not None
        self.scheduler.slot_prefill = False
        self.runner.graph_rows = self.offload.graph_rows
        if self.offload.mapped:
            self.runner.drop_graphs()
        else:
            self.runner.use_graph = False

    def _fit_budget(self, parts: Sequence[tuple[Feed, int]], spans: Sequence[Span]) -> None:
        """Under a memory budget on a GPU: room for a prefill forward (its chunk's share of the
        workspace measured at warm-up, `Plan.workspace_for`), the KV its sequences grow by, the
        states it captures and the logits of every position where a feed asks for them, taken
        from the expert slots if need be; where they cannot give it, from the sequences kept
        between requests (`relieve`), one at a time."""
        if self.offload is None or self.device.type != "cuda":
            return
        growth = sum(cache.growth(count) for feed, count in parts for cache in feed.state.kv.values())
        # a layer's DeltaNet states at each capture point, on the device until copied to the host
        # (`keep`): ~2 MB a point at the 35B shape; the calibration's chunk captured none
        layers = expert_offload.recurrent_bytes(self.config, self.dtype, layers=2)  # two in flight
        captures = layers * sum(len(span.capture_at) for span in spans)
        # a feed that wants every position's logits gets them with its last chunk: [T, V] in the model's dtype, then fp32
        logits = sum(
            (feed.done + count) * self.config.vocab_size * (self.dtype.itemsize + 4)
            for feed, count in parts
            if feed.all_logits and count == feed.remaining
        )
        workspace = self.offload.plan.workspace_for(sum(count for _, count in parts))
        while True:
            try:
                return self.offload.fit_forward(workspace + growth + captures + logits)
            except expert_offload.BudgetError:
                if not self.relieve():
                    raise


def _decoded(feeds: Sequence[Feed], logits: torch.Tensor) -> None:
    for feed, row in zip(feeds, logits, strict=True):
        feed.done, feed.result = 1, PrefillResult(row, [])


def configured(config: EngineConfig | None, choices: dict[str, Any]) -> EngineConfig:
    """`config` (default `EngineConfig()`) with the fields in `choices` replaced."""
    return dataclasses.replace(config or EngineConfig(), **choices)


def ensure_preset(name: str) -> Path:
    """The preset's folder under FT_HOME, written on first use (safe against concurrent writers)."""
    folder = presets.default_model_dir(name)
    if not (folder / "config.json").is_file():
        presets.write_preset(name, folder)
    return folder


def materialised_shard(
    name: str, device: str, dtype: torch.dtype | None, parallel: ExpertParallel, split_heads: bool = False
) -> tuple[HybridForCausalLM, str]:
    """Preset `name` generated in memory with this rank's experts alone (each layer's stacks
    made whole one at a time, then cut), with `split_heads` its share of the heads, and the whole
    model's fingerprint."""
    is_stack = EXPERT_STACK.match
    model_config, _, state_dict = presets.materialise(name, device, dtype, only=lambda n: not is_stack(n))
    shard = parallel.shard(model_config.num_experts)
    with torch.device("meta"):
        stacks = [n for n in HybridForCausalLM(model_config).state_dict() if is_stack(n)]
    for stack in stacks:
        whole = presets.materialise(name, device, dtype, only=lambda n, stack=stack: n == stack)[2][stack]
        state_dict[stack] = shard.take(whole)
        del whole
    heads = HeadShard.of(parallel, model_config) if split_heads else None
    model = build_model(model_config, state_dict, shard, heads)
    return model, shard.agree(fingerprint(model_config, state_dict, shard))


def host_transfers(config: ModelConfig, device: torch.device, dtype: torch.dtype):
    """On CUDA, state copies to and from pinned host memory on a side stream; None elsewhere (the
    copies are plain tensor copies). Imported here: the CUDA module loads the GPU kernels."""
    if device.type != "cuda":
        return None
    from engine.host_transfers import HostTransfers  # noqa: PLC0415

    return HostTransfers(config, device, dtype)
