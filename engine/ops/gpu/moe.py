"""Routed experts through grouped GEMMs: one launch per projection for all experts, no host sync
(so the same code runs inside a CUDA graph)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.ops.moe import experts_loop

_grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm
SMALL_GATHER_ROWS = 64  # fp32 (tests): gather the few hit experts' weights and batch-matmul them


def group_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] -> order [T*k] (assignments sorted by expert) and offs [E] int32 (end of each
    expert's rows), computed on the device."""
    flat = ids.flatten()
    order = torch.argsort(flat)
    experts = torch.arange(num_experts, device=ids.device, dtype=flat.dtype)
    offs = torch.searchsorted(flat[order], experts, right=True).to(torch.int32)
    return order, offs


def experts_grouped(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """x: [T, H]; weights, ids: [T, k]; gate_up: [E, 2I, H]; down: [E, H, I]. Returns [T, H]."""
    if x.dtype != torch.bfloat16:
        return _experts_gathered(x, weights, ids, gate_up, down)
    num_tokens, top_k = ids.shape
    order, offs = group_by_expert(ids, gate_up.shape[0])
    xs = x[order // top_k]  # [T*k, H], rows grouped by expert
    gate, up = _grouped_mm(xs, gate_up.transpose(1, 2), offs=offs).chunk(2, dim=-1)  # [T*k, I] each
    ys = _grouped_mm(F.silu(gate) * up, down.transpose(1, 2), offs=offs)  # [T*k, H]
    ys = ys.float() * weights.flatten()[order, None].float()
    out = torch.empty_like(ys)
    out[order] = ys
    return out.view(num_tokens, top_k, -1).sum(1).to(x.dtype)


def _experts_gathered(x, weights, ids, gate_up, down):
    if ids.numel() > SMALL_GATHER_ROWS:
        return experts_loop(x, weights, ids, gate_up, down)
    num_tokens, top_k = ids.shape
    flat = ids.flatten()
    xs = x.repeat_interleave(top_k, dim=0)[:, None, :]  # [T*k, 1, H]
    gate, up = torch.bmm(xs, gate_up[flat].transpose(1, 2)).chunk(2, dim=-1)  # [T*k, 1, I]
    ys = torch.bmm(F.silu(gate) * up, down[flat].transpose(1, 2))[:, 0]  # [T*k, H]
    ys = ys * weights.flatten()[:, None]
    return ys.view(num_tokens, top_k, -1).sum(1)
