"""Random Q4_K_M GGUF files (peer/gguf_random.py): llama-quantize's tensor types and order at the
preset shapes (against its rules here, and against its own output where it has been built), the
values as sane as the preset's, a file our engine loads and runs, and the same greedy tokens as
llama.cpp on it."""

from __future__ import annotations

import json
import math

import pytest
import torch

gguf = pytest.importorskip("gguf")

from engine.config import ModelConfig  # noqa: E402
from engine.gguf_file import read_gguf  # noqa: E402
from engine.gguf_layout import to_gguf  # noqa: E402
from engine.gguf_loader import open_gguf, tensor  # noqa: E402
from engine.model import HybridForCausalLM  # noqa: E402
from engine.presets import materialise, preset_config  # noqa: E402
from peer.gguf_random import q4_k_m_types, quantize_order, spread, use_more_bits, write_random_gguf  # noqa: E402
from peer.llama_server import quantize_binary, server_binary  # noqa: E402

T = gguf.GGMLQuantizationType


def plan(preset: str) -> tuple[ModelConfig, dict[str, tuple[int, ...]], dict[str, T]]:
    c = ModelConfig.from_dict(preset_config(preset))
    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in to_gguf(c, HybridForCausalLM(c).state_dict())}
    return c, shapes, q4_k_m_types(shapes, c.num_hidden_layers, c.num_experts)


def layer(name: str) -> int:
    return int(name.split(".")[1])


def test_order_is_llama_cpps():
    names = ["blk.10.attn_v.weight", "output.weight", "blk.2.ffn_up_exps.weight", "blk.2.attn_gate.weight"]
    assert sorted(names, key=quantize_order) == [
        "output.weight",
        "blk.2.attn_gate.weight",
        "blk.2.ffn_up_exps.weight",
        "blk.10.attn_v.weight",
    ]


def test_full_35b_shape_gets_q6_k_where_q4_k_m_puts_it():
    c, shapes, types = plan("qwen3.6-35b-a3b")
    more_bits = {i for i in range(40) if use_more_bits(i, 40)}
    assert len(more_bits) == 20
    q6 = {name for name, t in types.items() if t == T.Q6_K}
    # one attn_v-like tensor per layer (attn_v or the DeltaNet's attn_qkv), counted in layer order
    assert {layer(n) for n in q6 if n.endswith(("attn_v.weight", "attn_qkv.weight"))} == more_bits
    assert {layer(n) for n in q6 if "ffn_down_exps" in n} == more_bits
    assert {layer(n) for n in q6 if "ffn_down_shexp" in n} == more_bits
    assert "output.weight" in q6 and types["token_embd.weight"] == T.Q4_K
    assert set(types.values()) == {T.Q4_K, T.Q6_K, T.F32}
    assert all(
        types[n] == T.F32
        for n in shapes
        if n.endswith(("_norm.weight", "ffn_gate_inp.weight", "ssm_conv1d.weight"))
    )
    nbytes = sum(
        math.prod(shapes[n]) // gguf.GGML_QUANT_SIZES[t][0] * gguf.GGML_QUANT_SIZES[t][1]
        for n, t in types.items()
    )
    assert 20e9 < nbytes < 22e9  # about 21 GB, what a Q4_K_M of this model weighs


def test_tiny_shape_falls_back_as_llama_quantize_does():
    """Rows of 32/64/128 weights: 32-block types; eight experts: llama.cpp's 8-expert rules."""
    _, _, types = plan("tiny")
    assert types["output.weight"] == T.Q8_0 and types["token_embd.weight"] == T.Q5_0
    assert (
        types["blk.0.attn_qkv.weight"]
        == types["blk.3.attn_v.weight"]
        == types["blk.3.attn_k.weight"]
        == T.Q8_0
    )
    assert types["blk.3.attn_output.weight"] == T.Q5_1  # Q5_K for 8 experts, row 128
    assert [types[f"blk.{i}.ffn_down_exps.weight"] for i in range(4)] == [T.Q5_0, T.Q5_0, T.Q8_0, T.Q8_0]
    assert types["blk.0.ffn_gate_exps.weight"] == types["blk.0.ssm_out.weight"] == T.Q5_0


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    return write_random_gguf("tiny", tmp_path_factory.mktemp("random") / "tiny.gguf")


def test_values_spread_as_the_presets_and_unquantized_ones_are_the_presets(tiny_file):
    model = open_gguf(tiny_file)
    c = ModelConfig.from_dict(preset_config("tiny"))
    _, _, own = materialise("tiny", "cpu", torch.float32)
    reference = dict(to_gguf(c, own))
    for name, info in model.tensors.items():
        values = tensor(model, name)
        if info.tensor_type == T.F32:
            assert torch.equal(values, reference[name]), name
        else:
            expected = spread(name, tuple(values.shape), c.num_hidden_layers)
            assert values.std().item() == pytest.approx(expected, rel=0.15), name
            assert abs(values.mean().item()) < 0.25 * expected, name


def test_engine_loads_and_runs_it(tiny_file):
    from engine import Engine

    engine = Engine.load(tiny_file, device="cpu")
    logits = engine.prefill(engine.new_state(), list(range(100, 140))).logits
    assert torch.isfinite(logits).all()
    assert 0.3 < logits.std().item() < 3  # sane: neither collapsed nor blown up
    assert engine.config.num_experts == 8 and engine.config.vocab_size == 248320


@pytest.mark.slow  # `bash .ci/run --slow` builds llama.cpp first
@pytest.mark.skipif(not quantize_binary().is_file(), reason="llama-quantize not built (.peer/build)")
@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_same_layout_as_llama_quantizes_own_file(preset, tmp_path):
    from peer.gguf_export import preset_gguf

    theirs = read_gguf(preset_gguf(preset, tmp_path, "q4_k_m"))
    ours = read_gguf(write_random_gguf(preset, tmp_path / "random.gguf"))
    layout = lambda f: [(n, t.tensor_type, t.ne, t.n_bytes) for n, t in f.tensors.items()]  # noqa: E731
    assert layout(ours) == layout(theirs)
    assert set(ours.meta) == set(theirs.meta)
    assert ours.meta["general.file_type"] == theirs.meta["general.file_type"]


@pytest.mark.slow
@pytest.mark.skipif(not server_binary().is_file(), reason="llama-server not built (.peer/build)")
@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_same_greedy_tokens_as_llama_cpp_on_it(preset):
    """As tests/peer/test_identity_quant.py, on the random file: against llama.cpp on an f32 file of
    the weights as we dequantize them, f32 identity; against its quantized arithmetic, the same
    tokens wherever our top-2 margin is clear of its 8-bit activation noise."""
    from peer.identity import RANDOM, run

    result = run(preset, 8, 5, RANDOM)
    print(json.dumps({k: v for k, v in result.items() if k not in ("ours", "theirs")}))
    exact = result["dequantized_f32"]
    assert exact["first_difference"] is None or exact["first_difference"]["our_margin"] < 1e-2, result
    assert exact["max_abs_logprob_diff"] < 1e-2, result
    diff = result["first_difference"]
    assert diff is None or diff["our_margin"] < 0.5, result
    assert result["max_abs_logprob_diff"] < 0.5, result
