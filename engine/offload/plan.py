"""How a device budget is spent with the routed experts offloaded: the dense parts, the decode
slots, a forward's workspace, and the rest as expert slots per MoE layer (`plan`)."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.config import ModelConfig
from engine.offload.cache import IN_PLACE_ROWS
from engine.offload.stream import stream_bytes

if TYPE_CHECKING:
    from engine.model import HybridForCausalLM

log = logging.getLogger(__name__)


GiB = 1 << 30
EXPERT_PARAMS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


class BudgetError(ValueError):
    """The device memory budget cannot hold the dense parts, the decode slots and top_k experts per layer."""


def _size(n: int) -> str:
    return f"{n / GiB:.3f} GiB ({n:,} bytes)"


@dataclass(frozen=True)
class OffloadPlan:
    """How a device budget is spent (bytes): dense weights, decode slots, a forward's workspace
    (with `rows` staging rows of experts a decode step reads from host memory, `stages`), and
    `slots` experts of `expert_bytes` in each of `layers` MoE layers, of the `experts` a layer holds
    (all the model's, or an expert-parallel rank's share, `engine.parallel`). `workspace` is a full
    chunk's (`chunk` tokens), `small` what the shortest chunks allocate (0 until measured)."""

    budget: int
    dense: int
    states: int
    workspace: int
    expert_bytes: int
    layers: int
    slots: int
    rows: int
    stream: int = 0  # bytes of the buffers long chunks stream experts through (engine/offload/stream.py), or 0
    chunk: int = 1
    small: int = 0
    experts: int = 0

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


def least_slots(c: ModelConfig, experts: int) -> int:
    """The fewest expert slots a layer of `experts` may have: top_k (a token's experts resident at
    once), or all of them where a rank holds fewer."""
    return min(c.num_experts_per_tok, experts)


def streams(c: ModelConfig, slots: int, experts: int) -> bool:
    """Whether `plan` streams long chunks' experts with `slots` of a layer's `experts` resident: most
    of them are not resident, so long chunks stream them whole, through buffers that cost a few slots
    (engine/offload/stream.py)."""
    return least_slots(c, experts) <= slots < experts // 2


def budget_for(c: ModelConfig, p: OffloadPlan, slots: int) -> int:
    """The smallest budget `plan` splits into `slots` experts per layer with p's other parts (dense
    weights, decode slots, workspace), the stream buffers it reserves at that many included."""
    stream = stream_bytes(p.experts, p.expert_bytes) if streams(c, slots, p.experts) else 0
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
    experts: int | None = None,
) -> OffloadPlan:
    """Split `budget` bytes: the dense parts, the decode slots of `sequences` sequences of
    `capacity` tokens, the workspace of a `tokens`-token chunk, and the rest as expert slots of
    `expert_bytes` (default: a `dtype` expert; quantized experts pass their own size), evenly per
    MoE layer (at most every expert of the `experts` a layer holds: default all, under expert
    parallel the rank's share). Raises `BudgetError` naming the numbers when the rest is not
    top_k experts per layer (`least_slots`)."""
    layers, experts = c.num_hidden_layers, experts or c.num_experts
    least = least_slots(c, experts)
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
    slots = min(experts, max(rest, 0) // (expert * layers))
    stream = stream_bytes(experts, expert)
    streamed = max(rest - stream, 0) // (expert * layers)
    if streams(c, streamed, experts):
        slots = streamed
    else:
        stream = 0
    if slots < least:
        need = dense + states + workspace + least * expert * layers
        raise BudgetError(
            f"--gpu-memory {_size(budget)} leaves room for {slots} experts per layer, fewer than top_k = "
            f"{least}: dense weights {_size(dense)} + decode slots {_size(states)} ({sequences} "
            f"sequences x {capacity} tokens) + workspace {_size(workspace)} + {least} x {layers} "
            f"experts of {expert:,} bytes need {_size(need)}"
        )
    return OffloadPlan(budget, dense, states, workspace, expert, layers, slots, rows, stream, chunk=tokens,
                       experts=experts)
