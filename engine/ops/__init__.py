"""Kernels by op. The model calls ops only through a `Kernels` bundle chosen by device, so a GPU
path (fla-core Gated DeltaNet, flash attention, grouped MoE GEMMs) plugs in without touching
the model code."""

from __future__ import annotations

import torch

from engine.ops.kernels import REFERENCE, Kernels

__all__ = ["REFERENCE", "Kernels", "kernels_for", "moe_experts_quantized"]


def moe_experts_quantized(x, weights, ids, gate_up, down, partial: bool = False) -> torch.Tensor:
    """Routed experts whose stacks are `QuantWeight`s, on any device: Triton's grouped kernels
    (engine/ops/gpu/moe.py; on the CPU in Triton's interpreter, the tests' path)."""
    from engine.ops.gpu.moe import experts_quantized  # noqa: PLC0415 (Triton)

    return experts_quantized(x, weights, ids, gate_up, down, partial)


def kernels_for(device: torch.device) -> Kernels:
    """The fastest kernels available for `device`; the reference path everywhere else."""
    if device.type == "cuda":
        try:
            from engine.ops import gpu  # noqa: PLC0415 (GPU-only imports: fla-core, triton)
        except ImportError:
            return REFERENCE
        return gpu.KERNELS
    return REFERENCE
