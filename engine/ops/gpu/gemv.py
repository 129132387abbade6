"""The split-K GEMV over quantized weights: a few rows of x (decode) times a weight [N, K] or each row's
experts of a stack [E, N, K], K split over as many programs as fill the GPU, the split's sums taken by its
last program (`tickets.last_to_finish`). Here too the launch's choices: outputs a program
(`gemv_block_n`), the split (`_splits`, `_heuristic_split`) and the compile-time arguments
(`gemv_constexprs`); each is read by `_gemv` alone, and the tests pin them.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from engine.ops.gpu.quant_dot import _dot, _padded
from engine.ops.gpu.quant_weight import FP8, FP8_ROWS, GEMV_CHUNK, QuantWeight
from engine.ops.gpu.tickets import TICKETS, last_to_finish, tickets

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
MAX_PROGRAMS = 1 << 15  # a GEMV's programs at most, whatever its split


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
def _gemv_out(OUT, SCALE, acc, acc_up, m, n, N, keep, GLU: tl.constexpr):
    """Output row m's BN sums, in OUT's dtype (GLU: SiLU of the gate's times the up's, weighted)."""
    if GLU:
        acc = acc * tl.sigmoid(acc) * acc_up * tl.load(SCALE + m).to(tl.float32)
    tl.store(OUT + m * N + n, acc.to(OUT.dtype.element_ty), mask=keep)


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

