"""Gated DeltaNet on the GPU through fla-core's Triton kernels (bf16/fp16; fp32 runs the reference
scan on the GPU, since fla's fp32 dots are tf32 and fp32 is the exactness mode).

Same contract as `engine.ops.deltanet`: q, k [T, Hk, Dk]; v [T, Hv, Dv]; g, beta [T, Hv];
state [Hv, Dk, Dv] fp32. fla takes [B, T, H, D] and maps value head i to key head
i // (Hv / Hk), the same consecutive grouping as the reference's repeat_interleave, so no copy
of q/k per value head is made. q/k are L2-normalised (once per call, not per segment) and q is
scaled by Dk^-0.5 in the kernel.

Captures split the scan: fla's final state is fp32 (its per-chunk states are not), so each
capture position ends one segment. Inputs are made contiguous once; segments along T of a
[1, T, H, D] tensor are then contiguous views, and each segment calls fla's forward directly
(no autograd Function, no per-segment copies or l2norm).
"""

from __future__ import annotations

import torch
import triton
from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_recurrent

import engine.ops.deltanet as reference
from engine.ops.gpu import spans

try:  # fla-core 0.6 internals; the public API below is the fallback
    from fla.modules.norm.l2norm import l2norm_fwd
    from fla.ops.common.chunk_delta_h import (
        chunk_gated_delta_rule_fwd_kernel_h_blockdim64 as fla_state_kernel,
    )
    from fla.ops.common.chunk_o import chunk_fwd_o
    from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_fwd
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2
except ImportError:  # pragma: no cover
    chunk_gated_delta_rule_fwd = None


def _segment(q, k, v, g, beta, h, normalised: bool):
    """One scan over [1, t, H, D] contiguous inputs from state h [1, Hv, Dk, Dv]: out, final state."""
    if normalised:
        out = chunk_gated_delta_rule_fwd(q=q, k=k, v=v, g=g, beta=beta, scale=q.shape[-1] ** -0.5,
                                         initial_state=h, output_final_state=True)
        return out[1].to(q.dtype), out[3]
    return fla_chunk(q, k, v, g, beta=beta, initial_state=h, output_final_state=True, use_qk_l2norm_in_kernel=True)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    capture_at: list[int],
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Prefill scan; returns out [T, Hv, Dv], the final fp32 state and the state after each offset
    in `capture_at`."""
    if q.dtype == torch.float32:
        return reference.chunk_gated_delta_rule(q, k, v, g, beta, state, capture_at)
    q, k, v, g, beta = (x.unsqueeze(0).contiguous() for x in (q, k, v, g.float(), beta))  # [1, T, H, *]
    normalised = chunk_gated_delta_rule_fwd is not None
    if normalised:
        q, k = l2norm_fwd(q)[0], l2norm_fwd(k)[0]
    h = state.float().unsqueeze(0).contiguous()  # [1, Hv, Dk, Dv]
    outs, captured, lo = [], [], 0
    for hi in sorted({*capture_at, q.shape[1]}):
        out, h = _segment(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], g[:, lo:hi], beta[:, lo:hi], h, normalised)
        outs.append(out[0])  # [hi - lo, Hv, Dv]
        if hi in capture_at:
            captured.append(h[0])
        lo = hi
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out, h[0], captured


def chunk_gated_delta_rule_spans(q, k, v, g, beta, states, bounds, capture_ats):
    """`engine.ops.deltanet.chunk_gated_delta_rule_spans`'s contract: several sequences' rows, each
    from its own state. Their segments between captures run round by round (`engine.ops.gpu.spans`,
    `_FlaRounds`); q and k are normalised once for all rows. One sequence without captures, fp32,
    or fla without its forward internals: scan by scan."""
    one = len(bounds) == 1 and not capture_ats[0]
    if one or q.dtype == torch.float32 or chunk_gated_delta_rule_fwd is None:
        return reference.chunk_gated_delta_rule_spans(q, k, v, g, beta, states, bounds, capture_ats,
                                                      scan=chunk_gated_delta_rule)
    where = spans.layout(tuple(bounds), tuple(map(tuple, capture_ats)), q.device)
    q, k = l2norm_fwd(q.contiguous())[0], l2norm_fwd(k.contiguous())[0]
    return spans.scan_rounds(where, q, k, v.contiguous(), g.float().contiguous(), beta.contiguous(), states,
                             _FlaRounds)


class _FlaRounds:
    """fla's chunked forward split where the rounds need it: what each chunk computes from its own
    rows (the gates' cumulative sums in log2 units, the WY representation w, u) once over every
    round's segments, then fla's state kernel round by round (each a slice of the segments, writing
    every chunk's state and new values into buffers of all of them), then the outputs once."""

    def __init__(self, q, k, v, g, beta, where: spans.SpanLayout):
        cu, chunks = where.cu_seqlens, where.chunk_indices
        self.where = where
        self.q, self.k = q.unsqueeze(0), k.unsqueeze(0)  # [1, T, Hk, Dk]
        self.g = chunk_local_cumsum(g.unsqueeze(0), chunk_size=spans.CHUNK, scale=RCP_LN2, cu_seqlens=cu,
                                    chunk_indices=chunks)
        self.w, self.u, _ = chunk_gated_delta_rule_fwd_intra(k=self.k, v=v.unsqueeze(0), g=self.g, beta=beta.unsqueeze(0),
                                                             cu_seqlens=cu, chunk_indices=chunks, chunk_size=spans.CHUNK)
        hv, dk, dv = v.shape[1], k.shape[2], v.shape[2]
        self.h = k.new_empty(1, len(chunks), hv, dk, dv)  # every chunk's state at its start
        self.v_new = torch.empty_like(self.u)

    def carry(self, h0, rnd: spans.Round, finals) -> None:
        _, rows, hk, dk = self.k.shape
        hv, dv = self.u.shape[2], self.u.shape[3]
        fla_state_kernel[lambda meta: (triton.cdiv(dv, meta["BV"]) * len(rnd.pieces) * hv,)](
            k=self.k, v=self.u, w=self.w, v_new=self.v_new, g=self.g, gk=None, h=self.h, h0=h0, ht=finals,
            cu_seqlens=rnd.cu_seqlens, chunk_offsets=rnd.chunk_offsets,
            T=rows, H=hk, HV=hv, K=dk, V=dv, BT=spans.CHUNK, STATE_V_FIRST=False,
        )

    def outputs(self) -> torch.Tensor:
        out = chunk_fwd_o(q=self.q, k=self.k, v=self.v_new, h=self.h, g=self.g, scale=self.k.shape[-1] ** -0.5,
                          cu_seqlens=self.where.cu_seqlens, chunk_size=spans.CHUNK,
                          chunk_indices=self.where.chunk_indices)
        return out[0]


def decode_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B sequences (fla's batch dimension): out [B, Hv, Dv], new fp32 states."""
    if q.dtype == torch.float32:
        return reference.decode_gated_delta_rule(q, k, v, g, beta, state)
    out, h = fla_recurrent(
        q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), g.float().unsqueeze(1), beta=beta.unsqueeze(1),
        initial_state=state.float().contiguous(), output_final_state=True, use_qk_l2norm_in_kernel=True,
    )
    return out[:, 0], h
