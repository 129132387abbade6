"""Decode one token at batch 1 through a CUDA graph.

The step is the model's forward for one token, written for the decode shapes: projections that
read the same input are one GEMV (weights concatenated once: about 2 GiB more at the 35B shape),
residual adds are fused into the following RMSNorm, and the routed experts run as two Triton
GEMV kernels that read only the chosen experts.

The graph runs on static buffers: the token id and position, a KV cache per attention layer
preallocated to `capacity` tokens, and the conv and recurrent state per DeltaNet layer. Attention
reads the valid length from the device (`decode_attention`), so one graph serves every length up to
the capacity; past it the buffers double and the graph is captured again.

A `SequenceState` being decoded adopts the static buffers (its KV caches and state tensors become
views of them), so consecutive steps and a later prefill on the same state copy nothing. When
another state is bound, the previous owner first gets private copies of whatever it still shares.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from engine.model import GatedDeltaNet, HybridForCausalLM
from engine.ops.gpu.attention import decode_attention
from engine.ops.gpu.norm import add_rms_norm, gated_rms_norm
from engine.ops.rope import apply_rope, rope_cos_sin
from engine.state import SequenceState

MIN_CAPACITY = 4096


class GraphDecoder:
    def __init__(self, model: HybridForCausalLM, kernels, use_graph: bool = True):
        self.model, self.kernels, self.use_graph = model, kernels, use_graph
        self.c = model.config
        self.device = model.lm_head.weight.device
        self.dtype = model.lm_head.weight.dtype
        self.capacity = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.owner: weakref.ref | None = None
        self.token = torch.zeros(1, dtype=torch.long, device=self.device)
        self.position = torch.zeros(1, dtype=torch.long, device=self.device)

    @torch.no_grad()
    def step(self, state: SequenceState, token: int) -> torch.Tensor:
        """Feed `token` at position state.length; returns the next logits [V] fp32."""
        if state.length + 1 > self.capacity:
            self._allocate(max(MIN_CAPACITY, 2 * self.capacity, 1 << (state.length + 1).bit_length()))
        self._bind(state)
        self.token.fill_(token)
        self.position.fill_(state.length)
        if self.graph is not None:
            self.graph.replay()
            logits = self.logits.clone()
        else:
            logits = self._forward()
        for cache in state.kv.values():
            cache.length += 1
        state.length += 1
        return logits

    # -- static buffers and the graph

    def _allocate(self, capacity: int) -> None:
        self._release()
        c, dev = self.c, self.device
        self.k = {i: torch.zeros(capacity, c.num_key_value_heads, c.head_dim, dtype=self.dtype, device=dev) for i in c.attention_layers}
        self.v = {i: torch.zeros_like(t) for i, t in self.k.items()}
        self.conv = {i: torch.zeros(c.conv_dim, c.linear_conv_kernel_dim - 1, dtype=self.dtype, device=dev) for i in c.deltanet_layers}
        rec_shape = (c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim)
        self.rec = {i: torch.zeros(rec_shape, dtype=torch.float32, device=dev) for i in c.deltanet_layers}
        self.capacity, self.graph = capacity, None
        if self.use_graph:
            self._capture()

    def _capture(self) -> None:
        self.position.zero_()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up: Triton compiles and autotunes outside the capture
            for _ in range(2):
                self._forward()
        torch.cuda.current_stream(self.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._forward()

    def _owned_by(self, state: SequenceState) -> bool:
        return self.owner is not None and self.owner() is state

    def _release(self) -> None:
        """Give the current owner private copies of the buffers it still shares."""
        prev = self.owner() if self.owner is not None else None
        self.owner = None
        if prev is None:
            return
        for i, cache in prev.kv.items():
            if cache.k is self.k[i]:
                cache.k, cache.v = cache.k[: cache.length].clone(), cache.v[: cache.length].clone()
        for i in self.c.deltanet_layers:
            if prev.conv.get(i) is self.conv[i]:
                prev.conv[i] = self.conv[i].clone()
            if prev.rec.get(i) is self.rec[i]:
                prev.rec[i] = self.rec[i].clone()

    def _bind(self, state: SequenceState) -> None:
        """Make `state` use the static buffers, copying in whatever it does not already share."""
        if not self._owned_by(state):
            self._release()
        state.wait_all()
        for i, cache in state.kv.items():
            if cache.k is not self.k[i]:
                n = cache.length
                self.k[i][:n].copy_(cache.k[:n])
                self.v[i][:n].copy_(cache.v[:n])
                cache.k, cache.v = self.k[i], self.v[i]
        for i in self.c.deltanet_layers:
            for mine, theirs in ((self.conv, state.conv), (self.rec, state.rec)):
                if theirs.get(i) is not mine[i]:
                    if i in theirs:
                        mine[i].copy_(theirs[i])
                    else:
                        mine[i].zero_()
                    theirs[i] = mine[i]
        self.owner = weakref.ref(state)

    # -- one token through every layer, on the static buffers

    def _fuse_weights(self) -> None:
        """Per layer, the projections that read the same input as one weight (one GEMV each)."""
        self.fused: dict[int, torch.Tensor] = {}
        for layer in self.model.model.layers:
            i = layer.layer
            if layer.is_attention:
                a = layer.self_attn
                self.fused[i] = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
            elif type(layer.linear_attn) is GatedDeltaNet:  # Qwen3.5 layout; Qwen3-Next keeps project()
                n = layer.linear_attn
                self.fused[i] = torch.cat([n.in_proj_qkv.weight, n.in_proj_z.weight, n.in_proj_b.weight, n.in_proj_a.weight])
            mlp = layer.mlp
            shared = mlp.shared_expert
            self.fused[-1 - i] = torch.cat(
                [mlp.gate.weight, shared.gate_proj.weight, shared.up_proj.weight, mlp.shared_expert_gate.weight]
            )
        self.neg_a = {i: -layer.linear_attn.A_log.float().exp() for i, layer in enumerate(self.model.model.layers) if not layer.is_attention}

    def _forward(self) -> torch.Tensor:
        m, c = self.model, self.c
        if not hasattr(self, "fused"):
            self._fuse_weights()
        rope = rope_cos_sin(self.position, c.rotary_dim, c.rope_theta, self.dtype)
        x = m.model.embed_tokens(self.token)  # [1, H]
        h = None
        for layer in m.model.layers:
            x, normed = add_rms_norm(x, h, layer.input_layernorm.weight, c.rms_norm_eps)
            if layer.is_attention:
                h = self._attention(layer.self_attn, normed, rope, layer.layer)
            else:
                h = self._deltanet(layer.linear_attn, normed, layer.layer)
            x, normed = add_rms_norm(x, h, layer.post_attention_layernorm.weight, c.rms_norm_eps)
            h = self._moe(layer.mlp, normed, layer.layer)
        _, normed = add_rms_norm(x, h, m.model.norm.weight, c.rms_norm_eps)
        return m.logits(normed[0])

    def _attention(self, attn, x: torch.Tensor, rope, layer: int) -> torch.Tensor:
        c = self.c
        q_dim, kv_dim = attn.num_heads * attn.head_dim * 2, c.num_key_value_heads * attn.head_dim
        q, k, v = F.linear(x, self.fused[layer]).split([q_dim, kv_dim, kv_dim], dim=-1)
        q, gate = q.view(1, attn.num_heads, 2 * attn.head_dim).chunk(2, dim=-1)
        q = apply_rope(add_rms_norm(q, None, attn.q_norm.weight, c.rms_norm_eps)[1], *rope)  # [1, Hq, D]
        k = apply_rope(add_rms_norm(k.view(1, -1, attn.head_dim), None, attn.k_norm.weight, c.rms_norm_eps)[1], *rope)
        self.k[layer].index_copy_(0, self.position, k)
        self.v[layer].index_copy_(0, self.position, v.view(1, -1, attn.head_dim))
        out = decode_attention(q[0], self.k[layer], self.v[layer], self.position + 1)  # [Hq, D]
        return attn.o_proj(out.reshape(1, -1) * torch.sigmoid(gate.reshape(1, -1)))

    def _deltanet(self, net, x: torch.Tensor, layer: int) -> torch.Tensor:
        c = self.c
        if layer in self.fused:
            hv = c.linear_num_value_heads
            mixed, z, b, a = F.linear(x, self.fused[layer]).split([c.conv_dim, c.linear_value_dim, hv, hv], dim=-1)
        else:
            mixed, z, b, a = net.project(x)  # [1, conv_dim], [1, Hv*Dv], [1, Hv], [1, Hv]
        mixed, conv, _ = self.kernels.causal_conv(mixed, self.conv[layer], net.conv1d.weight[:, 0], [])
        self.conv[layer].copy_(conv)
        q, k, v = mixed.split([c.linear_key_dim, c.linear_key_dim, c.linear_value_dim], dim=-1)
        q = q.reshape(1, -1, c.linear_key_head_dim)
        k = k.reshape(1, -1, c.linear_key_head_dim)
        v = v.reshape(1, -1, c.linear_value_head_dim)
        g = self.neg_a[layer] * F.softplus(a.float() + net.dt_bias)
        out, rec = self.kernels.recurrent_gated_delta_rule(q, k, v, g, b.sigmoid(), self.rec[layer])
        self.rec[layer].copy_(rec)
        out = gated_rms_norm(out, z.view(1, -1, c.linear_value_head_dim), net.norm.weight, c.rms_norm_eps)
        return net.out_proj(out.reshape(1, -1))

    def _moe(self, mlp, x: torch.Tensor, layer: int) -> torch.Tensor:
        c = self.c
        inter = c.shared_expert_intermediate_size
        router, gate, up, shared_gate = F.linear(x, self.fused[-1 - layer]).split([c.num_experts, inter, inter, 1], dim=-1)
        probs = F.softmax(router, dim=-1, dtype=torch.float)
        weights, ids = torch.topk(probs, c.num_experts_per_tok, dim=-1)
        if c.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        routed = self.kernels.moe_experts(x, weights.to(x.dtype), ids, mlp.experts.gate_up_proj, mlp.experts.down_proj)
        shared = mlp.shared_expert.down_proj(F.silu(gate) * up)
        return routed + torch.sigmoid(shared_gate) * shared
