"""Matmuls over weights kept quantized in memory (`QuantWeight`, engine/ops/gpu/quant_weight.py: GGML
Q8_0, Q4_K, Q5_K, Q6_K and Qwen's block FP8), dispatched by the rows of x to the kernel that suits them:

- `linear(x, w)`: x [M, K] @ w.T; the split-K GEMV (engine/ops/gpu/gemv.py) for a few rows (decode),
  the tiled GEMM (engine/ops/gpu/gemm.py) for some more, and for prefill a transient bf16 copy
  (`dequantize_to`) and cuBLAS; `linear_pair(x, a, b)`: two weights of different formats in one GEMV;
- `grouped(x, w, order, offs)`: rows grouped by expert (`moe.group_by_expert`) times each row's
  expert's weight, tiles never straddling two experts, or for many rows a transient copy and
  torch's grouped GEMM (MoE prefill); no host sync;
- `experts_glu`, `experts_sum`: MoE decode through the GEMV, reading only the chosen experts;
- FP8 prefill (both) runs e4m3 times e4m3 on the tensor cores, x quantized per row and 128 columns
  (`engine.ops.gpu.fp8_prefill`).

The kernels dequantize in registers with the reference's operations (engine/ops/gpu/quant_dot.py).
"""

from __future__ import annotations

import torch

from engine.ops.gpu import fp8_prefill
from engine.ops.gpu.gemm import _launch_gemm, dequantize_to
from engine.ops.gpu.gemv import _gemv, gemv_fits
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

# the weights' names (engine/ops/gpu/quant_weight.py), the tiles', the prefill copy (`dequantize_to`) and
# whether the GEMV takes a weight (`gemv_fits`) are this module's interface too
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
    "gemv_fits",
    "glu_row",
    "grouped",
    "linear",
    "linear_pair",
    "pack_fp8",
    "pack_ggml",
    "stack",
    "tile_launch",
    "tile_rows",
]

GEMV_ROWS = 4  # up to this many rows of x, the GEMV kernel
grouped_mm = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm  # torch's grouped GEMM, by either name


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
