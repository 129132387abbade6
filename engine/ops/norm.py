"""RMS norms: zero-centred (`1 + w`, Qwen3-Next / Qwen3.5) and gated (DeltaNet output)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm: normalise in fp32, scale by `1 + weight`, cast back."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).type_as(x)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """(x + residual, zero-centred rms_norm of it), the sum rounded to x's dtype as the model adds;
    without a residual, (x, rms_norm(x))."""
    s = x if residual is None else x + residual
    return s, rms_norm(s, weight, eps)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of `x` (plain `weight`), then multiplied by SiLU(gate); computed as HF/fla do."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * xf.to(dtype)
    return (out * F.silu(gate.float())).to(dtype)
