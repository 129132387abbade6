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


@triton.jit
def _conv_slots_kernel(X, S, IDX, W, Y, C, stride_x, K: tl.constexpr, KP: tl.constexpr, BLOCK_C: tl.constexpr):
    """Row b, channels of one block: the conv over the state of slot IDX[b] ([C, K-1]) and x[b],
    SiLU'd into Y[b]; the state shifted by one and x appended, in place (loaded whole first)."""
    b = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    j = tl.arange(0, KP)
    cols = c < C
    held = cols[:, None] & (j < K - 1)[None, :]
    state = S + tl.load(IDX + b).to(tl.int64) * C * (K - 1) + c[:, None] * (K - 1) + j[None, :]
    s = tl.load(state, mask=held, other=0.0)  # [BLOCK_C, KP]
    x = tl.load(X + b * stride_x + c, mask=cols, other=0.0)
    w = tl.load(W + c[:, None] * K + j[None, :], mask=held, other=0.0).to(tl.float32)
    acc = tl.sum(s.to(tl.float32) * w, 1) + x.to(tl.float32) * tl.load(W + c * K + K - 1, mask=cols, other=0.0).to(tl.float32)
    tl.store(Y + b * C + c, (acc * tl.sigmoid(acc)).to(Y.dtype.element_ty), mask=cols)
    # column j takes column j + 1 (the last takes x): a one-hot sum over the loaded state, no re-read
    after = (j[None, :, None] + 1) == j[None, None, :]  # [1, KP, KP]: picks column j + 1 for column j
    shifted = tl.sum(tl.where(after, s[:, None, :], 0.0), 2)
    new = tl.where((j == K - 2)[None, :], x[:, None], shifted.to(s.dtype))
    tl.store(state, new, mask=held)


def _triton_conv_slots(x, slots, index, weight):
    batch, channels = x.shape
    width = slots.shape[2]
    if x.stride(1) != 1 or not slots.is_contiguous() or weight.stride(1) != 1 or weight.stride(0) != width + 1:
        return reference.decode_conv_slots(x, slots, index, weight)
    y = torch.empty(batch, channels, dtype=x.dtype, device=x.device)
    block = 256
    _conv_slots_kernel[(batch, triton.cdiv(channels, block))](
        x, slots, index, weight, y, channels, x.stride(0), K=width + 1, KP=triton.next_power_of_2(width + 1),
        BLOCK_C=block,
    )  # fmt: skip
    return y


def _slots_after(out, args):
    """A slot op's output and the states of its rows' slots after it."""
    return out, args[1][args[2]]


decode_conv_slots = Checked(
    "decode_conv_slots", _triton_conv_slots, reference.decode_conv_slots, canon=_slots_after,
    fresh=lambda args: (args[0], args[1].clone(), *args[2:]),
)  # fmt: skip
