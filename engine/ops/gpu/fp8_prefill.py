"""Prefill over Qwen's block-FP8 weights on FP8 tensor cores (sm_89 on; Triton's interpreter on the CPU).

x is quantized per row and 128 columns (`fp8_rows`: the dynamic 1x128 activation scaling Qwen's FP8
checkpoints declare, as vLLM and SGLang run them) and multiplied e4m3 by e4m3, each 128-column step's
fp32 sums scaled by both blocks' scales (x's per row, the weight's [128, 128] block's):

- `linear(x, w)`: one Triton GEMM (`_fp8_gemm_kernel`), one kernel for every FP8 prefill (cuBLAS's
  block-scaled GEMM is faster on the device but costs more on the host);
- `grouped(x, w, order, offs)`: experts' rows in expert order (`moe.group_by_expert`), each program
  finding its tile's expert and rows from the experts' row ends (no tile layout on the host);
- `experts(...)`: an MoE layer in four launches, the activation quantized as it is made and down's
  rows written back in the assignments' order.

`quant.linear` and `quant.grouped` hand over what `runs` takes: bf16 activations past DEQUANT_ROWS rows.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from engine.ops.gpu.quant_weight import FP8, QuantWeight
from engine.ops.gpu.tiles import DEQUANT_ROWS, glu_row, tile_launch, tile_rows

# x's quantization blocks: `engine.quant.fp8.quantize(x, X_BLOCK, torch.float32)` is `fp8_rows`
X_BLOCK = (1, 128)


class Tile(NamedTuple):
    """The FP8 GEMM's launch: rows a tile, warps, pipelining stages, and whether a tile's programs over
    N run one after another (its x rows and its expert's weight stay in L2). Hopper's FP8 MMA sums each
    128-column step at its reduced precision (Triton's default: promoting every 32 products to fp32
    costs MMA time, and the sums are within a bf16 result's tolerance without it)."""

    bm: int = 64
    warps: int = 4
    stages: int = 3
    n_first: bool = False

    @classmethod
    def parse(cls, spec: str) -> Tile:
        """From "BM:warps:stages[:n|t]", e.g. "64:4:4:n"."""
        v = spec.split(":")
        return cls(*(int(x) for x in v[:3]), *([v[3] == "n"] if len(v) > 3 else []))


# 64 rows, 4 warps, 4 stages, a tile's programs over N together
TILE = Tile(bm=64, warps=4, stages=4, n_first=True)


@triton.jit
def _e4m3_grid(v):
    """v (fp32, |v| <= 448) rounded to the nearest e4m3 value (ties to even) in fp32 arithmetic:
    adding and taking back 1.5 * 2**23 ulps rounds to a multiple of the ulp. The cast to e4m3 is then
    exact on every backend (Triton's interpreter's own rounding drops the carry into the exponent)."""
    exponent = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    ulp = ((tl.maximum(exponent, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)  # subnormals: 2**-9
    big = ulp * 12582912.0  # 1.5 * 2**23
    rounded = (tl.abs(v) + big) - big
    return tl.where(v < 0, -rounded, rounded)  # -0 stays -0


@triton.jit
def _store_fp8_groups(x, q_at, s_at, keep, g_keep):
    """x [G, 128] (fp32, one row's 128-column groups) as e4m3 at q_at and fp32 scales at s_at [G]:
    each group over its largest |x| / 448."""
    s = tl.maximum(tl.max(tl.abs(x), 1), 1e-12) / 448.0
    q = _e4m3_grid(tl.clamp(x / s[:, None], -448.0, 448.0))
    tl.store(q_at, q.to(q_at.dtype.element_ty), mask=keep)
    tl.store(s_at, s, mask=g_keep)


@triton.jit
def _fp8_rows_kernel(X, Q, S, K, S_ROW, S_GROUP, GROUPS: tl.constexpr):
    """Row m of X [M, K] as e4m3 Q and fp32 scales S (group g of row m at m * S_ROW + g * S_GROUP)."""
    m = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, GROUPS)
    k = g[:, None] * 128 + tl.arange(0, 128)[None, :]
    keep = k < K
    x = tl.load(X + m * K + k, mask=keep, other=0.0).to(tl.float32)
    _store_fp8_groups(x, Q + m * K + k, S + m * S_ROW + g * S_GROUP, keep, g < K // 128)


@triton.jit
def _fp8_gemm_kernel(
    XQ, XS, W, WS, Y, ORDER, OFFS, M, N, K, E, TILES, TOP_K,
    BM: tl.constexpr, EXPERTS: tl.constexpr, GATHER: tl.constexpr, SCATTER: tl.constexpr,
    N_FIRST: tl.constexpr,
):
    """Y [M, N] = x @ w.T in FP8: x's rows (e4m3 XQ, a scale per 128 columns in XS) times expert e's
    e4m3 rows n (128 a program: one scale block row), each 128-column step's fp32 sums scaled by both
    blocks' scales, tile t's expert and rows j from `quant.tile_rows`. Row j reads x's row
    ORDER[j] // TOP_K (GATHER) or j, and is written at row ORDER[j] of Y (SCATTER: back in the
    assignments' order) or j. One program axis: tile t's programs over N one after another (N_FIRST)
    or each block of N's over the tiles."""
    blocks = tl.cdiv(N, 128)
    if N_FIRST:
        t, block = tl.program_id(0) // blocks, tl.program_id(0) % blocks
    else:
        t, block = tl.program_id(0) % TILES, tl.program_id(0) // TILES
    e, r, valid = tile_rows(t, OFFS, M, E, BM, EXPERTS)
    if e >= E:
        return
    if GATHER or SCATTER:
        assignment = tl.load(ORDER + r, mask=valid, other=0).to(tl.int64)
    src = assignment // TOP_K if GATHER else r.to(tl.int64)
    dst = assignment if SCATTER else r.to(tl.int64)
    n = (block * 128 + tl.arange(0, 128)).to(tl.int64)
    col = tl.arange(0, 128)
    steps = K // 128
    x_at = XQ + src[:, None] * K + col[None, :]
    w_at = W + (e * N + tl.minimum(n, N - 1))[:, None] * K + col[None, :]
    xs_at = XS + src * steps
    ws_at = WS + (e * blocks + block) * steps
    acc = tl.zeros([BM, 128], tl.float32)
    for i in range(steps):
        x = tl.load(x_at + i * 128, mask=valid[:, None], other=0.0)
        w = tl.load(w_at + i * 128)
        scale = tl.load(xs_at + i, mask=valid, other=0.0) * tl.load(ws_at + i)
        acc += tl.dot(x, tl.trans(w)) * scale[:, None]
    tl.store(
        Y + dst[:, None] * N + n[None, :], acc.to(Y.dtype.element_ty), mask=valid[:, None] & (n < N)[None, :]
    )


@triton.jit
def _glu_fp8_rows_kernel(GU, RW, ORDER, Q, S, INTER, GROUPS: tl.constexpr):
    """Row j of GU [M, 2 * INTER] (gate | up, expert order) as the down projection's x in FP8 rows:
    silu(gate) * up * the routing weight RW[ORDER[j]], in fp32, quantized as `_fp8_rows_kernel` does."""
    j = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, GROUPS)
    k = g[:, None] * 128 + tl.arange(0, 128)[None, :]
    keep = k < INTER
    a = glu_row(GU, RW, ORDER, j, k, keep, INTER)
    _store_fp8_groups(a, Q + j * INTER + k, S + j * (INTER // 128) + g, keep, g < INTER // 128)


def fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of 128) as e4m3 [M, K] and fp32 scales [M, K/128]: each row's 128-column
    groups divided by their largest |x| / 448 (`engine.quant.fp8.quantize` in X_BLOCK blocks)."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, k // 128, dtype=torch.float32, device=x.device)
    if m:
        _fp8_rows_kernel[(m,)](x, q, s, k, s.stride(0), s.stride(1), GROUPS=triton.next_power_of_2(k // 128))
    return q, s


_FP8_DOT: dict[torch.device, bool] = {}  # per GPU: whether it has FP8 tensor cores (sm_89 on)


def runs(x: torch.Tensor, w: QuantWeight, rows: int) -> bool:
    """Whether `rows` rows of x times w run here (FP8 weights, bf16 x past DEQUANT_ROWS rows, a GPU
    with FP8 tensor cores or the interpreter)."""
    if not (w.fmt == FP8 and x.dtype == torch.bfloat16 and rows > DEQUANT_ROWS):
        return False
    if x.device.type != "cuda":
        return True
    if x.device not in _FP8_DOT:
        _FP8_DOT[x.device] = torch.cuda.get_device_capability(x.device) >= (8, 9)
    return _FP8_DOT[x.device]


def gemm(
    xq: torch.Tensor, xs: torch.Tensor, w: QuantWeight, out: torch.Tensor, order: torch.Tensor | None = None,
    offs: torch.Tensor | None = None, top_k: int = 1, scatter: bool = False, tile: Tile = TILE,
) -> torch.Tensor:
    """out = x @ w.T (w [N, K]; x as `fp8_rows` gives it) or, with `order` and `offs` (`grouped`'s),
    each expert-ordered row's expert's product, reading x's row order[j] // top_k, or with `scatter`
    row j of x and writing out's row order[j]: one launch of `_fp8_gemm_kernel` in `tile`'s layout."""
    m, (n, k) = order.numel() if order is not None else out.shape[0], w.shape[-2:]
    tiles, experts, lanes = tile_launch(m, tile.bm, offs)
    _fp8_gemm_kernel[(tiles * triton.cdiv(n, 128),)](
        xq, xs, *w.parts, out, xs if order is None else order, xs if offs is None else offs, m, n, k,
        experts, tiles, top_k, BM=tile.bm, EXPERTS=lanes,
        GATHER=order is not None and not scatter, SCATTER=scatter, N_FIRST=tile.n_first,
        num_warps=tile.warps, num_stages=tile.stages,
    )
    return out


def experts(
    x: torch.Tensor, routing: torch.Tensor, gate_up: QuantWeight, down: QuantWeight, order: torch.Tensor,
    offs: torch.Tensor, top_k: int,
) -> torch.Tensor | None:
    """MoE prefill on FP8 tensor cores (both stacks FP8, bf16 x past DEQUANT_ROWS assignments; else
    None): gate_up over x's FP8 rows gathered in expert order, silu(gate) * up * the routing weight
    straight into the down projection's FP8 rows (one kernel), down written back in the assignments'
    order. Returns [T * k, H] (rows of absent assignments unset). Four launches."""
    assignments, inter = order.numel(), down.shape[-1]
    if not (runs(x, gate_up, assignments) and down.fmt == FP8 and inter % 128 == 0):
        return None
    gu = gemm(*fp8_rows(x.contiguous()), gate_up, x.new_empty(assignments, 2 * inter), order, offs, top_k)
    aq = torch.empty(assignments, inter, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(assignments, inter // 128, dtype=torch.float32, device=x.device)
    groups = triton.next_power_of_2(inter // 128)
    _glu_fp8_rows_kernel[(assignments,)](gu, routing.flatten(), order, aq, scales, inter, GROUPS=groups)
    return gemm(aq, scales, down, x.new_empty(assignments, down.shape[1]), order, offs, scatter=True)


def linear(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """x [M, K] @ w.T → [M, N] in x's dtype (w one FP8 weight [N, K], x in the packed column order)."""
    return gemm(*fp8_rows(x), w, torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device))


def grouped(
    x: torch.Tensor, w: QuantWeight, order: torch.Tensor, offs: torch.Tensor, top_k: int
) -> torch.Tensor:
    """`quant.grouped` for FP8 experts w [E, N, K]: [len(order), N] in expert order."""
    out = torch.empty(order.numel(), w.shape[1], dtype=x.dtype, device=x.device)
    return gemm(*fp8_rows(x.contiguous()), w, out, order, offs, top_k)
