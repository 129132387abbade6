"""Causal depthwise conv1d + SiLU that carries its state, as one Triton kernel over [T, C] (no
transposes, no concatenation with the state: rows before 0 are read from the state)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.ops import conv as reference
from engine.ops.gpu.checked import Checked


@triton.jit
def _causal_conv(X, S, W, Y, T, C, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    rows, cols = t < T, c < C
    acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
    for j in tl.static_range(K):
        src = t - (K - 1) + j  # input time; below 0 it is state column K - 1 + src
        in_x = rows & (src >= 0)
        in_s = rows & (src < 0)
        xv = tl.load(X + src[:, None] * C + c[None, :], mask=in_x[:, None] & cols[None, :], other=0.0).to(tl.float32)
        sv = tl.load(S + c[None, :] * (K - 1) + (K - 1 + src)[:, None], mask=in_s[:, None] & cols[None, :], other=0.0).to(tl.float32)
        w = tl.load(W + c * K + j, mask=cols, other=0.0).to(tl.float32)
        acc += (xv + sv) * w[None, :]
    y = acc * tl.sigmoid(acc)
    tl.store(Y + t[:, None] * C + c[None, :], y.to(Y.dtype.element_ty), mask=rows[:, None] & cols[None, :])


def _window(x: torch.Tensor, state: torch.Tensor, end: int) -> torch.Tensor:
    """The K-1 inputs before `end` as a conv state [C, K-1]."""
    width = state.shape[1]
    if end >= width:
        return x[end - width : end].transpose(0, 1).contiguous()
    return torch.cat([state[:, end:], x[:end].transpose(0, 1)], dim=1)


def _triton_conv(x, state, weight, capture_at):
    length, channels = x.shape
    x = x.contiguous()
    state = state.to(x.dtype).contiguous()
    y = torch.empty_like(x)
    grid = (triton.cdiv(length, 32), triton.cdiv(channels, 128))
    _causal_conv[grid](x, state, weight.contiguous(), y, length, channels, K=weight.shape[1], BLOCK_T=32, BLOCK_C=128)
    return y, _window(x, state, length), [_window(x, state, off) for off in capture_at]


causal_conv = Checked("causal_conv", _triton_conv, reference.causal_conv)
