"""The hybrid model: gated attention, Gated DeltaNet and sparse MoE layers, with module and
parameter names identical to the HF checkpoints (`model.layers.N.linear_attn.in_proj_qkv.weight`)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.batch import Batch, Mixed, SlotBatch, SlotPrefill, Span, Spans
from engine.config import ModelConfig
from engine.head_split import HeadShard
from engine.ops import Kernels, moe_experts_quantized
from engine.ops.deltanet import decode_mix
from engine.ops.rope import rope_cos_sin
from engine.parallel import ExpertShard


class OffloadedExperts(Protocol):
    """A MoE layer's routed experts held outside the model (`engine.offload.cache.ExpertCache`)."""

    def run(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, moe_experts: Callable
    ) -> torch.Tensor: ...


def matmul(x: torch.Tensor, w) -> torch.Tensor:
    """x [T, K] @ w.T → [T, N] for a weight of any kind: a tensor (`F.linear`; 2-16 rows on a GPU
    `engine.ops.gpu.dense`), a `QuantWeight` (its Triton kernels,
    engine/ops/gpu/quant.py) or a `Concat` of parts that could not be one."""
    if isinstance(w, Concat):
        return w.linear(x)
    if not isinstance(w, torch.Tensor):
        from engine.ops.gpu import quant  # noqa: PLC0415 (Triton: only with quantized weights)

        return quant.linear(x, w)
    if x.is_cuda:
        from engine.ops.gpu import dense  # noqa: PLC0415 (Triton: only on a GPU)

        if dense.fits(x, w):
            return dense.small_linear(x, w)
    return F.linear(x, w)


def embed(w, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` [T] of the embedding table `w` (a tensor, or a `QuantWeight` whose rows are
    dequantized when read) → [T, H]."""
    return F.embedding(ids, w) if isinstance(w, torch.Tensor) else w.rows(ids)


class Concat(nn.Module):
    """Projections that read the same input but cannot share one weight (quantized in different
    formats, FP8 rows off a scale block, a plain part beside quantized ones): one matmul per
    weight, the outputs concatenated."""

    def __init__(self, weights: list):
        super().__init__()
        self.count = len(weights)
        for i, w in enumerate(weights):
            if isinstance(w, torch.Tensor):
                self.register_buffer(f"w{i}", w, persistent=False)
            else:
                self.add_module(f"w{i}", w)

    def weights(self) -> list:
        return [getattr(self, f"w{i}") for i in range(self.count)]

    def outputs(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x times each weight, in order (decode's pair of quantized weights: one GEMV launch, one output)."""
        weights = self.weights()
        if len(weights) == 2 and not any(isinstance(w, torch.Tensor) for w in weights):
            from engine.ops.gpu.quant import linear_pair  # noqa: PLC0415 (Triton: only with quantized weights)

            out = linear_pair(x, *weights)
            if out is not None:
                return [out]
        return [matmul(x, w) for w in weights]

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        outs = self.outputs(x)
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


def matmul_split(x: torch.Tensor, w, widths: list[int]) -> list[torch.Tensor]:
    """`matmul(x, w)` split into column blocks of `widths` (their sum may stop short of the output's:
    padding), as views; for a `Concat`, of its parts' outputs, not concatenated first where each block
    lies within one part (a DeltaNet's fused FP8 projection beside its plain b and a)."""
    outs = w.outputs(x) if isinstance(w, Concat) else [matmul(x, w)]
    blocks, part, at = [], 0, 0
    for width in widths:
        if at == outs[part].shape[-1]:
            part, at = part + 1, 0
        if at + width > outs[part].shape[-1]:  # a block across two parts
            return list(torch.cat(outs, dim=-1)[..., : sum(widths)].split(widths, dim=-1))
        blocks.append(outs[part][..., at : at + width])
        at += width
    return blocks


def _joins(run: list[nn.Module], w) -> bool:
    """Whether weight `w` can be concatenated row-wise to the weights of `run`."""
    first = run[0].weight
    if isinstance(first, torch.Tensor) or isinstance(w, torch.Tensor):
        return isinstance(first, torch.Tensor) and isinstance(w, torch.Tensor)
    from engine.ops.gpu.quant import can_concat  # noqa: PLC0415 (Triton: only with quantized weights)

    return can_concat([*(m.weight for m in run), w])


def _fuse_run(run: list[nn.Module], pad: int = 0):
    """One weight for the modules of `run`, each module's weight becoming a view of it; with `pad`,
    that many zero rows after theirs (plain tensors only)."""
    if len(run) == 1 and not pad:
        return run[0].weight
    if isinstance(run[0].weight, torch.Tensor):
        first = run[0].weight
        fused = torch.cat([*(m.weight for m in run), first.new_zeros(pad, *first.shape[1:])])
        view = lambda lo, rows: nn.Parameter(fused[lo : lo + rows], requires_grad=False)  # noqa: E731
    else:
        from engine.ops.gpu.quant import concat_rows  # noqa: PLC0415

        fused = concat_rows([m.weight for m in run])
        view = fused.narrow_rows
    lo = 0
    for m in run:
        rows = m.weight.shape[-2]
        m.weight = view(lo, rows)
        lo += rows
    return fused


def fuse(module: nn.Module, name: str, parts: list[nn.Module], align: int = 1) -> None:
    """Register `name` as the row-wise concatenation of the parts' weights and make each part's
    weight a view of it: projections that read the same input run as one GEMM (one GEMV in decode),
    with no second copy of the weights and the HF parameter names unchanged. Quantized weights
    join when their format's blocks line up (`quant.can_concat`); where consecutive parts cannot,
    each run of those that can is one weight of a `Concat` (so callers put the parts that stay plain
    in a quantized model side by side). A last run of plain weights gets zero rows up to a multiple
    of `align` (its output rows then stay 16-byte aligned: cuBLAS takes its fast kernels, not the
    unaligned ones); the caller drops those outputs, the last."""
    runs: list[list[nn.Module]] = []
    for m in parts:
        if runs and _joins(runs[-1], m.weight):
            runs[-1].append(m)
        else:
            runs.append([m])
    last = sum(m.weight.shape[-2] for m in runs[-1])
    pad = -last % align if isinstance(runs[-1][0].weight, torch.Tensor) else 0  # after the last outputs
    weights = [_fuse_run(run, pad if run is runs[-1] else 0) for run in runs]
    fused = weights[0] if len(weights) == 1 else Concat(weights)
    adopt(module, name, fused)


def adopt(module: nn.Module, name: str, w) -> None:
    """`w` (a tensor or a quantized weight) as `module`'s `name`, replacing what was there: a
    non-persistent buffer or a submodule, so it moves with the model and stays out of state dicts."""
    module._buffers.pop(name, None)  # fused again after a move: the old one goes
    module._modules.pop(name, None)
    if isinstance(w, torch.Tensor):
        module.register_buffer(name, w, persistent=False)
    else:
        module.add_module(name, w)


class Weight(nn.Module):
    """A bare `weight` parameter under an HF module name (`linear_attn.norm`, `mlp.gate`)."""

    weight: torch.Tensor

    def __init__(self, *shape: int, fill: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.full(shape, fill))


class Experts(nn.Module):
    """Stacked expert weights: gate_up_proj [E, 2I, H], down_proj [E, H, I] (E: `count`, by default
    all of the model's); with the shared expert folded in (`SparseMoe.fold_shared`), views of
    `gate_up_all` and `down_all`, which end with it."""

    gate_up_proj: torch.Tensor
    down_proj: torch.Tensor

    def __init__(self, c: ModelConfig, count: int | None = None):
        super().__init__()
        count = c.num_experts if count is None else count
        self.gate_up_proj = nn.Parameter(torch.zeros(count, 2 * c.moe_intermediate_size, c.hidden_size))
        self.down_proj = nn.Parameter(torch.zeros(count, c.hidden_size, c.moe_intermediate_size))


class RMSNorm(nn.Module):
    """A zero-centred RMSNorm's weight; applied through `Kernels.add_rms_norm` (residual add fused)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, kernels: Kernels) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual, the norm of it)."""
        return kernels.add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    """Full attention with an output gate, q/k RMSNorm before partial RoPE, grouped KV heads."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.num_heads, self.head_dim = c.num_attention_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim * 2, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.splits = [c.num_attention_heads * c.head_dim * 2, c.num_key_value_heads * c.head_dim, c.num_key_value_heads * c.head_dim]

    def fuse(self) -> None:
        fuse(self, "qkv", [self.q_proj, self.k_proj, self.v_proj])

    def forward(self, x, rope, batch: Batch, layer: int, kernels: Kernels) -> torch.Tensor:
        length = x.shape[0]
        q, k, v = matmul_split(x, self.qkv, self.splits)
        q, gate = q.view(length, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = kernels.norm_rope(q, self.q_norm.weight, self.q_norm.eps, *rope)  # [T, Hq, D]
        k = kernels.norm_rope(k.view(length, -1, self.head_dim), self.k_norm.weight, self.k_norm.eps, *rope)  # [T, Hkv, D]
        v = v.view(length, -1, self.head_dim)
        out = self._attend(q, k, v, batch, layer, kernels)
        out = kernels.sigmoid_mul(out.reshape(length, self.num_heads, -1), gate)  # gate [T, Hq, D]
        return matmul(out.reshape(length, -1), self.o_proj.weight)

    def _attend(self, q, k, v, batch: Batch, layer: int, kernels: Kernels) -> torch.Tensor:
        """q [T, Hq, D], the new k, v [T, Hkv, D] -> out [T, Hq, D], the new KV written where the batch keeps it."""
        if isinstance(batch, Mixed):  # the decode rows, then the prefill spans
            n = batch.rows
            decoded = self._attend(q[:n], k[:n], v[:n], batch.decode, layer, kernels)
            return torch.cat([decoded, self._attend(q[n:], k[n:], v[n:], batch.prefill, layer, kernels)])
        if isinstance(batch, SlotBatch):  # one query per slot, the new KV row written in place by the kernel
            keys, values = batch.buffers.k[layer], batch.buffers.v[layer]
            return kernels.decode_attention(q, keys, values, batch.index, batch.pos + 1, k, v)
        if isinstance(batch, SlotPrefill):  # a few tokens of one slot: their KV rows written in place
            keys, values = batch.buffers.k[layer], batch.buffers.v[layer]
            rows = (batch.slot.expand(q.shape[0]), batch.pos)
            keys.index_put_(rows, k)
            values.index_put_(rows, v)
            return kernels.slot_prefill_attention(q, keys, values, batch.slot, batch.start)
        outs = []
        for span, (lo, hi) in zip(batch.spans, batch.bounds(), strict=True):
            keys, values = span.state.kv[layer].append(k[lo:hi], v[lo:hi])  # [S, Hkv, D]
            outs.append(kernels.causal_attention(q[lo:hi], keys, values))
        return outs[0] if len(outs) == 1 else torch.cat(outs)


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet, Qwen3.5/3.6 layout: separate in_proj_qkv / in_proj_z / in_proj_b / in_proj_a."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.c = c
        self.conv1d = nn.Conv1d(c.conv_dim, c.conv_dim, c.linear_conv_kernel_dim, groups=c.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(c.linear_num_value_heads))
        self.A_log = nn.Parameter(torch.zeros(c.linear_num_value_heads))
        self.norm = Weight(c.linear_value_head_dim, fill=1.0)
        self.out_proj = nn.Linear(c.linear_value_dim, c.hidden_size, bias=False)
        self.qkv_widths = (c.linear_key_dim, c.linear_key_dim, c.linear_value_dim)  # the conv's channels
        self._init_projections(c)

    def _init_projections(self, c: ModelConfig) -> None:
        self.in_proj_qkv = nn.Linear(c.hidden_size, c.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(c.hidden_size, c.linear_value_dim, bias=False)
        self.in_proj_b = nn.Linear(c.hidden_size, c.linear_num_value_heads, bias=False)
        self.in_proj_a = nn.Linear(c.hidden_size, c.linear_num_value_heads, bias=False)

    def fuse(self) -> None:
        fuse(self, "in_proj", [self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a])
        self.register_buffer("neg_a", -self.A_log.float().exp(), persistent=False)

    def project(self, x: torch.Tensor):
        """x [T, H] -> mixed qkv [T, conv_dim] (q ‖ k ‖ v), z [T, Hv*Dv], b [T, Hv], a [T, Hv]."""
        c = self.c
        return matmul_split(x, self.in_proj, [c.conv_dim, c.linear_value_dim, c.linear_num_value_heads, c.linear_num_value_heads])

    def forward(self, x, batch: Batch, layer: int, kernels: Kernels):
        """x [T, H] of all sequences -> out [T, H] and, per span, its captures [(conv, rec)]."""
        c, length = self.c, x.shape[0]
        mixed, z, b, a = self.project(x)
        if isinstance(batch, SlotBatch):  # a decode step: one op from the projection to the output's
            out = kernels.deltanet_decode(
                mixed, z, a, b, self.neg_a, self.dt_bias, self.conv1d.weight[:, 0], self.norm.weight, c.rms_norm_eps,
                batch.buffers.conv[layer], batch.buffers.rec[layer], batch.index,
            )
            return matmul(out.reshape(length, -1), self.out_proj.weight), []
        g, beta = kernels.deltanet_gates(a, b, self.neg_a, self.dt_bias)  # [T, Hv] fp32, b's dtype
        out, captures = self._mix(batch, layer, mixed, g, beta, kernels)
        out = kernels.gated_rms_norm(out, z.view(length, -1, c.linear_value_head_dim), self.norm.weight, c.rms_norm_eps)
        return matmul(out.reshape(length, -1), self.out_proj.weight), captures

    def _mix(self, batch: Batch, layer: int, mixed, g, beta, kernels: Kernels):
        """The conv and the scan of the batch's rows, each sequence from its own states and back into
        them -> out [T, Hv, Dv] and, per span, its captures [(conv, rec)]."""
        if isinstance(batch, Mixed):  # the decode rows, then the prefill spans
            n = batch.rows
            decoded, _ = self._mix(batch.decode, layer, mixed[:n], g[:n], beta[:n], kernels)
            out, captures = self._mix(batch.prefill, layer, mixed[n:], g[n:], beta[n:], kernels)
            return torch.cat([decoded, out]), captures
        if isinstance(batch, SlotBatch):  # a mixed step's decode rows
            return self._decode(batch, layer, mixed, g, beta, kernels), []
        if isinstance(batch, SlotPrefill):
            return self._slot_scan(batch, layer, mixed, g, beta, kernels), []
        return self._scan(batch, layer, mixed, g, beta, kernels)

    def _heads(self, q, k, v):
        """q, k [T, Hk*Dk], v [T, Hv*Dv] (the conv's output) -> q, k [T, Hk, Dk], v [T, Hv, Dv]."""
        c, length = self.c, q.shape[0]
        return (q.view(length, -1, c.linear_key_head_dim), k.view(length, -1, c.linear_key_head_dim),
                v.view(length, -1, c.linear_value_head_dim))

    def _scan(self, batch: Spans, layer: int, mixed, g, beta, kernels: Kernels):
        """Every span's tokens through the conv and the chunked scan, each from its own states (a new
        sequence's are zeros) and back into them; the spans' rows go through each op together."""
        c, states = self.c, [span.state for span in batch.spans]
        bounds, capture_ats = batch.bounds(), [span.capture_at for span in batch.spans]
        conv_states = [s.conv.get(layer) for s in states]
        conv_states = [mixed.new_zeros(c.conv_dim, c.linear_conv_kernel_dim - 1) if s is None else s for s in conv_states]
        parts, conv_finals, conv_caps = kernels.causal_conv_spans(
            mixed, conv_states, self.conv1d.weight[:, 0], bounds, capture_ats, self.qkv_widths
        )
        q, k, v = self._heads(*parts)
        recs = [s.rec.get(layer) for s in states]
        recs = [torch.zeros(v.shape[1], c.linear_key_head_dim, c.linear_value_head_dim, device=mixed.device)
                if r is None else r for r in recs]
        out, rec_finals, rec_caps = kernels.chunk_gated_delta_rule_spans(q, k, v, g, beta, recs, bounds, capture_ats)
        for state, conv_state, rec in zip(states, conv_finals, rec_finals, strict=True):
            state.conv[layer], state.rec[layer] = conv_state, rec
        return out, [list(zip(cc, rc, strict=True)) for cc, rc in zip(conv_caps, rec_caps, strict=True)]

    def _slot_scan(self, batch: SlotPrefill, layer: int, mixed, g, beta, kernels: Kernels) -> torch.Tensor:
        """A few tokens of one slot's sequence through the conv and the chunked scan, from the
        slot's states and back into them. Padding rows get no decay (g = 0) and no update
        (beta = 0), so the recurrent state is the one after the real tokens; the conv state is
        read off after them too (on the device: the count is not known to the host in a graph)."""
        conv_slots, rec_slots = batch.buffers.conv[layer], batch.buffers.rec[layer]
        valid = batch.valid[:, None]
        g, beta = g * valid, beta * valid
        weight = self.conv1d.weight[:, 0]
        conv_state = conv_slots[batch.slot][0]  # [C, K-1]
        parts, _, _ = kernels.causal_conv(mixed, conv_state, weight, [], self.qkv_widths)
        inputs = torch.cat([conv_state, mixed.transpose(0, 1)], dim=1)  # [C, K-1+T]: state after n tokens at [n, n+K-1)
        width = conv_state.shape[1]
        conv_slots.index_copy_(0, batch.slot, inputs.index_select(1, batch.count + batch.arange[:width])[None])
        q, k, v = self._heads(*parts)
        out, rec, _ = kernels.chunk_gated_delta_rule(q, k, v, g, beta, rec_slots[batch.slot][0], [])
        rec_slots.index_copy_(0, batch.slot, rec[None])
        return out

    def _decode(self, batch: SlotBatch, layer: int, mixed, g, beta, kernels: Kernels) -> torch.Tensor:
        """One token of each slot's sequence: one batched conv step and one batched recurrent step,
        each on the states of the rows' slots, updated in place -> [B, Hv, Dv]."""
        conv_slots, rec_slots = batch.buffers.conv[layer], batch.buffers.rec[layer]
        weight = self.conv1d.weight[:, 0]
        return decode_mix(mixed, g, beta, weight, conv_slots, rec_slots, batch.index, kernels)


class NextGatedDeltaNet(GatedDeltaNet):
    """Qwen3-Next layout: fused in_proj_qkvz / in_proj_ba, grouped per key head."""

    def _init_projections(self, c: ModelConfig) -> None:
        self.in_proj_qkvz = nn.Linear(c.hidden_size, 2 * c.linear_key_dim + 2 * c.linear_value_dim, bias=False)
        self.in_proj_ba = nn.Linear(c.hidden_size, 2 * c.linear_num_value_heads, bias=False)

    def fuse(self) -> None:
        fuse(self, "in_proj", [self.in_proj_qkvz, self.in_proj_ba])
        self.register_buffer("neg_a", -self.A_log.float().exp(), persistent=False)

    def project(self, x: torch.Tensor):
        c, length = self.c, x.shape[0]
        group = c.linear_num_value_heads // c.linear_num_key_heads
        dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
        qkvz, ba = matmul_split(x, self.in_proj, [self.in_proj_qkvz.weight.shape[0], self.in_proj_ba.weight.shape[0]])
        q, k, v, z = qkvz.reshape(length, c.linear_num_key_heads, -1).split([dk, dk, group * dv, group * dv], dim=-1)  # [T, Hk, ...]
        b, a = ba.reshape(length, c.linear_num_key_heads, -1).split([group, group], dim=-1)
        mixed = torch.cat([q.reshape(length, -1), k.reshape(length, -1), v.reshape(length, -1)], dim=-1)
        return mixed, z.reshape(length, -1), b.reshape(length, -1), a.reshape(length, -1)


class MLP(nn.Module):
    """The shared expert's weights (run by `SparseMoe.forward`, its gate and up fused with the router)."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)


class SparseMoe(nn.Module):
    """Routed experts and a shared expert. With `offload` set (engine/offload/), the routed
    experts live there instead of in `experts`, and run on its device slots. With `shard` set
    (expert parallel, `engine.parallel`), `experts` (or `offload`) holds this rank's share and the
    routed outputs are summed over the ranks."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.c = c
        self.gate = Weight(c.num_experts, c.hidden_size)
        self.experts: Experts | None = Experts(c)
        self.offload: OffloadedExperts | None = None
        self.shard: ExpertShard | None = None
        self.shared_expert = MLP(c.hidden_size, c.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(c.hidden_size, 1, bias=False)
        self.folded = False  # the shared expert is expert E of the routed stacks (`fold_shared`)

    def fuse(self) -> None:
        """The shared expert's gate and up projections, the router and the shared expert's output
        gate: one GEMM (in a quantized file, where the router and the output gate stay plain: one
        quantized GEMV and one plain GEMM, the plain ones side by side)."""
        shared = self.shared_expert
        # gate and up (2 x I) + router (E) + the output gate (1): an odd width, padded to 8 outputs
        fuse(self, "in_proj", [shared.gate_proj, shared.up_proj, self.gate, self.shared_expert_gate], align=8)

    def shard_experts(self, shard: ExpertShard) -> None:
        """Hold experts [shard.first, shard.first + shard.count) only (new stacks, before loading)."""
        self.experts, self.shard = Experts(self.c, shard.count), shard

    def fold_shared(self) -> None:
        """Make the shared expert one more routed expert, E, at the end of the stacks (its weights
        then views of them). The router (`kernels.router`: with the shared expert's gate, one plain
        weight) appends it to each token's experts with weight sigmoid(its gate), and one pair of
        expert launches runs the nine a token reads: decode loses the shared expert's own GEMVs or
        GEMMs, its activation and the gated add. Only where it has the routed experts' size and kind
        (a quantized model: their format), the router is plain and the experts are in the layer (not
        offloaded) and held whole (not sharded: every rank would add it to the sum); else nothing
        changes. The new stacks cost one layer's memory while built."""
        c, shared, experts = self.c, self.shared_expert, self.experts
        if self.folded or experts is None or self.shard is not None:
            return
        if c.shared_expert_intermediate_size != c.moe_intermediate_size:
            return
        if not all(isinstance(m.weight, torch.Tensor) for m in (self.gate, self.shared_expert_gate)):
            return  # a quantized router: `kernels.router` takes plain weights (no file so far quantizes it)
        gate, up = shared.gate_proj.weight, shared.up_proj.weight
        gate_up = _append_expert(experts.gate_up_proj, [gate, up])
        down = _append_expert(experts.down_proj, [shared.down_proj.weight])
        if gate_up is None or down is None:
            return
        adopt(experts, "gate_up_all", gate_up)
        adopt(experts, "down_all", down)
        e, i = c.num_experts, c.moe_intermediate_size
        experts.gate_up_proj, shared_gate_up = _split_last(gate_up, e)
        experts.down_proj, shared.down_proj.weight = _split_last(down, e)
        shared.gate_proj.weight, shared.up_proj.weight = _rows(shared_gate_up, 0, i), _rows(shared_gate_up, i, i)
        fuse(self, "in_proj", [self.gate, self.shared_expert_gate], align=8)  # the router and the output gate
        self.folded = True

    def forward(self, x: torch.Tensor, kernels: Kernels) -> torch.Tensor:
        c = self.c
        if self.folded:  # in_proj: the router, then the shared expert's gate (plain weights)
            weights, ids = kernels.router(x, self.in_proj, c.num_experts, c.num_experts_per_tok, c.norm_topk_prob)
            assert self.experts is not None
            return routed_experts(kernels, x, weights, ids, self.experts.gate_up_all, self.experts.down_all)
        splits = [c.shared_expert_intermediate_size, c.shared_expert_intermediate_size, c.num_experts, 1]
        gate, up, router, shared_gate = matmul_split(x, self.in_proj, splits)  # without the padding's outputs
        weights, ids = kernels.route(router, c.num_experts_per_tok, c.norm_topk_prob, x.dtype)
        run = partial(routed_experts, kernels)
        if self.shard is not None:  # this rank's experts (the others' assignments at -1), then the sum over the ranks
            ids, run = self.shard.local(ids), partial(run, partial=True)
        if self.offload is not None:  # the stacks of its device slots, whichever kind they are
            routed = self.offload.run(x, weights, ids, run)
        else:
            assert self.experts is not None
            routed = run(x, weights, ids, self.experts.gate_up_proj, self.experts.down_proj)
        if self.shard is not None:
            routed = self.shard.combine(routed)
        shared = matmul(kernels.silu_mul(gate, up), self.shared_expert.down_proj.weight)
        return kernels.add_sigmoid_mul(routed, shared_gate, shared)


def _append_expert(stack, rows: list):
    """A stack [E, N, K] and one more expert given as its row blocks (each [n, K], summing to N) →
    a fresh stack [E + 1, N, K]; None where they are not all of the stack's kind (dtype, or
    quantized format and blocks)."""
    if isinstance(stack, torch.Tensor):
        if not all(isinstance(w, torch.Tensor) and w.dtype == stack.dtype for w in rows):
            return None
        w = torch.cat(rows)
        return torch.cat([stack, w[None]]) if w.shape == stack.shape[1:] else None
    if any(isinstance(w, torch.Tensor) for w in rows):
        return None
    from engine.ops.gpu.quant import append_expert, can_concat, concat_rows  # noqa: PLC0415

    if not can_concat(rows):
        return None
    return append_expert(stack, rows[0] if len(rows) == 1 else concat_rows(rows))


def _split_last(stack, count: int):
    """A stack of count + 1 experts → (the first `count`, the last as one weight [N, K]), views."""
    if isinstance(stack, torch.Tensor):
        return nn.Parameter(stack[:count], requires_grad=False), nn.Parameter(stack[count], requires_grad=False)
    return stack.experts(0, count), stack.expert(count)


def _rows(w, start: int, length: int):
    """Rows [start, start + length) of a weight [N, K], a view."""
    if isinstance(w, torch.Tensor):
        return nn.Parameter(w[start : start + length], requires_grad=False)
    return w.narrow_rows(start, length)


def routed_experts(kernels: Kernels, x, weights, ids, gate_up, down, partial: bool = False) -> torch.Tensor:
    """Routed experts over stacks of either kind: dense tensors (the device's kernels) or
    `QuantWeight`s (the quantized kernels)."""
    op = kernels.moe_experts if isinstance(gate_up, torch.Tensor) else moe_experts_quantized
    return op(x, weights, ids, gate_up, down, partial)


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, layer: int):
        super().__init__()
        self.layer, self.is_attention = layer, c.layer_types[layer] == "full_attention"
        if self.is_attention:
            self.self_attn = Attention(c)
        else:
            self.linear_attn = (NextGatedDeltaNet if c.arch == "qwen3_next" else GatedDeltaNet)(c)
        self.mlp = SparseMoe(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.heads: HeadShard | None = None  # head split: this rank's heads, their outputs summed over the ranks

    def forward(self, x, h, rope, batch: Batch, kernels: Kernels):
        """The residual stream x and the previous layer's output h (added here, fused into the
        norm) -> the new residual stream, this layer's MLP output and the DeltaNet captures."""
        x, normed = self.input_layernorm(x, h, kernels)
        captured: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        if self.is_attention:
            h = self.self_attn(normed, rope, batch, self.layer, kernels)
        else:
            h, captured = self.linear_attn(normed, batch, self.layer, kernels)
        if self.heads is not None:
            h = self.heads.combine(h)
        x, normed = self.post_attention_layernorm(x, h, kernels)
        return x, self.mlp(normed, kernels), captured


class Backbone(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class HybridForCausalLM(nn.Module):
    """`forward` runs new tokens through every layer, extending `state` in place."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.config = c
        self.model = Backbone(c)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.heads: HeadShard | None = None  # head split (`engine.head_split`): `config` is the rank's share

    def split_heads(self, heads: HeadShard) -> None:
        """Mark a model built of `heads.local_config` as `heads`' share: each layer sums its heads' outputs over the ranks."""
        self.heads = heads
        for layer in cast(list[DecoderLayer], self.model.layers):
            layer.heads = heads

    def forward(
        self, ids: torch.Tensor, batch: Batch | list[Span], kernels: Kernels,
        keep: Callable[[list[dict]], list[dict]] | None = None,
    ) -> tuple[torch.Tensor, list[list[dict]]]:
        """ids [T] (the batch's tokens, sequence after sequence) -> final hidden states [T, H] and,
        for `Spans`, per span and per offset in its `capture_at`, the DeltaNet states after that
        many of its tokens: {"conv.L": [C, K-1], "rec.L": [Hv, Dk, Dv]}, each layer's passed through
        `keep` as the layer makes them, all of the layer's captures in one list (the engine's copies
        them to host memory: the forward then holds one layer's captures on the device, not every
        layer's). Every sequence's state is extended in place (a `SlotBatch`'s lengths are committed
        by its runner)."""
        c = self.config
        batch = Spans(batch) if isinstance(batch, list) else batch
        rope = rope_cos_sin(batch.positions(ids.device), c.rotary_dim, c.rope_theta, self.lm_head.weight.dtype)
        x, h = embed(self.model.embed_tokens.weight, ids), None  # [T, H]: the residual stream, the last layer's output
        spans = batch.spans if isinstance(batch, (Spans, Mixed)) else []
        captures: list[list[dict[str, torch.Tensor]]] = [[{} for _ in s.capture_at] for s in spans]
        for layer in cast(list[DecoderLayer], self.model.layers):
            batch.wait_for(layer.layer)
            x, h, captured = layer(x, h, rope, batch, kernels)
            made = [{f"conv.{layer.layer}": conv, f"rec.{layer.layer}": rec} for caps in captured for conv, rec in caps]
            if made:
                kept = iter(made if keep is None else keep(made))
                for per_span, caps in zip(captures, captured, strict=False):
                    for snapshot in per_span[: len(caps)]:
                        snapshot.update(next(kept))
        batch.advance()
        return self.model.norm(x, h, kernels)[1], captures

    def fuse_projections(self) -> None:
        """Per layer, the projections that read the same input become one weight (`fuse`); done
        once after the weights are loaded."""
        for layer in cast(list[DecoderLayer], self.model.layers):
            (layer.self_attn if layer.is_attention else layer.linear_attn).fuse()
            layer.mlp.fuse()

    def fold_shared_experts(self) -> None:
        """Each MoE layer's shared expert into its routed stacks where it can be
        (`SparseMoe.fold_shared`); for a model whose experts stay in the layers (not offloaded), on
        the device it runs on, before any forward."""
        for layer in cast(list[DecoderLayer], self.model.layers):
            layer.mlp.fold_shared()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return matmul(hidden, self.lm_head.weight).float()
