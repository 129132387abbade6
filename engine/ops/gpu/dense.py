"""A plain weight against a few rows of x (a batched decode step's projections), reading the weight
once for all the rows: one launch, tensor-core tiles of every row at once, K split over enough programs
to fill the GPU, each split's sums taken in order by the last program of its column block.

A decode step's projections are skinny products (e.g. [8, 4096] x [4096, 2048]): their cost is reading
the weight. cuBLAS runs such a product as a split-K kernel and a separate reduction; this kernel does
both in one launch, with enough programs to keep every SM reading. `engine.weights.matmul` takes it for
every plain weight it fits."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.ops.gpu import tickets

ROWS = 16  # rows of x at most: one tensor-core tile's
BLOCK_N, BLOCK_K = 32, 256
PROGRAMS = 264  # at least, where K allows: two an SM of an H200
MAX_N = 16384  # outputs at most (their column blocks within the GEMV's tickets, `tickets.TICKETS`)


@triton.jit
def _small_gemm_kernel(X, W, PART, OUT, COUNT, M, N, K, K_SPLIT, SPLIT: tl.constexpr, MT: tl.constexpr,
                       BN: tl.constexpr, BK: tl.constexpr):
    """Program (column block, split s): x's M rows (MT, the rest zeros) against the block's BN rows of
    W over K_SPLIT columns; with SPLIT > 1 fp32 partials into PART [SPLIT, MT, N] and the last of the
    block's programs (a ticket in COUNT, reset by it) sums them in order into OUT."""
    block, s = tl.program_id(0), tl.program_id(1)
    n = block * BN + tl.arange(0, BN)
    m = tl.arange(0, MT)
    acc = tl.zeros([MT, BN], tl.float32)
    for k0 in range(s * K_SPLIT, (s + 1) * K_SPLIT, BK):
        k = k0 + tl.arange(0, BK)
        xv = tl.load(X + m[:, None] * K + k[None, :], mask=(m < M)[:, None], other=0.0)
        wv = tl.load(W + n[:, None].to(tl.int64) * K + k[None, :], mask=(n < N)[:, None], other=0.0)
        acc = tl.dot(xv, tl.trans(wv), acc, input_precision="ieee")
    keep = (m < M)[:, None] & (n < N)[None, :]
    if SPLIT == 1:
        tl.store(OUT + m[:, None] * N + n[None, :], acc.to(OUT.dtype.element_ty), mask=keep)
    else:
        tl.store(PART + (s * MT + m[:, None]) * N + n[None, :], acc, mask=keep)
        ticket = COUNT + block
        if tickets.last_to_finish(ticket, SPLIT):
            total = tl.zeros([MT, BN], tl.float32)
            for t in range(SPLIT):
                total += tl.load(PART + (t * MT + m[:, None]) * N + n[None, :], mask=keep, other=0.0,
                                 cache_modifier=".cg")
            tl.atomic_xchg(ticket, 0)  # for the next launch
            tl.store(OUT + m[:, None] * N + n[None, :], total.to(OUT.dtype.element_ty), mask=keep)


def split_for(n: int, k: int, programs: int = PROGRAMS) -> int:
    """K's split (a power of two, each part whole BLOCK_K steps) that brings the launch to `programs`."""
    split = 1
    while triton.cdiv(n, BLOCK_N) * split < programs and k % (2 * split * BLOCK_K) == 0:
        split *= 2
    return split


def fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `small_linear` takes x @ w.T: 2 to ROWS rows, a contiguous weight of K whole BLOCK_K steps,
    at most MAX_N outputs (a decode step's projections; not a lm_head, which cuBLAS reads at the copy
    rate already)."""
    n, k = w.shape
    return 1 < x.shape[0] <= ROWS and w.is_contiguous() and k % BLOCK_K == 0 and x.dtype == w.dtype and n <= MAX_N


def small_linear(x: torch.Tensor, w: torch.Tensor, split: int | None = None) -> torch.Tensor:
    """x [M <= ROWS, K] @ w.T ([N, K]) → [M, N] in x's dtype, fp32 sums."""
    (m, k), n = x.shape, w.shape[0]
    x = x.contiguous()
    split = split or split_for(n, k)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    part = torch.empty(split, ROWS, n, dtype=torch.float32, device=x.device) if split > 1 else out
    _small_gemm_kernel[(triton.cdiv(n, BLOCK_N), split)](
        x, w, part, out, tickets.tickets(x.device), m, n, k, k // split, SPLIT=split, MT=ROWS, BN=BLOCK_N, BK=BLOCK_K,
    )
    return out
