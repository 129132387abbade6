"""Export any model the engine loads (an HF folder or a preset) to GGUF for llama.cpp.

Architectures: Qwen3.5/3.6-MoE → `qwen35moe`, Qwen3-Next → `qwen3next`. The tensor names,
metadata keys and transforms are the ones llama.cpp's loader expects; the name table and the
transforms live in `engine.gguf_layout`, shared with the engine's GGUF loader (their inverse).
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

import gguf
import numpy as np
import torch

from engine.config import ModelConfig
from engine.gguf_layout import GGUF_ARCH, to_gguf
from engine.loader import read_state_dict
from peer.gguf_vocab import add_vocab, qwen_vocab

ROPE_SECTIONS = [11, 11, 10, 0]  # Qwen3.5's interleaved MRoPE; text positions are equal in all sections
TEMPLATE = Path(__file__).resolve().parent.parent / "gateway" / "render" / "templates" / "qwen3_6.jinja"
FILE_TYPES = {
    "f32": gguf.LlamaFileType.ALL_F32,
    "f16": gguf.LlamaFileType.MOSTLY_F16,
    "bf16": gguf.LlamaFileType.MOSTLY_BF16,
    "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,  # gguf's quantizer (bit-exact with ggml's reference)
}
# K-quant mixes: written as f32, then requantized by llama.cpp's own `llama-quantize`, which picks
# each tensor's type (and falls back where a row is not a multiple of 256: Q5_0, Q5_1, Q8_0)
LLAMA_QUANTIZE = {"q4_k_m": "Q4_K_M", "q5_k_m": "Q5_K_M", "q6_k": "Q6_K"}
DTYPES = sorted([*FILE_TYPES, *LLAMA_QUANTIZE])
F32_SUFFIXES = ("_norm.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight")


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
    if dtype == "q8_0":
        q8 = gguf.GGMLQuantizationType.Q8_0
        if t.shape[-1] % 32:
            return t.float().contiguous().cpu().numpy(), gguf.GGMLQuantizationType.F32
        return gguf.quants.quantize(t.float().contiguous().cpu().numpy(), q8), q8
    return t.bfloat16().contiguous().view(torch.int16).cpu().numpy(), gguf.GGMLQuantizationType.BF16


def open_writer(
    c: ModelConfig,
    raw: dict,
    path: Path,
    file_type: gguf.LlamaFileType,
    name: str,
    chat_template: str | None = None,
    split_tensors: int = 0,
) -> gguf.GGUFWriter:
    """A writer for `path` holding the model's metadata, vocabulary and chat template (ours by
    default), to which the tensors are added next."""
    if c.arch not in GGUF_ARCH:
        raise ValueError(f"no GGUF architecture for {c.arch}")
    if c.linear_key_head_dim != c.linear_value_head_dim and c.arch == "qwen3_5_moe":
        raise ValueError("llama.cpp's qwen35moe needs equal DeltaNet key and value head sizes")
    template = (
        chat_template if chat_template is not None else (TEMPLATE.read_text() if TEMPLATE.is_file() else None)
    )
    w = gguf.GGUFWriter(str(path), GGUF_ARCH[c.arch], split_max_tensors=split_tensors)
    add_hparams(w, c, raw, name)
    w.add_file_type(file_type)
    add_vocab(w, qwen_vocab(c.vocab_size), template)
    return w


def write_gguf(
    c: ModelConfig,
    raw: dict,
    state_dict: dict[str, torch.Tensor],
    out: str | Path,
    dtype: str = "f32",
    chat_template: str | None = None,
    split_tensors: int = 0,
) -> Path:
    """Write a model (its config, raw config.json dict and in-memory state dict) as one GGUF file,
    atomically (a file at `out` is complete); returns `out`. `dtype`: one of `DTYPES`. With
    `split_tensors`, as llama.cpp's split files of that many tensors each (`NAME-00001-of-0000N.gguf`,
    not atomically); returns the first part."""
    out = Path(out)
    if dtype in LLAMA_QUANTIZE:
        source = write_gguf(c, raw, state_dict, out.with_name(out.name + ".f32.tmp"), "f32", chat_template)
        return requantize(source, out, dtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp") if not split_tensors else out
    w = open_writer(
        c, raw, tmp, FILE_TYPES[dtype], raw.get("ft_preset") or out.stem, chat_template, split_tensors
    )
    for name, tensor in to_gguf(c, state_dict):  # (GGUF name, fp32 tensor) for every weight
        array, qtype = to_numpy(name, tensor, dtype)
        plain = qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
        w.add_tensor(name, array, raw_dtype=None if plain else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=True)
    w.close()
    if split_tensors:
        return w.format_shard_names(out)[0]
    tmp.rename(out)
    return out


def requantize(source: Path, out: Path, dtype: str) -> Path:
    """`source` (f32) requantized to `dtype` by llama-quantize (built on first use) at `out`; `source`
    is removed."""
    from peer.llama_server import build  # noqa: PLC0415

    binary = build(target="llama-quantize")
    tmp = out.with_name(out.name + ".tmp")
    try:
        subprocess.run(
            [str(binary), str(source), str(tmp), LLAMA_QUANTIZE[dtype]], check=True, capture_output=True
        )
    except subprocess.CalledProcessError as exc:
        raise RuntimeError(
            f"llama-quantize {LLAMA_QUANTIZE[dtype]} failed: {exc.stderr.decode()[-2000:]}"
        ) from None
    finally:
        source.unlink(missing_ok=True)
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


def export_dequantized(path: str | Path, out: str | Path) -> Path:
    """A quantized GGUF model's weights, as our loader dequantizes them, written as an f32 GGUF
    (llama.cpp then computes with exactly those values); `out` if it exists."""
    from engine.gguf_loader import config_dict, open_gguf, read_gguf_state_dict  # noqa: PLC0415

    out = Path(out)
    if out.is_file():
        return out
    model = open_gguf(path)
    raw = {**config_dict(model), "ft_preset": Path(path).stem}
    c = ModelConfig.from_dict(raw)
    return write_gguf(c, raw, read_gguf_state_dict(model, c, torch.float32), out, "f32")


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
    p.add_argument("--dtype", choices=DTYPES, default="f32")
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
