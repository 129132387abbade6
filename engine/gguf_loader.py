"""Load a llama.cpp GGUF model (`qwen35moe`, `qwen3next`): one file, the parts of a split file,
or a folder holding either.

Files are memory-mapped (`engine.gguf_file`): tensors are read one at a time, never the whole
file. Everything that can be wrong is checked before the first tensor is dequantized:
the files open and hold every tensor's bytes (a truncated file is an error naming it), the
architecture is one we run, every tensor has a name we know and a supported GGML type. The
config comes from the metadata (`config_dict` builds an HF `config.json` dict from it), the
tensors are dequantized once at load (`engine.quant.ggml`) and laid out as our own loader's
(`engine.gguf_layout.from_gguf`). The tokenizer and chat template are in the same metadata
(`engine.gguf_tokenizer`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.config import ModelConfig
from engine.gguf_file import GGUFFile, GGUFFormatError, TensorInfo, read_gguf
from engine.gguf_layout import (
    FUSED,
    GGUF_GLOBAL_NAMES,
    GGUF_LAYER_NAMES,
    HF_ARCH,
    NEXT_FUSED,
    from_gguf,
    from_gguf_global,
    permute_value_heads,
)
from engine.loader import CheckpointError, build_model, fingerprint, place
from engine.model import HybridForCausalLM
from engine.quant.ggml import SUPPORTED, T, as_bytes, dequantize
from engine.weights import aligned, dense, one_way

SPLIT_NAME = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
BLOCK_NAME = re.compile(r"^blk\.(\d+)\.(.+)$")


class GGUFError(CheckpointError):
    """A GGUF file this engine cannot load (named in the message, with the tensor where one is at fault)."""


def is_gguf(path: str | Path) -> bool:
    """A `.gguf` file, or a folder of them with no `config.json`."""
    path = Path(path)
    if path.suffix == ".gguf":
        return True
    return path.is_dir() and not (path / "config.json").is_file() and any(path.glob("*.gguf"))


def gguf_parts(path: str | Path) -> list[Path]:
    """The files of one GGUF model: `path` itself, or every part of the split it belongs to
    (`NAME-00001-of-00003.gguf`); a folder must hold exactly one model."""
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.gguf"))
        stems = {m["stem"] if (m := SPLIT_NAME.match(f.name)) else f.name for f in files}
        if len(stems) != 1:
            raise GGUFError(
                f"{path}: expected the file(s) of one GGUF model, found {[f.name for f in files]}"
            )
        path = files[0]
    if not path.is_file():
        raise GGUFError(f"{path}: no such file")
    match = SPLIT_NAME.match(path.name)
    if match is None:
        return [path]
    count = int(match["count"])
    parts = [path.with_name(f"{match['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise GGUFError(f"{path}: split GGUF is missing part(s) {missing}")
    return parts


@dataclass
class GGUFModel:
    """The opened, checked files of one model: metadata of the first part, tensors of all."""

    paths: list[Path]
    arch: str  # GGUF architecture: qwen35moe | qwen3next
    meta: dict[str, Any]
    files: dict[str, GGUFFile]  # tensor name → the part that holds it
    tensors: dict[str, TensorInfo]

    def get(self, key: str, default: Any = ...) -> Any:
        if key in self.meta:
            return self.meta[key]
        if default is ...:
            raise GGUFError(f"{self.paths[0]}: metadata key {key!r} is missing")
        return default

    def hp(self, key: str, default: Any = ...) -> Any:
        """An architecture hyperparameter (`{arch}.{key}`)."""
        return self.get(f"{self.arch}.{key}", default)


def _open(path: Path) -> GGUFFile:
    try:
        return read_gguf(path)
    except GGUFFormatError as exc:
        raise GGUFError(f"{path}: not a readable GGUF file: {exc}") from None


def open_gguf(path: str | Path) -> GGUFModel:
    """Open and check every part; raise `GGUFError` before any tensor is read."""
    parts = gguf_parts(path)
    files = [_open(p) for p in parts]
    meta = files[0].meta
    arch = meta.get("general.architecture")
    if arch not in HF_ARCH:
        raise GGUFError(
            f"{parts[0]}: architecture {arch!r} is not supported (supported: {', '.join(HF_ARCH)})"
        )
    count = int(meta.get("split.count", 1))
    if count != len(parts):
        raise GGUFError(f"{parts[0]}: metadata says {count} split part(s), found {len(parts)}")
    owners: dict[str, GGUFFile] = {}
    for f in files:
        for name in f.tensors:
            if name in owners:
                raise GGUFError(f"{f.path}: tensor {name} appears twice")
            owners[name] = f
    model = GGUFModel(parts, arch, meta, owners, {name: f.tensors[name] for name, f in owners.items()})
    check_tensors(model)
    return model


def num_layers(model: GGUFModel) -> int:
    """Layers of the model proper: llama.cpp counts multi-token-prediction blocks in block_count."""
    return int(model.hp("block_count")) - int(model.hp("nextn_predict_layers", 0))


def check_tensors(model: GGUFModel) -> None:
    layers = num_layers(model)
    for name, t in model.tensors.items():
        block = BLOCK_NAME.match(name)
        if block is not None and int(block[1]) >= layers:
            continue  # MTP blocks: ignored, as the safetensors loader ignores mtp.*
        known = (
            name in GGUF_GLOBAL_NAMES if block is None else block[2] in GGUF_LAYER_NAMES or block[2] in FUSED
        )
        if not known:
            raise GGUFError(f"{model.paths[0]}: unexpected tensor {name}")
        if t.tensor_type not in SUPPORTED:
            supported = ", ".join(sorted(s.name for s in SUPPORTED))
            kind = getattr(t.tensor_type, "name", f"#{t.tensor_type}")
            raise GGUFError(
                f"{model.files[name].path}: tensor {name} has GGML type {kind}, which this engine does not "
                f"load (supported: {supported})"
            )


def config_dict(model: GGUFModel) -> dict:
    """An HF `config.json` dict for the model, from its GGUF metadata."""
    hp = model.hp
    layers = num_layers(model)
    recurrent = hp("attention.recurrent_layers", None)
    if recurrent is not None:
        layer_types = ["linear_attention" if r else "full_attention" for r in recurrent[:layers]]
    else:
        interval = int(hp("full_attention_interval", 4))
        layer_types = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)
        ]
    head_dim = int(hp("attention.key_length"))
    value_heads = int(hp("ssm.time_step_rank"))
    eos = [model.get("tokenizer.ggml.eos_token_id", None), model.get("tokenizer.ggml.eot_token_id", None)]
    raw = {
        "architectures": [HF_ARCH[model.arch]],
        "vocab_size": int(model.tensors["token_embd.weight"].ne[1]),
        "hidden_size": int(hp("embedding_length")),
        "num_hidden_layers": layers,
        "layer_types": layer_types,
        "num_attention_heads": int(hp("attention.head_count")),
        "num_key_value_heads": int(hp("attention.head_count_kv")),
        "head_dim": head_dim,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": float(hp("rope.freq_base")),
            "partial_rotary_factor": int(hp("rope.dimension_count")) / head_dim,
        },
        "linear_num_key_heads": int(hp("ssm.group_count")),
        "linear_num_value_heads": value_heads,
        "linear_key_head_dim": int(hp("ssm.state_size")),
        "linear_value_head_dim": int(hp("ssm.inner_size")) // value_heads,
        "linear_conv_kernel_dim": int(hp("ssm.conv_kernel")),
        "num_experts": int(hp("expert_count")),
        "num_experts_per_tok": int(hp("expert_used_count")),
        "moe_intermediate_size": int(hp("expert_feed_forward_length")),
        "shared_expert_intermediate_size": int(hp("expert_shared_feed_forward_length")),
        "norm_topk_prob": bool(hp("expert_weights_norm", True)),
        "rms_norm_eps": float(hp("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(hp("context_length")),
        "tie_word_embeddings": "output.weight" not in model.tensors,
        "eos_token_id": list(dict.fromkeys(int(e) for e in eos if e is not None)),
    }
    if (ffn := hp("feed_forward_length", None)) is not None:
        raw["intermediate_size"] = int(ffn)
    if (name := model.get("general.name", None)) is not None:
        raw["ft_gguf_name"] = name
    return raw


PACKED = frozenset({T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K})  # the types kept quantized (engine/ops/gpu/quant.py)
PROBE = 1 << 32  # a row probe's value: source * PROBE + row


def tensor(model: GGUFModel, name: str) -> torch.Tensor:
    """One tensor, dequantized to fp32 in PyTorch order (`ne` reversed)."""
    t = model.tensors[name]
    return dequantize(model.files[name].tensor_bytes(t), t.tensor_type, t.shape, torch.float32, name)


def packed(model: GGUFModel, name: str, dtype: torch.dtype) -> Any:
    """One tensor kept quantized (`QuantWeight` standing for `dtype`) where its type is packed and it
    is a matrix (or a stack of them), else dequantized to fp32 as `tensor`."""
    t = model.tensors[name]
    if t.tensor_type not in PACKED or len(t.shape) < 2:
        return tensor(model, name)
    from engine.ops.gpu.quant import pack_ggml  # noqa: PLC0415 (Triton: only for kept weights)

    raw = (
        as_bytes(model.files[name].tensor_bytes(t)).clone().reshape(*t.shape[:-1], -1)
    )  # off the mapped file
    return pack_ggml(raw, t.tensor_type, tuple(t.shape), dtype)


def tiled_columns(c: ModelConfig) -> torch.Tensor | None:
    """Qwen3.5 with more value heads than key heads: where each column of the file's `ssm_out`
    (value heads in tiled order along its rows) sits among the model's columns; else None."""
    if c.arch != "qwen3_5_moe" or c.linear_num_value_heads == c.linear_num_key_heads:
        return None
    key = "linear_attn.out_proj.weight"
    ours = permute_value_heads(c, key, torch.arange(c.linear_value_dim).view(1, -1), inverse=True)[0]
    return torch.argsort(ours)  # ours[j]: the file's column of our column j


def from_gguf_packed(
    c: ModelConfig, layer: int, tensors: dict[str, Any], dtype: torch.dtype
) -> dict[str, Any]:
    """`from_gguf` for a block some of whose tensors are `QuantWeight`s. Their transforms move rows
    (head reorders, the experts' gate ‖ up, Qwen3-Next's q, k, v, z merge) but for Qwen3.5's
    `ssm_out`, whose columns are reordered (kept with `tiled_columns`), so each other packed
    tensor goes through `from_gguf` as a probe (int64 [.., N, 1] of source * PROBE + row) and
    every output made of probes is gathered from the packed sources' rows (`resolve`). Fused
    pairs with one part dequantized are dequantized whole."""
    from engine.ops.gpu.quant import QuantWeight  # noqa: PLC0415 (Triton: only for kept weights)

    tensors, extra = dict(tensors), {}
    out_proj, columns = tensors.get("ssm_out.weight"), tiled_columns(c)
    if isinstance(out_proj, QuantWeight) and columns is not None:  # its blocks cannot move: x's columns do
        del tensors["ssm_out.weight"]
        extra[f"model.layers.{layer}.linear_attn.out_proj.weight"] = QuantWeight(
            out_proj.fmt, out_proj.shape, out_proj.parts, out_proj.dtype, columns
        )
    for group in (FUSED, NEXT_FUSED):
        present = [k for k in group if k in tensors]
        if any(not isinstance(tensors[k], torch.Tensor) for k in present) and any(
            isinstance(tensors[k], torch.Tensor) for k in present
        ):
            tensors.update({k: dense(tensors[k], torch.float32) for k in present})
    sources = [w for w in tensors.values() if not isinstance(w, torch.Tensor)]
    probes = {}
    for key, w in tensors.items():
        if isinstance(w, torch.Tensor):
            probes[key] = w
            continue
        rows = torch.arange(w.shape[-2], dtype=torch.int64) + sources.index(w) * PROBE
        probes[key] = rows.view(-1, 1).expand(*w.shape[:-2], -1, 1)
    out = from_gguf(c, layer, probes)
    return {
        name: resolve(t, sources, dtype) if t.dtype == torch.int64 else t for name, t in out.items()
    } | extra


def resolve(probe: torch.Tensor, sources: list, dtype: torch.dtype) -> Any:
    """The weight a probe [.., N, 1] stands for: the rows it names of its sources, still packed
    where the sources concatenate (`quant.can_concat`), else dequantized (fp32)."""
    from engine.ops.gpu import quant  # noqa: PLC0415

    rows = probe.reshape(-1, probe.shape[-2])[0]  # the same rows in every expert
    used = sorted(set((rows // PROBE).tolist()))
    weights = [sources[i] for i in used]
    offsets = dict(
        zip(used, torch.tensor([0] + [w.shape[-2] for w in weights]).cumsum(0).tolist(), strict=False)
    )
    index = torch.tensor([offsets[int(s)] for s in rows // PROBE]) + rows % PROBE
    if not quant.can_concat(weights):
        return torch.cat([w.dequantize() for w in weights], dim=-2).index_select(-2, index)
    base = weights[0] if len(weights) == 1 else quant.concat_rows(weights)
    if torch.equal(index, torch.arange(base.shape[-2])):
        return base
    return base.take_rows(index)


def read_gguf_state_dict(
    model: GGUFModel, config: ModelConfig, dtype: torch.dtype, keep_quantized: bool = False
) -> dict[str, Any]:
    """Our in-memory state dict (stacked experts), one block at a time: fp32 while transformed,
    then cast to `dtype`; with `keep_quantized`, the Q8_0 / Q4_K / Q5_K / Q6_K matrices stay
    packed (`QuantWeight`s standing for `dtype`; the embedding's rows are dequantized as read)."""
    blocks: dict[int, list[str]] = {}
    out: dict[str, Any] = {}
    for name in model.tensors:
        if (block := BLOCK_NAME.match(name)) is None:
            w = packed(model, name, dtype) if keep_quantized else tensor(model, name)
            if isinstance(w, torch.Tensor):
                ours, t = from_gguf_global(name, w)
                out[ours] = aligned(t.to(dtype))
            else:
                out[GGUF_GLOBAL_NAMES[name]] = w
        elif int(block[1]) < config.num_hidden_layers:
            blocks.setdefault(int(block[1]), []).append(name)
    for layer, names in sorted(blocks.items()):
        keys = {name: name.split(".", 2)[2] for name in names}
        if keep_quantized:
            loaded = {key: packed(model, name, dtype) for name, key in keys.items()}
            ours = from_gguf_packed(config, layer, loaded, dtype)
            experts = [f"model.layers.{layer}.mlp.experts.{p}" for p in ("gate_up_proj", "down_proj")]
            if all(name in ours for name in experts):
                ours[experts[0]], ours[experts[1]] = one_way(ours[experts[0]], ours[experts[1]])
        else:
            ours = from_gguf(config, layer, {key: tensor(model, name) for name, key in keys.items()})
        out |= {
            k: aligned(v.to(dtype).contiguous()) if isinstance(v, torch.Tensor) else v
            for k, v in ours.items()
        }
    return out


def load_gguf(
    path: str | Path, device: torch.device, dtype: torch.dtype | None = None, keep_quantized: bool = False
) -> tuple[HybridForCausalLM, str]:
    """The model of a GGUF file (or split, or folder) on `device`, dequantized to `dtype`
    (default: fp32 on the CPU, bf16 on a GPU) or, with `keep_quantized`, its Q8_0 / K-quant
    matrices kept packed; and its fingerprint."""
    model = open_gguf(path)
    config = ModelConfig.from_dict(config_dict(model))
    dtype = dtype or (torch.float32 if device.type == "cpu" else torch.bfloat16)
    state_dict = read_gguf_state_dict(model, config, dtype, keep_quantized)
    hybrid = build_model(config, state_dict)
    return place(hybrid, device), fingerprint(config, state_dict)
