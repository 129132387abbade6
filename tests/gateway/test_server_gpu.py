"""The gateway on a CUDA device (run where one is: `pytest -m gpu tests/gateway/test_server_gpu.py`):
continuing the live sequence in place (its tensors may be the CUDA-graph decoder's static buffers)
answers exactly as a restore from the store does."""

from __future__ import annotations

import pytest
import torch

from engine.engine_config import EngineConfig
from tests.conftest import start_server
from tests.gateway.test_server_anchors import assert_continuation_is_exact, continuation_answers

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_live_continuation_on_the_gpu_is_exact():
    server = start_server(preset="tiny", engine=EngineConfig(device="cuda"), policy="anchor")
    try:
        assert_continuation_is_exact(continuation_answers(server))
    finally:
        server.stop()
