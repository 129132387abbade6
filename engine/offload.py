"""Expert offload: the routed experts live in host memory, a few per layer on the device.

With a device memory budget (`ft serve --gpu-memory GiB`), everything but the routed experts (the
dense parts: embeddings, attention, Gated DeltaNet, shared experts, routers, norms, lm_head), the
decode slots of the running sequences and a forward's workspace are placed first (`plan`); the
rest becomes `slots` expert slots per MoE layer. Each layer's `ExpertCache` keeps all its experts
in host tensors (pinned on CUDA) and stacked slot buffers on the device ([slots, 2I, H] and
[slots, H, I]); before the experts run, `prepare` makes the chunk's experts resident and the ids
are remapped from experts to slots, so `Kernels.moe_experts` runs unchanged on the slot buffers.

Copies are synchronous for now: on CUDA they run on a side stream that the compute stream waits
on (`Copier`), so prefetching the next layer's experts while this layer computes (double
buffering) is a matter of calling `ExpertCache.load` one layer earlier.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import torch

from engine.config import ModelConfig

if TYPE_CHECKING:
    from engine.model import DecoderLayer, HybridForCausalLM

GiB = 1 << 30
EXPERT_PARAMS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


class BudgetError(ValueError):
    """The device memory budget cannot hold the dense parts, the decode slots and top_k experts per layer."""


def _size(n: int) -> str:
    return f"{n / GiB:.3f} GiB ({n:,} bytes)"


@dataclass(frozen=True)
class Plan:
    """How a device budget is spent (bytes): dense weights, decode slots, a forward's workspace,
    and `slots` experts of `expert_bytes` in each of `layers` MoE layers."""

    budget: int
    dense: int
    states: int
    workspace: int
    expert_bytes: int
    layers: int
    slots: int

    @property
    def expert_cache(self) -> int:
        return self.slots * self.expert_bytes * self.layers

    def budget_for(self, slots: int) -> int:
        """The smallest budget that leaves `slots` experts per layer with the same other parts."""
        return self.dense + self.states + self.workspace + slots * self.expert_bytes * self.layers


def state_bytes(c: ModelConfig, dtype: torch.dtype, sequences: int, capacity: int) -> int:
    """Bytes of the runner's slot buffers (engine/runner.py) for `sequences` slots (+ its scratch
    slot) of `capacity` tokens: KV per attention layer, conv and fp32 recurrent state per DeltaNet layer."""
    size = torch.empty(0, dtype=dtype).element_size()
    kv = 2 * capacity * c.num_key_value_heads * c.head_dim * size * len(c.attention_layers)
    conv = c.conv_dim * (c.linear_conv_kernel_dim - 1) * size
    rec = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
    return (sequences + 1) * (kv + (conv + rec) * len(c.deltanet_layers))


def workspace_bytes(c: ModelConfig, dtype: torch.dtype, tokens: int, rows: int) -> int:
    """An estimate of one forward's transient tensors for a chunk of `tokens`: the residual stream
    and norms, the widest fused projection, the experts' rows (top_k per token) and `rows` logits."""
    size = torch.empty(0, dtype=dtype).element_size()
    widest = max(
        c.conv_dim + 2 * c.linear_value_dim + 2 * c.linear_num_value_heads,
        (2 * c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim,
        c.num_experts + 2 * c.shared_expert_intermediate_size + 1,
    )
    experts = c.num_experts_per_tok * (2 * c.hidden_size + 3 * c.moe_intermediate_size)
    return tokens * size * (6 * c.hidden_size + 2 * widest + experts) + rows * c.vocab_size * 4


def dense_bytes(model: HybridForCausalLM) -> int:
    """Bytes of every parameter and buffer except the routed experts (each storage once: fused
    projections are views of one tensor)."""
    named = [*model.named_parameters(), *model.named_buffers()]
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for name, t in named
        if not name.endswith(EXPERT_PARAMS)
    }
    return sum(storages.values())


def plan(
    c: ModelConfig, dense: int, budget: int, dtype: torch.dtype, sequences: int, capacity: int, tokens: int
) -> Plan:
    """Split `budget` bytes: the dense parts, the decode slots of `sequences` sequences of
    `capacity` tokens, the workspace of a `tokens`-token chunk, and the rest as expert slots,
    evenly per MoE layer (at most every expert). Raises `BudgetError` naming the numbers when the
    rest is not top_k experts per layer."""
    layers = c.num_hidden_layers
    expert = (3 * c.moe_intermediate_size * c.hidden_size) * torch.empty(0, dtype=dtype).element_size()
    states = state_bytes(c, dtype, sequences, capacity)
    workspace = workspace_bytes(c, dtype, tokens, max(sequences, 1))
    if budget < dense:
        raise BudgetError(
            f"--gpu-memory {_size(budget)} is below the dense weights alone ({_size(dense)}: "
            "embeddings, attention, DeltaNet, shared experts, routers, norms, lm_head)"
        )
    rest = budget - dense - states - workspace
    slots = min(c.num_experts, max(rest, 0) // (expert * layers))
    if slots < c.num_experts_per_tok:
        need = dense + states + workspace + c.num_experts_per_tok * expert * layers
        raise BudgetError(
            f"--gpu-memory {_size(budget)} leaves room for {slots} experts per layer, fewer than top_k = "
            f"{c.num_experts_per_tok}: dense weights {_size(dense)} + decode slots {_size(states)} ({sequences} "
            f"sequences x {capacity} tokens) + workspace {_size(workspace)} + {c.num_experts_per_tok} x {layers} "
            f"experts of {expert:,} bytes need {_size(need)}"
        )
    return Plan(budget, dense, states, workspace, expert, layers, slots)


@dataclass
class OffloadStats:
    """Counters over every layer: experts found resident (hits) or copied in (misses), experts
    evicted, and bytes copied host -> device with the tokens and forwards of each phase."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_in: dict[str, int] = field(default_factory=lambda: {"prefill": 0, "decode": 0})
    tokens: dict[str, int] = field(default_factory=lambda: {"prefill": 0, "decode": 0})
    forwards: dict[str, int] = field(default_factory=lambda: {"prefill": 0, "decode": 0})
    phase: str = "prefill"

    def as_dict(self) -> dict[str, int]:
        out = {"hits": self.hits, "misses": self.misses, "evictions": self.evictions}
        for name in ("bytes_in", "tokens", "forwards"):
            out.update({f"{name}_{phase}": n for phase, n in getattr(self, name).items()})
        return out


class Copier:
    """Host -> device expert copies. On CUDA they run on a side stream after the compute stream's
    earlier work (which may still read an evicted slot), and the compute stream waits for them."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Each (device slot, host expert) pair; the compute stream may use the slots on return."""
        if self.stream is None:
            for dst, src in pairs:
                dst.copy_(src)
            return
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
        compute.wait_stream(self.stream)


class ExpertCache:
    """One MoE layer's routed experts: all of them in host memory, `slots` resident on the device.

    host gate_up [E, 2I, H], down [E, H, I] (pinned on CUDA); device gate_up [S, 2I, H], down [S, H, I].
    Eviction takes the least recently used slot, the least used expert among equals, and never
    one the chunk being prepared needs."""

    def __init__(
        self,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        slots: int,
        device: torch.device,
        stats: OffloadStats,
        copier: Copier,
    ):
        self.host_gate_up, self.host_down = gate_up, down
        self.gate_up = torch.zeros(
            (slots, *gate_up.shape[1:]), dtype=gate_up.dtype, device=device
        )  # [S, 2I, H]
        self.down = torch.zeros((slots, *down.shape[1:]), dtype=down.dtype, device=device)  # [S, H, I]
        self.stats, self.copier = stats, copier
        self.expert_bytes = gate_up[0].nbytes + down[0].nbytes
        self.expert_in = [-1] * slots  # the expert each slot holds
        self.slot_of = [-1] * gate_up.shape[0]  # the slot holding each expert
        self.slot_table = torch.full((gate_up.shape[0],), -1, dtype=torch.long, device=device)  # slot_of on the device
        self.last_used = [0] * slots
        self.uses = [0] * gate_up.shape[0]  # forwards that routed to each expert
        self.clock = 0

    @property
    def slots(self) -> int:
        return len(self.expert_in)

    def run(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, moe_experts: Callable
    ) -> torch.Tensor:
        """`moe_experts(x [T, H], weights [T, k], ids [T, k], gate_up, down)` on the slot buffers.
        A chunk that routes to more experts than there are slots runs in groups of experts, each
        group's token x expert assignments as rows of their own (k = 1), summed in fp32."""
        groups = self.prepare(ids)
        if len(groups) == 1:
            self.load(groups[0])
            return moe_experts(x, weights, self.remap(ids), self.gate_up, self.down)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for group in groups:
            self.load(group)
            rows, cols = torch.isin(ids, torch.as_tensor(group, device=ids.device)).nonzero(as_tuple=True)
            y = moe_experts(
                x[rows], weights[rows, cols, None], self.remap(ids[rows, cols, None]), self.gate_up, self.down
            )
            out.index_add_(0, rows, y.float())
        return out.to(x.dtype)

    def prepare(self, ids: torch.Tensor) -> list[list[int]]:
        """The experts `ids` [T, k] routes to, in groups of at most `slots`: those already resident
        first (a hit is never evicted before its use). Counts the hits; `load` each group in turn."""
        needed = cast(list[int], ids.unique().tolist())
        self.clock += 1
        for expert in needed:
            self.uses[expert] += 1
        resident = [e for e in needed if self.slot_of[e] >= 0]
        self.stats.hits += len(resident)
        ordered = resident + [e for e in needed if self.slot_of[e] < 0]
        return [ordered[i : i + self.slots] for i in range(0, len(ordered), self.slots)]

    def load(self, group: list[int]) -> None:
        """Make every expert of `group` (at most `slots`) resident, evicting only experts outside it."""
        keep, copies = set(group), []
        for expert in group:
            if self.slot_of[expert] < 0:
                slot = self._victim(keep)
                if (old := self.expert_in[slot]) >= 0:
                    self.slot_of[old] = -1
                    self.stats.evictions += 1
                self.expert_in[slot], self.slot_of[expert] = expert, slot
                copies += [
                    (self.gate_up[slot], self.host_gate_up[expert]),
                    (self.down[slot], self.host_down[expert]),
                ]
            self.last_used[self.slot_of[expert]] = self.clock
        if copies:
            self.slot_table = torch.as_tensor(self.slot_of, device=self.gate_up.device)  # changes only with copies
            self.copier.copy(copies)
            self.stats.misses += len(copies) // 2
            self.stats.bytes_in[self.stats.phase] += len(copies) // 2 * self.expert_bytes

    def remap(self, ids: torch.Tensor) -> torch.Tensor:
        """Expert ids -> slot ids (every expert in `ids` resident)."""
        return self.slot_table[ids]

    def _victim(self, keep: set[int]) -> int:
        """An empty slot, else the least recently used one (least used expert among equals) outside `keep`."""
        free = [s for s in range(self.slots) if self.expert_in[s] not in keep]
        return min(
            free, key=lambda s: (self.expert_in[s] >= 0, self.last_used[s], self.uses[self.expert_in[s]])
        )


class ExpertOffload:
    """Every MoE layer's `ExpertCache`, their shared counters and copy stream."""

    def __init__(self, caches: dict[int, ExpertCache], stats: OffloadStats, plan: Plan):
        self.caches, self.stats, self.plan = caches, stats, plan

    @property
    def nbytes(self) -> int:
        """Device bytes of the expert slots."""
        return sum(c.gate_up.nbytes + c.down.nbytes for c in self.caches.values())

    @property
    def host_bytes(self) -> int:
        return sum(c.host_gate_up.nbytes + c.host_down.nbytes for c in self.caches.values())

    @contextlib.contextmanager
    def phase(self, name: str, tokens: int) -> Iterator[None]:
        """Count the copies of one forward under `name` ("prefill" or "decode") of `tokens` tokens."""
        self.stats.phase = name
        self.stats.tokens[name] += tokens
        self.stats.forwards[name] += 1
        try:
            yield
        finally:
            self.stats.phase = "prefill"

    def reset_stats(self) -> None:
        """Zero the counters (the cache contents stay): after warm-up, so metrics count requests only."""
        fresh = OffloadStats()
        self.stats.__dict__.update(fresh.__dict__)


def install(model: HybridForCausalLM, device: torch.device, plan: Plan) -> ExpertOffload:
    """Move each MoE layer's routed experts out of `model` (still on the host) into host tensors,
    pinned when `device` is CUDA, and give the layer an `ExpertCache` of `plan.slots` slots on
    `device`. The model then holds only the dense parts, to be moved to `device` as usual."""
    stats, copier = OffloadStats(), Copier(device)
    caches = {}
    for layer in cast("list[DecoderLayer]", model.model.layers):
        moe = layer.mlp
        gate_up, down = moe.experts.gate_up_proj.detach(), moe.experts.down_proj.detach()
        if device.type == "cuda":
            gate_up, down = gate_up.pin_memory(), down.pin_memory()
        moe.offload = caches[layer.layer] = ExpertCache(gate_up, down, plan.slots, device, stats, copier)
        moe.experts = None
    return ExpertOffload(caches, stats, plan)
