"""A bf16 bound that routing flips do not break: every position of a bf16 result within the one-pass bf16
run's worst position (each position's relative error against fp32), over every position of the same input.

On the random-weight presets one top-k routing flip moves a position's logits by 0.2-0.5 (relative), so a
noise estimate from a few positions is a single draw of that: session 30 measured on the CPU (`small`, 40
draws, `bench/bf16_bounds.py`) that the GPU tests' last-position bound (8x the one-pass's last position + 0.01)
failed a correct restore once and caught a one-token shift twice, and this bound failed none and caught 38."""

from __future__ import annotations

import torch


def position_errors(got: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """Each position's ‖got − exact‖ / ‖exact‖ over the vocabulary ([P, V] → [P], float64 on the CPU)."""
    got, exact = got.double().cpu(), exact.double().cpu()
    return (got - exact).norm(dim=-1) / exact.norm(dim=-1)


def worst_position_bound(one_pass: torch.Tensor, exact: torch.Tensor, slack: float = 0.01) -> float:
    """The one-pass bf16 run's largest position error against fp32 over all its positions, plus `slack`."""
    return position_errors(one_pass, exact).max().item() + slack
