"""Decode one token at batch 1 through a CUDA graph.

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

from engine.model import HybridForCausalLM
from engine.ops.gpu.attention import decode_attention
from engine.ops.norm import gated_rms_norm
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

    def _forward(self) -> torch.Tensor:
        m = self.model
        rope = rope_cos_sin(self.position, self.c.rotary_dim, self.c.rope_theta, self.dtype)
        x = m.model.embed_tokens(self.token)  # [1, H]
        for layer in m.model.layers:
            h = layer.input_layernorm(x)
            if layer.is_attention:
                h = self._attention(layer.self_attn, h, rope, layer.layer)
            else:
                h = self._deltanet(layer.linear_attn, h, layer.layer)
            x = x + h
            x = x + layer.mlp(layer.post_attention_layernorm(x), self.kernels)
        return m.logits(m.model.norm(x)[0])

    def _attention(self, attn, x: torch.Tensor, rope, layer: int) -> torch.Tensor:
        q, gate = attn.q_proj(x).view(1, attn.num_heads, 2 * attn.head_dim).chunk(2, dim=-1)
        q = apply_rope(attn.q_norm(q), *rope)  # [1, Hq, D]
        k = apply_rope(attn.k_norm(attn.k_proj(x).view(1, -1, attn.head_dim)), *rope)  # [1, Hkv, D]
        v = attn.v_proj(x).view(1, -1, attn.head_dim)
        self.k[layer].index_copy_(0, self.position, k)
        self.v[layer].index_copy_(0, self.position, v)
        out = decode_attention(q[0], self.k[layer], self.v[layer], self.position + 1)  # [Hq, D]
        return attn.o_proj(out.reshape(1, -1) * torch.sigmoid(gate.reshape(1, -1)))

    def _deltanet(self, net, x: torch.Tensor, layer: int) -> torch.Tensor:
        c = self.c
        mixed, z, b, a = net.project(x)  # [1, conv_dim], [1, Hv*Dv], [1, Hv], [1, Hv]
        window = torch.cat([self.conv[layer], mixed.transpose(0, 1)], dim=1)  # [C, K]
        weight = net.conv1d.weight[:, 0]  # [C, K]
        mixed = F.silu((window.float() * weight.float()).sum(-1)).to(self.dtype)[None]  # [1, C]
        self.conv[layer].copy_(window[:, 1:])
        q, k, v = mixed.split([c.linear_key_dim, c.linear_key_dim, c.linear_value_dim], dim=-1)
        q = q.reshape(1, -1, c.linear_key_head_dim)
        k = k.reshape(1, -1, c.linear_key_head_dim)
        v = v.reshape(1, -1, c.linear_value_head_dim)
        beta = b.sigmoid()
        g = -net.A_log.float().exp() * F.softplus(a.float() + net.dt_bias)
        out, rec = self.kernels.recurrent_gated_delta_rule(q, k, v, g, beta, self.rec[layer])
        self.rec[layer].copy_(rec)
        out = gated_rms_norm(out, z.view(1, -1, c.linear_value_head_dim), net.norm.weight, c.rms_norm_eps)
        return net.out_proj(out.reshape(1, -1))
