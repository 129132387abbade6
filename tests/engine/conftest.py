from __future__ import annotations

import os
import random

import pytest
import torch

from engine import Engine
from engine.presets import write_preset

# the random draws of the tests that take `rng` (printed with their metrics; set it to draw a failure's again)
SEED = int(os.environ.get("FT_TEST_SEED", random.SystemRandom().randrange(1 << 30)))
SMALL_HF_SHAPE = dict(
    vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
)


@pytest.fixture(scope="session")
def preset_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("presets")
    return {name: str(write_preset(name, root / name)) for name in ("tiny", "tiny-next")}


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory) -> dict[str, str]:
    """Random tiny checkpoints written by transformers' own save_pretrained."""
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("hf")
    out = {}
    torch.manual_seed(0)
    for name, (cfg_cls, model_cls, extra) in {
        "next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM, {"intermediate_size": 64}),
        "qwen3_5_moe": (transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM, {}),
    }.items():
        model = model_cls(cfg_cls(**SMALL_HF_SHAPE, **extra))
        with torch.no_grad():  # move norms and gates off their init values so every term matters
            for pname, p in model.named_parameters():
                if "norm" in pname or "dt_bias" in pname:
                    p.add_(torch.randn_like(p) * 0.1)
        model.save_pretrained(root / name)
        out[name] = str(root / name)
    return out


@pytest.fixture(scope="session")
def tiny(preset_dirs) -> Engine:
    return Engine.load(preset_dirs["tiny"])


@pytest.fixture
def rng(request) -> random.Random:
    """The test's own draws: from SEED and its name alone (with its parameters), not from which tests ran
    before it, so `FT_TEST_SEED=S pytest -k <that test>` draws a failure's inputs again."""
    return random.Random(f"{SEED}/{request.node.name}")
