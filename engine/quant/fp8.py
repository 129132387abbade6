"""Block-scaled FP8 weights, laid out as Qwen's official `-FP8` releases (DeepSeek-V3's format).

`config.json` carries `quantization_config = {"quant_method": "fp8", "fmt": "e4m3",
"activation_scheme": "dynamic", "weight_block_size": [128, 128], "modules_to_not_convert": [...]}`.
Every quantized linear `X.weight` [N, K] is float8_e4m3fn with a sibling `X.weight_scale_inv`
[ceil(N/128), ceil(K/128)]: the weight is `fp8 * scale_inv` per 128x128 block (edge blocks are
partial). Qwen leaves the embedding, lm_head, norms, routers, the shared-expert gate and the
DeltaNet's small projections and state parameters unquantized (`NOT_CONVERTED`); the rest of
the linear weights (attention, DeltaNet in/out projections, experts, shared expert) are FP8.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn
BLOCK = (128, 128)
SCALE_SUFFIX = "_scale_inv"
# modules Qwen's FP8 releases keep in the model's dtype (matched against the module path's end)
NOT_CONVERTED = (
    "lm_head",
    "embed_tokens",
    "input_layernorm",
    "post_attention_layernorm",
    "q_norm",
    "k_norm",
    "linear_attn.A_log",
    "linear_attn.conv1d",
    "linear_attn.dt_bias",
    "linear_attn.in_proj_a",
    "linear_attn.in_proj_b",
    "linear_attn.in_proj_ba",
    "linear_attn.norm",
    "mlp.gate",
    "mlp.shared_expert_gate",
    "norm",
)


class FP8ConfigError(ValueError):
    """A `quantization_config` this engine does not load."""


def block_size(config: dict) -> tuple[int, int] | None:
    """The weight block of an HF config's FP8 `quantization_config`; None if it has none."""
    q = (config.get("text_config") or {}).get("quantization_config") or config.get("quantization_config")
    if q is None:
        return None
    if q.get("quant_method") != "fp8":
        raise FP8ConfigError(f"quantization {q.get('quant_method')!r} is not supported (only Qwen's block fp8)")
    if q.get("fmt", "e4m3") != "e4m3" or q.get("activation_scheme", "dynamic") != "dynamic":
        raise FP8ConfigError(f"fp8 {q.get('fmt')!r} with {q.get('activation_scheme')!r} activations is not supported")
    block = q.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise FP8ConfigError(f"fp8 weight_block_size {block!r}: expected two positive integers (Qwen: [128, 128])")
    return block[0], block[1]


def is_converted(module: str) -> bool:
    """Whether Qwen's FP8 releases quantize the linear `module` (a path without `.weight`)."""
    return not module.endswith(NOT_CONVERTED)


def scale_shape(shape: tuple[int, ...], block: tuple[int, int] = BLOCK) -> tuple[int, ...]:
    return (*shape[:-2], -(-shape[-2] // block[0]), -(-shape[-1] // block[1]))


def expand_scales(scale_inv: torch.Tensor, shape: tuple[int, ...], block: tuple[int, int]) -> torch.Tensor:
    """Per-block scales [.., ceil(N/bn), ceil(K/bk)] → per weight [.., N, K] (fp32)."""
    s = scale_inv.float().repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return s[..., : shape[-2], : shape[-1]]


def dequantize(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = BLOCK, name: str = "weight"
) -> torch.Tensor:
    """FP8 weight [.., N, K] and its block scales → fp32 [.., N, K]."""
    check(weight, scale_inv, block, name)
    return weight.float() * expand_scales(scale_inv, tuple(weight.shape), block)


def check(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], name: str) -> None:
    """An e4m3 weight with scales covering it in `block` blocks, else `FP8ConfigError`."""
    if weight.dtype != FP8:
        raise FP8ConfigError(f"{name}: dtype {weight.dtype}, expected {FP8} beside its weight_scale_inv")
    if tuple(scale_inv.shape) != scale_shape(tuple(weight.shape), block):
        raise FP8ConfigError(
            f"{name}: weight_scale_inv {tuple(scale_inv.shape)} does not cover {tuple(weight.shape)} "
            f"in {list(block)} blocks"
        )


def quantize(
    weight: torch.Tensor, block: tuple[int, int] = BLOCK, scale_dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest block quantization as the releases do it: each block's scale is its
    |max| / 448 (stored in `scale_dtype`; the weights are divided by the stored value)."""
    w = weight.float()
    n, k = w.shape[-2:]
    pad = (0, -k % block[1], 0, -n % block[0])
    blocks = torch.nn.functional.pad(w, pad).unflatten(-1, (-1, block[1])).unflatten(-3, (-1, block[0]))
    amax = blocks.abs().amax(dim=(-3, -1))  # [.., N/bn, K/bk]
    scale_inv = (amax.clamp(min=1e-12) / FP8_MAX).to(scale_dtype)
    q = (w / expand_scales(scale_inv, tuple(w.shape), block)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale_inv


class Pairing:
    """Pairs FP8 weights with their scales while a checkpoint is read (the two may sit in
    different shards) and hands back each weight dequantized to `dtype` once both are seen, or,
    with `pack`, `pack(weight, scale_inv, dtype)` (kept quantized: `engine.ops.gpu.quant.pack_fp8`)."""

    def __init__(self, block: tuple[int, int], dtype: torch.dtype, pack: Callable | None = None):
        self.block, self.dtype, self.pack = block, dtype, pack
        self.pending: dict[str, torch.Tensor] = {}

    @staticmethod
    def holds(name: str, tensor: torch.Tensor) -> bool:
        return name.endswith(SCALE_SUFFIX) or tensor.dtype == FP8

    def take(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        self.pending[name] = tensor
        weight = name.removesuffix(SCALE_SUFFIX)
        if weight not in self.pending or weight + SCALE_SUFFIX not in self.pending:
            return None
        q, scale = self.pending.pop(weight), self.pending.pop(weight + SCALE_SUFFIX)
        if self.pack is not None and self.block == BLOCK:
            check(q, scale, self.block, weight)
            return weight, self.pack(q, scale, self.dtype)
        return weight, dequantize(q, scale, self.block, weight).to(self.dtype)

    def unpaired(self) -> list[str]:
        return sorted(self.pending)
