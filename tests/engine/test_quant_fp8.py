"""FP8 checkpoints in Qwen's `-FP8` layout: block dequantization against a plain torch reference,
the presets' FP8 format, loading (sharded too), restore exactness, and clear errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoint_store import concat_chain
from engine import Engine
from engine.loader import CheckpointError
from engine.presets import materialise, unstack_experts, write_preset
from engine.quant import fp8


def reference_dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """One block at a time, as the format is written down."""
    q3, s3 = q.reshape(-1, *q.shape[-2:]), scale.reshape(-1, *scale.shape[-2:])
    out = torch.empty(q3.shape)
    for e in range(q3.shape[0]):
        for i in range(s3.shape[1]):
            for j in range(s3.shape[2]):
                rows, cols = slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1])
                out[e, rows, cols] = q3[e, rows, cols].float() * s3[e, i, j].float()
    return out.reshape(q.shape)


@pytest.mark.parametrize(
    "shape,block,scale_dtype",
    [
        ((256, 384), (128, 128), torch.bfloat16),
        ((200, 70), (128, 128), torch.float32),
        ((3, 130, 260), (128, 128), torch.bfloat16),
        ((64, 96), (32, 16), torch.float32),
    ],
)
def test_block_dequantization_equals_plain_reference(shape, block, scale_dtype):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * torch.rand(shape[-1]) * 4
    q, scale = fp8.quantize(w, block, scale_dtype)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == scale_dtype
    assert tuple(scale.shape) == fp8.scale_shape(shape, block)
    ours = fp8.dequantize(q, scale, block)
    assert torch.equal(ours, reference_dequantize(q, scale, block))
    # e4m3 keeps 3 mantissa bits: within 1/16 of each weight, or a subnormal step of its block's scale
    step = fp8.expand_scales(scale, shape, block) * 2.0**-9
    assert ((ours - w).abs() <= w.abs() / 16 + step).all()


def test_mismatched_scales_are_an_error():
    q, scale = fp8.quantize(torch.randn(256, 256))
    with pytest.raises(fp8.FP8ConfigError, match="does not cover"):
        fp8.dequantize(q, scale[:1], name="x.weight")


@pytest.fixture(scope="module")
def fp8_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("fp8")
    return {name: str(write_preset(name, root / name, fmt="fp8")) for name in ("tiny", "tiny-next")}


def test_preset_is_laid_out_as_qwens_releases(fp8_dirs):
    folder = fp8_dirs["tiny"]
    config = json.loads(open(f"{folder}/config.json").read())
    q = config["quantization_config"]
    assert q | {"modules_to_not_convert": None} == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": None,
    }
    tensors = load_file(f"{folder}/model.safetensors")
    quantized = {n.removesuffix(".weight") for n, t in tensors.items() if t.dtype == torch.float8_e4m3fn}
    assert {n.removesuffix(".weight_scale_inv") for n in tensors if n.endswith("_scale_inv")} == quantized
    kept = set(q["modules_to_not_convert"])
    assert {
        "lm_head",
        "model.embed_tokens",
        "model.layers.0.mlp.gate",
        "model.layers.0.mlp.shared_expert_gate",
        "model.layers.0.linear_attn.in_proj_a",
        "model.layers.0.linear_attn.in_proj_b",
        "model.layers.0.linear_attn.conv1d",
        "model.layers.0.linear_attn.A_log",
        "model.layers.3.self_attn.q_norm",
        "model.layers.0.input_layernorm",
    } <= kept
    assert {
        "model.layers.3.self_attn.q_proj",
        "model.layers.0.linear_attn.in_proj_qkv",
        "model.layers.0.linear_attn.out_proj",
        "model.layers.0.mlp.experts.5.down_proj",
        "model.layers.0.mlp.shared_expert.up_proj",
    } <= quantized
    assert not kept & quantized
    assert tensors["model.layers.0.mlp.experts.0.gate_proj.weight_scale_inv"].dtype == torch.bfloat16


@pytest.mark.parametrize("preset", ["tiny", "tiny-next"])
def test_loaded_weights_are_the_block_dequantized_presets(fp8_dirs, preset):
    engine = Engine.load(fp8_dirs[preset])
    _, _, original = materialise(preset)
    on_disk = unstack_experts(original)
    expected = {}
    for name, w in on_disk.items():
        if name.endswith(".weight") and w.ndim == 2 and fp8.is_converted(name.removesuffix(".weight")):
            q, scale = fp8.quantize(w)
            w = reference_dequantize(q, scale, fp8.BLOCK)
        expected[name] = w
    from engine.loader import stack_experts

    expected = stack_experts(expected)
    got = engine.model.state_dict()
    assert engine.dtype == torch.float32  # the preset's dtype
    for name, t in got.items():
        assert torch.equal(t, expected[name]), name


def test_restore_is_exact_on_an_fp8_model(fp8_dirs):
    engine = Engine.load(fp8_dirs["tiny"])
    ids = [int(x) for x in torch.randint(0, 248_000, (80,), generator=torch.Generator().manual_seed(5))]
    full = engine.prefill(engine.new_state(), ids)
    snapshots = engine.prefill(engine.new_state(), ids, capture_at=[9, 41]).snapshots
    for upto, at in ((1, 9), (2, 41)):
        rest = engine.prefill(engine.restore(concat_chain(snapshots[:upto])), ids[at:])
        assert (rest.logits - full.logits).abs().max().item() <= 1e-4


def test_scales_in_another_shard(fp8_dirs, tmp_path):
    """Scales in the first shard, their weights in the second: each waits for its other half."""
    tensors = load_file(f"{fp8_dirs['tiny']}/model.safetensors")
    shards = {
        "model-00001-of-00002.safetensors": {k: v for k, v in tensors.items() if k.endswith("_scale_inv")},
        "model-00002-of-00002.safetensors": {
            k: v for k, v in tensors.items() if not k.endswith("_scale_inv")
        },
    }
    for file, part in shards.items():
        save_file(part, str(tmp_path / file))
    weight_map = {name: file for file, part in shards.items() for name in part}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text(open(f"{fp8_dirs['tiny']}/config.json").read())
    a, b = Engine.load(tmp_path), Engine.load(fp8_dirs["tiny"])
    for key, t in b.model.state_dict().items():
        assert torch.equal(a.model.state_dict()[key], t), key


def damaged(folder: str, tmp_path, edit_config=None, drop: str | None = None):
    out = tmp_path / "damaged"
    out.mkdir()
    config = json.loads(open(f"{folder}/config.json").read())
    (out / "config.json").write_text(json.dumps(edit_config(config) if edit_config else config))
    tensors = load_file(f"{folder}/model.safetensors")
    save_file({k: v for k, v in tensors.items() if k != drop}, str(out / "model.safetensors"))
    return out


def test_missing_scale_is_an_error(fp8_dirs, tmp_path):
    drop = "model.layers.3.self_attn.q_proj.weight_scale_inv"
    with pytest.raises(
        CheckpointError, match="without their other half: model.layers.3.self_attn.q_proj.weight"
    ):
        Engine.load(damaged(fp8_dirs["tiny"], tmp_path, drop=drop))


def test_other_quantization_methods_are_an_error(fp8_dirs, tmp_path):
    def awq(config):
        config["quantization_config"]["quant_method"] = "awq"
        return config

    with pytest.raises(CheckpointError, match="quantization 'awq' is not supported"):
        Engine.load(damaged(fp8_dirs["tiny"], tmp_path, awq))


def test_fp8_tensor_without_quantization_config_is_an_error(fp8_dirs, tmp_path):
    def plain(config):
        del config["quantization_config"]
        return config

    with pytest.raises(CheckpointError, match="no fp8 quantization_config"):
        Engine.load(damaged(fp8_dirs["tiny"], tmp_path, plain))


def test_model_init_writes_the_fp8_format(tmp_path):
    from ft.cli import main

    assert main(["model", "init", "--preset", "tiny", "--format", "fp8", "--out", str(tmp_path / "m")]) == 0
    assert (
        json.loads((tmp_path / "m" / "config.json").read_text())["quantization_config"]["quant_method"]
        == "fp8"
    )
    assert main(["model", "init", "--preset", "tiny", "--format", "fp8", "--out", str(tmp_path / "m")]) == 1
