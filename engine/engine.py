"""The engine: load a model, prefill with captures, restore, snapshot, decode."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from engine import offload as expert_offload
from engine import presets
from engine.batch import Mixed, Span, Spans
from engine.config import ModelConfig
from engine.feed import Feed, PrefillResult
from engine.loader import build_model, fingerprint, load_folder, place
from engine.model import HybridForCausalLM
from engine.ops import Kernels, kernels_for
from engine.runner import GRAPH_CAPACITY, PREFILL_BUCKETS, Runner, bucket, starting_capacity
from engine.sampling import Decoding, SamplingParams, TokenEvent
from engine.snapshot import Snapshot
from engine.state import KVCache, SequenceState

log = logging.getLogger(__name__)
PREFILL_CHUNK: int | None = int(os.environ["FT_PREFILL_CHUNK"]) if os.environ.get("FT_PREFILL_CHUNK") else None
# A sequence prefilled alone runs on its slot in pieces of the largest bucket up to this many tokens:
# a 512-token replay takes 29 ms on the H200 at the 35B shape, the eager forward ~100 ms of launches
# plus ~25 us a token, so pieces win up to ~3K tokens (with several sequences, one eager forward
# over all their chunks wins sooner: there only a single bucket runs on the slot).
SLOT_PREFILL_ALONE = 2048
MIXED_STEPS = os.environ.get("FT_MIXED_STEPS", "1") != "0"
PINNED_CAPTURES = 3  # captured states a sequence of a step, whose pinned host memory warm-up pins ahead (the first
# step of four SWE-agent sessions at once captured 7 states in two prompts)
DEFAULT_CHUNK = {"cuda": 8192, "cpu": 4096}  # tokens per forward: bigger GEMMs on a GPU (bench/RESULTS.md)


class Engine:
    """One model on one device. Not thread-safe: the scheduler runs one call at a time."""

    def __init__(self, model: HybridForCausalLM, fingerprint: str, model_dir: Path | None = None,
                 offload: expert_offload.ExpertOffload | None = None):
        """`offload`: the routed experts' host copies and device slots (`offload.install`). Decode
        steps stay CUDA graphs where the device reads the host copies in place (`offload.mapped`)
        or every expert has a slot; otherwise a step fetches experts between layers and runs
        eagerly. Short prefills then never run as slot graphs (their chunks fetch), and the decode
        slots make room for their growth in the expert cache."""
        if os.environ.get("FT_FOLD_SHARED", "1") != "0":  # off: the shared expert apart (a same-lease baseline)
            model.fold_shared_experts()  # before any forward or graph (a no-op for offloaded experts)
        self.model = model
        self.offload = offload
        self.config: ModelConfig = model.config
        self.fingerprint = fingerprint
        self.model_dir = model_dir
        self.device = model.lm_head.weight.device
        self.dtype = model.lm_head.weight.dtype
        self.kernels: Kernels = kernels_for(self.device)
        make_runtime = getattr(self.kernels, "runtime", None)  # device extras: host copies
        self.runtime = make_runtime(self.config, self.device, self.dtype) if make_runtime is not None else None
        # where a checkpoint store keeps what this engine restores: pageable host memory (None), or
        # with FT_PINNED_STORE=1 memory registered with the device, whose restores are 2.7x faster
        # (four sessions at once on the H200, session 20: median 12 against 33 ms) but which lost end
        # to end in the same lease (K=1 median TTFT 56 against 38 ms, K=4's output rate 247 against 275
        # tok/s): registering each record on the store's thread holds up the engine's CUDA calls, ~18
        # ms a request. What would make it pay: a pool registered once, at start.
        pinned = self.runtime is not None and os.environ.get("FT_PINNED_STORE", "0") == "1"
        self.host_memory = self.runtime.host_memory if pinned else None
        graphs = self.device.type == "cuda" and os.environ.get("FT_CUDA_GRAPHS", "1") != "0"
        self.runner = Runner(
            model, self.kernels,
            use_graph=graphs and (offload is None or offload.holds_all or offload.mapped),
            before_overwrite=self.runtime.wait_copies if self.runtime is not None else None,
            before_allocate=self._make_room if offload is not None else None,
            capacity=GRAPH_CAPACITY if graphs and offload is None else None,
            graph_rows=offload.graph_rows if offload is not None else None,
        )
        # short prefills on the sequence's slot (a graph per bucket)
        self.slot_prefill = self.runner.use_graph and (offload is None or offload.holds_all)
        if offload is not None:
            offload.on_change = self._after_offload_change
        # log every prefill forward slower than this many ms (INFO, this module's logger), its time
        # split into fitting the budget, queueing the forward and the device finishing it (a sync
        # after each forward while set: a diagnosis, not a serving mode)
        self.step_log_ms: float | None = None

    @classmethod
    def load(cls, model_dir: str | Path, device: str = "cpu", dtype: torch.dtype | None = None,
             gpu_memory_gib: float | None = None, max_running: int = 4, keep_quantized: bool | None = None) -> Engine:
        """With `gpu_memory_gib`, the routed experts stay in host memory and the device holds the
        dense parts, the decode slots of `max_running` sequences and an expert cache within that
        budget (`engine.offload`); a budget that cannot is a `BudgetError`. `keep_quantized`: a
        quantized model's weights stay packed and run through the Triton kernels (default: on a
        GPU, offloaded experts included, or FT_KEEP_QUANTIZED=1; on the CPU they run in Triton's
        interpreter)."""
        target = torch.device(device)
        if keep_quantized is None and os.environ.get("FT_KEEP_QUANTIZED"):
            keep_quantized = os.environ["FT_KEEP_QUANTIZED"] == "1"
        if gpu_memory_gib is None:
            model, fp = load_folder(model_dir, target, dtype, keep_quantized)
            return cls(model, fp, Path(model_dir))
        from engine.gguf_loader import is_gguf  # noqa: PLC0415 (it imports the loader)

        if dtype is None and target.type != "cpu" and is_gguf(model_dir):
            dtype = torch.bfloat16  # what a GGUF dequantizes to on a GPU (load_gguf's default there)
        if keep_quantized is None:  # the experts then live and move in their quantized form
            keep_quantized = target.type == "cuda"
        model, fp = load_folder(model_dir, torch.device("cpu"), dtype, keep_quantized)
        return cls.offloaded(model, fp, target, gpu_memory_gib, max_running, Path(model_dir))

    @classmethod
    def offloaded(cls, model: HybridForCausalLM, fp: str, device: torch.device, gpu_memory_gib: float,
                  max_running: int, model_dir: Path | None = None) -> Engine:
        """An engine for `model` (on the host) with its routed experts offloaded within the budget."""
        dtype = model.lm_head.weight.dtype
        plan = expert_offload.plan(
            model.config, expert_offload.dense_bytes(model), int(gpu_memory_gib * expert_offload.GiB), dtype,
            sequences=bucket(max_running), capacity=starting_capacity(device), tokens=chunk_tokens(device),
            expert_bytes=expert_offload.expert_bytes(model))
        offload = expert_offload.install(model, device, plan)
        if device.type == "cuda":
            offload.calibrate()
        return cls(place(model, device), fp, model_dir, offload)

    @classmethod
    def from_preset(cls, name: str, device: str = "cpu", dtype: torch.dtype | None = None,
                    gpu_memory_gib: float | None = None, max_running: int = 4,
                    keep_quantized: bool | None = None) -> Engine:
        """Load preset `name`, writing it under FT_HOME first if needed; on a GPU the weights may be
        built in device memory instead (`FT_MATERIALISE=1`, used for the 35B shape; in host memory
        with `gpu_memory_gib`)."""
        if os.environ.get("FT_MATERIALISE") == "1":
            build_on = device if gpu_memory_gib is None else "cpu"
            config, _, state_dict = presets.materialise(name, build_on, dtype)
            model, fp = build_model(config, state_dict), fingerprint(config, state_dict)
            del state_dict  # the model holds the tensors: an offload frees each layer's stacks once pinned
            if gpu_memory_gib is not None:
                return cls.offloaded(model, fp, torch.device(device), gpu_memory_gib, max_running)
            return cls(model, fp)
        return cls.load(ensure_preset(name), device, dtype, gpu_memory_gib, max_running, keep_quantized)

    def memory(self) -> dict[str, int]:
        """Resident bytes on the engine's device: the weights (each storage once: fused projections
        are views; weights kept quantized count their packed arrays, `QuantWeight.nbytes`) and the
        decode slots (KV and states of the sequences being decoded); on a GPU also all that torch's
        allocator holds there (`device_reserved`: those parts and everything else)."""
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
        return memory

    def held_bytes(self, states: Iterable[SequenceState]) -> int:
        """Bytes `states` hold on the engine's device beyond the decode slots (each storage once,
        KV buffers at their capacity): what sequences kept between requests cost."""
        slots, held = self.runner.storages(), {}
        for state in states:
            tensors = [*(c.k for c in state.kv.values()), *(c.v for c in state.kv.values()), *state.conv.values(),
                       *state.rec.values()]  # fmt: skip
            for t in tensors:
                storage = t.untyped_storage()
                if storage.data_ptr() not in slots:
                    held[storage.data_ptr()] = storage.nbytes()
        return sum(held.values())

    def _make_room(self, slots: int, capacity: int) -> None:
        assert self.offload is not None
        self.offload.make_room(expert_offload.state_bytes(self.config, self.dtype, slots, capacity))

    def _after_offload_change(self) -> None:
        """After the expert slots shrank (new slot tensors) or decode changed how it reads host
        memory: the graphs are captured again where steps read experts in place, else no graph may
        hold a step (experts are fetched)."""
        assert self.offload is not None
        self.slot_prefill = False
        self.runner.graph_rows = self.offload.graph_rows
        if self.offload.mapped:
            self.runner.drop_graphs()
        else:
            self.runner.use_graph = False

    def _fit_budget(self, parts: Sequence[tuple[Feed, int]], spans: Sequence[Span]) -> None:
        """Under a memory budget on a GPU: room for a prefill forward (its chunk's share of the
        workspace measured at warm-up, `Plan.workspace_for`), the KV its sequences grow by, the
        states it captures and the logits of every position where a feed asks for them, taken
        from the expert slots if need be."""
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
        self.offload.fit_forward(workspace + growth + captures + logits)

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

    def _phase(self, name: str, tokens: int) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if self.offload is None else self.offload.phase(name, tokens)

    @property
    def max_context(self) -> int:
        return self.config.max_position_embeddings

    def new_state(self) -> SequenceState:
        c = self.config
        kv = {i: KVCache(c.num_key_value_heads, c.head_dim, self.dtype, self.device) for i in c.attention_layers}
        return SequenceState(kv=kv)

    @property
    def step_tokens(self) -> int:
        return chunk_tokens(self.device)

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
            self.step([(feed, min(feed.remaining, self.step_tokens))])
        feed.result.ready()
        return feed.result

    @torch.no_grad()
    def step(self, parts: Sequence[tuple[Feed, int]]) -> None:
        """One step over the next `count` tokens of each feed (one part per sequence): short
        prefills as captured slot prefills; the rest in one forward over their own states, which
        takes the decode tokens (one token, nothing captured) too, on their slots (`Mixed`: the
        weights are read once); without such a prefill (or under a memory budget: `mixes`) the
        decode tokens are one runner step. A feed whose last token ran gets its `result`; its
        snapshots' host copies may still be running on a GPU until `result.ready()` returns."""
        decodes = [feed for feed, _ in parts if not feed.is_prefill]
        parts = [(feed, count) for feed, count in parts if feed.is_prefill]
        limit = SLOT_PREFILL_ALONE if len(parts) == 1 else PREFILL_BUCKETS[-1]
        slotted = [(feed, count) for feed, count in parts if self._fits_slot(feed, count, limit)]
        parts = [(feed, count) for feed, count in parts if not self._fits_slot(feed, count, limit)]
        if decodes and not (parts and self.mixes):
            with self._phase("decode", len(decodes)):
                logits = self.runner.decode([f.state for f in decodes], [f.token_ids[0] for f in decodes])
            self._decoded(decodes, logits)
            decodes = []
        for feed, count in slotted:
            self._slot_prefill(feed, count)
        if not parts:
            return
        spans = [feed.span(count) for feed, count in parts]
        timer = _StepTimer(self) if self.step_log_ms is not None else None
        self._fit_budget(parts, spans)
        if timer is not None:
            timer.mark("fit")
        ids = torch.as_tensor([t for feed, count in parts for t in feed.next_ids(count)], dtype=torch.long, device=self.device)
        batch: Spans | Mixed = Spans(spans)
        if decodes:
            decode_ids, rows = self.runner.slot_batch([f.state for f in decodes], [f.token_ids[0] for f in decodes])
            ids, batch = torch.cat([decode_ids, ids]), Mixed(rows, batch)
        hidden, captures = self._prefill_forward(ids, batch)  # [T, H]
        if timer is not None:
            timer.mark("queue")
            timer.done(len(ids), len(parts), sum(len(span.capture_at) for span in spans))
        self.runner.commit([f.state for f in decodes])
        lo, finished = len(decodes), []
        for (feed, count), span, caps in zip(parts, spans, captures, strict=True):
            base = feed.start + feed.done
            feed.captured.update(dict(zip((base + off for off in span.capture_at), caps, strict=True)))  # copied out as made (`keep`)
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
            self._decoded(decodes, logits[: len(decodes)])
            for feed, row in zip(last, logits[len(decodes) :], strict=True):
                self._finish(feed, row)
        for feed in finished:
            if feed.all_logits:
                self._finish(feed, self.model.logits(torch.cat(feed.hidden)))

    @staticmethod
    def _decoded(feeds: Sequence[Feed], logits: torch.Tensor) -> None:
        for feed, row in zip(feeds, logits, strict=True):
            feed.done, feed.result = 1, PrefillResult(row, [])

    @property
    def mixes(self) -> bool:
        """Whether decode tokens run in a prefill's forward (`step`): not under a memory budget,
        where a forward that ran out of device memory is undone and run again, and the decode
        rows' slot states, updated in place, could not be undone. FT_MIXED_STEPS=0: never (a
        same-run baseline)."""
        return self.offload is None and MIXED_STEPS

    def _prefill_forward(self, ids: torch.Tensor, batch: Spans | Mixed) -> tuple[torch.Tensor, list[list[dict]]]:
        """The model's forward over the batch. Under a memory budget, a forward that runs out of
        device memory is undone (every sequence back where it was: `SequenceState.rewinder`) and
        run once more with an eighth fewer expert slots; a second failure is raised."""
        def forward() -> tuple[torch.Tensor, list[list[dict]]]:
            with self._phase("prefill", len(ids)):
                return self.model(ids, batch, self.kernels, keep=self._to_host_many)

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

    def _fits_slot(self, feed: Feed, count: int, limit: int) -> bool:
        """Whether the feed's last `count` tokens can run as captured slot prefills: at most `limit`
        and only the last position's logits wanted."""
        return self.slot_prefill and count == feed.remaining and count <= limit and not feed.all_logits

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
                    feed.captured[stop] = self._to_host(self._states(feed.state))
        self._finish(feed, logits)

    def _states(self, state: SequenceState) -> dict[str, torch.Tensor]:
        """Copies of the DeltaNet states of `state` (a slot's are overwritten by its next step): every
        layer's conv states in one buffer, its recurrent states in another (two launches, and their
        copy to host memory goes in a few runs, not one copy a tensor)."""
        layers = self.config.deltanet_layers
        conv = torch.stack([state.conv[layer] for layer in layers])
        rec = torch.stack([state.rec[layer] for layer in layers])
        return {**{f"conv.{layer}": conv[i] for i, layer in enumerate(layers)},
                **{f"rec.{layer}": rec[i] for i, layer in enumerate(layers)}}  # fmt: skip

    def _finish(self, feed: Feed, logits: torch.Tensor) -> None:
        kv_start = feed.start if feed.kv_start is None else feed.kv_start
        snapshots = self._snapshots(feed.state, feed.capture_at, feed.captured, kv_start, feed.state_at)
        feed.hidden = []
        feed.result = PrefillResult(logits, snapshots)
        if self.runtime is not None and snapshots:
            feed.result.ready = self.runtime.fence().synchronize

    def _to_host(self, tensors: dict[str, Any]) -> dict[str, torch.Tensor]:
        return self._to_host_many([tensors])[0]

    def _to_host_many(self, groups: list[dict[str, Any]]) -> list[dict[str, torch.Tensor]]:
        """On a GPU, snapshot tensors go to pinned host memory on a side stream (each group behind
        one wait: a layer's captures of every sequence)."""
        return groups if self.runtime is None else self.runtime.to_host_many(groups)

    def _snapshots(self, state, positions, captured, kv_start, state_at) -> list[Snapshot]:
        """A snapshot at each of `positions`: the KV since the one before (one copy to host memory for
        all of them: a layer's ranges lie side by side in its cache) and, where `state_at` wants it,
        the DeltaNet states captured there."""
        bounds = list(zip([kv_start, *positions], positions, strict=False))
        kv = self._to_host_many([self._kv_views(state, start, end) for start, end in bounds])
        snapshots = []
        for (start, end), tensors in zip(bounds, kv, strict=True):
            if state_at is None or end in state_at:
                tensors.update(captured[end])
            snapshots.append(Snapshot(start, end, tensors))
        return snapshots

    def _kv_views(self, state: SequenceState, start: int, end: int) -> dict[str, torch.Tensor]:
        tensors = {}
        for layer, cache in state.kv.items():
            k, v = cache.slice(start, end)  # a private cache is append-only: its views stay valid
            if self.runtime is None and self.runner.holds(cache.k):  # a decode slot is reused: copy now
                k, v = k.clone(), v.clone()  # (a GPU copies to the host before the slot is reused)
            tensors[f"kv.{layer}.k"], tensors[f"kv.{layer}.v"] = k, v
        return tensors

    def kv_delta(self, state: SequenceState, start: int, end: int) -> Snapshot:
        """A KV-only snapshot of positions [start, end) of `state` (no DeltaNet state)."""
        if not 0 <= start <= end <= state.length:
            raise ValueError(f"KV range [{start}, {end}) outside the state's {state.length} tokens")
        return Snapshot(start, end, self._to_host(self._kv_views(state, start, end)))

    def snapshot(self, state: SequenceState, start: int) -> Snapshot:
        """KV of [start, state.length) and the current DeltaNet states."""
        state.wait_all()
        tensors = self._to_host({**self._kv_views(state, start, state.length), **self._states(state)})
        if self.runtime is not None:
            self.runtime.sync()
        return Snapshot(start, state.length, tensors)

    def restore(self, snapshot: Snapshot | Sequence[Snapshot]) -> SequenceState:
        """A state at the chain's end from a chain snapshot starting at 0 (see concat_chain), or
        from the chain itself (a list of consecutive snapshots: each KV delta is copied into place,
        never concatenated on the host). On a GPU the copies overlap the next prefill."""
        chain = [snapshot] if isinstance(snapshot, Snapshot) else list(snapshot)
        if not chain or chain[0].start != 0 or not chain[-1].has_state:
            raise ValueError("restore needs a chain from position 0 that ends with a state")
        if any(a.end != b.start for a, b in zip(chain, chain[1:], strict=False)):
            raise ValueError("chain has a hole")
        if self.runtime is not None:
            return self.runtime.restore(self.new_state(), chain)
        state = self.new_state()
        for layer, cache in state.kv.items():
            cache.reserve(chain[-1].end)
            for part in chain:  # each delta copied into place once (store views are read-only)
                cache.append(part.tensors[f"kv.{layer}.k"].to(self.dtype), part.tensors[f"kv.{layer}.v"].to(self.dtype))
        return self._load_states(state, chain[-1])

    def rewind(self, state: SequenceState, record: Snapshot) -> SequenceState:
        """`state` put back at `record.end`, where its tokens so far ran through the chain that
        `record` ends (its KV caches cut there; its DeltaNet states `record`'s, copied in as a
        restore copies them): what restoring that chain gives, for the states' bytes alone."""
        if not record.has_state or record.end > state.length:
            raise ValueError("rewind needs a record with a state at or before the sequence's end")
        if self.runtime is not None:
            return self.runtime.restore(state, [Snapshot(record.end, record.end, record.without_kv().tensors)])
        for cache in state.kv.values():
            cache.length = record.end
        return self._load_states(state, record)

    def _load_states(self, state: SequenceState, record: Snapshot) -> SequenceState:
        """On the CPU: `record`'s DeltaNet states copied into `state`, which ends where `record` does."""
        for layer in self.config.deltanet_layers:
            state.conv[layer] = record.tensors[f"conv.{layer}"].to(self.device, self.dtype, copy=True)
            state.rec[layer] = record.tensors[f"rec.{layer}"].to(self.device, torch.float32, copy=True)
        state.length = record.end
        return state

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

    def warmup(self, max_batch: int = 1) -> None:
        """Run every path once (kernel compilation and checks, the CUDA graphs of decode batches up
        to `max_batch`, capture and restore copies) so that the first request does not pay for it."""
        def graphs() -> None:
            self.runner.warmup(max_batch, prefill=self.slot_prefill)

        if self.device.type != "cuda":
            graphs()
        else:  # kernels tuned per shape: one full prefill chunk as well
            if self.runtime is not None:
                captures = PINNED_CAPTURES * max(max_batch, 2)  # 2: warm-up's own step of two sequences, below
                states = captures * expert_offload.recurrent_bytes(self.config, self.dtype)
                kv = expert_offload.kv_bytes(self.config, self.dtype, self.step_tokens)  # a step's, snapshotted too
                self.runtime.reserve_pinned(states + kv)
                self.runtime.prepare_attention(self.step_tokens)

            def chunk() -> None:
                self.prefill(self.new_state(), [1000 + i % 50_000 for i in range(self.step_tokens)])

            if self.offload is None:
                graphs()
                chunk()
            else:  # what both allocate is measured: the expert slots keep room for them within the budget
                offload = self.offload

                def calibrated() -> None:
                    chunk()
                    if offload.stream is not None:  # it filled the empty slots: the next runs them too
                        chunk()
                    graphs()

                offload.calibrate_workspace(calibrated)
                offload.calibrate_stream(lambda n: self.prefill(self.new_state(), [1000 + i for i in range(n)]))
            # A first request's eager prefill: unaligned lengths split at captures (the aligned runs
            # above leave other kernel specialisations to it; a cold 2,800-token first request took
            # 1.2-1.9 s on the H200 after them, its later peers 0.1 s).
            self.prefill(self.new_state(), [1000 + i for i in range(SLOT_PREFILL_ALONE + 733)], capture_at=[1_001])
            # several sequences in one forward (the varlen conv and scan), one of them split at a capture
            feeds = [Feed(self.new_state(), [1000 + i for i in range(PREFILL_BUCKETS[-1] + n)], capture_at=caps)
                     for n, caps in ((77, [300]), (301, []))]  # fmt: skip
            self.step([(feed, feed.remaining) for feed in feeds])
        state = self.new_state()
        result = self.prefill(state, list(range(1000, 1160)), capture_at=[64, 160])
        list(self.generate(state, result.logits, SamplingParams(), forced=[11, 12, 13, 14]))
        restored = self.restore(result.snapshots)
        self.prefill(restored, [15, 16, 17])
        if self.offload is not None:
            graphs()  # those dropped if the slots shrank since
            self.offload.reset_stats()

    @torch.no_grad()
    def feed(self, state: SequenceState, token_ids: Sequence[int]) -> torch.Tensor:
        """Teacher-force `token_ids` one decode step at a time; returns the logits after each [T, V]."""
        return torch.stack([self.decode(state, token) for token in token_ids])

    def decode(self, state: SequenceState, token: int) -> torch.Tensor:
        """One decode step: `token` into `state`; the logits [V] after it."""
        feed = Feed(state, [token])
        self.step([(feed, 1)])
        assert feed.result is not None
        return feed.result.logits


class _StepTimer:
    """`Engine.step_log_ms`: one prefill forward's host time by part, then (after a sync) the
    device's rest, logged when the whole passes the threshold."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.start = self.last = time.perf_counter()
        self.parts: dict[str, float] = {}
        self.slots = engine.offload.plan.slots if engine.offload is not None else None
        self.link = engine.link_bytes(counted=False) or 0
        self.stalls = self._stalls()

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.parts[name], self.last = (now - self.last) * 1e3, now

    def done(self, tokens: int, sequences: int, captures: int) -> None:
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize(self.engine.device)
        self.mark("device")
        total = (self.last - self.start) * 1e3
        assert self.engine.step_log_ms is not None
        if total < self.engine.step_log_ms:
            return
        parts = " ".join(f"{name} {ms:.1f}" for name, ms in self.parts.items())
        extra = f"; link {((self.engine.link_bytes(counted=False) or 0) - self.link) / 2**20:,.1f} MiB"
        if self.engine.offload is not None:
            extra += f", expert slots {self.slots} -> {self.engine.offload.plan.slots}"
        if self.engine.runtime is not None:
            (retries, slabs), (retries_after, slabs_after) = self.stalls, self._stalls()
            extra += f", allocator retries {retries_after - retries}, capture slabs {slabs} -> {slabs_after}"
        log.info("prefill forward of %d tokens (%d sequences, %d captures): %.1f ms (%s)%s",
                 tokens, sequences, captures, total, parts, extra)  # fmt: skip

    def _stalls(self) -> tuple[int, int]:
        """On a GPU, two host waits a forward can hide: the CUDA allocator's retries (each frees its
        cached blocks, synchronising the device) and the pinned slabs captures are cut from."""
        runtime = self.engine.runtime
        if runtime is None:
            return 0, 0
        return torch.cuda.memory_stats(self.engine.device).get("num_alloc_retries", 0), runtime.capture_slabs


def chunk_tokens(device: torch.device) -> int:
    """Tokens per forward: bigger GEMMs on a GPU (bench/RESULTS.md)."""
    return PREFILL_CHUNK or DEFAULT_CHUNK.get(device.type, 4096)


def ensure_preset(name: str) -> Path:
    """The preset's folder under FT_HOME, written on first use (safe against concurrent writers)."""
    folder = presets.default_model_dir(name)
    if not (folder / "config.json").is_file():
        presets.write_preset(name, folder)
    return folder
