"""Partial rotary position embedding (rotate-half form, on the first `rotary_dim` dims of a head)."""

from __future__ import annotations

import torch

from engine.ops.norm import rms_norm


def rope_cos_sin(
    positions: torch.Tensor, rotary_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [T, rotary_dim] for integer positions [T]."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float, device=positions.device) / rotary_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, rotary_dim/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos/sin: [T, R] with R <= D; the last D - R dims pass through."""
    rd = cos.shape[-1]
    rot, rest = x[..., :rd], x[..., rd:]
    rot = rot * cos[:, None, :] + _rotate_half(rot) * sin[:, None, :]
    return torch.cat([rot, rest], dim=-1)


def norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """A head's zero-centred RMSNorm (q_norm / k_norm), then the partial rotary embedding: x [T, H, D]."""
    return apply_rope(rms_norm(x, weight, eps), cos, sin)
