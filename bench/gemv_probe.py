"""What holds the quantized decode GEMV at 0.8-1.6 TB/s on the H200: memory latency, or the
instructions each weight costs? Kernels timed as CUDA graphs of 20 launches (the best of three):

- `engine` (the default): the engine's GEMVs (`quant.linear`, `experts_glu`, `experts_sum`) at the
  Q4_K_M decode shapes of the 35B model, 32 and 64 rows a program;
- on one Q4_K weight [N, K] and one row of x, at a decode-sized and a streaming-sized N:
  `current` (`quant._gemv` at each split of K); `loads` (the same programs' loads, the weight's
  32-bit words and its scales, and an XOR a word: the memory side's ceiling for 64 columns a step);
  `lean` (32-bit words, nibbles made floats by the exponent trick, an OR and a subtraction,
  instead of integer conversions, per-column sums reduced once after the K loop); `bytes` (`lean`
  over the bytes, x's columns contiguous); `wide` and `w2` (G groups of 64 columns a step as a
  [BN, G, 32] or [BN, G * 32] tile: each row's bytes contiguous, whole lines a warp; `-ld`: their
  loads alone); `dp4a` (x as llama.cpp's Q8_1, 8-bit ints in 32-column blocks quantized once
  outside, against the nibbles in integer dot products); `wide-dp4a` (`dp4a` over `wide`'s tiles:
  2.5-4 instructions a weight, SASS: the engine's `_dot_q4_k_q8`); `dot` (the tile dequantized to bf16 and
  multiplied on the tensor cores);
- torch's bf16 GEMV and a copy of the weight's bytes, as the device's yardsticks.

Session 13 (H200, `bench/results/gemv-probe-h200-s13.json`), the MoE up's size (9216 x 2048 Q4_K,
10.9 MB): copy 4.2 us, torch's bf16 GEMV 8.5 us for 3.5 times the bytes (4.4 TB/s), `current`
13.5 us (0.81 TB/s); its loads alone 8.2-11 us, `wide` loads alone 5.8 us; `lean` 11.7, `bytes`
12.2, `wide` 12.4, `dp4a` 9.2 (128 rows a program; 10.5 against 16.2 at 12352 rows, 43 against
69 at 65536), `dot` 18-29 us. Tried in the engine and removed: lean Q4_K and Q6_K chunks (Q4_K 3%
faster, Q6_K 2.6-3.4 times slower: the lm_head 888 against 262 us); Q4_K against x's Q8 blocks
made inside each GEMV with dp4a (five instructions a weight against 12.8): Q4_K_M decode 264.8
tok/s against 289.9 without, in the same lease. Neither the access pattern nor the instruction
count alone moves it far: Triton's loads of 32-byte row pieces reach 1-2.6 TB/s with nothing to compute.

Session 14: each of those graphs repeats one weight, and a weight under the H200's 50 MB of L2 stays in
it from call to call: warm figures, where a decode token reads every weight once, from HBM. In the
engine `wide-dp4a` (8.0 against 12.7 us warm at 9216 rows) left the decode slower (`quant.Q8X`).
`--cold` rotates each kernel's calls over copies of the weight (different experts for the engine's
MoE rows), 160 MB of them, so that no call finds its weight in L2. Cold, at 9216 x 2048
(`gemv-probe-h200-cold-s14.json`): copy 6.5 us, torch's bf16 12.1, `current` 13.7, `dp4a` 10.5,
`wide-dp4a` 10.1, `wide` loads alone 7.6; the engine's MoE up 13.8 us, 17.6 with x as Q8_1, its
[12352, 2048] 17.6 and 12.1, and still a decode with Q8_1 in that GEMV alone ran 294.0 tok/s against
303.2 without: the added launch per GEMV costs a decode token more than these figures show.

Session 30 (`gemv-probe-h200-cold-{fma-s30a,lines-s30b}.json`, cold): `wide-fma` (`wide`'s tiles, x as it
is, each nibble 1 + q / 16 by the exponent trick: a shift, an and-or and an FMA, the sub-blocks' scales
applied to the sums) and `lines` (the same with a thread's 16 bytes summed in its registers and x read
four bf16 to a 64-bit word), best over rows, groups, warps and splits: 13.8 us against the engine's 13.6 at
9216 x 2048, 16.0 against 16.7 at 12352 x 2048, 8.2 against 10.3 at 2048 x 4096 (`wide` 8.2 too).
`wide-fma` at 32 rows and 4 groups is ~8 SASS instructions a weight in all (the engine's 12.8) and no
faster where the weight is cold: these GEMVs wait on memory latency, not on arithmetic; only the K = 4096
shape gains, from whole rows a program (~2% of a Q4_K_M token: not taken into the engine).

    python bench/gemv_probe.py [--kinds engine,narrow,wide,w2,dp4a,wide-dp4a,wide-fma,dot] [--cold] [--json OUT.json]   # on a GPU
    TRITON_INTERPRET=1 python bench/gemv_probe.py --check   # the probe's kernels against quant.linear, CPU
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # bench/engine.py would shadow the `engine` package

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from engine.ops.gpu import quant  # noqa: E402
from engine.quant.ggml import T  # noqa: E402


@triton.jit
def _rows(N, BN: tl.constexpr):
    """A probe program's split s, its BN output rows n and the weight rows they read (n clamped to
    N - 1, int64): program (n-block, s) of the grid."""
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    return tl.program_id(1), n, tl.minimum(n, N - 1).to(tl.int64)


@triton.jit
def _scales(SC, MN, dd, sub):
    """A 64-column group's two sub-blocks: d * sc (the high nibble's divided by 16: it is taken in
    place, 16 times its value) and dmin * mn, at the rows and groups `sub` and `dd` index."""
    d, dmin = tl.load(dd).to(tl.float32), tl.load(dd + 1).to(tl.float32)
    s0, s1 = d * tl.load(SC + sub).to(tl.float32), d * tl.load(SC + sub + 1).to(tl.float32) * 0.0625
    return s0, s1, dmin * tl.load(MN + sub).to(tl.float32), dmin * tl.load(MN + sub + 1).to(tl.float32)


@triton.jit
def _nibbles(q):
    """Bytes (uint32) as fp32: the low nibble and 16 times the high one, by the exponent trick."""
    lo = ((q & 0x0F) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    return lo, ((q & 0xF0) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _store(OUT, n, N, out, ATOMIC: tl.constexpr):
    """A program's sums: added atomically (K split) or stored."""
    if ATOMIC:
        tl.atomic_add(OUT + n, out, mask=n < N)
    else:
        tl.store(OUT + n, out, mask=n < N)


@triton.jit
def _q4k_lean(X, QS, SC, MN, DD, OUT, N, K, K_SPLIT, BN: tl.constexpr, ATOMIC: tl.constexpr):
    """64 columns a step as [BN, 8] 32-bit words; per-column sums, reduced after the K loop."""
    s, n, row = _rows(N, BN)
    words = tl.arange(0, 8)
    qw = QS.to(tl.pointer_type(tl.uint32))
    acc = tl.zeros([BN, 8], tl.float32)
    for k0 in range(s * K_SPLIT, (s + 1) * K_SPLIT, 64):
        # the 32 bytes of this 64-column group: byte j holds column j (low nibble) and 32 + j (high)
        w = tl.load(qw + row[:, None] * (K // 8) + k0 // 8 + words[None, :])
        sub = row * (K // 32) + k0 // 32
        dd = DD + (row * (K // 256) + k0 // 256) * 2
        d, dmin = tl.load(dd).to(tl.float32), tl.load(dd + 1).to(tl.float32)
        s0 = d * tl.load(SC + sub).to(tl.float32)
        s1 = d * tl.load(SC + sub + 1).to(tl.float32)
        m0 = dmin * tl.load(MN + sub).to(tl.float32)
        m1 = dmin * tl.load(MN + sub + 1).to(tl.float32)
        for b in tl.static_range(4):
            lo = (((w >> (8 * b)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
            hi = (((w >> (8 * b + 4)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
            x_lo = tl.load(X + k0 + 4 * words + b).to(tl.float32)
            x_hi = tl.load(X + k0 + 32 + 4 * words + b).to(tl.float32)
            acc += (s0[:, None] * lo - m0[:, None]) * x_lo[None, :]
            acc += (s1[:, None] * hi - m1[:, None]) * x_hi[None, :]
    out = tl.sum(acc, 1)
    _store(OUT, n, N, out, ATOMIC)


@triton.jit
def _q4k_bytes(X, QS, SC, MN, DD, OUT, N, K, K_SPLIT, BN: tl.constexpr, ATOMIC: tl.constexpr):
    """`lean` over the group's bytes [BN, 32] (x's columns contiguous), each widened once; the
    per-row scales kept as [BN, 1] (the tile's own layout: no shuffle through shared memory), the
    high nibble taken in place (16 times its value, the scale divided by 16: exact)."""
    s, n, row = _rows(N, BN)
    row = row[:, None]
    col = tl.arange(0, 32)[None, :]
    acc = tl.zeros([BN, 32], tl.float32)
    for k0 in range(s * K_SPLIT, (s + 1) * K_SPLIT, 64):
        byte = tl.load(QS + row * (K // 2) + k0 // 2 + col).to(tl.uint32)
        sub = row * (K // 32) + k0 // 32
        dd = DD + (row * (K // 256) + k0 // 256) * 2
        s0, s1, m0, m1 = _scales(SC, MN, dd, sub)
        lo, hi = _nibbles(byte)
        x_lo = tl.load(X + k0 + col).to(tl.float32)
        x_hi = tl.load(X + k0 + 32 + col).to(tl.float32)
        acc += (s0 * lo - m0) * x_lo
        acc += (s1 * hi - m1) * x_hi
    out = tl.sum(acc, 1)
    _store(OUT, n, N, out, ATOMIC)


@triton.jit
def _q4k_wide(X, QS, SC, MN, DD, OUT, N, K, K_SPLIT, BN: tl.constexpr, ATOMIC: tl.constexpr,
              G: tl.constexpr, LOADS: tl.constexpr):  # fmt: skip
    """G 64-column groups a step as one [BN, G, 32]-byte tile: each row's G * 32 bytes contiguous
    (a warp reads whole lines of one row), per-row sums reduced once a step. LOADS: the loads alone."""
    s, n, row = _rows(N, BN)
    row = row[:, None, None]
    g = tl.arange(0, G)[None, :, None]
    j = tl.arange(0, 32)[None, None, :]
    acc = tl.zeros([BN], tl.float32)
    for k0 in range(s * K_SPLIT, (s + 1) * K_SPLIT, 64 * G):
        byte = tl.load(QS + row * (K // 2) + k0 // 2 + g * 32 + j)
        sub = row * (K // 32) + k0 // 32 + 2 * g  # [BN, G, 1]
        dd = DD + (row * (K // 256) + (k0 + 64 * g) // 256) * 2
        if LOADS:
            acc += tl.sum(tl.sum((byte.to(tl.int32) ^ tl.load(SC + sub).to(tl.int32) ^ tl.load(MN + sub + 1).to(tl.int32))
                                 .to(tl.float32) + tl.load(dd).to(tl.float32), 2), 1)  # fmt: skip
        else:
            s0, s1, m0, m1 = _scales(SC, MN, dd, sub)
            b = byte.to(tl.uint32)
            lo, hi = _nibbles(b)
            x_lo = tl.load(X + k0 + 64 * g + j).to(tl.float32)
            x_hi = tl.load(X + k0 + 64 * g + 32 + j).to(tl.float32)
            acc += tl.sum(tl.sum((s0 * lo - m0) * x_lo + (s1 * hi - m1) * x_hi, 2), 1)
    _store(OUT, n, N, acc, ATOMIC)


@triton.jit
def _q4k_w2(X, QS, SC, MN, DD, OUT, N, K, K_SPLIT, BN: tl.constexpr, ATOMIC: tl.constexpr,
            G: tl.constexpr, LOADS: tl.constexpr):  # fmt: skip
    """`wide` as a 2-D tile [BN, G * 32 bytes]: byte b of a step is column (b // 32) * 64 + b % 32
    (low nibble) and that + 32 (high) of the step; its scales those of group b // 32."""
    s, n, row = _rows(N, BN)
    row = row[:, None]
    b = tl.arange(0, G * 32)[None, :]
    col = (b // 32) * 64 + b % 32  # the low nibble's column in the step
    acc = tl.zeros([BN], tl.float32)
    for k0 in range(s * K_SPLIT, (s + 1) * K_SPLIT, 64 * G):
        byte = tl.load(QS + row * (K // 2) + k0 // 2 + b)
        sub = row * (K // 32) + k0 // 32 + 2 * (b // 32)
        dd = DD + (row * (K // 256) + (k0 + col) // 256) * 2
        if LOADS:
            acc += tl.sum((byte.to(tl.int32) ^ tl.load(SC + sub).to(tl.int32) ^ tl.load(MN + sub + 1).to(tl.int32))
                          .to(tl.float32) + tl.load(dd).to(tl.float32), 1)  # fmt: skip
        else:
            s0, s1, m0, m1 = _scales(SC, MN, dd, sub)
            q = byte.to(tl.uint32)
            lo, hi = _nibbles(q)
            x_lo = tl.load(X + k0 + col).to(tl.float32)
            x_hi = tl.load(X + k0 + 32 + col).to(tl.float32)
            acc += tl.sum((s0 * lo - m0) * x_lo + (s1 * hi - m1) * x_hi, 1)
    _store(OUT, n, N, acc, ATOMIC)


@triton.jit
def _q4k_dot(X, QS, SC, MN, DD, OUT, N, K, K_SPLIT, BN: tl.constexpr, ATOMIC: tl.constexpr,
             G: tl.constexpr, LOADS: tl.constexpr):  # fmt: skip
    """`wide`'s tile dequantized to bf16 (x's dtype) and multiplied on the tensor cores: x's row as
    column 0 of a [G * 32, 16] operand, the products summed by the MMA (no per-weight FFMA with
    x, no shuffles). LOADS is unused (one kernel, for the probe's table)."""
    s, n, row = _rows(N, BN)
    row = row[:, None, None]
    g = tl.arange(0, G)[None, :, None]
    j = tl.arange(0, 32)[None, None, :]
    c = tl.arange(0, G * 32)[:, None]
    m = tl.arange(0, 16)[None, :]
    acc = tl.zeros([BN, 16], tl.float32)
    for k0 in range(s * K_SPLIT, (s + 1) * K_SPLIT, 64 * G):
        byte = tl.load(QS + row * (K // 2) + k0 // 2 + g * 32 + j)
        sub = row * (K // 32) + k0 // 32 + 2 * g  # [BN, G, 1]
        dd = DD + (row * (K // 256) + (k0 + 64 * g) // 256) * 2
        s0, s1, m0, m1 = _scales(SC, MN, dd, sub)
        q = byte.to(tl.uint32)
        lo, hi = _nibbles(q)
        w_lo = tl.reshape((s0 * lo - m0).to(X.dtype.element_ty), [BN, G * 32])
        w_hi = tl.reshape((s1 * hi - m1).to(X.dtype.element_ty), [BN, G * 32])
        xc = X + m * K + k0 + (c // 32) * 64 + c % 32  # [G * 32, 16]: x's row 0 in column 0
        x_lo = tl.load(xc, mask=m < 1, other=0.0)
        x_hi = tl.load(xc + 32, mask=m < 1, other=0.0)
        acc = tl.dot(w_lo, x_lo, acc)
        acc = tl.dot(w_hi, x_hi, acc)
    out = tl.sum(tl.where(m == 0, acc, 0.0), 1)
    _store(OUT, n, N, out, ATOMIC)


_dp4a = quant._dp4a  # the engine's (dp4a.u32.s32; shifts in the interpreter)


@triton.jit
def _q4k_dp4a(XQ, XD, XS, QS, SC, MN, DD, OUT, N, K, K_SPLIT, BN: tl.constexpr, ATOMIC: tl.constexpr,
              NATIVE: tl.constexpr):  # fmt: skip
    """x quantized as llama.cpp's Q8_1 (int8 in 32-column blocks: XQ words of four, XD the blocks'
    scales, XS scale * sum of the block's ints) against Q4_K in integer dot products (dp4a): a word
    of four low nibbles (or high) against a word of x, its sum scaled once a sub-block."""
    s, n, row = _rows(N, BN)
    words = tl.arange(0, 8)[None, :]
    qw = QS.to(tl.pointer_type(tl.uint32))
    acc = tl.zeros([BN, 8], tl.float32)
    mins = tl.zeros([BN], tl.float32)
    for k0 in range(s * K_SPLIT, (s + 1) * K_SPLIT, 64):
        w = tl.load(qw + row[:, None] * (K // 8) + k0 // 8 + words)
        sub = row * (K // 32) + k0 // 32
        dd = DD + (row * (K // 256) + k0 // 256) * 2
        d, dmin = tl.load(dd).to(tl.float32), tl.load(dd + 1).to(tl.float32)
        x_lo = tl.load(XQ + k0 // 4 + words)
        x_hi = tl.load(XQ + k0 // 4 + 8 + words)
        dx0, dx1 = tl.load(XD + k0 // 32), tl.load(XD + k0 // 32 + 1)
        s0 = d * tl.load(SC + sub).to(tl.float32) * dx0
        s1 = d * tl.load(SC + sub + 1).to(tl.float32) * dx1
        lo = _dp4a(w & 0x0F0F0F0F, x_lo, NATIVE).to(tl.float32)
        hi = _dp4a((w >> 4) & 0x0F0F0F0F, x_hi, NATIVE).to(tl.float32)
        acc += s0[:, None] * lo + s1[:, None] * hi
        mins += dmin * (tl.load(MN + sub).to(tl.float32) * tl.load(XS + k0 // 32)
                        + tl.load(MN + sub + 1).to(tl.float32) * tl.load(XS + k0 // 32 + 1))  # fmt: skip
    out = tl.sum(acc, 1) - mins
    _store(OUT, n, N, out, ATOMIC)


_dot_q4_k_q8 = quant._dot_q4_k_q8  # the engine's chunk (FT_Q8X), at this probe's own rows and groups a step


@triton.jit
def _q4k_wide_dp4a(XC, QS, SC, MN, DD, OUT, N, K, K_SPLIT, BN: tl.constexpr, ATOMIC: tl.constexpr,
                   G: tl.constexpr, NATIVE: tl.constexpr):  # fmt: skip
    """`dp4a` over `wide`'s tiles: the engine's `_dot_q4_k_q8` (G 64-column groups a step as [BN, G, 8]
    words, x's row as `quant.quantize_x` writes it), BN rows a program, K split."""
    s, n, row = _rows(N, BN)
    acc = tl.zeros([BN], tl.float32)
    for k0 in range(s * K_SPLIT, (s + 1) * K_SPLIT, 64 * G):
        acc += _dot_q4_k_q8(XC, QS, SC, MN, DD, row, k0, K, G, NATIVE)
    _store(OUT, n, N, acc, ATOMIC)


@triton.jit
def _unit(w, BIT: tl.constexpr):
    """The nibble at bits BIT..BIT+3 of each uint32 word as the fp32 1 + q / 16: shifted into the
    mantissa's top four bits under 1.0's exponent (a shift and an and-or, no integer conversion)."""
    if BIT <= 19:
        v = (w << (19 - BIT)) & 0x780000
    else:
        v = (w >> (BIT - 19)) & 0x780000
    return (v | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def _dot_q4_k_wide(XC, P0, P1, P2, P3, row, k0, K, G: tl.constexpr):
    """Q4_K, G groups of 64 columns from k0 as one [BN, G, 8]-word tile (each row's G * 32 bytes
    contiguous: whole lines a warp) against x's columns at XC as they are. A nibble q costs a shift,
    an and-or and an FMA: sum_c (1 + q_c / 16) x_c, less sum_c x_c once a sub-block, is
    (sum_c q_c x_c) / 16; the sub-blocks' scales apply to those sums, not to each weight."""
    r = row[:, None, None]  # [BN, 1, 1]
    g = tl.arange(0, G)[None, :, None]
    words = tl.arange(0, 8)[None, None, :]
    line = tl.multiple_of(r * (K // 8) + k0 // 8, [8, 1, 1])  # K is whole super-blocks: 16-byte loads
    w = tl.load(P0.to(tl.pointer_type(tl.uint32)) + line + g * 8 + words)  # [BN, G, 8]
    xc = XC + 64 * g + 4 * words  # byte b of a word: columns 4 * word + b (low nibble) and 32 more (high)
    s_lo = tl.zeros(w.shape, tl.float32)
    s_hi = tl.zeros(w.shape, tl.float32)
    x_lo = tl.zeros(xc.shape, tl.float32)
    x_hi = tl.zeros(xc.shape, tl.float32)
    for b in tl.static_range(4):
        xl = tl.load(xc + b).to(tl.float32)
        xh = tl.load(xc + 32 + b).to(tl.float32)
        s_lo += _unit(w, 8 * b) * xl
        s_hi += _unit(w, 8 * b + 4) * xh
        x_lo += xl
        x_hi += xh
    sum_lo, sum_hi = tl.sum(x_lo, 2), tl.sum(x_hi, 2)  # [1, G]
    q_lo = tl.sum(s_lo, 2) - sum_lo  # [BN, G]: (sum q x) / 16 of each group's low sub-block
    q_hi = tl.sum(s_hi, 2) - sum_hi
    r2 = row[:, None]
    g2 = tl.arange(0, G)[None, :]
    sub = r2 * (K // 32) + k0 // 32 + 2 * g2  # [BN, G]: each group's low sub-block
    dd = P3 + (r2 * (K // 256) + (k0 + 64 * g2) // 256) * 2
    d, dmin = tl.load(dd).to(tl.float32) * 16.0, tl.load(dd + 1).to(tl.float32)
    scaled = d * (tl.load(P1 + sub).to(tl.float32) * q_lo + tl.load(P1 + sub + 1).to(tl.float32) * q_hi)
    mins = dmin * (tl.load(P2 + sub).to(tl.float32) * sum_lo + tl.load(P2 + sub + 1).to(tl.float32) * sum_hi)
    return tl.sum(scaled - mins, 1)


@triton.jit
def _bf16_of(xw, B: tl.constexpr):
    """bf16 number B of each 64-bit word of four as fp32 (its bits moved up 16)."""
    return (((xw >> (16 * B)) & 0xFFFF).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _dot_q4_k_lines(XC, P0, P1, P2, P3, row, k0, K, G: tl.constexpr):
    """`_dot_q4_k_wide` with a thread's four words (16 bytes: 32 nibbles of one sub-block pair) summed
    in its registers before any shuffle, and x's bf16 columns read as 64-bit words of four."""
    r = row[:, None, None, None]  # [BN, 1, 1, 1]
    g = tl.arange(0, G)[None, :, None, None]
    h = tl.arange(0, 2)[None, None, :, None]
    j = tl.arange(0, 4)[None, None, None, :]
    line = tl.multiple_of(r * (K // 8) + k0 // 8, [8, 1, 1, 1])
    w = tl.load(P0.to(tl.pointer_type(tl.uint32)) + line + g * 8 + h * 4 + j)  # [BN, G, 2, 4]
    xq = XC.to(tl.pointer_type(tl.uint64)) + 16 * g + 4 * h + j  # word 4h + j's four low-nibble columns
    xl, xh = tl.load(xq), tl.load(xq + 8)  # and its four high-nibble ones, 32 columns on
    s_lo = tl.zeros(w.shape, tl.float32)
    s_hi = tl.zeros(w.shape, tl.float32)
    x_lo = tl.zeros(xq.shape, tl.float32)
    x_hi = tl.zeros(xq.shape, tl.float32)
    for b in tl.static_range(4):
        lo, hi = _bf16_of(xl, b), _bf16_of(xh, b)
        s_lo += _unit(w, 8 * b) * lo
        s_hi += _unit(w, 8 * b + 4) * hi
        x_lo += lo
        x_hi += hi
    sum_lo, sum_hi = tl.sum(x_lo, 3), tl.sum(x_hi, 3)  # [1, G, 2]: in the thread's registers
    q_lo = tl.sum(s_lo, 3) - sum_lo  # [BN, G, 2]
    q_hi = tl.sum(s_hi, 3) - sum_hi
    r3 = row[:, None, None]
    g3 = tl.arange(0, G)[None, :, None]
    sub = r3 * (K // 32) + k0 // 32 + 2 * g3  # [BN, G, 1]
    dd = P3 + (r3 * (K // 256) + (k0 + 64 * g3) // 256) * 2
    d, dmin = tl.load(dd).to(tl.float32) * 16.0, tl.load(dd + 1).to(tl.float32)
    scaled = d * (tl.load(P1 + sub).to(tl.float32) * q_lo + tl.load(P1 + sub + 1).to(tl.float32) * q_hi)
    mins = dmin * (tl.load(P2 + sub).to(tl.float32) * sum_lo + tl.load(P2 + sub + 1).to(tl.float32) * sum_hi)
    return tl.sum(tl.sum(scaled - mins, 2), 1)


@triton.jit
def _q4k_wide_fma(X, QS, SC, MN, DD, OUT, N, K, K_SPLIT, BN: tl.constexpr, ATOMIC: tl.constexpr, G: tl.constexpr,
                  LINES: tl.constexpr):  # fmt: skip
    """`wide`'s tiles with x as it is, each nibble as 1 + q / 16 by the exponent trick and one FMA:
    `_dot_q4_k_wide` (LINES: `_dot_q4_k_lines`), BN rows a program, K split."""
    s, n, row = _rows(N, BN)
    acc = tl.zeros([BN], tl.float32)
    for k0 in range(s * K_SPLIT, (s + 1) * K_SPLIT, 64 * G):
        if LINES:
            acc += _dot_q4_k_lines(X + k0, QS, SC, MN, DD, row, k0, K, G)
        else:
            acc += _dot_q4_k_wide(X + k0, QS, SC, MN, DD, row, k0, K, G)
    _store(OUT, n, N, acc, ATOMIC)


q8_1 = quant.q8_1_reference  # x [K] as Q8_1: what `quant.quantize_x` writes, in torch


def q8_1_product(x: torch.Tensor, w: quant.QuantWeight) -> torch.Tensor:
    """What the dp4a probes compute, in torch: the dequantized Q4_K against x rounded to its Q8_1 blocks."""
    return w.dequantize() @ quant.q8_1_rounded(x)


@triton.jit
def _q4k_loads(X, QS, SC, MN, DD, OUT, N, K, K_SPLIT, BN: tl.constexpr, ATOMIC: tl.constexpr):
    """`_q4k_lean`'s loads alone, the same program shape on purpose (each word XORed in)."""
    s, n, row = _rows(N, BN)
    words = tl.arange(0, 8)
    qw = QS.to(tl.pointer_type(tl.int32))
    acc = tl.zeros([BN, 8], tl.int32)
    extra = tl.zeros([BN], tl.int32)
    for k0 in range(s * K_SPLIT, (s + 1) * K_SPLIT, 64):
        acc ^= tl.load(qw + row[:, None] * (K // 8) + k0 // 8 + words[None, :])
        sub = row * (K // 32) + k0 // 32
        extra ^= tl.load(SC + sub).to(tl.int32) ^ tl.load(MN + sub + 1).to(tl.int32)
        extra ^= tl.load((DD + (row * (K // 256) + k0 // 256) * 2).to(tl.pointer_type(tl.int32)))
    out = (tl.sum(acc, 1) ^ extra).to(tl.float32)
    _store(OUT, n, N, out, ATOMIC)


def launcher(
    kernel, x: torch.Tensor, w: quant.QuantWeight, bn: int, split: int, warps: int = 4, **constexprs
):
    """A call of `kernel` over x's row (the dp4a kernel: its Q8_1, made once here, as a separate
    launch would) and w, K split `split` ways (atomic sums into a zeroed output)."""
    n, k = w.shape
    out = torch.zeros(n, dtype=torch.float32, device=x.device)
    xs = q8_1(x[0]) if kernel is _q4k_dp4a else (quant.quantize_x(x),) if kernel is _q4k_wide_dp4a else (x,)

    def launch() -> torch.Tensor:
        if split > 1:
            out.zero_()
        kernel[(triton.cdiv(n, bn), split)](*xs, *w.parts, out, n, k, k // split, BN=bn, ATOMIC=split > 1,
                                           num_warps=warps, **constexprs)  # fmt: skip
        return out

    return launch


COLD_BYTES = 160e6  # with --cold: the weight copies a kernel's calls rotate over, at least this many bytes
COLD = False


def copies(make) -> list:
    """One `make()` (a weight or a tensor), or with COLD as many as COLD_BYTES of them take."""
    first = make()
    return [first] + [make() for _ in range(math.ceil(COLD_BYTES / first.nbytes) - 1 if COLD else 0)]


def rotate(fns: list):
    """A call of the next of `fns` each time (from the first): a CUDA graph of calls reads each weight once in turn."""
    turn = itertools.cycle(fns)
    return lambda: next(turn)()


def graph_us(fn) -> float:
    """Microseconds a call: `quant._time_split`'s CUDA graph of TUNE_REPEATS calls, the best of three."""
    return quant._time_split(lambda _split: fn(), 1) * 1e3 / quant.TUNE_REPEATS


def random_q4k(n: int, k: int, device) -> quant.QuantWeight:
    from bench.quant_kernels import random_weight  # noqa: PLC0415

    return random_weight(T.Q4_K, (n, k), device)


def check() -> None:
    """The probe's Triton kernels against the engine's `quant.linear` (dp4a: against its torch
    twin, `q8_1_product`), fp32 in Triton's interpreter; the loads-only ones just run."""
    w = random_q4k(96, 512, "cpu")
    x = torch.randn(1, 512)
    want = quant.linear(x, w)[0]
    wide = ((8, 1, {"G": 8}), (16, 2, {"G": 4}), (4, 1, {"G": 2}))
    cases = [
        (_q4k_lean, ((32, 1, {}), (64, 2, {}), (128, 4, {})), want),
        (_q4k_bytes, ((32, 1, {}), (64, 2, {}), (128, 4, {})), want),
        (_q4k_loads, ((32, 1, {}), (64, 2, {})), None),
        *((k, tuple((bn, sp, {**c, "LOADS": loads}) for bn, sp, c in wide), None if loads else want)
          for k in (_q4k_wide, _q4k_w2) for loads in (False, True)),
        (_q4k_dp4a, tuple((bn, sp, {"NATIVE": False}) for bn, sp in ((32, 1), (64, 2), (16, 4))), q8_1_product(x[0], w)),
        (_q4k_wide_dp4a, tuple((bn, sp, {**c, "NATIVE": False}) for bn, sp, c in wide), q8_1_product(x[0], w)),
        (_q4k_wide_fma, tuple((bn, sp, {**c, "LINES": False}) for bn, sp, c in wide), want),
        (_q4k_dot, tuple((bn, sp, {"G": g, "LOADS": False}) for bn, sp, g in ((16, 1, 4), (32, 2, 2), (64, 1, 1))), want),
    ]  # fmt: skip
    x16 = x.bfloat16()  # `lines` reads x's bf16 columns four to a word
    cases.append((_q4k_wide_fma, tuple((bn, sp, {**c, "LINES": True}) for bn, sp, c in wide), quant.linear(x16.float(), w)[0]))
    for kernel, configs, reference in cases:
        for bn, split, constexprs in configs:
            got = launcher(kernel, x16 if constexprs.get("LINES") else x, w, bn, split, **constexprs)()
            if reference is None:
                continue
            err = ((got - reference).abs().max() / reference.abs().max()).item()
            print(f"{kernel.__name__} BN={bn} split={split} {constexprs}: max relative error {err:.2e}")
            assert err < 1e-5, (kernel.__name__, err)
    print("ok")


# the (groups a step, rows a program, warps) each probe of G-group tiles sweeps
WIDE_GRID = ((16, 4, 4), (16, 8, 4), (16, 16, 4), (16, 8, 8), (8, 8, 4), (8, 16, 4), (4, 16, 4), (4, 32, 4))
WIDE_DP4A_GRID = ((16, 8, 4), (16, 16, 4), (8, 16, 4), (8, 32, 4), (4, 32, 4), (4, 64, 4))
WIDE_FMA_GRID = ((16, 4, 4), (16, 4, 2), (16, 4, 1), (16, 8, 2), (16, 8, 4), (8, 8, 2), (32, 4, 2), (16, 2, 1), (8, 4, 1),
                 (16, 16, 4), (4, 32, 4), (4, 16, 4), (2, 32, 4), (8, 16, 4), (8, 32, 4), (4, 64, 4), (2, 64, 4), (4, 32, 8))
# (session 30: lease a timed `wide-fma` over the last eight, lease b both kinds over the first ten)
DOT_GRID = ((4, 64, 4), (4, 32, 4), (8, 32, 4), (8, 64, 4), (2, 64, 4), (4, 128, 4), (4, 64, 8))


def probe(n: int, k: int, kinds: set[str]) -> list[dict]:
    """Every kernel's time on one random Q4_K weight [n, k] and one bf16 row of x."""
    rows: list[dict] = []
    ws = copies(lambda: random_q4k(n, k, "cuda"))
    w = ws[0]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    want = quant.linear(x, w)[0].float()
    want8 = q8_1_product(x[0], w).float()  # what the dp4a probes compute: x's row as Q8_1
    plains = copies(lambda: torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
    copy_srcs = copies(lambda: torch.empty(w.nbytes, dtype=torch.uint8, device="cuda"))
    copy_dst = torch.empty_like(copy_srcs[0])

    def launchers(kernel, *args, **constexprs):  # the kernel over each copy of the weight in turn
        return rotate([launcher(kernel, x, wi, *args, **constexprs) for wi in ws])

    def row(kind, us, nbytes=w.nbytes, err=None, **kw):
        r = {"shape": f"{n}x{k}", "kind": kind, **kw, "us": us, "TB/s": nbytes / us / 1e6, "rel_err": err}
        rows.append(r)
        extra = " ".join(f"{a}={b}" for a, b in kw.items())
        e = f"  err {err:.1e}" if err is not None else ""
        print(f"{r['shape']:>11} {kind:8} {extra:22} {us:8.1f} us {r['TB/s']:6.2f} TB/s{e}", flush=True)

    def timed(kind, fn, reference=want, **kw):  # reference None: a loads-only probe, nothing to compare
        err = None if reference is None else ((fn() - reference).abs().max() / reference.abs().max()).item()
        row(kind, graph_us(fn), err=err, **kw)

    row("copy", graph_us(rotate([lambda src=src: copy_dst.copy_(src) for src in copy_srcs])), 2 * w.nbytes)
    row("bf16", graph_us(rotate([lambda plain=plain: x @ plain.T for plain in plains])), n * k * 2)
    q8x = quant.q8x_groups(x, w)  # the engine's GEMV as it runs here (FT_Q8X)
    for split in quant._splits(k, 64 * q8x or 64, 1, triton.cdiv(n, quant.gemv_block_n(n, q8x=q8x))):
        timed("current", rotate([lambda wi=wi, split=split: quant._gemv(x, wi, 1, n, split=split)[0] for wi in ws]),
              split=split)  # fmt: skip
    if "narrow" in kinds:
        for bn, warps in ((32, 4), (64, 4), (128, 4), (128, 8)):
            for split in (1, 2, 4, 8):
                if k % (64 * split) == 0:
                    for kind, kernel, ref in (("lean", _q4k_lean, want), ("bytes", _q4k_bytes, want),
                                              ("loads", _q4k_loads, None)):  # fmt: skip
                        fn = launchers(kernel, bn, split, warps)
                        timed(kind, fn, ref, bn=bn, warps=warps, split=split)
    if "wide" in kinds:
        for g, bn, warps in WIDE_GRID:
            for split in (1, 2, 4):
                if k % (64 * g * split) == 0:
                    for kind, kernel, loads in (("wide", _q4k_wide, False), ("wide-ld", _q4k_wide, True),
                                                ("w2", _q4k_w2, False), ("w2-ld", _q4k_w2, True)):  # fmt: skip
                        fn = launchers(kernel, bn, split, warps, G=g, LOADS=loads)
                        timed(kind, fn, None if loads else want, bn=bn, warps=warps, split=split, g=g)
    if "dp4a" in kinds:
        for bn, warps in ((32, 4), (64, 4), (128, 4), (128, 8), (256, 8)):
            for split in (1, 2, 4, 8):
                fn = launchers(_q4k_dp4a, bn, split, warps, NATIVE=True)
                timed("dp4a", fn, want8, bn=bn, warps=warps, split=split)
    if "wide-dp4a" in kinds:
        for g, bn, warps in WIDE_DP4A_GRID:
            for split in (1, 2, 4):
                if k % (64 * g * split) == 0:
                    fn = launchers(_q4k_wide_dp4a, bn, split, warps, G=g, NATIVE=True)
                    timed("wide-dp4a", fn, want8, bn=bn, warps=warps, split=split, g=g)
    if "wide-fma" in kinds:
        for g, bn, warps in WIDE_FMA_GRID:
            for split in (1, 2, 4):
                if k % (64 * g * split) == 0:
                    for kind, lines in (("wide-fma", False), ("lines", True)):
                        timed(kind, launchers(_q4k_wide_fma, bn, split, warps, G=g, LINES=lines),
                              bn=bn, warps=warps, split=split, g=g)  # fmt: skip
    if "dot" in kinds:
        for g, bn, warps in DOT_GRID:
            for split in (1, 2, 4):
                if k % (64 * g * split) == 0:
                    timed("dot", launchers(_q4k_dot, bn, split, warps, G=g, LOADS=False),
                          bn=bn, warps=warps, split=split, g=g)  # fmt: skip
    return rows


ENGINE_SHAPES = {  # the Q4_K_M decode GEMVs of the 35B shape: (format, rows, cols, experts a token or 0)
    "Q4_K moe up [9 x 1024, 2048]": (T.Q4_K, 1024, 2048, 9),
    "Q6_K moe down [9 x 2048, 512]": (T.Q6_K, 2048, 512, 9),
    "Q4_K moe down [9 x 2048, 512]": (T.Q4_K, 2048, 512, 9),
    "Q4_K out_proj [2048, 4096]": (T.Q4_K, 2048, 4096, 0),
    "Q4_K [12352, 2048]": (T.Q4_K, 12352, 2048, 0),
    "Q6_K [8192, 2048]": (T.Q6_K, 8192, 2048, 0),
    "Q6_K lm_head [248320, 2048]": (T.Q6_K, 248320, 2048, 0),
}


def engine_rows(only: str = "") -> list[dict]:
    """The engine's own GEMV (`quant.linear`, `experts_glu`, `experts_sum`) at each decode shape, at
    32 and 64 rows a program, the split the engine picks (its heuristic)."""
    from bench.quant_kernels import random_weight  # noqa: PLC0415

    rows = []
    before = quant.GEMV_BLOCK_N
    for name, (fmt, n, k, experts) in ENGINE_SHAPES.items():
        if only not in name:
            continue
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        if experts:  # a stack of 64 experts (cold: the model's 256), a token's 9 of them (cold: other 9 each call)
            stack = 256 if COLD else 64
            w = random_weight(fmt, (stack, n, k), "cuda")
            nbytes = w.nbytes * experts // stack
            weights = torch.rand(1, experts, device="cuda", dtype=torch.bfloat16)
            xs = x.expand(experts, k).contiguous()
            picks = [torch.randperm(stack, device="cuda")[:experts][None] for _ in range(stack // experts if COLD else 1)]
            if "up" in name:
                fns = [lambda x=x, w=w, ids=ids, r=weights: quant.experts_glu(x, w, ids, r) for ids in picks]
            else:
                fns = [lambda xs=xs, w=w, ids=ids: quant.experts_sum(xs, w, ids) for ids in picks]
        else:
            ws = copies(lambda fmt=fmt, n=n, k=k: random_weight(fmt, (n, k), "cuda"))
            fns = [lambda x=x, wi=wi: quant.linear(x, wi) for wi in ws]
            nbytes = ws[0].nbytes
        fn = rotate(fns)
        try:
            for bn in (32, 64):
                quant.GEMV_BLOCK_N = bn
                quant._SPLITS.clear()
                us = graph_us(fn)
                rows.append({"shape": name, "bn": bn, "us": us, "TB/s": nbytes / us / 1e6})
                print(f"{name:32} BN={bn:3} {us:8.1f} us {nbytes / us / 1e6:6.2f} TB/s", flush=True)
        finally:
            quant.GEMV_BLOCK_N = before
            quant._SPLITS.clear()
        del fns, fn
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="the kernels against quant.linear (CPU, interpreter)")
    p.add_argument("--json", type=Path)
    p.add_argument(
        "--kinds",
        default="engine",
        help="engine: the engine's GEMVs at the Q4_K_M decode shapes, 32 and 64 rows a program; probes of one "
        "Q4_K weight: narrow (64 columns a step), wide, w2 (G groups of 64), dp4a, wide-dp4a, wide-fma, dot",
    )
    p.add_argument("--shapes", default="9216x2048,12352x2048,65536x2048")
    p.add_argument("--engine-only", default="", metavar="TEXT", help="engine: the shapes whose name holds TEXT")
    p.add_argument("--shapes-off", action="store_true", help="no probes of one weight (--shapes), the engine's rows only")
    p.add_argument("--cold", action="store_true", help="each call reads a weight not in L2 (copies rotated, 160 MB)")
    args = p.parse_args()
    if args.check:
        return check()
    global COLD
    COLD = args.cold
    kinds = set(args.kinds.split(","))
    rows = engine_rows(args.engine_only) if "engine" in kinds else []
    if not args.shapes_off:
        rows += [r for shape in args.shapes.split(",") for r in probe(*map(int, shape.split("x")), kinds)]
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "cold": COLD, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
