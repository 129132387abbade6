"""A Q4_K_M GGUF of the `small` preset on the GPU with its weights kept quantized (the default on
CUDA) against the same file dequantized at load: the resident weights under 0.4x bf16's, and
prefill, CUDA-graph decode and restores within bf16 noise of the fp32 model (the bound of
tests/engine/test_gpu.py: every position no further from fp32 than a one-pass bf16 run's worst position
over the same input, plus 0.01).

    FT_MATERIALISE=1 pytest -m gpu tests/engine/test_gpu_quant.py -s

The file is llama.cpp's Q4_K_M when `llama-quantize` is built (.peer/), else the tests' own
Q4_K_M-like mix (tests/engine/kquants.py: Q4_K, Q5_K, Q6_K). Each test prints `METRIC name value`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
pytest.importorskip("gguf")

from engine import Engine  # noqa: E402
from engine.gguf_file import read_gguf  # noqa: E402
from tests.engine.conftest import SEED  # noqa: E402
from tests.engine.test_gpu import _within_bf16_noise, rel  # noqa: E402

METRICS: dict[str, float | str] = {}


def metric(name: str, value) -> None:
    METRICS[name] = value
    print(f"METRIC {name} {value} seed={SEED}")


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory) -> Path:
    from engine.presets import materialise
    from peer.gguf_export import write_gguf
    from peer.llama_server import quantize_binary
    from tests.engine.kquants import write_kquant_gguf

    out = tmp_path_factory.mktemp("q4_k_m") / "small-q4_k_m.gguf"
    config, raw, state_dict = materialise("small")
    if quantize_binary().is_file():
        metric("file", "llama-quantize Q4_K_M")
        return write_gguf(config, raw, state_dict, out, "q4_k_m")
    metric("file", "tests/engine/kquants.py Q4_K_M-like mix")
    return write_kquant_gguf(config, raw, state_dict, out)


@pytest.fixture(scope="module")
def engines(q4_k_m) -> dict[str, Engine]:
    return {
        "quantized": Engine.load(q4_k_m, device="cuda"),
        "bf16": Engine.load(q4_k_m, device="cuda", keep_quantized=False),
        "fp32": Engine.load(q4_k_m, device="cuda", dtype=torch.float32, keep_quantized=False),
    }


def test_weights_stay_quantized_at_the_files_size(engines, q4_k_m):
    from engine.ops.gpu.quant import QuantWeight

    q, bf16 = engines["quantized"], engines["bf16"]
    packed = [m for m in q.model.modules() if isinstance(m, QuantWeight)]
    assert packed and all(m.device.type == "cuda" for m in packed)
    weights, dense = q.memory()["weights"], bf16.memory()["weights"]
    file = sum(t.n_bytes for t in read_gguf(q4_k_m).tensors.values())
    metric("weights_quantized_bytes", weights)
    metric("weights_bf16_bytes", dense)
    metric("file_tensor_bytes", file)
    metric("quantized_over_bf16", round(weights / dense, 4))
    metric("quantized_over_file", round(weights / file, 4))
    assert weights < 0.4 * dense
    assert weights <= 1.05 * file  # fp32 norms and routers of the file are bf16 here


def test_prefill_within_bf16_noise(engines, rng):
    q, bf16, fp32 = engines["quantized"], engines["bf16"], engines["fp32"]
    ids = [rng.randrange(248_000) for _ in range(rng.randrange(100, 400))]
    run = lambda e: e.prefill(e.new_state(), ids, all_logits=True).logits  # noqa: E731
    got, one_pass, exact = run(q), run(bf16), run(fp32)
    metric("prefill_quantized_vs_bf16", f"{rel(got, one_pass):.3e}")
    _within_bf16_noise(got, exact, one_pass, exact, "quant_prefill_bf16")


def test_graph_decode_and_restore_within_bf16_noise(engines, rng):
    q, fp32 = engines["quantized"], engines["fp32"]
    assert q.runner.use_graph  # the quantized decode step is captured as a CUDA graph
    prompt = [rng.randrange(248_000) for _ in range(rng.randrange(50, 300))]
    forced = [rng.randrange(248_000) for _ in range(8)]
    exact = fp32.prefill(fp32.new_state(), prompt + forced, all_logits=True).logits
    one_pass = q.prefill(q.new_state(), prompt + forced, all_logits=True).logits  # the quantized model's own
    state = q.new_state()
    q.prefill(state, prompt)
    _within_bf16_noise(q.feed(state, forced), exact[len(prompt) :], one_pass, exact, "quant_graph_decode_bf16")
    split = rng.randrange(1, len(prompt))
    snaps = q.prefill(q.new_state(), prompt, capture_at=[split]).snapshots
    rest = q.prefill(q.restore(snaps), prompt[split:], all_logits=True).logits
    _within_bf16_noise(rest, exact[split : len(prompt)], one_pass, exact, "quant_restore_split_bf16")
