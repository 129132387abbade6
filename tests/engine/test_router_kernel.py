"""The fused router kernel (`engine.ops.gpu.moe.route`: softmax, top-k, renormalisation in one
launch) against the torch version (`engine.ops.moe.route`) that the CPU path runs."""

from __future__ import annotations

import pytest
import torch

from tests.engine.triton_interpreter import CUDA, RUNNABLE, in_this_process, run_interpreted

pytest.importorskip("triton")


@pytest.mark.skipif(RUNNABLE, reason="this process runs the kernels itself")
def test_router_in_triton_interpreter_process():
    run_interpreted(__file__)


from engine.ops.gpu.moe import _route_triton  # noqa: E402
from engine.ops.moe import route  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"


@in_this_process
@pytest.mark.parametrize(
    ("rows", "experts", "top_k", "renormalise", "dtype"),
    [
        (1, 256, 8, True, torch.bfloat16),  # the 35B-A3B shape, one decode row
        (5, 64, 8, True, torch.float32),
        (37, 8, 2, False, torch.float32),  # tiny's shape
        (3, 10, 3, True, torch.bfloat16),  # neither a power of two
        (0, 64, 8, True, torch.float32),  # an empty chunk
    ],
)
def test_fused_route_equals_the_torch_route(rows, experts, top_k, renormalise, dtype):
    gen = torch.Generator().manual_seed(rows * 1000 + experts)
    fused = torch.randn(rows, experts + 40, generator=gen).to(dtype).to(DEVICE)
    logits = fused[:, :experts]  # a split of the fused projection: rows strided by its whole width
    weights, ids = _route_triton(logits, top_k, renormalise, dtype)
    want_w, want_ids = route(logits, top_k, renormalise, dtype)
    assert weights.dtype == dtype and ids.dtype == torch.long and weights.shape == ids.shape == (rows, top_k)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-6)


@in_this_process
def test_equal_probabilities_take_the_lowest_expert_first():
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0, 2.0]], device=DEVICE)
    weights, ids = _route_triton(logits, 3, True, torch.float32)
    assert ids.tolist() == [[1, 2, 4]]
    torch.testing.assert_close(weights, torch.full((1, 3), 1 / 3, device=DEVICE))
