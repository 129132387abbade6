"""Gated delta rule (reference path): chunked scan for prefill, one recurrent step for decode.

Shapes: q, k [T, Hk, Dk]; v [T, Hv, Dv]; g, beta [T, Hv]; state [Hv, Dk, Dv] fp32.
Each key head serves Hv / Hk consecutive value heads. q and k are L2-normalised here and q is
scaled by Dk^-0.5, as fla's kernels do with `use_qk_l2norm_in_kernel=True`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from engine.ops import conv, gates, norm

CHUNK = 64


def _prepare(q, k, v, g, beta):
    group = v.shape[1] // k.shape[1]
    q = q.float().repeat_interleave(group, dim=1)
    k = k.float().repeat_interleave(group, dim=1)
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    # -> [H, T, D] and [H, T]
    return (x.transpose(0, 1).contiguous() for x in (q, k, v.float(), g.float(), beta.float()))


def _chunk_size(length: int) -> int:
    """CHUNK, or the smallest power of two covering a shorter segment (less padding when a
    capture splits the scan into short pieces)."""
    return CHUNK if length >= CHUNK else max(8, 1 << (length - 1).bit_length())


def _chunk_scan(q, k, v, g, beta, state):
    """One chunked scan over [H, T, *] inputs from `state`; returns out [H, T, Dv], final state."""
    num_heads, length, _ = q.shape
    chunk = _chunk_size(length)
    pad = (chunk - length % chunk) % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (length + pad) // chunk
    v_beta = (v * beta[..., None]).view(num_heads, n, chunk, -1)
    k_beta = (k * beta[..., None]).view(num_heads, n, chunk, -1)
    q, k = q.view(num_heads, n, chunk, -1), k.view(num_heads, n, chunk, -1)
    cum = g.view(num_heads, n, chunk).cumsum(-1)  # [H, N, C]
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()  # [H, N, C, C]
    system = (k_beta @ k.transpose(-1, -2)) * decay
    intra = (q @ k.transpose(-1, -2)) * decay
    # unitriangular solve: the unit diagonal is implied, the (zero) upper triangle ignored
    new_v = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    q = q * cum.exp()[..., None]
    k = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [H, N, 1, 1]
    out = torch.empty_like(new_v)
    for i in range(n):
        v_new = new_v[:, i] - k_cum[:, i] @ state
        out[:, i] = q[:, i] @ state + intra[:, i] @ v_new
        state = state * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    return out.reshape(num_heads, n * chunk, -1)[:, :length], state


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    capture_at: list[int],
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Prefill scan. Returns out [T, Hv, Dv] (input dtype), the final state, and the exact state
    after each offset in `capture_at` (the scan is split there, so no second pass is needed)."""
    dtype = v.dtype
    qh, kh, vh, gh, bh = _prepare(q, k, v, g, beta)
    state = state.float()
    outs, captured, lo = [], [], 0
    for hi in sorted({*capture_at, q.shape[0]}):
        out, state = _chunk_scan(qh[:, lo:hi], kh[:, lo:hi], vh[:, lo:hi], gh[:, lo:hi], bh[:, lo:hi], state)
        outs.append(out)
        if hi in capture_at:
            captured.append(state.clone())
        lo = hi
    return torch.cat(outs, dim=1).transpose(0, 1).to(dtype), state, captured


def chunk_gated_delta_rule_spans(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    states: Sequence[torch.Tensor], bounds: Sequence[tuple[int, int]], capture_ats: Sequence[list[int]],
    scan: Callable = chunk_gated_delta_rule,
) -> tuple[torch.Tensor, list[torch.Tensor], list[list[torch.Tensor]]]:
    """`chunk_gated_delta_rule` over several sequences' rows ([lo, hi) each, in `bounds`), each
    from its own state: out over all rows, and per sequence its final state and captures. This one
    runs `scan` on each sequence; the GPU's runs them together (fla's varlen scan)."""
    runs = [scan(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], state, caps)
            for state, (lo, hi), caps in zip(states, bounds, capture_ats, strict=True)]
    out = runs[0][0] if len(runs) == 1 else torch.cat([r[0] for r in runs])
    return out, [r[1] for r in runs], [r[2] for r in runs]


def recurrent_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token recurrence (decode). Returns out [T, Hv, Dv] and the final state."""
    dtype = v.dtype
    qh, kh, vh, gh, bh = _prepare(q, k, v, g, beta)
    state = state.float()
    outs = []
    for t in range(qh.shape[1]):
        state = state * gh[:, t].exp()[:, None, None]
        memory = (state * kh[:, t, :, None]).sum(-2)  # [H, Dv]
        delta = (vh[:, t] - memory) * bh[:, t, None]
        state = state + kh[:, t, :, None] * delta[:, None, :]
        outs.append((state * qh[:, t, :, None]).sum(-2))
    return torch.stack(outs, dim=0).to(dtype), state


def decode_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B sequences, each from its own state: q, k [B, Hk, Dk]; v [B, Hv, Dv];
    g, beta [B, Hv]; state [B, Hv, Dk, Dv] fp32. Returns out [B, Hv, Dv] and the new states."""
    dtype = v.dtype
    # _prepare's [H, T, D] with the B sequences in the T place: one recurrence step for each
    qh, kh, vh, gh, bh = (x.transpose(0, 1) for x in _prepare(q, k, v, g, beta))  # [B, H, D], [B, H]
    state = state.float() * gh.exp()[..., None, None]
    memory = (state * kh[..., :, None]).sum(-2)  # [B, H, Dv]
    delta = (vh - memory) * bh[..., None]
    state = state + kh[..., :, None] * delta[..., None, :]
    return (state * qh[..., :, None]).sum(-2).to(dtype), state


def decode_gated_delta_rule_slots(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, slots: torch.Tensor,
    index: torch.Tensor, decode: Callable = decode_gated_delta_rule,
) -> torch.Tensor:
    """`decode` (one token of each of B sequences) on the states of slots[index] (slots: [S, Hv,
    Dk, Dv] fp32), written back in place. Returns out [B, Hv, Dv]."""
    out, state = decode(q, k, v, g, beta, slots[index])
    slots.index_copy_(0, index, state)
    return out


# the references of the ops a decode step runs (`Kernels`' defaults)
REFERENCE_OPS = SimpleNamespace(
    deltanet_gates=gates.deltanet_gates,
    decode_conv_slots=conv.decode_conv_slots,
    decode_gated_delta_rule_slots=decode_gated_delta_rule_slots,
    gated_rms_norm=norm.gated_rms_norm,
)


def decode_mix(
    mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, conv_weight: torch.Tensor, conv_slots: torch.Tensor,
    rec_slots: torch.Tensor, index: torch.Tensor, ops=REFERENCE_OPS,
) -> torch.Tensor:
    """One token of each slot's sequence: the conv of mixed [B, C] (q ‖ k ‖ v) on conv_slots
    [S, C, K-1], then the recurrent step on rec_slots [S, Hv, Dk, Dv], both updated in place at the
    rows' slots `index`. Returns [B, Hv, Dv]."""
    rows, (hv, dk, dv) = mixed.shape[0], rec_slots.shape[1:]
    key = (mixed.shape[1] - hv * dv) // 2
    q, k, v = ops.decode_conv_slots(mixed, conv_slots, index, conv_weight).split([key, key, hv * dv], dim=-1)
    return ops.decode_gated_delta_rule_slots(
        q.view(rows, -1, dk), k.view(rows, -1, dk), v.view(rows, hv, dv), g, beta, rec_slots, index
    )


def decode_step(
    mixed: torch.Tensor, z: torch.Tensor, a: torch.Tensor, b: torch.Tensor, neg_a: torch.Tensor, dt_bias: torch.Tensor,
    conv_weight: torch.Tensor, norm_weight: torch.Tensor, eps: float, conv_slots: torch.Tensor, rec_slots: torch.Tensor,
    index: torch.Tensor, *, ops=REFERENCE_OPS,
) -> torch.Tensor:
    """A Gated DeltaNet's decode step after its input projection, on slotted states (updated in
    place): the gates of a, b [B, Hv], `decode_mix`, the output's RMSNorm gated by SiLU(z [B, Hv*Dv]).
    Returns [B, Hv, Dv]. `ops`: a `Kernels` whose four ops it runs (default: the references)."""
    rows, (hv, _, dv) = mixed.shape[0], rec_slots.shape[1:]
    g, beta = ops.deltanet_gates(a, b, neg_a, dt_bias)
    out = decode_mix(mixed, g, beta, conv_weight, conv_slots, rec_slots, index, ops)
    return ops.gated_rms_norm(out, z.view(rows, hv, dv), norm_weight, eps)
