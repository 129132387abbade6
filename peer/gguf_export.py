"""Export any model the engine loads (an HF folder or a preset) to GGUF for llama.cpp.

Architectures: Qwen3.5/3.6-MoE → `qwen35moe`, Qwen3-Next → `qwen3next`. The tensor names,
metadata keys and the transforms are the ones llama.cpp's loader expects (as its own HF
converter writes them); the transforms, applied here from our loader's in-memory names:

- zero-centred RMSNorm weights are folded: `w` → `1 + w` (llama.cpp multiplies by the weight);
  the DeltaNet output norm (`linear_attn.norm`, a plain RMSNorm) is left as is;
- `A_log` → `ssm_a = -exp(A_log)`; `dt_bias` → `ssm_dt.bias`;
- `conv1d.weight` [C, 1, K] → `ssm_conv1d` [C, K];
- experts are stacked per layer: `ffn_gate_exps`/`ffn_up_exps` [E, I, H], `ffn_down_exps` [E, H, I];
- Qwen3-Next's fused `in_proj_qkvz` (per key head: q, k, v-group, z-group) is split into
  `attn_qkv` (all q ‖ all k ‖ all v) and `attn_gate` (z); `in_proj_ba` is `ssm_ba` unchanged;
- Qwen3.5: where there are more value heads than key heads, value heads are reordered from
  grouped (by key head) to tiled order in every tensor that carries them (ggml broadcasts
  key heads by tiling), and the rope sections key required by `qwen35moe` is written.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import torch

from engine.config import ModelConfig
from engine.loader import read_state_dict
from peer.gguf_vocab import add_vocab, qwen_vocab

GGUF_ARCH = {"qwen3_5_moe": "qwen35moe", "qwen3_next": "qwen3next"}
ROPE_SECTIONS = [11, 11, 10, 0]  # Qwen3.5's interleaved MRoPE; text positions are equal in all sections
TEMPLATE = Path(__file__).resolve().parent.parent / "gateway" / "render" / "templates" / "qwen3_6.jinja"
FILE_TYPES = {
    "f32": gguf.LlamaFileType.ALL_F32,
    "f16": gguf.LlamaFileType.MOSTLY_F16,
    "bf16": gguf.LlamaFileType.MOSTLY_BF16,
}

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
F32_SUFFIXES = ("_norm.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight")
ZERO_CENTRED = ("layernorm.weight", "q_norm.weight", "k_norm.weight", "model.norm.weight")


def gguf_tensors(c: ModelConfig, state_dict: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
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
            t = tile_value_heads(c, key, t)
        if key not in LAYER_NAMES:
            raise KeyError(f"no GGUF name for {name}")
        yield blk + LAYER_NAMES[key], t


def split_qkvz(c: ModelConfig, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-Next in_proj_qkvz [Hk*(2Dk + 2gDv), H] → qkv [2Hk*Dk + Hv*Dv, H], z [Hv*Dv, H]."""
    group = c.linear_num_value_heads // c.linear_num_key_heads
    dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
    w = w.view(c.linear_num_key_heads, -1, w.shape[-1])  # [Hk, 2Dk + 2gDv, H]
    q, k, v, z = w.split([dk, dk, group * dv, group * dv], dim=1)
    flat = [x.reshape(-1, w.shape[-1]) for x in (q, k, v, z)]
    return torch.cat(flat[:3]), flat[3]


def tile_value_heads(c: ModelConfig, key: str, t: torch.Tensor) -> torch.Tensor:
    """Value heads grouped by key head [k0v0, k0v1, k1v0, …] → tiled [k0v0, k1v0, k0v1, …]."""
    hk, hv = c.linear_num_key_heads, c.linear_num_value_heads
    if hk == hv:
        return t
    group, dv = hv // hk, c.linear_value_head_dim

    def tile(x: torch.Tensor, dim: int, head_dim: int) -> torch.Tensor:
        shape = list(x.shape)
        x = x.reshape(*shape[:dim], hk, group, head_dim, *shape[dim + 1 :])
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


def add_hparams(w: gguf.GGUFWriter, c: ModelConfig, raw: dict, name: str) -> None:
    w.add_name(name)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    if (text := raw.get("text_config") or raw).get("intermediate_size"):
        w.add_feed_forward_length(text["intermediate_size"])
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(c.rope_theta)
    w.add_rope_dimension_count(c.rotary_dim)
    if c.arch == "qwen3_5_moe":
        w.add_rope_dimension_sections(ROPE_SECTIONS)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_expert_count(c.num_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    w.add_expert_weights_norm(c.norm_topk_prob)
    w.add_ssm_conv_kernel(c.linear_conv_kernel_dim)
    w.add_ssm_state_size(c.linear_key_head_dim)
    w.add_ssm_group_count(c.linear_num_key_heads)
    w.add_ssm_time_step_rank(c.linear_num_value_heads)
    w.add_ssm_inner_size(c.linear_value_dim)
    w.add_array(f"{w.arch}.attention.recurrent_layers", [t == "linear_attention" for t in c.layer_types])
    w.add_full_attention_interval(
        c.attention_layers[0] + 1 if c.attention_layers else c.num_hidden_layers + 1
    )


def keeps_f32(name: str, t: torch.Tensor) -> bool:
    """Tensors llama.cpp wants in fp32 whatever the file type: 1-D ones (norms, biases, ssm_a), the
    routers, and the conv kernel (its CPU ssm_conv op is fp32 only)."""
    return t.ndim == 1 or not name.endswith(".weight") or name.endswith(F32_SUFFIXES)


def to_numpy(name: str, t: torch.Tensor, dtype: str) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
    """The tensor as written, converted where it lives (a GPU for materialised presets), then copied to host."""
    if dtype == "f32" or keeps_f32(name, t):
        return t.float().contiguous().cpu().numpy(), gguf.GGMLQuantizationType.F32
    if dtype == "f16":
        return t.half().contiguous().cpu().numpy(), gguf.GGMLQuantizationType.F16
    return t.bfloat16().contiguous().view(torch.int16).cpu().numpy(), gguf.GGMLQuantizationType.BF16


def write_gguf(
    c: ModelConfig,
    raw: dict,
    state_dict: dict[str, torch.Tensor],
    out: str | Path,
    dtype: str = "f32",
    chat_template: str | None = None,
) -> Path:
    """Write a model (its config, raw config.json dict and in-memory state dict) as one GGUF file,
    atomically (a file at `out` is complete); returns `out`."""
    out = Path(out)
    if c.arch not in GGUF_ARCH:
        raise ValueError(f"no GGUF architecture for {c.arch}")
    if c.linear_key_head_dim != c.linear_value_head_dim and c.arch == "qwen3_5_moe":
        raise ValueError("llama.cpp's qwen35moe needs equal DeltaNet key and value head sizes")
    template = (
        chat_template if chat_template is not None else (TEMPLATE.read_text() if TEMPLATE.is_file() else None)
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), GGUF_ARCH[c.arch])
    add_hparams(w, c, raw, raw.get("ft_preset") or out.stem)
    w.add_file_type(FILE_TYPES[dtype])
    add_vocab(w, qwen_vocab(c.vocab_size), template)
    for name, tensor in gguf_tensors(c, state_dict):
        array, qtype = to_numpy(name, tensor, dtype)
        w.add_tensor(name, array, raw_dtype=qtype if qtype == gguf.GGMLQuantizationType.BF16 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=True)
    w.close()
    tmp.rename(out)
    return out


def export_gguf(
    model_dir: str | Path, out: str | Path, dtype: str = "f32", chat_template: str | None = None
) -> Path:
    """Write `model_dir` (an HF folder) as one GGUF file at `out`; returns `out`."""
    import json  # noqa: PLC0415

    model_dir = Path(model_dir)
    raw = json.loads((model_dir / "config.json").read_text())
    raw.setdefault("ft_preset", model_dir.name)
    c = ModelConfig.from_folder(model_dir)
    return write_gguf(c, raw, read_state_dict(model_dir, None), out, dtype, chat_template)


def export_preset_gguf(preset: str, out: str | Path, dtype: str = "bf16", device: str = "cpu") -> Path:
    """Write preset `preset` as GGUF from weights built in memory on `device` (the same values
    `Engine.from_preset` builds with FT_MATERIALISE=1), with no HF folder on disk."""
    from engine.presets import materialise  # noqa: PLC0415

    config, raw, state_dict = materialise(preset, device)
    out = write_gguf(config, raw, state_dict, out, dtype)
    del state_dict
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()  # give the weights' device memory back before a server starts
    return out


def preset_gguf(preset: str, models_dir: Path, dtype: str = "f32", materialise_on: str | None = None) -> Path:
    """The GGUF of preset `preset` in `models_dir`, exported on first use: from its HF folder, or
    from weights built on device `materialise_on`. Named after the preset's folder, whose name
    carries the preset revision, so a GGUF of older weights is never reused."""
    from engine.engine import ensure_preset  # noqa: PLC0415
    from engine.presets import default_model_dir  # noqa: PLC0415

    out = models_dir / f"{default_model_dir(preset).name}-{dtype}.gguf"
    if out.is_file():
        return out
    if materialise_on is not None:
        return export_preset_gguf(preset, out, dtype, materialise_on)
    return export_gguf(ensure_preset(preset), out, dtype)


def ensure_gguf(model_dir: str | Path, out: str | Path, dtype: str = "f32") -> Path:
    """`out` if it exists (exports are written atomically), else a fresh export."""
    out = Path(out)
    return out if out.is_file() else export_gguf(model_dir, out, dtype)


def main(argv: list[str] | None = None) -> None:
    from engine.engine import ensure_preset  # noqa: PLC0415

    p = argparse.ArgumentParser(description="Export an engine model (HF folder or preset) to GGUF.")
    p.add_argument("model", help="an HF model folder, or a preset name (tiny, tiny-next, small, …)")
    p.add_argument("out", help="output .gguf path")
    p.add_argument("--dtype", choices=sorted(FILE_TYPES), default="f32")
    p.add_argument(
        "--materialise",
        metavar="DEVICE",
        help="build a preset's weights in memory on DEVICE (cpu, cuda) instead of writing its HF folder first",
    )
    args = p.parse_args(argv)
    if Path(args.model).is_dir():
        print(export_gguf(args.model, args.out, args.dtype))
    elif args.materialise:
        print(export_preset_gguf(args.model, args.out, args.dtype, args.materialise))
    else:
        print(export_gguf(ensure_preset(args.model), args.out, args.dtype))


if __name__ == "__main__":
    main()
