"""Causal depthwise conv1d + SiLU that carries its state, with the state read off at given offsets."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def causal_conv(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, capture_at: list[int], splits: Sequence[int]
) -> tuple[list[torch.Tensor], torch.Tensor, list[torch.Tensor]]:
    """x: [T, C] new inputs; state: [C, K-1] the previous K-1 inputs; weight: [C, K].

    Returns SiLU(conv) as contiguous column parts [T, n] of the widths `splits` (summing to C: a
    DeltaNet's q, k, v), the state after the last input, and the state after each offset in
    `capture_at` (1 <= offset <= T), all [C, K-1].
    """
    width = weight.shape[1] - 1
    full = torch.cat([state.to(x.dtype), x.transpose(0, 1)], dim=1)  # [C, K-1+T]
    out = F.conv1d(full[None], weight[:, None, :].to(x.dtype), groups=weight.shape[0])[0]  # [C, T]
    captured = [full[:, off : off + width].clone() for off in capture_at]
    parts = [p.transpose(0, 1).contiguous() for p in F.silu(out).split(list(splits))]
    return parts, full[:, -width:].clone(), captured


def causal_conv_spans(
    x: torch.Tensor, states: Sequence[torch.Tensor], weight: torch.Tensor, bounds: Sequence[tuple[int, int]],
    capture_ats: Sequence[list[int]], splits: Sequence[int], conv=causal_conv,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[list[torch.Tensor]]]:
    """`causal_conv` over several sequences' rows of x ([lo, hi) each, in `bounds`), each from its
    own state: the parts over all rows, and per sequence its final state and captures. This one runs
    `conv` on each sequence; the GPU's runs them all in one launch."""
    runs = [conv(x[lo:hi], state, weight, caps, splits) for state, (lo, hi), caps in zip(states, bounds, capture_ats, strict=True)]
    parts = [p[0] if len(runs) == 1 else torch.cat(p) for p in zip(*(r[0] for r in runs), strict=True)]
    return parts, [r[1] for r in runs], [r[2] for r in runs]


def decode_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One new input for each of B sequences. x: [B, C]; state: [B, C, K-1]; weight: [C, K].
    Returns SiLU(conv) [B, C] and the states after the input [B, C, K-1]."""
    full = torch.cat([state.to(x.dtype), x[:, :, None]], dim=2)  # [B, C, K]
    out = (full.float() * weight.float()).sum(-1)  # accumulated in fp32, as the prefill conv does
    return F.silu(out).to(x.dtype), full[:, :, 1:]


def decode_conv_slots(x: torch.Tensor, slots: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`decode_conv` on the states of slots[index] (slots: [S, C, K-1]), written back in place.
    Returns SiLU(conv) [B, C]."""
    out, state = decode_conv(x, slots[index], weight)
    slots.index_copy_(0, index, state)
    return out
