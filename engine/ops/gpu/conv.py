"""Causal depthwise conv1d + SiLU that carries its state, as one Triton kernel over [T, C] (no
transposes, no concatenation with the state: rows before 0 are read from the state). Its input may be
a column slice of a wider projection (rows strided), and its output comes as contiguous column parts
(a DeltaNet's q, k and v, as fla's scan takes them): no copy on either side. The same kernel takes
several sequences' rows at once, each row reading only its own sequence's rows and state."""

from __future__ import annotations

import functools
import itertools
import math

import torch
import triton
import triton.language as tl

import engine.ops.conv as reference
from engine.ops.gpu import spans
from engine.ops.gpu.checked import Checked


@triton.jit
def _causal_conv(X, S, SPAN, START, W, Y, T, C, stride_x, END0, END1, K: tl.constexpr, SPANS: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """Rows of X [T, C] (row stride `stride_x`) through the conv and SiLU into Y, which holds the output's
    column parts [0, END0), [END0, END1), [END1, C) one after another, each contiguous [T, width]; a
    program's BLOCK_C channels lie within one part. SPANS: the rows are several sequences', row t the
    sequence SPAN[t]'s, which starts at row START[SPAN[t]] and whose state is S[SPAN[t]] ([N, C, K-1]);
    otherwise one sequence from row 0, its state S [C, K-1]."""
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    c0 = tl.program_id(1) * BLOCK_C
    c = c0 + tl.arange(0, BLOCK_C)
    rows, cols = t < T, c < C
    if SPANS:
        span = tl.load(SPAN + t, mask=rows, other=0).to(tl.int64)
        start = tl.load(START + span, mask=rows, other=0).to(tl.int64)
    else:
        span = tl.zeros([BLOCK_T], tl.int64)
        start = tl.zeros([BLOCK_T], tl.int64)
    state = S + span[:, None] * C * (K - 1) + c[None, :] * (K - 1)  # [BLOCK_T, BLOCK_C]: each row's state row
    acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
    for j in tl.static_range(K):
        src = t - (K - 1) + j  # input row; before its sequence's start it is state column K - 1 + src - start
        in_x = rows & (src >= start)
        in_s = rows & (src < start)
        xv = tl.load(X + src[:, None] * stride_x + c[None, :], mask=in_x[:, None] & cols[None, :], other=0.0).to(tl.float32)
        sv = tl.load(state + (K - 1 + src - start)[:, None], mask=in_s[:, None] & cols[None, :], other=0.0).to(tl.float32)
        w = tl.load(W + c * K + j, mask=cols, other=0.0).to(tl.float32)
        acc += (xv + sv) * w[None, :]
    y = acc * tl.sigmoid(acc)
    start = tl.where(c0 >= END1, END1, tl.where(c0 >= END0, END0, 0)).to(tl.int64)
    width = tl.where(c0 >= END1, C, tl.where(c0 >= END0, END1, END0)) - start
    out = Y + start * T + t[:, None] * width + (c - start)[None, :]
    tl.store(out, y.to(Y.dtype.element_ty), mask=rows[:, None] & cols[None, :])


def _window(x: torch.Tensor, state: torch.Tensor, end: int) -> torch.Tensor:
    """The K-1 inputs before `end` as a conv state [C, K-1]."""
    width = state.shape[1]
    if end >= width:
        return x[end - width : end].transpose(0, 1).contiguous()
    return torch.cat([state[:, end:], x[:end].transpose(0, 1)], dim=1)


@triton.jit
def _windows_kernel(X, S, ROWS, OUT, C, stride_x, WIDTH: tl.constexpr, BLOCK_C: tl.constexpr):
    """Window w's BLOCK_C channels: OUT[w] [C, WIDTH] takes, for each column j, row ROWS[w, j] of X, or
    where that is negative (r = -1 - ROWS[w, j]) column r % WIDTH of the state S[r // WIDTH] ([N, C, WIDTH])."""
    w = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cols = c < C
    for j in tl.static_range(WIDTH):
        row = tl.zeros([BLOCK_C], tl.int64) + tl.load(ROWS + w * WIDTH + j)  # the same for every channel
        held = -1 - row
        xv = tl.load(X + row * stride_x + c, mask=cols & (row >= 0), other=0.0)
        sv = tl.load(S + (held // WIDTH) * C * WIDTH + c * WIDTH + held % WIDTH, mask=cols & (row < 0), other=0.0)
        tl.store(OUT + w * C * WIDTH + c * WIDTH + j, tl.where(row >= 0, xv, sv), mask=cols)


@functools.lru_cache(maxsize=4)
def _window_rows(bounds: tuple[tuple[int, int], ...], capture_ats: tuple[tuple[int, ...], ...], width: int,
                 device: torch.device) -> torch.Tensor:
    """[W, width] int32: for every capture of every sequence in order, then every sequence's end, the
    `width` inputs before it as `_windows_kernel` reads them (a row of x, or -1 - the state element)."""
    ends = [(i, off) for i, caps in enumerate(capture_ats) for off in caps]
    ends += [(i, hi - lo) for i, (lo, hi) in enumerate(bounds)]
    rows = [bounds[i][0] + src if src >= 0 else -1 - (i * width + width + src)
            for i, off in ends for src in range(off - width, off)]
    return spans.to_device(rows, torch.int32, device).view(-1, width)


def _windows(x, states, bounds, capture_ats):
    """The conv states [C, K-1] at each capture and at each sequence's end (its K-1 inputs before
    there, from x's rows or before its first row from its state; states [N, C, K-1]) in one launch:
    per sequence its final state and its captures, views of one buffer (the captures consecutive)."""
    width, channels = states.shape[2], x.shape[1]
    rows = _window_rows(tuple(bounds), tuple(map(tuple, capture_ats)), width, x.device)
    out = torch.empty(rows.shape[0], channels, width, dtype=x.dtype, device=x.device)
    block = 128
    _windows_kernel[(rows.shape[0], triton.cdiv(channels, block))](x, states, rows, out, channels, x.stride(0),
                                                                    WIDTH=width, BLOCK_C=block)
    captured, n = [], 0
    for caps in capture_ats:
        captured.append(list(out[n : n + len(caps)]))
        n += len(caps)
    return list(out[n:]), captured


def _launch(x, states, rows, weight, splits):
    """The conv kernel over x's rows into contiguous parts of the widths `splits`. `rows`: None (one
    sequence, `states` [C, K-1]) or (each row's sequence, each sequence's first row), `states` [N, C, K-1]."""
    length, channels = x.shape
    assert len(splits) <= 3 and sum(splits) == channels
    ends = [*itertools.accumulate(splits), channels, channels][:2]
    block_c = min(128, math.gcd(*splits) & -math.gcd(*splits))  # a power of two dividing every part
    y = torch.empty(length * channels, dtype=x.dtype, device=x.device)
    if length:
        span, start = rows if rows is not None else (x, x)  # not read without SPANS
        grid = (triton.cdiv(length, 32), triton.cdiv(channels, block_c))
        _causal_conv[grid](x, states, span, start, weight.contiguous(), y, length, channels, x.stride(0), *ends,
                           K=weight.shape[1], SPANS=rows is not None, BLOCK_T=32, BLOCK_C=block_c)
    starts = [0, *itertools.accumulate(splits)]
    return [y[length * lo : length * (lo + n)].view(length, n) for lo, n in zip(starts, splits, strict=False)]


def _triton_conv(x, state, weight, capture_at, splits):
    if x.stride(1) != 1:
        x = x.contiguous()
    state = state.to(x.dtype).contiguous()
    parts = _launch(x, state, None, weight, splits)
    if not capture_at:  # (what a graphed slot prefill runs: no index copied in from the host)
        return parts, _window(x, state, x.shape[0]), []
    (final,), (captured,) = _windows(x, state.unsqueeze(0), [(0, x.shape[0])], [capture_at])
    return parts, final, captured


def _triton_conv_spans(x, states, weight, bounds, capture_ats, splits):
    if x.stride(1) != 1:
        x = x.contiguous()
    states = torch.stack([s.to(x.dtype) for s in states])
    where = spans.layout(tuple(bounds), tuple(map(tuple, capture_ats)), x.device)
    parts = _launch(x, states, (where.span, where.starts), weight, splits)
    return parts, *_windows(x, states, bounds, capture_ats)


causal_conv = Checked("causal_conv", _triton_conv, reference.causal_conv)
_conv_spans = Checked("causal_conv_spans", _triton_conv_spans, reference.causal_conv_spans)


def causal_conv_spans(x, states, weight, bounds, capture_ats, splits):
    """One sequence through `causal_conv`; several through the kernel's SPANS form, checked on its own first
    use (a first single-sequence call would otherwise settle the check without running that form)."""
    if len(bounds) == 1:
        return reference.causal_conv_spans(x, states, weight, bounds, capture_ats, splits, conv=causal_conv)
    return _conv_spans(x, states, weight, bounds, capture_ats, splits)


@triton.jit
def conv_step(X, S, W, c, cols, K: tl.constexpr, KP: tl.constexpr):
    """Channels c (where `cols`) of one row, X its input row and S its state [C, K-1]: SiLU of the conv
    over the state and x, rounded to x's dtype (held in fp32), and the new state (shifted by one, x
    appended; not stored). Shared by `_conv_slots_kernel` and the fused DeltaNet decode step."""
    j = tl.arange(0, KP)
    held = cols[:, None] & (j < K - 1)[None, :]
    s = tl.load(S + c[:, None] * (K - 1) + j[None, :], mask=held, other=0.0)  # [len(c), KP]
    x = tl.load(X + c, mask=cols, other=0.0)
    w = tl.load(W + c[:, None] * K + j[None, :], mask=held, other=0.0).to(tl.float32)
    acc = tl.sum(s.to(tl.float32) * w, 1) + x.to(tl.float32) * tl.load(W + c * K + K - 1, mask=cols, other=0.0).to(tl.float32)
    y = (acc * tl.sigmoid(acc)).to(X.dtype.element_ty).to(tl.float32)
    # column j takes column j + 1 (the last takes x): a one-hot sum over the loaded state, no re-read
    after = (j[None, :, None] + 1) == j[None, None, :]  # [1, KP, KP]: picks column j + 1 for column j
    shifted = tl.sum(tl.where(after, s[:, None, :], 0.0), 2)
    return y, tl.where((j == K - 2)[None, :], x[:, None], shifted.to(s.dtype))


@triton.jit
def store_state(S, c, cols, new, K: tl.constexpr, KP: tl.constexpr):
    """`conv_step`'s new state of channels c (where `cols`) into S [C, K-1]."""
    j = tl.arange(0, KP)
    tl.store(S + c[:, None] * (K - 1) + j[None, :], new, mask=cols[:, None] & (j < K - 1)[None, :])


@triton.jit
def _conv_slots_kernel(X, S, IDX, W, Y, C, stride_x, K: tl.constexpr, KP: tl.constexpr, BLOCK_C: tl.constexpr):
    """Row b, channels of one block: the conv over the state of slot IDX[b] ([C, K-1]) and x[b],
    SiLU'd into Y[b]; the state shifted by one and x appended, in place (loaded whole first)."""
    b = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cols = c < C
    state = S + tl.load(IDX + b).to(tl.int64) * C * (K - 1)
    y, new = conv_step(X + b * stride_x, state, W, c, cols, K, KP)
    tl.store(Y + b * C + c, y.to(Y.dtype.element_ty), mask=cols)
    store_state(state, c, cols, new, K, KP)


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
    )
    return y


def _slots_after(out, args):
    """A slot op's output and the states of its rows' slots after it."""
    return out, args[1][args[2]]


decode_conv_slots = Checked(
    "decode_conv_slots", _triton_conv_slots, reference.decode_conv_slots, canon=_slots_after,
    fresh=lambda args: (args[0], args[1].clone(), *args[2:]),
)
