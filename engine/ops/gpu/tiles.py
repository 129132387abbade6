"""Row tiles of the grouped GEMMs (quantized and FP8): which expert and rows a tile takes, and the
GLU of a row of gate | up."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

DEQUANT_ROWS = 64  # above this many rows (bf16), the GEMMs: x in FP8 rows, or a dequantized copy and cuBLAS


@triton.jit
def glu_row(GU, RW, ORDER, j, k, keep, INTER):
    """Columns k of the activation of row j of GU [M, 2 * INTER] (gate | up, the experts' up projections in
    expert order): silu(gate) * up * the routing weight RW[ORDER[j]], in fp32."""
    gate = tl.load(GU + j * 2 * INTER + k, mask=keep, other=0.0).to(tl.float32)
    up = tl.load(GU + j * 2 * INTER + INTER + k, mask=keep, other=0.0).to(tl.float32)
    return gate * tl.sigmoid(gate) * up * tl.load(RW + tl.load(ORDER + j)).to(tl.float32)


@triton.jit
def tile_rows(t, OFFS, M, E, BM: tl.constexpr, EXPERTS: tl.constexpr):
    """Tile t's expert (int64) and rows r [BM], `valid` where they are the tile's. EXPERTS = 0: one
    weight, rows [t * BM, ..) of M. Else (a power of two >= E): rows grouped by expert
    (`moe.group_by_expert`: expert e's end at OFFS[e]), each expert's in tiles of BM after the tiles
    of the experts before it, found here from OFFS (no layout on the host); past the last tile the
    expert is E or more and no row valid (its program returns)."""
    if EXPERTS:
        ex = tl.arange(0, EXPERTS)
        ends = tl.load(OFFS + ex, mask=ex < E, other=0)
        starts = tl.load(OFFS + ex - 1, mask=(ex > 0) & (ex < E), other=0)
        tiles = tl.where(ex < E, (ends - starts + BM - 1) // BM, 0)
        last = tl.cumsum(tiles, 0)  # one past each expert's last tile
        e = tl.sum((last <= t).to(tl.int32), 0)  # the experts whose tiles end before tile t: t's expert
        mine = ex == e
        r = tl.sum(tl.where(mine, starts + (t - (last - tiles)) * BM, 0), 0) + tl.arange(0, BM)
        return e.to(tl.int64), r, r < tl.sum(tl.where(mine, ends, 0), 0)
    else:
        r = t * BM + tl.arange(0, BM)
        return tl.full((), 0, tl.int64), r, r < M


def tile_launch(m: int, bm: int, offs: torch.Tensor | None) -> tuple[int, int, int]:
    """(tiles, E, EXPERTS) of `tile_rows` for m rows, grouped by expert when `offs` is given: at most
    one partial tile an expert."""
    if offs is None:
        return triton.cdiv(m, bm), 1, 0
    return triton.cdiv(m, bm) + min(m, offs.numel()), offs.numel(), triton.next_power_of_2(offs.numel())
