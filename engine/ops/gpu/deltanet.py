"""Gated DeltaNet on the GPU through fla-core's Triton kernels.

Same contract as `engine.ops.deltanet`: q, k [T, Hk, Dk]; v [T, Hv, Dv]; g, beta [T, Hv];
state [Hv, Dk, Dv] fp32. fla takes [B, T, H, D] and maps value head i to key head
i // (Hv / Hk), the same consecutive grouping as the reference's repeat_interleave, so no copy
of q/k per value head is made. q/k are L2-normalised in the kernel and q is scaled by Dk^-0.5.
"""

from __future__ import annotations

import torch
from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_recurrent


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    capture_at: list[int],
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Prefill scan, split at each offset in `capture_at` so the fp32 state there is exact
    (fla's final state is fp32; its per-chunk states are not, so they are not read off)."""
    q, k, v, g, beta = (x.unsqueeze(0) for x in (q, k, v, g.float(), beta))  # [1, T, H, *]
    h = state.float().unsqueeze(0)  # [1, Hv, Dk, Dv]
    outs, captured, lo = [], [], 0
    for hi in sorted({*capture_at, q.shape[1]}):
        out, h = fla_chunk(
            q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], g[:, lo:hi], beta=beta[:, lo:hi],
            initial_state=h, output_final_state=True, use_qk_l2norm_in_kernel=True,
        )
        outs.append(out[0])  # [hi - lo, Hv, Dv]
        if hi in capture_at:
            captured.append(h[0])
        lo = hi
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out, h[0], captured


def recurrent_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token recurrence (decode): out [T, Hv, Dv] and the final fp32 state."""
    out, h = fla_recurrent(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.float().unsqueeze(0), beta=beta.unsqueeze(0),
        initial_state=state.float().unsqueeze(0), output_final_state=True, use_qk_l2norm_in_kernel=True,
    )
    return out[0], h[0]
