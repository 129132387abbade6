"""How our (HF) tensors are laid out in a llama.cpp GGUF file, both ways.

The names, metadata and transforms are the ones llama.cpp's loader expects (as its own HF
converter writes them), for Qwen3.5/3.6-MoE (`qwen35moe`) and Qwen3-Next (`qwen3next`):

- zero-centred RMSNorm weights are folded: `w` → `1 + w` (llama.cpp multiplies by the weight);
  the DeltaNet output norm (`linear_attn.norm`, a plain RMSNorm) is left as is;
- `A_log` → `ssm_a = -exp(A_log)`; `dt_bias` → `ssm_dt.bias`;
- `conv1d.weight` [C, 1, K] → `ssm_conv1d` [C, K];
- experts are stacked per layer: `ffn_gate_exps`/`ffn_up_exps` [E, I, H], `ffn_down_exps` [E, H, I];
- Qwen3-Next's fused `in_proj_qkvz` (per key head: q, k, v-group, z-group) is split into
  `attn_qkv` (all q ‖ all k ‖ all v) and `attn_gate` (z); `in_proj_ba` is `ssm_ba` unchanged;
- Qwen3.5: where there are more value heads than key heads, value heads are reordered from
  grouped (by key head) to tiled order in every tensor that carries them (ggml broadcasts
  key heads by tiling).

`to_gguf` (the exporter) and `from_gguf` (the GGUF loader) are inverses. Quantization is per
GGML row (the last PyTorch dim), so it commutes with every transform but one: Qwen3.5's
`out_proj` has its value heads along the row, so its quantized blocks mix heads in tiled order.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from engine.config import ModelConfig

GGUF_ARCH = {"qwen3_5_moe": "qwen35moe", "qwen3_next": "qwen3next"}
HF_ARCH = {"qwen35moe": "Qwen3_5MoeForCausalLM", "qwen3next": "Qwen3NextForCausalLM"}

LAYER_NAMES = {  # our (HF) name inside `model.layers.N.` → GGUF name inside `blk.N.`
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
    "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.in_proj_ba.weight": "ssm_ba.weight",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
ZERO_CENTRED = ("layernorm.weight", "q_norm.weight", "k_norm.weight", "model.norm.weight")
# GGUF names (inside blk.N.) whose HF tensor is built from two GGUF tensors
FUSED = {"ffn_gate_exps.weight", "ffn_up_exps.weight"}
NEXT_FUSED = {"attn_qkv.weight", "attn_gate.weight"}
GGUF_LAYER_NAMES = {v: k for k, v in LAYER_NAMES.items()}
GGUF_GLOBAL_NAMES = {v: k for k, v in GLOBAL_NAMES.items()}


def to_gguf(c: ModelConfig, state_dict: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """(GGUF name, fp32 tensor in PyTorch layout) for every weight of the model."""
    for name, tensor in state_dict.items():
        t = tensor.float()
        if name.endswith(ZERO_CENTRED):
            t = t + 1
        if name in GLOBAL_NAMES:
            yield GLOBAL_NAMES[name], t
            continue
        _, _, layer, key = name.split(".", 3)
        blk = f"blk.{layer}."
        if key == "linear_attn.in_proj_qkvz.weight":
            qkv, z = split_qkvz(c, t)
            yield blk + "attn_qkv.weight", qkv
            yield blk + "attn_gate.weight", z
            continue
        if key == "mlp.experts.gate_up_proj":  # [E, 2I, H]
            gate, up = t.chunk(2, dim=1)
            yield blk + "ffn_gate_exps.weight", gate
            yield blk + "ffn_up_exps.weight", up
            continue
        if key == "linear_attn.A_log":
            t = -t.exp()
        elif key == "linear_attn.conv1d.weight":
            t = t.squeeze(1)  # [C, K]
        elif key == "mlp.shared_expert_gate.weight":
            t = t.reshape(-1)  # [1, H] → [H]
        if c.arch == "qwen3_5_moe" and key.startswith("linear_attn."):
            t = permute_value_heads(c, key, t)
        if key not in LAYER_NAMES:
            raise KeyError(f"no GGUF name for {name}")
        yield blk + LAYER_NAMES[key], t


def from_gguf(c: ModelConfig, layer: int, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One block's GGUF tensors (names inside `blk.N.`, fp32 in PyTorch layout) → our tensors."""
    out: dict[str, torch.Tensor] = {}
    prefix = f"model.layers.{layer}."
    next_fused = c.arch == "qwen3_next" and NEXT_FUSED <= tensors.keys()
    for key, t in tensors.items():
        if key in FUSED or (next_fused and key in NEXT_FUSED):
            continue
        ours = GGUF_LAYER_NAMES[key]
        if c.arch == "qwen3_5_moe" and ours.startswith("linear_attn."):
            t = permute_value_heads(c, ours, t, inverse=True)
        if ours == "linear_attn.A_log":
            t = (-t).log()
        elif ours == "linear_attn.conv1d.weight":
            t = t.unsqueeze(1)  # [C, 1, K]
        elif ours == "mlp.shared_expert_gate.weight":
            t = t.reshape(1, -1)
        elif ours.endswith(ZERO_CENTRED):
            t = t - 1
        out[prefix + ours] = t
    if FUSED <= tensors.keys():
        gate_up = torch.cat([tensors["ffn_gate_exps.weight"], tensors["ffn_up_exps.weight"]], dim=1)
        out[prefix + "mlp.experts.gate_up_proj"] = gate_up  # [E, 2I, H]
    if next_fused:
        qkvz = merge_qkvz(c, tensors["attn_qkv.weight"], tensors["attn_gate.weight"])
        out[prefix + "linear_attn.in_proj_qkvz.weight"] = qkvz
    return out


def from_gguf_global(name: str, t: torch.Tensor) -> tuple[str, torch.Tensor]:
    ours = GGUF_GLOBAL_NAMES[name]
    return ours, (t - 1 if ours.endswith(ZERO_CENTRED) else t)


def split_qkvz(c: ModelConfig, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-Next in_proj_qkvz [Hk*(2Dk + 2gDv), H] → qkv [2Hk*Dk + Hv*Dv, H], z [Hv*Dv, H]."""
    group = c.linear_num_value_heads // c.linear_num_key_heads
    dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
    w = w.view(c.linear_num_key_heads, -1, w.shape[-1])  # [Hk, 2Dk + 2gDv, H]
    q, k, v, z = w.split([dk, dk, group * dv, group * dv], dim=1)
    flat = [x.reshape(-1, w.shape[-1]) for x in (q, k, v, z)]
    return torch.cat(flat[:3]), flat[3]


def merge_qkvz(c: ModelConfig, qkv: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """The inverse of `split_qkvz`."""
    hk, hidden = c.linear_num_key_heads, qkv.shape[-1]
    q, k, v = qkv.split([c.linear_key_dim, c.linear_key_dim, c.linear_value_dim])
    per_head = [x.reshape(hk, -1, hidden) for x in (q, k, v, z)]  # [Hk, ·, H]
    return torch.cat(per_head, dim=1).reshape(-1, hidden)


def permute_value_heads(c: ModelConfig, key: str, t: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Value heads grouped by key head [k0v0, k0v1, k1v0, …] → tiled [k0v0, k1v0, k0v1, …]
    (or back, `inverse`), in the dim of `t` that carries value heads."""
    hk, hv = c.linear_num_key_heads, c.linear_num_value_heads
    if hk == hv:
        return t
    group, dv = hv // hk, c.linear_value_head_dim
    outer, inner = (group, hk) if inverse else (hk, group)

    def tile(x: torch.Tensor, dim: int, head_dim: int) -> torch.Tensor:
        shape = list(x.shape)
        x = x.reshape(*shape[:dim], outer, inner, head_dim, *shape[dim + 1 :])
        return x.transpose(dim, dim + 1).reshape(shape)

    if key in ("linear_attn.in_proj_qkv.weight", "linear_attn.conv1d.weight"):
        qk = 2 * c.linear_key_dim
        return torch.cat([t[:qk], tile(t[qk:], 0, dv)])
    if key == "linear_attn.in_proj_z.weight":
        return tile(t, 0, dv)
    if key in (
        "linear_attn.in_proj_b.weight",
        "linear_attn.in_proj_a.weight",
        "linear_attn.A_log",
        "linear_attn.dt_bias",
    ):
        return tile(t, 0, 1)
    if key == "linear_attn.out_proj.weight":
        return tile(t, 1, dv)
    return t
