"""A bf16 bound that routing flips do not break: every position of a bf16 result within the one-pass bf16
run's worst position (each position's relative error against fp32), over every position of the same input.

On the random-weight presets one top-k routing flip moves a position's logits by 0.2-0.5 (relative), so a
noise estimate from a few positions is a single draw of that: a bound scaled from the last position alone
fails a correct restore where that position happens to be quiet and misses a shift where it happens to
flip. The worst over every position of the one-pass run has seen the flips this input takes under bf16,
while a restore fed one token late moves every position's logits, most of them past it."""

from __future__ import annotations

import random

import torch


def position_errors(got: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """Each position's ‖got − exact‖ / ‖exact‖ over the vocabulary ([P, V] → [P]: float64, computed on
    `got`'s device, returned on the CPU)."""
    got, exact = got.double(), exact.to(got.device).double()
    return ((got - exact).norm(dim=-1) / exact.norm(dim=-1)).cpu()


def worst_position_bound(one_pass: torch.Tensor, slack: float = 0.01) -> float:
    """The bound from the one-pass bf16 run's position errors (every position): the largest, plus `slack`."""
    return one_pass.max().item() + slack


def small_pair(device: str = "cpu"):
    """The `small` preset (its routing flips under bf16) as fp32 and bf16 engines of one set of weights."""
    from engine import Engine  # noqa: PLC0415
    from engine.loader import build_model, fingerprint  # noqa: PLC0415
    from engine.presets import materialise  # noqa: PLC0415

    config, _, state_dict = materialise("small", device, torch.float32)
    engines = []
    for dtype in (torch.float32, torch.bfloat16):
        moved = {n: t.to(dtype) for n, t in state_dict.items()}
        engines.append(Engine(build_model(config, moved), fingerprint(config, moved)))
    return tuple(engines)


def restore_and_shift(e32, e16, draw: int) -> dict:
    """Draw `draw`: a prompt of 200-700 tokens and a capture at a random split. Position errors against fp32
    of the one-pass bf16 run ("one_pass", every position), the bf16 restore then the suffix ("right"), and
    the same restore fed the suffix one token late, its context shifted ("shifted")."""
    rng = random.Random(draw)
    n = rng.randrange(200, 700)
    ids = [rng.randrange(248_000) for _ in range(n)]
    split = rng.randrange(1, n - 1)
    exact = e32.prefill(e32.new_state(), ids, all_logits=True).logits
    snaps = e16.prefill(e16.new_state(), ids, capture_at=[split]).snapshots

    def after(start: int) -> torch.Tensor:
        return position_errors(e16.prefill(e16.restore(snaps), ids[start:], all_logits=True).logits, exact[start:])

    return {
        "tokens": n,
        "split": split,
        "right": after(split),
        "shifted": after(split + 1),
        "one_pass": position_errors(e16.prefill(e16.new_state(), ids, all_logits=True).logits, exact),
    }
