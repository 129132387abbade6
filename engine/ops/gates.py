"""Gates and activations between the projections, each rounded as the model's plain torch code
rounds it (every intermediate in the activations' dtype): the reference the GPU's fused Triton
versions (engine/ops/gpu/gates.py, one launch each instead of two to five) are checked against."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def deltanet_gates(a: torch.Tensor, b: torch.Tensor, neg_a: torch.Tensor, dt_bias: torch.Tensor):
    """The DeltaNet's decay and write strength from its projections a, b [T, Hv]: g = -exp(A_log) *
    softplus(a + dt_bias) (fp32) and beta = sigmoid(b) (b's dtype)."""
    return neg_a * F.softplus(a.float() + dt_bias), b.sigmoid()


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up: a gated MLP's activation."""
    return F.silu(gate) * up


def sigmoid_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(gate): the attention output's gate."""
    return x * torch.sigmoid(gate)


def add_sigmoid_mul(base: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """base + sigmoid(gate) * y, gate [T, 1]: the shared expert added to the routed ones."""
    return base + torch.sigmoid(gate) * y
