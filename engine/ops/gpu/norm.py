"""Fused norms: residual add + zero-centred RMSNorm, and the DeltaNet's gated RMSNorm, one Triton
kernel each (the torch versions take 7 to 10 kernels), one program per token row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.ops.gpu.checked import Checked
from engine.ops.gpu.gates import as_heads
from engine.ops.norm import add_rms_norm as reference_add_rms
from engine.ops.norm import gated_rms_norm as reference_gated
from engine.ops.rope import norm_rope as reference_norm_rope


@triton.jit
def _add_rms_norm(X, R, S, W, Y, N, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * N + cols, mask=mask, other=0.0)
    if HAS_RES:  # s = x + r, rounded as the model rounds it, and kept as the new residual
        x = (x.to(tl.float32) + tl.load(R + row * N + cols, mask=mask, other=0.0).to(tl.float32)).to(X.dtype.element_ty)
        tl.store(S + row * N + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / N + eps)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * N + cols, (xf * rstd * (1.0 + w)).to(Y.dtype.element_ty), mask=mask)


def _add_rms_norm_triton(x, residual, weight, eps):
    """(x + residual, rms_norm(x + residual)); residual may be None (then just the norm)."""
    shape = x.shape
    x = x.reshape(-1, shape[-1]).contiguous()
    n = x.shape[-1]
    s = torch.empty_like(x) if residual is not None else x
    y = torch.empty_like(x)
    r = residual.reshape(-1, n).contiguous() if residual is not None else x
    _add_rms_norm[(x.shape[0],)](x, r, s, weight, y, n, eps, HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(n))
    return s.view(shape), y.view(shape)


@triton.jit
def _gated_rms_norm(X, Z, W, Y, H, N, sx, sxh, sz, szh, eps, BLOCK: tl.constexpr):
    """Row r (one head of one token) of x and of its gate z, each at (r // H) * its row stride + (r % H) *
    its head stride (`gates.as_heads`: z is a view of the fused input projection's columns)."""
    row = tl.program_id(0)
    t, h = row // H, row % H
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + t * sx + h * sxh + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 0) / N + eps)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = Y.dtype.element_ty  # w * the normed x, each rounded as torch rounds them (in fp32, not in bf16 arithmetic)
    normed = (w * (x * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    z = tl.load(Z + t * sz + h * szh + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * N + cols, (normed * z * tl.sigmoid(z)).to(Y.dtype.element_ty), mask=mask)


def _gated_triton(x, gate, weight, eps):
    x3, z3 = as_heads(x), as_heads(gate)
    rows, heads, n = x3.shape
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if rows * heads:
        _gated_rms_norm[(rows * heads,)](x3, z3, weight, y, heads, n, *x3.stride()[:2], *z3.stride()[:2], eps,
                                         BLOCK=triton.next_power_of_2(n))
    return y


_with_residual = Checked("add_rms_norm", _add_rms_norm_triton, reference_add_rms)
_plain = Checked("rms_norm", _add_rms_norm_triton, reference_add_rms)


def add_rms_norm(x, residual, weight, eps):
    """(x + residual, zero-centred rms_norm of it); without a residual, (x, rms_norm(x))."""
    return (_plain if residual is None else _with_residual)(x, residual, weight, eps)


gated_rms_norm = Checked("gated_rms_norm", _gated_triton, reference_gated)


@triton.jit
def _norm_rope(X, W, COS, SIN, Y, H, D, R, eps, st, sh, BLOCK: tl.constexpr):
    """One head of one token: zero-centred RMSNorm, then rotate-half RoPE on its first R dims, each
    product and sum rounded to the activations' dtype as the torch version rounds them."""
    row = tl.program_id(0)
    t, h = row // H, row % H
    dtype = Y.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    half = R // 2
    partner = tl.where(cols < half, cols + half, cols - half)
    rotated = cols < R
    base = X + t * st + h * sh
    x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 0) / D + eps)
    y = (x * rstd * (1.0 + tl.load(W + cols, mask=mask, other=0.0).to(tl.float32))).to(dtype).to(tl.float32)
    xp = tl.load(base + partner, mask=rotated, other=0.0).to(tl.float32)
    yp = (xp * rstd * (1.0 + tl.load(W + partner, mask=rotated, other=0.0).to(tl.float32))).to(dtype).to(tl.float32)
    yp = tl.where(cols < half, -yp, yp)  # rotate_half: (-x2, x1)
    cos = tl.load(COS + t * R + cols, mask=rotated, other=0.0).to(tl.float32)
    sin = tl.load(SIN + t * R + cols, mask=rotated, other=0.0).to(tl.float32)
    roped = (y * cos).to(dtype).to(tl.float32) + (yp * sin).to(dtype).to(tl.float32)
    tl.store(Y + row * D + cols, tl.where(rotated, roped, y).to(dtype), mask=mask)


def _norm_rope_triton(x, weight, eps, cos, sin):
    tokens, heads, dim = x.shape
    if x.stride(2) != 1:
        x = x.contiguous()
    y = torch.empty(tokens, heads, dim, dtype=x.dtype, device=x.device)
    if tokens:
        _norm_rope[(tokens * heads,)](
            x, weight, cos.contiguous(), sin.contiguous(), y, heads, dim, cos.shape[-1], eps,
            x.stride(0), x.stride(1), BLOCK=triton.next_power_of_2(dim),
        )
    return y


norm_rope = Checked("norm_rope", _norm_rope_triton, reference_norm_rope)
