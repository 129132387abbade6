"""Sparse MoE: softmax router, top-k (renormalised), experts; the shared expert lives in the layer.

Every experts function takes an expert id of -1 as no expert: its row contributes nothing and no
weight is read for it (an offloaded layer runs its resident experts and those it reads from host
memory as two calls over the same assignments, each with the other's ids at -1). Beyond decode
sizes the GPU's grouped paths need `partial=True` for that (a streamed piece's experts): their
GEMMs leave the absent rows unwritten, and zeroing them is a pass over the rows a plain prefill,
which has none, does not pay."""

from __future__ import annotations

import torch
import torch.nn.functional as F

DECODE_ROWS = 32  # token x expert assignments up to which the GPU's decode kernels run (GEMV-like)


def route(logits: torch.Tensor, top_k: int, renormalise: bool, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> weights [T, k] (in `dtype`) and expert ids [T, k]."""
    probs = F.softmax(logits, dim=-1, dtype=torch.float)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), ids


def experts_loop(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
    partial: bool = False,
) -> torch.Tensor:
    """Reference experts: tokens grouped by expert, one GEMM pair per hit expert.

    x: [T, H]; weights, ids: [T, k]; gate_up: [E, 2I, H]; down: [E, H, I]. Returns [T, H].
    (`partial`: ids that may hold -1 at any size, always so here.)
    """
    out = torch.zeros_like(x)
    flat_ids = ids.flatten()
    order = torch.argsort(flat_ids, stable=True)  # the absent (-1) first, skipped
    absent, *counts = torch.bincount(flat_ids + 1, minlength=gate_up.shape[0] + 1).tolist()
    token_of = order // ids.shape[1]  # [T*k] token index of each sorted assignment
    weight_of = weights.flatten()[order]
    start = absent
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        tokens = token_of[start : start + count]
        gate, up = F.linear(x[tokens], gate_up[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[expert]) * weight_of[start : start + count, None]
        out.index_add_(0, tokens, y.to(out.dtype))
        start += count
    return out
