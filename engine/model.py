"""The hybrid model: gated attention, Gated DeltaNet and sparse MoE layers, with module and
parameter names identical to the HF checkpoints (`model.layers.N.linear_attn.in_proj_qkv.weight`)."""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.batch import Span, bounds, positions
from engine.config import ModelConfig
from engine.ops import Kernels
from engine.ops.moe import route
from engine.ops.norm import gated_rms_norm, rms_norm
from engine.ops.rope import apply_rope, rope_cos_sin


class Weight(nn.Module):
    """A bare `weight` parameter under an HF module name (`linear_attn.norm`, `mlp.gate`)."""

    weight: torch.Tensor

    def __init__(self, *shape: int, fill: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.full(shape, fill))


class Experts(nn.Module):
    """Stacked expert weights: gate_up_proj [E, 2I, H], down_proj [E, H, I]."""

    gate_up_proj: torch.Tensor
    down_proj: torch.Tensor

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(c.num_experts, 2 * c.moe_intermediate_size, c.hidden_size))
        self.down_proj = nn.Parameter(torch.zeros(c.num_experts, c.hidden_size, c.moe_intermediate_size))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


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

    def forward(self, x, rope, spans: list[Span], layer: int, kernels: Kernels) -> torch.Tensor:
        length = x.shape[0]
        q, gate = self.q_proj(x).view(length, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = apply_rope(self.q_norm(q), *rope)  # [T, Hq, D]
        k = apply_rope(self.k_norm(self.k_proj(x).view(length, -1, self.head_dim)), *rope)  # [T, Hkv, D]
        v = self.v_proj(x).view(length, -1, self.head_dim)
        outs = []
        for span, (lo, hi) in zip(spans, bounds(spans), strict=True):
            keys, values = span.state.kv[layer].append(k[lo:hi], v[lo:hi])  # [S, Hkv, D]
            outs.append(kernels.causal_attention(q[lo:hi], keys, values))
        out = (outs[0] if len(outs) == 1 else torch.cat(outs)).reshape(length, -1)
        return self.o_proj(out * torch.sigmoid(gate.reshape(length, -1)))


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
        self._init_projections(c)

    def _init_projections(self, c: ModelConfig) -> None:
        self.in_proj_qkv = nn.Linear(c.hidden_size, c.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(c.hidden_size, c.linear_value_dim, bias=False)
        self.in_proj_b = nn.Linear(c.hidden_size, c.linear_num_value_heads, bias=False)
        self.in_proj_a = nn.Linear(c.hidden_size, c.linear_num_value_heads, bias=False)

    def project(self, x: torch.Tensor):
        """x [T, H] -> mixed qkv [T, conv_dim] (q ‖ k ‖ v), z [T, Hv*Dv], b [T, Hv], a [T, Hv]."""
        return self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)

    def forward(self, x, spans: list[Span], layer: int, kernels: Kernels):
        """x [T, H] of all spans -> out [T, H] and, per span, its captures [(conv, rec)]."""
        c, length = self.c, x.shape[0]
        mixed, z, b, a = self.project(x)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # [T, Hv]
        out = torch.empty(length, c.linear_num_value_heads, c.linear_value_head_dim, dtype=x.dtype, device=x.device)
        captures: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in spans]
        decode = [i for i, s in enumerate(spans) if s.is_decode]
        rows = bounds(spans)
        if decode:
            idx = torch.tensor([rows[i][0] for i in decode], device=x.device)
            out[idx] = self._decode([spans[i] for i in decode], layer, mixed[idx], g[idx], beta[idx], kernels)
        for i, (span, (lo, hi)) in enumerate(zip(spans, rows, strict=True)):
            if not span.is_decode:
                out[lo:hi], captures[i] = self._scan(span, layer, mixed[lo:hi], g[lo:hi], beta[lo:hi], kernels)
        out = gated_rms_norm(out, z.view(length, -1, c.linear_value_head_dim), self.norm.weight, c.rms_norm_eps)
        return self.out_proj(out.reshape(length, -1)), captures

    def _split(self, mixed: torch.Tensor):
        """mixed [T, conv_dim] after the conv -> q, k [T, Hk, Dk], v [T, Hv, Dv]."""
        c, length = self.c, mixed.shape[0]
        q, k, v = mixed.split([c.linear_key_dim, c.linear_key_dim, c.linear_value_dim], dim=-1)
        return (q.reshape(length, -1, c.linear_key_head_dim), k.reshape(length, -1, c.linear_key_head_dim),
                v.reshape(length, -1, c.linear_value_head_dim))

    def _scan(self, span: Span, layer: int, mixed, g, beta, kernels: Kernels):
        """One sequence's tokens through the conv and the chunked scan, from its own state."""
        c, state = self.c, span.state
        conv_state = state.conv.get(layer)
        if conv_state is None:
            conv_state = mixed.new_zeros(c.conv_dim, c.linear_conv_kernel_dim - 1)
        mixed, state.conv[layer], conv_caps = kernels.causal_conv(mixed, conv_state, self.conv1d.weight[:, 0], span.capture_at)
        q, k, v = self._split(mixed)
        rec = state.rec.get(layer)
        if rec is None:
            rec = torch.zeros(v.shape[1], c.linear_key_head_dim, c.linear_value_head_dim, device=mixed.device)
        out, state.rec[layer], rec_caps = kernels.chunk_gated_delta_rule(q, k, v, g, beta, rec, span.capture_at)
        return out, list(zip(conv_caps, rec_caps, strict=True))

    def _decode(self, spans: list[Span], layer: int, mixed, g, beta, kernels: Kernels) -> torch.Tensor:
        """One token of each of B sequences: one batched conv step and one batched recurrent step."""
        c, device = self.c, mixed.device
        conv = torch.stack([s.state.conv[layer] if layer in s.state.conv else
                            mixed.new_zeros(c.conv_dim, c.linear_conv_kernel_dim - 1) for s in spans])  # [B, C, K-1]
        rec = torch.stack([s.state.rec[layer] if layer in s.state.rec else torch.zeros(
            c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim, device=device) for s in spans])
        mixed, conv = kernels.decode_conv(mixed, conv, self.conv1d.weight[:, 0])
        q, k, v = self._split(mixed)
        out, rec = kernels.decode_gated_delta_rule(q, k, v, g, beta, rec)  # [B, Hv, Dv], [B, Hv, Dk, Dv]
        for i, span in enumerate(spans):
            span.state.conv[layer], span.state.rec[layer] = conv[i], rec[i]
        return out


class NextGatedDeltaNet(GatedDeltaNet):
    """Qwen3-Next layout: fused in_proj_qkvz / in_proj_ba, grouped per key head."""

    def _init_projections(self, c: ModelConfig) -> None:
        self.in_proj_qkvz = nn.Linear(c.hidden_size, 2 * c.linear_key_dim + 2 * c.linear_value_dim, bias=False)
        self.in_proj_ba = nn.Linear(c.hidden_size, 2 * c.linear_num_value_heads, bias=False)

    def project(self, x: torch.Tensor):
        c, length = self.c, x.shape[0]
        group = c.linear_num_value_heads // c.linear_num_key_heads
        dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
        qkvz = self.in_proj_qkvz(x).view(length, c.linear_num_key_heads, -1)  # [T, Hk, 2Dk + 2*group*Dv]
        q, k, v, z = qkvz.split([dk, dk, group * dv, group * dv], dim=-1)
        b, a = self.in_proj_ba(x).view(length, c.linear_num_key_heads, -1).split([group, group], dim=-1)
        mixed = torch.cat([q.reshape(length, -1), k.reshape(length, -1), v.reshape(length, -1)], dim=-1)
        return mixed, z.reshape(length, -1), b.reshape(length, -1), a.reshape(length, -1)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoe(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.c = c
        self.gate = Weight(c.num_experts, c.hidden_size)
        self.experts = Experts(c)
        self.shared_expert = MLP(c.hidden_size, c.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(c.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor, kernels: Kernels) -> torch.Tensor:
        weights, ids = route(x, self.gate.weight, self.c.num_experts_per_tok, self.c.norm_topk_prob)
        routed = kernels.moe_experts(x, weights, ids, self.experts.gate_up_proj, self.experts.down_proj)
        return routed + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


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

    def forward(self, x, rope, spans: list[Span], kernels: Kernels):
        h = self.input_layernorm(x)
        captured: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in spans]
        if self.is_attention:
            h = self.self_attn(h, rope, spans, self.layer, kernels)
        else:
            h, captured = self.linear_attn(h, spans, self.layer, kernels)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x), kernels), captured


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

    def forward(self, ids: torch.Tensor, spans: list[Span], kernels: Kernels) -> tuple[torch.Tensor, list[list[dict]]]:
        """ids [T] (the spans' tokens, span after span) -> final hidden states [T, H] and, per span
        and per offset in its `capture_at`, the DeltaNet states after that many of its tokens:
        {"conv.L": [C, K-1], "rec.L": [Hv, Dk, Dv]}. Every span's state is extended in place."""
        c = self.config
        rope = rope_cos_sin(positions(spans, ids.device), c.rotary_dim, c.rope_theta, self.lm_head.weight.dtype)
        x = self.model.embed_tokens(ids)  # [T, H]
        captures: list[list[dict[str, torch.Tensor]]] = [[{} for _ in s.capture_at] for s in spans]
        for layer in cast(list[DecoderLayer], self.model.layers):
            for span in spans:
                span.state.wait_for(layer.layer)  # a restore may still be copying this layer's state in
            x, captured = layer(x, rope, spans, kernels)
            for per_span, caps in zip(captures, captured, strict=True):
                for snapshot, (conv, rec) in zip(per_span, caps, strict=False):
                    snapshot[f"conv.{layer.layer}"], snapshot[f"rec.{layer.layer}"] = conv, rec
        for span in spans:
            span.state.length += span.length
        return self.model.norm(x), captures

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
