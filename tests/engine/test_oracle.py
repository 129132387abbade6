"""Our logits equal transformers' on the same checkpoints (fp32, max abs diff <= 1e-4)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine import Engine

transformers = pytest.importorskip("transformers")


def _compare(folder: str, vocab: int, length: int = 200) -> float:
    ours = Engine.load(folder)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(length))
    with torch.no_grad():
        expected = theirs(ids[None]).logits[0]
    got = ours.prefill(ours.new_state(), ids.tolist(), all_logits=True).logits
    assert got.shape == expected.shape
    return (got - expected).abs().max().item()


@pytest.mark.parametrize("arch", ["next", "qwen3_5_moe"])
def test_matches_transformers_on_its_own_checkpoints(hf_dirs, arch):
    assert _compare(hf_dirs[arch], 512) <= 1e-4


@pytest.mark.parametrize("preset", ["tiny", "tiny-next"])
def test_matches_transformers_on_preset_checkpoints(preset_dirs, preset):
    assert _compare(preset_dirs[preset], 248_000, length=150) <= 1e-4


def test_prefill_in_several_chunks_matches_one(tiny, monkeypatch):
    ids = torch.randint(0, 248_000, (300,)).tolist()
    whole = tiny.prefill(tiny.new_state(), ids, all_logits=True).logits
    monkeypatch.setattr(tiny.scheduler, "limits", dataclasses.replace(tiny.scheduler.limits, step_tokens=64))
    chunked = tiny.prefill(tiny.new_state(), ids, all_logits=True).logits
    assert (whole - chunked).abs().max().item() <= 1e-4


def test_bf16_matches_transformers_bf16(preset_dirs):
    """Random weights make bf16 drift far from fp32 (cosine ~0.8 for transformers too), so the
    bf16 bar is agreement with transformers' own bf16 run."""
    folder = preset_dirs["tiny"]
    ours = Engine.load(folder, dtype=torch.bfloat16)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    ids = torch.arange(2000, 2050)
    with torch.no_grad():
        expected = theirs(ids[None]).logits[0, -1].float()
    got = ours.prefill(ours.new_state(), ids.tolist()).logits
    assert torch.nn.functional.cosine_similarity(got, expected, dim=0) > 0.999
