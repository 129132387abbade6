"""The shared expert folded into the routed stacks as expert E (`SparseMoe.fold_shared`): the same
logits as the model that runs it apart, no second copy of any weight, the HF names unchanged, and
layers where it cannot fold (another size or kind) left as they were."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from engine import Engine
from engine.config import ModelConfig
from engine.model import HybridForCausalLM, SparseMoe
from engine.presets import PRESETS


def _pair(folder: str) -> tuple[Engine, Engine]:
    """The model as served (folded) and the same model with its shared experts run apart (the
    engine's fold skipped)."""
    with mock.patch.object(HybridForCausalLM, "fold_shared_experts", lambda self: None):
        apart = Engine.load(folder)
    return Engine.load(folder), apart


@pytest.mark.parametrize("preset", ["tiny", "tiny-next"])
def test_folded_shared_expert_gives_the_logits_of_the_model_that_runs_it_apart(preset_dirs, preset):
    folded, apart = _pair(preset_dirs[preset])
    layers = [layer.mlp for layer in folded.model.model.layers]
    assert all(m.folded for m in layers) and not any(layer.mlp.folded for layer in apart.model.model.layers)
    c = folded.config
    assert layers[0].experts.gate_up_all.shape == (c.num_experts + 1, 2 * c.moe_intermediate_size, c.hidden_size)
    ids = [1000 + 37 * i % 4000 for i in range(40)]  # 80 assignments: the grouped path, then decode steps
    out = {}
    for name, engine in (("folded", folded), ("apart", apart)):
        state = engine.new_state()
        out[name] = torch.stack([engine.prefill(state, ids).logits, *engine.feed(state, [11, 12])])
    torch.testing.assert_close(out["folded"], out["apart"], rtol=0, atol=1e-5)


def test_fold_keeps_every_weight_once_under_its_hf_name(preset_dirs):
    """The HF-named weights keep their names, shapes and values, as views of the new stacks (the
    resident bytes do not grow: the old stacks and the shared expert's own tensors are gone)."""
    folded, apart = _pair(preset_dirs["tiny"])
    ours, theirs = folded.model.state_dict(), apart.model.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)
    assert folded.memory()["weights"] <= apart.memory()["weights"]
    mlp = folded.model.model.layers[0].mlp
    stack = mlp.experts.gate_up_all.untyped_storage().data_ptr()
    for w in (mlp.experts.gate_up_proj, mlp.shared_expert.gate_proj.weight, mlp.shared_expert.up_proj.weight):
        assert w.untyped_storage().data_ptr() == stack
    assert mlp.shared_expert.down_proj.weight.untyped_storage().data_ptr() == mlp.experts.down_all.untyped_storage().data_ptr()


def _moe(shared_size: int, shared_dtype: torch.dtype) -> SparseMoe:
    moe = SparseMoe(ModelConfig.from_dict({**PRESETS["tiny"], "shared_expert_intermediate_size": shared_size}))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / 8)
    for m in (moe.shared_expert.gate_proj, moe.shared_expert.up_proj, moe.shared_expert.down_proj):
        m.weight = torch.nn.Parameter(m.weight.to(shared_dtype), requires_grad=False)
    moe.fuse()
    return moe


@pytest.mark.parametrize(("size", "dtype"), [(48, torch.float32), (32, torch.bfloat16)], ids=["size", "dtype"])
def test_a_shared_expert_of_another_size_or_kind_stays_apart(size, dtype):
    moe = _moe(size, dtype)
    before = moe.experts.gate_up_proj
    moe.fold_shared()
    assert not moe.folded and moe.experts.gate_up_proj is before and not hasattr(moe.experts, "gate_up_all")


def test_route_appends_the_shared_expert_with_its_sigmoid():
    from engine.ops.moe import route  # noqa: PLC0415

    logits = torch.randn(5, 9, generator=torch.Generator().manual_seed(3))
    weights, ids = route(logits, 2, True, torch.float32, shared=True)
    plain_w, plain_ids = route(logits[:, :8], 2, True, torch.float32)
    assert torch.equal(ids[:, :2], plain_ids) and (ids[:, 2] == 8).all()
    assert torch.equal(weights[:, :2], plain_w) and torch.equal(weights[:, 2], torch.sigmoid(logits[:, 8]))
