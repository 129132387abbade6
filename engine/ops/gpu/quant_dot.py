"""In-register dequantization of the quantized weights (`QuantWeight`, engine/ops/gpu/quant_weight.py),
the Triton helpers of the GEMV (engine/ops/gpu/gemv.py) and the tiled GEMM (engine/ops/gpu/gemm.py), in fp32
with the operations of the reference (`engine.quant.ggml`, `engine.quant.fp8`):

- `_dequant`: a tile of weights at given rows and columns (the GEMM, the prefill copy);
- `_dot`: a format-sized chunk of columns of some rows against x's chunk (the GEMV), each block's
  scales loaded once a row and applied to the sums, not to every weight.

Both take a weight's field arrays as four pointers P0..P3 (`_padded`: a format with fewer repeats its first).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.ops.gpu.quant_weight import QuantWeight


@triton.jit
def _f16(x):
    return x.to(tl.float32)


@triton.jit
def _dequant(P0, P1, P2, P3, e, n, k, N, K, FMT: tl.constexpr):
    """fp32 weights at rows n [BN, 1] and columns k [1, BK] of expert e (the reference's operations)."""
    row = e * N + n  # [BN, 1] int64
    if FMT == 0:  # Q8_0
        q = tl.load(P0 + row * K + k).to(tl.float32)
        d = _f16(tl.load(P1 + row * (K // 32) + k // 32))
        w = q * d
    elif FMT == 1:  # Q4_K: byte s*128 + g*32 + l holds elements g*64 + l (low) and g*64 + 32 + l (high)
        kk = k % 256
        byte = tl.load(P0 + row * (K // 2) + (k // 256) * 128 + (kk // 64) * 32 + kk % 32)
        q = ((byte >> (((kk // 32) % 2) * 4).to(tl.uint8)) & 0x0F).to(tl.float32)
        sc = tl.load(P1 + row * (K // 32) + k // 32).to(tl.float32)
        mn = tl.load(P2 + row * (K // 32) + k // 32).to(tl.float32)
        d = _f16(tl.load(P3 + (row * (K // 256) + k // 256) * 2))
        dmin = _f16(tl.load(P3 + (row * (K // 256) + k // 256) * 2 + 1))
        w = (d * sc) * q - dmin * mn
    elif FMT == 4:  # Q5_K: Q4_K's nibbles, and the fifth bit j of sub-block j in byte s*32 + l of qh
        kk = k % 256
        byte = tl.load(P0 + row * (K // 2) + (k // 256) * 128 + (kk // 64) * 32 + kk % 32)
        low = (byte >> (((kk // 32) % 2) * 4).to(tl.uint8)) & 0x0F
        high = (tl.load(P1 + row * (K // 8) + (k // 256) * 32 + kk % 32) >> (kk // 32).to(tl.uint8)) & 1
        q = (low | (high << 4)).to(tl.float32)
        sc = tl.load(P2 + (row * (K // 32) + k // 32) * 2).to(tl.float32)
        mn = tl.load(P2 + (row * (K // 32) + k // 32) * 2 + 1).to(tl.float32)
        d = _f16(tl.load(P3 + (row * (K // 256) + k // 256) * 2))
        dmin = _f16(tl.load(P3 + (row * (K // 256) + k // 256) * 2 + 1))
        w = (d * sc) * q - dmin * mn
    elif FMT == 2:  # Q6_K: low nibbles in ql (64 bytes per half), 2 high bits in qh (32 bytes per half)
        half, e128 = k // 128, k % 128
        low = tl.load(P0 + row * (K // 2) + half * 64 + e128 % 64)
        low = (low >> ((e128 // 64) * 4).to(tl.uint8)) & 0x0F
        high = tl.load(P1 + row * (K // 4) + half * 32 + e128 % 32)
        high = (high >> ((e128 // 32) * 2).to(tl.uint8)) & 3
        q = ((low | (high << 4)).to(tl.int32) - 32).to(tl.float32)
        sc = tl.load(P2 + row * (K // 16) + k // 16).to(tl.float32)
        d = _f16(tl.load(P3 + row * (K // 256) + k // 256))
        w = (d * sc) * q
    else:  # FP8 with [128, 128] block scales
        w = tl.load(P0 + row * K + k).to(tl.float32)
        s = tl.load(P1 + (e * ((N + 127) // 128) + n // 128) * ((K + 127) // 128) + k // 128)
        w = w * s
    return w


@triton.jit
def _dot_q4_k(XC, P0, P1, P2, P3, row, k0, K):
    """Q4_K, 64 columns from k0 (a 32-byte group of one super-block: two sub-blocks, low and high
    nibbles) against x's 64 from XC: each field is loaded once per row, not once per weight."""
    col = tl.arange(0, 32)
    byte = tl.load(P0 + row[:, None] * (K // 2) + (k0 // 256) * 128 + ((k0 % 256) // 64) * 32 + col[None, :])
    sub = row * (K // 32) + k0 // 32
    sc0, sc1 = tl.load(P1 + sub).to(tl.float32), tl.load(P1 + sub + 1).to(tl.float32)
    mn0, mn1 = tl.load(P2 + sub).to(tl.float32), tl.load(P2 + sub + 1).to(tl.float32)
    d = tl.load(P3 + (row * (K // 256) + k0 // 256) * 2).to(tl.float32)
    dmin = tl.load(P3 + (row * (K // 256) + k0 // 256) * 2 + 1).to(tl.float32)
    x_lo = tl.load(XC + col).to(tl.float32)
    x_hi = tl.load(XC + 32 + col).to(tl.float32)
    # sum_c (d sc q_c - dmin mn) x_c = d sc (sum_c q_c x_c) - dmin mn (sum_c x_c): the scales per row, not per weight
    q_lo = tl.sum((byte & 0x0F).to(tl.float32) * x_lo[None, :], 1)
    q_hi = tl.sum((byte >> 4).to(tl.float32) * x_hi[None, :], 1)
    return d * (sc0 * q_lo + sc1 * q_hi) - dmin * (mn0 * tl.sum(x_lo, 0) + mn1 * tl.sum(x_hi, 0))


@triton.jit
def _dot_q5_k(XC, P0, P1, P2, P3, row, k0, K):
    """Q5_K, 64 columns from k0: Q4_K's two sub-blocks of nibbles, plus their fifth bits (bits j
    and j + 1 of the super-block's 32 qh bytes, j = the first sub-block)."""
    col = tl.arange(0, 32)
    byte = tl.load(P0 + row[:, None] * (K // 2) + (k0 // 256) * 128 + ((k0 % 256) // 64) * 32 + col[None, :])
    qh = tl.load(P1 + row[:, None] * (K // 8) + (k0 // 256) * 32 + col[None, :])
    j = (k0 % 256) // 32
    sub = (row * (K // 32) + k0 // 32) * 2
    sc0, sc1 = tl.load(P2 + sub).to(tl.float32), tl.load(P2 + sub + 2).to(tl.float32)
    mn0, mn1 = tl.load(P2 + sub + 1).to(tl.float32), tl.load(P2 + sub + 3).to(tl.float32)
    d = tl.load(P3 + (row * (K // 256) + k0 // 256) * 2).to(tl.float32)
    dmin = tl.load(P3 + (row * (K // 256) + k0 // 256) * 2 + 1).to(tl.float32)
    x_lo = tl.load(XC + col).to(tl.float32)
    x_hi = tl.load(XC + 32 + col).to(tl.float32)
    q_lo = tl.sum(((byte & 0x0F) | (((qh >> j) & 1) << 4)).to(tl.float32) * x_lo[None, :], 1)
    q_hi = tl.sum(((byte >> 4) | (((qh >> (j + 1)) & 1) << 4)).to(tl.float32) * x_hi[None, :], 1)
    return d * (sc0 * q_lo + sc1 * q_hi) - dmin * (mn0 * tl.sum(x_lo, 0) + mn1 * tl.sum(x_hi, 0))  # as Q4_K


@triton.jit
def _dot_q6_k(XC, P0, P1, P2, P3, row, k0, K):
    """Q6_K, 128 columns from k0 (half a super-block): 64 bytes of low nibbles, 32 of high bits,
    8 scales of 16 columns; quarter j holds columns j*32 .. j*32+31."""
    col = tl.arange(0, 32)
    half = k0 // 128
    ql = P0 + row[:, None] * (K // 2) + half * 64 + col[None, :]
    ql_a, ql_b = tl.load(ql), tl.load(ql + 32)
    qh = tl.load(P1 + row[:, None] * (K // 4) + half * 32 + col[None, :])
    second = (col >= 16)[None, :]
    acc = tl.zeros([ql_a.shape[0]], tl.float32)
    for j in tl.static_range(4):  # the scale per row and 16 columns applied to their sums, not per weight
        low = (ql_a if j % 2 == 0 else ql_b) >> (4 * (j // 2))
        q = (((low & 0x0F) | (((qh >> (2 * j)) & 3) << 4)).to(tl.int32) - 32).to(tl.float32)
        x = tl.load(XC + j * 32 + col).to(tl.float32)
        qx = q * x[None, :]
        sc_idx = row * (K // 16) + k0 // 16 + 2 * j
        acc += tl.load(P2 + sc_idx).to(tl.float32) * tl.sum(tl.where(second, 0.0, qx), 1)
        acc += tl.load(P2 + sc_idx + 1).to(tl.float32) * tl.sum(tl.where(second, qx, 0.0), 1)
    return tl.load(P3 + row * (K // 256) + k0 // 256).to(tl.float32) * acc


@triton.jit
def _dot_q8_0(XC, P0, P1, row, k0, K):
    """Q8_0, 32 columns from k0 (one block: one scale per row)."""
    col = tl.arange(0, 32)
    q = tl.load(P0 + row[:, None] * K + k0 + col[None, :]).to(tl.float32)
    d = tl.load(P1 + row * (K // 32) + k0 // 32).to(tl.float32)
    x = tl.load(XC + col).to(tl.float32)
    return d * tl.sum(q * x[None, :], 1)


@triton.jit
def _dot_fp8(XC, P0, P1, row, k0, N, K):
    """FP8, 128 columns from k0 (one block column: one scale per row)."""
    col = tl.arange(0, 128)
    w = tl.load(P0 + row[:, None] * K + k0 + col[None, :]).to(tl.float32)
    s = tl.load(P1 + (row // 128) * ((K + 127) // 128) + k0 // 128)
    x = tl.load(XC + col).to(tl.float32)
    return s * tl.sum(w * x[None, :], 1)


@triton.jit
def _dot(XC, P0, P1, P2, P3, row, k0, N, K, FMT: tl.constexpr):
    """The format's chunk of columns from k0: rows `row` [BN] against x's chunk at XC."""
    if FMT == 0:
        return _dot_q8_0(XC, P0, P1, row, k0, K)
    elif FMT == 1:
        return _dot_q4_k(XC, P0, P1, P2, P3, row, k0, K)
    elif FMT == 2:
        return _dot_q6_k(XC, P0, P1, P2, P3, row, k0, K)
    elif FMT == 4:
        return _dot_q5_k(XC, P0, P1, P2, P3, row, k0, K)
    else:
        return _dot_fp8(XC, P0, P1, row, k0, N, K)


def _padded(w: QuantWeight) -> tuple[torch.Tensor, ...]:
    return (*w.parts, *([w.parts[0]] * (4 - len(w.parts))))

