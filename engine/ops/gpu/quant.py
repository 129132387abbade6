"""Matmuls over weights kept quantized in memory: GGML Q8_0, Q4_K, Q5_K, Q6_K and Qwen's block FP8.

A `QuantWeight` holds one linear weight [N, K] (or a stack of experts [E, N, K]) repacked from the
file's blocks into separate arrays per field (quants, sub-block scales, super-block scales), the
same bytes as the file (Q4_K's 6-bit scales unpacked to bytes: 0.58 instead of 0.5625 bytes a
weight). The Triton kernels dequantize a tile of it in registers, in fp32 with the operations of
the reference (`engine.quant.ggml`, `engine.quant.fp8`), and multiply it with the activations:

- `linear(x, w)`: x [M, K] @ w.T; a split-K GEMV kernel for a few rows (decode), a tiled GEMM
  for some more, and for prefill a transient bf16 copy (`dequantize_to`) and cuBLAS;
- `grouped(x, w, order, offs)`: rows grouped by expert (`moe.group_by_expert`) times each row's
  expert's weight, tiles never straddling two experts, or for many rows a transient copy and
  torch's grouped GEMM (MoE prefill); no host sync;
- FP8 prefill (both) runs e4m3 times e4m3 on the tensor cores, x quantized per row and 128 columns
  (`engine.ops.gpu.fp8_prefill`).

On a GPU the dequantized tile is cast to the activations' dtype (bf16) before `tl.dot`, so results
are within bf16 rounding of `x @ w.dequantize().T`; in fp32 (the CPU tests, TRITON_INTERPRET=1)
they equal it to fp32 summation order.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from engine.ops.gpu import fp8_prefill
from engine.ops.gpu.quant_weight import (
    BLOCK_K,
    FIELDS,
    FORMATS,
    FP8,
    FP8_ROWS,
    GEMV_CHUNK,
    NAMES,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_0,
    QuantWeight,
    append_expert,
    can_concat,
    concat_rows,
    pack_fp8,
    pack_ggml,
    stack,
)
from engine.ops.gpu.tiles import DEQUANT_ROWS, glu_row, tile_launch, tile_rows

# the weights' names (engine/ops/gpu/quant_weight.py) and the tiles' are this module's interface too
__all__ = [
    "BLOCK_K",
    "DEQUANT_ROWS",
    "FIELDS",
    "FORMATS",
    "FP8",
    "FP8_ROWS",
    "GEMV_CHUNK",
    "NAMES",
    "Q4_K",
    "Q5_K",
    "Q6_K",
    "Q8_0",
    "QuantWeight",
    "append_expert",
    "can_concat",
    "concat_rows",
    "dequantize_to",
    "experts_glu",
    "experts_sum",
    "gemv_block_n",
    "gemv_constexprs",
    "gemv_fits",
    "glu_row",
    "grouped",
    "last_to_finish",
    "linear",
    "linear_pair",
    "pack_fp8",
    "pack_ggml",
    "stack",
    "tickets",
    "tile_launch",
    "tile_rows",
]

GEMV_ROWS = 4  # up to this many rows of x, the GEMV kernel
grouped_mm = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm  # torch's grouped GEMM, by either name
# Triton's interpreter (the CPU tests) runs one program after another, at a fixed cost each: there
# the GEMV kernel runs with wider row blocks (a [248320, H] lm_head in 31 programs, not thousands).
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
GEMV_BLOCK_N = 8192 if INTERPRETED else 32
# a plain (not grouped) GEMV of at least this many outputs runs 64 rows a program: the lm_head and the
# large projections fill the GPU with the wider blocks too, each program reading its x for more rows;
# experts' GEMVs and smaller ones keep the narrower blocks, to have programs enough
GEMV_WIDE_N = 8192
GEMV_PROGRAMS = 1024  # a GEMV's split: the smallest that fills the GPU with this many programs
# the GEMV's warps a program and its K loop's pipelining stages and unrolling (None: Triton's defaults)
GEMV_WARPS, GEMV_STAGES, GEMV_UNROLL = 4, None, None


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


@triton.jit
def _gemv_kernel(
    X, P0, P1, P2, P3, PART, OUT, COUNT, EXPERT, SCALE, XCOLS, Q0, Q1, Q2, Q3, N, N2, K, K_SPLIT, SPLIT, XROW,
    FMT: tl.constexpr, BN: tl.constexpr, CHUNK: tl.constexpr,
    GROUPED: tl.constexpr, X_PER: tl.constexpr, TOPK: tl.constexpr, GLU: tl.constexpr, XMAP: tl.constexpr,
    FMT2: tl.constexpr, CHUNK2: tl.constexpr, STAGES: tl.constexpr, UNROLL: tl.constexpr,
):
    """Program (n-block, split s, output row m): BN outputs of row m over one range of K_SPLIT
    columns, a format-sized chunk at a time (each block's scales loaded once), summed over the
    SPLIT programs of (n-block, m) by the last of them to finish (`COUNT`: one ticket per
    (m, n-block), left at zero for the next launch; fp32 partials in PART [SPLIT, M, N or 2N]).

    GROUPED (w: experts [E, N or 2N, K]): the program's assignment a = m * TOPK + s // (SPLIT / TOPK)
    takes x's row a // X_PER against expert EXPERT[a] (-1: none, nothing read, zeros); TOPK > 1
    sums that many assignments into output row m (the MoE down projection over a token's experts).
    GLU: rows n (gate) and N + n (up) of the expert, out = silu(gate) * up * SCALE[a] (MoE up).
    XMAP: x's columns in the weight's order are XCOLS[k] (`QuantWeight.columns`, in runs of whole
    chunks): a chunk's are x's from XCOLS[k0] on.
    FMT2 >= 0: a second plain weight [N2, K] of that format (Q0..Q3) whose outputs follow the first's
    (out [M, N + N2]: two projections of one input in two formats, one launch); the n-blocks past
    the first weight's are its (K_SPLIT a multiple of both formats' chunks).
    STAGES, UNROLL: the K loop's software pipelining and unrolling (`tl.range`; None: Triton's default).
    XROW: x's row stride."""
    pid, s, m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    KS = SPLIT // TOPK  # programs per assignment (a run-time value: the split is chosen per shape)
    a = m * TOPK + s // KS
    start = (s % KS) * K_SPLIT
    end = start + K_SPLIT
    x = X + (a // X_PER) * XROW  # x's row
    acc = tl.zeros([BN], tl.float32)
    acc_up = tl.zeros([BN], tl.float32)
    first = tl.cdiv(N, BN)  # the first weight's n-blocks
    if FMT2 >= 0:
        second = pid >= first
    else:
        second = False
    if second:
        n = (pid - first) * BN + tl.arange(0, BN)
        row = tl.minimum(n, N2 - 1).to(tl.int64)
        for k0 in tl.range(start, end, CHUNK2, num_stages=STAGES, loop_unroll_factor=UNROLL):
            acc += _dot(x + k0, Q0, Q1, Q2, Q3, row, k0, N2, K, FMT2)
        keep = n < N2
        n += N  # its outputs' columns
    else:
        n = pid * BN + tl.arange(0, BN)
        row = tl.minimum(n, N - 1).to(tl.int64)
        if GROUPED:
            expert = tl.load(EXPERT + a).to(tl.int64)
            row += tl.maximum(expert, 0) * (2 * N if GLU else N)
            end = tl.where(expert >= 0, end, start)
        for k0 in tl.range(start, end, CHUNK, num_stages=STAGES, loop_unroll_factor=UNROLL):
            xc = x + (tl.load(XCOLS + k0) if XMAP else k0)
            acc += _dot(xc, P0, P1, P2, P3, row, k0, N, K, FMT)
            if GLU:
                acc_up += _dot(xc, P0, P1, P2, P3, row + N, k0, N, K, FMT)
        keep = n < N
    width = N + N2  # the output's (N2 is 0 with one weight)
    if SPLIT > 1:
        part = width + N if GLU else width  # gate and up partials
        rows = tl.num_programs(2)
        tl.store(PART + (s * rows + m) * part + n, acc, mask=keep)
        if GLU:
            tl.store(PART + (s * rows + m) * part + N + n, acc_up, mask=keep)
        ticket = COUNT + m * tl.num_programs(0) + pid
        if last_to_finish(ticket, SPLIT):  # sums every program's partials (from L2: .cg)
            acc = tl.zeros([BN], tl.float32)
            acc_up = tl.zeros([BN], tl.float32)
            for t in range(SPLIT):
                acc += tl.load(PART + (t * rows + m) * part + n, mask=keep, other=0.0, cache_modifier=".cg")
                if GLU:
                    acc_up += tl.load(PART + (t * rows + m) * part + N + n, mask=keep, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(ticket, 0)  # for the next launch
            _gemv_out(OUT, SCALE, acc, acc_up, m, n, width, keep, GLU)
    else:
        _gemv_out(OUT, SCALE, acc, acc_up, m, n, width, keep, GLU)


@triton.jit
def last_to_finish(ticket, programs):
    """Called by each of `programs` programs after storing its partial results: whether it is the
    last to do so (then every partial is visible to it; it resets `ticket` to zero when done).
    The barrier orders the CTA's stores before the ticket, taken with acquire-release at GPU scope."""
    tl.debug_barrier()
    return tl.atomic_add(ticket, 1, sem="acq_rel", scope="gpu") == programs - 1


@triton.jit
def _gemv_out(OUT, SCALE, acc, acc_up, m, n, N, keep, GLU: tl.constexpr):
    """Output row m's BN sums, in OUT's dtype (GLU: SiLU of the gate's times the up's, weighted)."""
    if GLU:
        acc = acc * tl.sigmoid(acc) * acc_up * tl.load(SCALE + m).to(tl.float32)
    tl.store(OUT + m * N + n, acc.to(OUT.dtype.element_ty), mask=keep)


@triton.jit
def _dequant_kernel(P0, P1, P2, P3, OUT, N, K, FMT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """OUT [E, N, K] = the weight, dequantized (for prefill: one bf16 copy, then cuBLAS)."""
    tiles = tl.cdiv(N, BN)
    e = (tl.program_id(0) // tiles).to(tl.int64)
    n = ((tl.program_id(0) % tiles) * BN + tl.arange(0, BN)).to(tl.int64)[:, None]
    k = (tl.program_id(1) * BK + tl.arange(0, BK)).to(tl.int64)[None, :]
    w = _dequant(P0, P1, P2, P3, e, tl.minimum(n, N - 1), k, N, K, FMT)
    tl.store(OUT + (e * N + n) * K + k, w.to(OUT.dtype.element_ty), mask=n < N)


@triton.jit
def _gemm_kernel(
    X, P0, P1, P2, P3, Y, ORDER, OFFS, M, N, K, E, TOP_K,
    FMT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr,
    EXPERTS: tl.constexpr,
):
    """Y [M, N] = x @ w.T, the weight's tile dequantized in registers: tile t (`tile_rows`) of rows
    j, reading x's row ORDER[j] // TOP_K with experts, j with one weight."""
    t = tl.program_id(0)
    e, r, valid = tile_rows(t, OFFS, M, E, BM, EXPERTS)
    if e >= E:
        return
    if EXPERTS:
        src = (tl.load(ORDER + r, mask=valid, other=0) // TOP_K).to(tl.int64)
    else:
        src = r.to(tl.int64)
    n = (tl.program_id(1) * BN + tl.arange(0, BN)).to(tl.int64)
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        k = (k0 + tl.arange(0, BK)).to(tl.int64)
        x = tl.load(X + src[:, None] * K + k[None, :], mask=valid[:, None], other=0.0)
        w = _dequant(P0, P1, P2, P3, e, tl.minimum(n, N - 1)[:, None], k[None, :], N, K, FMT)  # [BN, BK]
        if IEEE:
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    tl.store(
        Y + r[:, None] * N + n[None, :], acc.to(Y.dtype.element_ty), mask=valid[:, None] & (n < N)[None, :]
    )


def _block_k(k: int) -> int:
    """Columns per GEMM / dequantization step: 64, or 32 for the narrow rows Q8_0 and FP8 allow."""
    if k % 32:
        raise ValueError(f"quantized matmul: K={k} is not a multiple of 32")
    return 64 if k % 64 == 0 else 32


def _launch_gemm(x: torch.Tensor, w: QuantWeight, m: int, order: torch.Tensor | None = None,
                 offs: torch.Tensor | None = None, top_k: int = 1) -> torch.Tensor:
    """`_gemm_kernel` over m rows of x (one weight) or, with `order` and `offs`, `grouped`'s rows."""
    n, k = w.shape[-2:]
    bm, bn, bk = 32, 64, _block_k(k)
    tiles, experts, lanes = tile_launch(m, bm, offs)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _gemm_kernel[(tiles, triton.cdiv(n, bn))](
        x, *_padded(w), out, x if order is None else order, x if offs is None else offs, m, n, k, experts, top_k,
        FMT=w.fmt, BM=bm, BN=bn, BK=bk, IEEE=x.dtype == torch.float32, EXPERTS=lanes,
    )
    return out


def _padded(w: QuantWeight) -> tuple[torch.Tensor, ...]:
    return (*w.parts, *([w.parts[0]] * (4 - len(w.parts))))


def dequantize_to(w: QuantWeight, dtype: torch.dtype) -> torch.Tensor:
    """The whole weight [.., N, K] in `dtype`, by the kernels' own dequantization (a transient copy)."""
    n, k = w.shape[-2:]
    experts = math.prod(w.shape[:-2])
    out = torch.empty(w.shape, dtype=dtype, device=w.parts[0].device)
    bn, bk = 64, _block_k(k)
    _dequant_kernel[(experts * triton.cdiv(n, bn), k // bk)](*_padded(w), out, n, k, FMT=w.fmt, BN=bn, BK=bk)
    return out


_TICKETS: dict[torch.device, torch.Tensor] = {}
TICKETS = 1 << 16  # (row, n-block) counters of the GEMV's split-K sums
MAX_PROGRAMS = 1 << 15  # a GEMV's programs at most, whatever its split


def tickets(device: torch.device) -> torch.Tensor:
    """The GEMV's ticket counters on `device`: zeros, and left at zero by every launch (the last
    program of each sum resets its own). One set per device: the GEMVs of a device run one after
    another on its compute stream. Made outside any graph capture (the first forward is eager)."""
    if device not in _TICKETS:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the GEMV's counters are made by an eager forward before any capture")
        _TICKETS[device] = torch.zeros(TICKETS, dtype=torch.int32, device=device)
    return _TICKETS[device]


def _gemv(
    x: torch.Tensor, w: QuantWeight, rows: int, n: int, experts: torch.Tensor | None = None,
    x_per: int = 1, top_k: int = 1, scale: torch.Tensor | None = None, split: int | None = None,
    second: QuantWeight | None = None,
) -> torch.Tensor:
    """`rows` output rows of `n` (`_gemv_kernel`), in one launch: K split over as many programs as
    `_heuristic_split` chooses for this shape (or `split`, one of `_splits`), the split's sums taken
    by its last program. `second`: a plain weight of another format whose outputs follow (rows x (n + its N))."""
    n2 = second.shape[0] if second is not None else 0
    k, grouped = w.shape[-1], experts is not None
    bn = gemv_block_n(n + n2, grouped)
    chunk = max(GEMV_CHUNK[w.fmt], GEMV_CHUNK[second.fmt] if second is not None else 0)
    blocks = triton.cdiv(n, bn) + triton.cdiv(n2, bn)
    if blocks * rows > TICKETS:
        raise ValueError(f"GEMV of {rows} x {n + n2} outputs: more than {TICKETS} sums")
    glu = scale is not None
    splits = _splits(k, chunk, top_k, blocks * rows)
    out = torch.empty(rows, n + n2, dtype=x.dtype, device=x.device)
    xmap = w.columns is not None
    ids = experts if grouped else x  # (unread when not grouped)
    columns = w.columns if xmap else x  # (unread without a column map)
    counters = tickets(x.device)
    fmt2, parts2 = (second.fmt, _padded(second)) if second is not None else (-1, _padded(w))
    constexprs = gemv_constexprs(w.fmt, bn, grouped, x_per, top_k, glu, xmap, fmt2)

    def launch(split: int) -> None:
        part = torch.empty(split, rows, (n if glu else 0) + n + n2, dtype=torch.float32, device=x.device) if split > 1 else x
        _gemv_kernel[(blocks, split, rows)](
            x, *_padded(w), part, out, counters, ids, scale if glu else x, columns, *parts2, n, n2, k,
            k // (split // top_k), split, x.shape[-1], **constexprs, num_warps=GEMV_WARPS,
        )

    if split is None:
        split = _heuristic_split(splits, blocks * rows)
    elif split not in splits:
        raise ValueError(f"split {split} is not one of {splits}")
    launch(split)
    return out


def gemv_constexprs(fmt: int, bn: int, grouped: bool = False, x_per: int = 1, top_k: int = 1, glu: bool = False,
                    xmap: bool = False, fmt2: int = -1) -> dict:
    """`_gemv_kernel`'s compile-time arguments for a launch of this kind under the module's settings
    (GEMV_STAGES, GEMV_UNROLL): the launcher's and the sm_90 compile tests'."""
    return {"FMT": fmt, "BN": bn, "CHUNK": GEMV_CHUNK[fmt], "GROUPED": grouped,
            "X_PER": x_per, "TOPK": top_k, "GLU": glu, "XMAP": xmap, "FMT2": fmt2,
            "CHUNK2": GEMV_CHUNK[fmt2] if fmt2 >= 0 else 1, "STAGES": GEMV_STAGES, "UNROLL": GEMV_UNROLL}


def gemv_block_n(n: int, grouped: bool = False) -> int:
    """Outputs per GEMV program for `n` outputs a row (of each expert, `grouped`)."""
    most = max(GEMV_BLOCK_N, 64) if n >= GEMV_WIDE_N and not grouped else GEMV_BLOCK_N
    return min(most, max(16, triton.next_power_of_2(n)))


def _splits(k: int, chunk: int, top_k: int, sums: int) -> list[int]:
    """The splits a GEMV of `sums` (row, n-block) outputs over K = `k` may run with, ascending:
    top_k times 1, 2, 4, ... programs per assignment, each over whole chunks of K, at most
    MAX_PROGRAMS programs in all."""
    splits, per = [], 1
    while k % (per * chunk) == 0 and (not splits or sums * top_k * per <= MAX_PROGRAMS):
        splits.append(top_k * per)
        per *= 2
    return splits


def _heuristic_split(splits: list[int], sums: int, programs: int = GEMV_PROGRAMS) -> int:
    """The smallest split that fills the GPU with `programs` programs, else the largest."""
    return next((s for s in splits if sums * s >= programs), splits[-1])


def gemv_fits(w: QuantWeight) -> bool:
    """Whether the GEMV kernel takes `w`: rows of whole chunks (and FP8 experts of whole scale blocks)."""
    return w.shape[-1] % GEMV_CHUNK[w.fmt] == 0 and (w.fmt != FP8 or w.shape[-2] % FP8_ROWS == 0)


def _experts_fit(w: QuantWeight) -> None:
    if not gemv_fits(w):
        raise ValueError(f"{NAMES[w.fmt]} experts {list(w.shape)}: rows or columns off the GEMV's blocks")


def experts_glu(x: torch.Tensor, gate_up: QuantWeight, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """MoE decode, up: act[a] = silu(x[t] @ gate[e].T) * (x[t] @ up[e].T) * weights[a] for each
    assignment a = (token t, its j-th expert e = ids[t, j]) of x [T, H], ids / weights [T, k],
    gate_up [E, 2I, H] (gate rows first); zeros for e = -1. Only the chosen experts' weights are
    read, in one launch. Returns [T * k, I] in x's dtype."""
    _experts_fit(gate_up)
    top_k = ids.shape[-1]
    flat = ids.reshape(-1)
    return _gemv(x.contiguous(), gate_up, flat.numel(), gate_up.shape[1] // 2, flat, top_k,
                 scale=weights.reshape(-1).contiguous())


def experts_sum(act: torch.Tensor, down: QuantWeight, ids: torch.Tensor) -> torch.Tensor:
    """MoE decode, down: out[t] = sum over j of act[t * k + j] @ down[ids[t, j]].T (fp32, one
    rounding to act's dtype), down [E, H, I]; nothing for -1. One launch. Returns [T, H]."""
    _experts_fit(down)
    tokens, top_k = ids.shape
    return _gemv(act.contiguous(), down, tokens, down.shape[1], ids.reshape(-1), top_k=top_k)


def linear(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """x [M, K] @ w.T → [M, N] in x's dtype (w: one weight [N, K]): a split-K GEMV for up to
    `GEMV_ROWS` rows (decode), the tiled kernel up to `DEQUANT_ROWS`, above that (prefill) FP8 on
    its tensor cores (`fp8_prefill`) or one transient dequantized copy and a cuBLAS GEMM (the copy costs
    far less than the GEMM)."""
    n, k = w.shape
    x = x.contiguous()
    m = x.shape[0]
    if m <= GEMV_ROWS and k % GEMV_CHUNK[w.fmt] == 0 and (w.columns is None or w.chunked_columns):
        return _gemv(x, w, m, n)  # x's columns through w's map, if any, a chunk at a time
    if w.columns is not None:  # into the packed order
        x = x.index_select(-1, w.columns)
    if fp8_prefill.runs(x, w, m):
        return fp8_prefill.linear(x, w)
    if m > DEQUANT_ROWS and x.dtype != torch.float32:
        return x @ dequantize_to(w, x.dtype).T
    return _launch_gemm(x, w, m)


def linear_pair(x: torch.Tensor, first: QuantWeight, second: QuantWeight) -> torch.Tensor | None:
    """x [M, K] @ [first; second].T → [M, N1 + N2] for two weights of different formats (a fused
    projection that could not be one weight: `engine.model.Concat`) in one GEMV launch; None beyond
    decode rows or where the GEMV does not take them (a column map, K off a chunk)."""
    m, k = x.shape
    if (m > GEMV_ROWS or len(first.shape) != 2 or len(second.shape) != 2 or second.shape[1] != k
            or first.columns is not None or second.columns is not None
            or k % max(GEMV_CHUNK[first.fmt], GEMV_CHUNK[second.fmt])):
        return None
    return _gemv(x.contiguous(), first, m, first.shape[0], second=second)


def grouped(
    x: torch.Tensor, w: QuantWeight, order: torch.Tensor, offs: torch.Tensor, top_k: int = 1
) -> torch.Tensor:
    """MoE prefill: y[j] = x[order[j] // top_k] @ w[e(j)].T for the j-th assignment in expert order
    (`order`, `offs` [E] int32 ends of each expert's rows, from `moe.group_by_expert`). Returns
    [len(order), N] in expert order. Each program finds its tile's expert and rows from `offs`
    (`tile_rows`: len(order) / BM + min(len(order), E) tiles at most, decode a few, the empty ones
    return at once; no host sync). Beyond DEQUANT_ROWS bf16 rows: FP8 on its tensor cores
    (`fp8_prefill`), other formats a transient bf16 copy and torch's grouped GEMM."""
    if fp8_prefill.runs(x, w, order.numel()):
        return fp8_prefill.grouped(x, w, order, offs, top_k)
    if order.numel() > DEQUANT_ROWS and x.dtype == torch.bfloat16:
        xs = x.index_select(0, order // top_k)  # row copies (x[i] is an elementwise kernel)
        return grouped_mm(xs, dequantize_to(w, x.dtype).transpose(1, 2), offs=offs)
    return _launch_gemm(x.contiguous(), w, order.numel(), order, offs, top_k)
