"""The memory plan (`ft serve --plan`, engine/fit.py) for the random Q4_K_M 35B-A3B model: its GGUF
header (the tensor index peer/gguf_random.py writes, from the preset's config) over a sparse file,
so the plan reads a real file index without 20 GB of weights."""

from __future__ import annotations

import math
import os
import re

import gguf
import numpy as np
import pytest
import torch

from engine import fit, footprint
from engine.config import ModelConfig
from engine.gguf_layout import to_gguf
from engine.model import HybridForCausalLM
from engine.presets import preset_config
from ft.cli import main
from peer.gguf_export import open_writer
from peer.gguf_random import q4_k_m_types

PRESET = "qwen3.6-35b-a3b"
PART = re.compile(r"^  (dense weights|routed experts|decode slots|workspace|expert stream)\s+([\d.]+) GiB$")


@pytest.fixture(scope="module")
def q4_k_m_index(tmp_path_factory):
    """The preset's Q4_K_M GGUF with its header written and its tensor data a hole (a sparse file)."""
    raw = preset_config(PRESET)
    c = ModelConfig.from_dict(raw)
    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in to_gguf(c, HybridForCausalLM(c).state_dict())}
    types = q4_k_m_types(shapes, c.num_hidden_layers, c.num_experts)
    path = tmp_path_factory.mktemp("gguf") / "qwen3.6-35b-a3b-Q4_K_M.gguf"
    w = open_writer(c, raw, path, gguf.LlamaFileType.MOSTLY_Q4_K_M, f"{PRESET}-random-q4_k_m")
    data = 0
    for name, qtype in types.items():
        shape = shapes[name]
        if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            size = 4 if qtype == gguf.GGMLQuantizationType.F32 else 2
            dtype, raw_shape, n_bytes, kind = np.dtype(np.float32 if size == 4 else np.float16), shape, math.prod(shape) * size, None
        else:
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            raw_shape = (*shape[:-1], shape[-1] // block * type_size)
            dtype, n_bytes, kind = np.dtype(np.uint8), math.prod(raw_shape), qtype
        w.add_tensor_info(name, raw_shape, dtype, n_bytes, kind)
        data += -(-n_bytes // 32) * 32
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    os.truncate(path, -(-path.stat().st_size // 32) * 32 + data)  # the data: a hole, no disk blocks
    return path


@pytest.mark.parametrize("gib", [8, 12, 24, 80])
def test_plan_parts_sum_within_the_budget_and_small_gpus_offload(q4_k_m_index, capsys, gib):
    assert main(["serve", "--plan", "--model", str(q4_k_m_index), "--gpu-memory", str(gib)]) == 0
    out = capsys.readouterr().out
    parts = {m[1]: float(m[2]) for line in out.splitlines() if (m := PART.match(line))}
    assert {"dense weights", "routed experts", "decode slots", "workspace"} <= set(parts)
    assert sum(parts.values()) <= gib
    assert parts["dense weights"] == pytest.approx(1.50, abs=0.01)  # the Q4_K_M file's, packed
    offloaded = "experts offloaded" in out.splitlines()[0]
    assert offloaded == (gib < 80)  # 24 GiB holds every expert, not with 32K tokens for 4 sequences too
    context = int(re.search(r"each up to ([\d,]+) tokens of context", out)[1].replace(",", ""))
    if gib == 8:  # one sequence: with two, each would reach fewer than MIN_CONTEXT tokens
        assert "1 sequence decoded at a time" in out and "traded: experts offloaded" in out
        assert "traded: 1 sequence decoded at a time instead of 4" in out
        assert parts["routed experts"] < 19.45 / 4
        assert fit.MIN_CONTEXT <= context < 2 * fit.MIN_CONTEXT
    else:
        assert "4 sequences decoded together" in out and context >= fit.MIN_CONTEXT


def test_footprint_of_the_file_is_the_one_computed_from_the_config(q4_k_m_index):
    fp = footprint.of(q4_k_m_index, PRESET, "cuda")
    assert fp.config.num_experts == 256 and fp.dtype == torch.bfloat16
    assert fp.experts / fit.GiB == pytest.approx(19.45, abs=0.01)  # layer 0's experts: Q4_K gate/up, Q6_K down
    on_cpu = footprint.of(q4_k_m_index, PRESET, "cpu")  # dequantized to fp32 there: twice the bf16 preset
    assert on_cpu.total == 2 * footprint.of_preset(PRESET).total


def test_a_model_that_cannot_fit_names_the_numbers_and_the_options(q4_k_m_index, capsys):
    assert main(["serve", "--plan", "--model", str(q4_k_m_index), "--gpu-memory", "2"]) == 2
    err = capsys.readouterr().err
    assert "does not fit 2.00 GiB" in err and "dense weights are 1.50 GiB" in err and "19.45 GiB" in err
    assert "smaller quant" in err and "--device cpu" in err
    need = re.search(r"--gpu-memory ([\d.]+) or more", err)[1]
    assert main(["serve", "--plan", "--model", str(q4_k_m_index), "--gpu-memory", need]) == 0  # and it does fit
    assert main(["serve", "--plan", "--model", str(q4_k_m_index), "--gpu-memory", str(float(need) - 0.1)]) == 2


def test_plan_without_a_budget_or_a_gpu_says_what_it_needs(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU gives the plan its free memory")
    assert main(["serve", "--plan", "--preset", "tiny", "--device", "cpu"]) == 2
    assert "--plan without a GPU needs --gpu-memory" in capsys.readouterr().err


def test_the_footprint_read_from_files_is_what_loading_holds():
    from engine import Engine
    from engine.engine import ensure_preset

    folder = ensure_preset("tiny")
    fp = footprint.of(folder, "tiny", "cpu")
    assert (fp.dense, fp.expert) == (footprint.of_preset("tiny").dense, footprint.of_preset("tiny").expert)
    weights = Engine.load(folder).memory()["weights"]
    assert abs(weights - fp.total) < 0.001 * weights  # buffers beside the parameters: the rest


RANK = re.compile(r"^plan: (cuda:\d) \(rank (\d)\) \(([\d.]+) GiB loaded\) in ([\d.]+) GiB \(--gpu-memory\): (.*)$")


def rank_blocks(out: str) -> list[dict]:
    """Each GPU's plan as `ft serve --plan --gpus` prints it: device, rank, what it chose and its parts."""
    blocks: list[dict] = []
    for line in out.splitlines():
        if m := RANK.match(line):
            blocks.append({"device": m[1], "rank": int(m[2]), "budget": float(m[4]), "how": m[5], "parts": {}})
        elif blocks and (part := PART.match(line)):
            blocks[-1]["parts"][part[1]] = float(part[2])
    return blocks


@pytest.mark.parametrize("gib", [8, 12, 24])
def test_plan_over_two_gpus_gives_each_its_own_parts_within_its_budget(q4_k_m_index, capsys, gib):
    """`--plan --gpus 0,1`: one plan a GPU (the dense weights and half the experts, resident or offloaded
    with an expert cache of its own), the numbers those `fit.fit_ranks` computes, and against one GPU
    of the same size (`fit.fit`): at 24 GiB every expert resident where one GPU offloads; at 12 and 8
    GiB the two offload too (a GPU's half of the experts, 9.73 GiB, with the dense weights, decode
    slots and workspace needs 13.5), keeping a larger share of their experts on the device."""
    assert main(["serve", "--plan", "--model", str(q4_k_m_index), "--gpus", "0,1", "--gpu-memory", str(gib)]) == 0
    out = capsys.readouterr().out
    blocks = rank_blocks(out)
    budget = fit.Budget(gib * fit.GiB, "--gpu-memory")
    fp = footprint.of(q4_k_m_index, PRESET, "cuda")
    computed = fit.fit_ranks(fp, [budget, budget], ["cuda:0", "cuda:1"])
    alone = fit.fit(fp, budget, "cuda")
    assert [(b["device"], b["rank"]) for b in blocks] == [("cuda:0", 0), ("cuda:1", 1)]
    for block, plan in zip(blocks, computed.ranks, strict=True):
        assert sum(block["parts"].values()) <= gib == block["budget"]
        assert block["parts"] == {name: pytest.approx(n / fit.GiB, abs=0.006) for name, n in plan.parts.items() if n}
        assert block["parts"]["dense weights"] == pytest.approx(1.50, abs=0.01)  # replicated
        assert ("everything resident" in block["how"]) == plan.resident
        assert plan.experts_held == 128 and plan.experts_bytes == fp.experts // 2
    shares = [plan.expert_slots / plan.experts_held for plan in computed.ranks]
    one = out.splitlines()[-1]
    assert one.startswith(f"on one GPU of {gib:.2f} GiB") and ("everything is resident too" in one) == alone.resident
    if gib == 24:
        assert all(plan.resident for plan in computed.ranks) and not alone.resident
        assert all(b["parts"]["routed experts"] == pytest.approx(19.45 / 2, abs=0.01) for b in blocks)
    if gib <= 12:  # each GPU offloads its experts too, but keeps a larger share of them on the device
        assert not any(plan.resident for plan in computed.ranks)
        assert min(shares) > alone.expert_slots / fp.config.num_experts
    if gib == 8:
        assert all(plan.expert_slots < plan.experts_held for plan in computed.ranks)


def test_the_plans_context_becomes_the_servers_limit(q4_k_m_index, capsys):
    """`ft serve` hands the plan's context to the engine (`EngineConfig.max_context`), unless
    --max-context sets one."""
    from gateway.serve import engine_config_from_args
    from gateway.serve_prepare import prepare
    from tests.conftest import serve_args

    args = serve_args("--model", str(q4_k_m_index), "--gpu-memory", "8", "--plan")
    assert prepare(args)
    context = int(re.search(r"each up to ([\d,]+) tokens of context", capsys.readouterr().out)[1].replace(",", ""))
    assert engine_config_from_args(args).max_context == context
    args = serve_args("--model", str(q4_k_m_index), "--gpu-memory", "8", "--plan", "--max-context", "8192")
    assert prepare(args)
    assert engine_config_from_args(args).max_context == 8192 and "past the" not in capsys.readouterr().out
    args = serve_args("--model", str(q4_k_m_index), "--gpu-memory", "8", "--plan", "--max-context", "65536")
    assert prepare(args)
    assert engine_config_from_args(args).max_context == 65536  # the user's choice, with a warning
    assert f"--max-context 65,536 is past the {context:,} tokens the plan leaves room for" in capsys.readouterr().out
