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

# token x expert assignments up to which the GPU's decode kernels run (one program per assignment, GEMV-
# like); beyond, the grouped GEMMs. Up to 16 tokens the decode kernels read each chosen expert once
# (`engine.ops.gpu.moe.GROUPED_TOKENS`: one tensor-core tile's rows) with no sort of the rows by expert; a
# token reads 9 with its shared expert folded in (`SparseMoe.fold_shared`): 144 keeps batch 16 there.
DECODE_ROWS = 144


def route(
    logits: torch.Tensor, top_k: int, renormalise: bool, dtype: torch.dtype, shared: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> weights [T, k] (in `dtype`) and expert ids [T, k]. With `shared`,
    logits [T, E + 1] end with the shared expert's gate: it joins each token's experts as expert E
    with weight sigmoid(gate), after the top k (k + 1 columns)."""
    probs = F.softmax(logits[:, :-1] if shared else logits, dim=-1, dtype=torch.float)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights.to(dtype)
    if shared:
        gate = logits[:, -1:]
        weights = torch.cat([weights, torch.sigmoid(gate).to(dtype)], dim=-1)
        ids = torch.cat([ids, torch.full_like(gate, logits.shape[1] - 1, dtype=ids.dtype)], dim=-1)
    return weights, ids


def router(
    x: torch.Tensor, w: torch.Tensor, experts: int, top_k: int, renormalise: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] through a router w [E + 1 (+ padding), H] whose row E (`experts`) is the shared
    expert's gate: `route` of those E + 1 logits with the shared expert appended ([T, k + 1])."""
    return route(router_logits(x, w, experts), top_k, renormalise, x.dtype, True)


def router_logits(x: torch.Tensor, w: torch.Tensor, experts: int) -> torch.Tensor:
    """The router's E logits and the shared expert's gate [T, E + 1] (w's padding rows left out)."""
    return F.linear(x, w)[:, : experts + 1]


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
