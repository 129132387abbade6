"""The tiled GEMM over quantized weights (some more rows than the GEMV's: up to `DEQUANT_ROWS`), one
weight or experts' rows grouped by expert (`tiles.tile_rows`), and for prefill a transient copy of the
whole weight in the activations' dtype (`dequantize_to`).

On a GPU the dequantized tile is cast to the activations' dtype (bf16) before `tl.dot`, so results
are within bf16 rounding of `x @ w.dequantize().T`; in fp32 (the CPU tests, TRITON_INTERPRET=1)
they equal it to fp32 summation order.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from engine.ops.gpu.quant_dot import _dequant, _padded
from engine.ops.gpu.quant_weight import QuantWeight
from engine.ops.gpu.tiles import tile_launch, tile_rows


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


def dequantize_to(w: QuantWeight, dtype: torch.dtype) -> torch.Tensor:
    """The whole weight [.., N, K] in `dtype`, by the kernels' own dequantization (a transient copy)."""
    n, k = w.shape[-2:]
    experts = math.prod(w.shape[:-2])
    out = torch.empty(w.shape, dtype=dtype, device=w.parts[0].device)
    bn, bk = 64, _block_k(k)
    _dequant_kernel[(experts * triton.cdiv(n, bn), k // bk)](*_padded(w), out, n, k, FMT=w.fmt, BN=bn, BK=bk)
    return out
