"""Weights of any kind: a tensor, or a `QuantWeight` kept packed (engine/ops/gpu/quant.py, imported
only where one is met: Triton). The helpers here take either and keep the packed form where they can."""

from __future__ import annotations

from typing import Any

import torch


def aligned(tensor: torch.Tensor, alignment: int = 64) -> torch.Tensor:
    """`tensor` in memory aligned like torch's own allocations. Where a weight sits in a file
    decides its alignment, and CPU kernels vectorise reductions by alignment: without this the
    same weights from a single file and from shards gave logits 7e-7 apart."""
    if tensor.data_ptr() % alignment == 0:
        return tensor
    return torch.empty_like(tensor).copy_(tensor)


def one_way(gate_up, down) -> tuple:
    """A layer's expert stacks, both kept quantized or both dense: the experts run one way."""
    if isinstance(gate_up, torch.Tensor) != isinstance(down, torch.Tensor):
        return dense(gate_up), dense(down)
    return gate_up, down


def dense(w, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A weight as a tensor: a `QuantWeight` dequantized, to `dtype` (default: the dtype it stands for)."""
    return w if isinstance(w, torch.Tensor) else w.dequantize().to(dtype or w.dtype)


def cat_rows(weights: list) -> Any:
    """Weights [.., N_i, K] → one [.., sum N_i, K]: still quantized where their blocks line up
    (`quant.can_concat`), else dequantized."""
    if all(isinstance(w, torch.Tensor) for w in weights):
        return torch.cat(weights, dim=-2)
    from engine.ops.gpu import quant  # noqa: PLC0415

    if all(isinstance(w, quant.QuantWeight) for w in weights) and quant.can_concat(weights):
        return quant.concat_rows(weights)
    return torch.cat([dense(w) for w in weights], dim=-2)


def stack(weights: list) -> Any:
    """Expert weights [N, K] → [E, N, K]: quantized if all are, in one format, else dequantized."""
    if all(isinstance(w, torch.Tensor) for w in weights):
        return torch.stack(weights)
    from engine.ops.gpu import quant  # noqa: PLC0415

    if all(isinstance(w, quant.QuantWeight) and w.fmt == weights[0].fmt for w in weights):
        return quant.stack(weights)
    return torch.stack([dense(w) for w in weights])
