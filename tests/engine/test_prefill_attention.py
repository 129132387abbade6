"""The GPU path's prefill attention (`engine.ops.gpu.attention.causal_attention`) run on CPU tensors,
where SDPA takes its math backend: the rows from PREFILL_CUDNN_ROWS on, padded to a multiple of
PREFILL_BUCKET for cuDNN on a GPU, give the reference's values (the padding goes after the last row,
where no real query sees it), and so do the rows below it and a suffix's bottom-right mask. On the
GPU `tests/engine/test_gpu.py` checks the same against cuDNN and flash."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from engine.ops.attention import causal_attention as reference  # noqa: E402
from engine.ops.gpu.attention import PREFILL_BUCKET, PREFILL_CUDNN_ROWS, causal_attention  # noqa: E402


@pytest.mark.parametrize(
    "queries, keys",
    [
        (PREFILL_CUDNN_ROWS + 404, PREFILL_CUDNN_ROWS + 404),
        (PREFILL_CUDNN_ROWS, PREFILL_CUDNN_ROWS),
        (PREFILL_CUDNN_ROWS - 3, PREFILL_CUDNN_ROWS - 3),
        (300, PREFILL_CUDNN_ROWS + 7),
    ],
)
def test_prefill_attention_equals_the_reference(queries, keys):
    assert (PREFILL_CUDNN_ROWS + 404) % PREFILL_BUCKET  # the first case is padded
    gen = torch.Generator().manual_seed(queries + keys)
    q = torch.randn(queries, 4, 16, generator=gen)
    k, v = (torch.randn(keys, 2, 16, generator=gen) for _ in range(2))
    got = causal_attention(q, k, v)
    assert got.shape == q.shape
    torch.testing.assert_close(got, reference(q, k, v), atol=1e-5, rtol=1e-5)
