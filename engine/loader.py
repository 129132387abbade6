"""Load an HF model folder (config.json + safetensors, single file or sharded) into the model.

On disk, experts are stored one tensor per expert (`mlp.experts.E.gate_proj.weight`, as HF
writes them); in memory they are stacked (`mlp.experts.gate_up_proj` [E, 2I, H],
`mlp.experts.down_proj` [E, H, I]). Multimodal checkpoints keep the text model under
`model.language_model.`; vision and MTP weights are ignored. FP8 checkpoints (Qwen's `-FP8`
releases) are dequantized at load; `engine.load.load_folder` sends a `.gguf` model to `engine.gguf_loader`.
Under expert parallel (`engine.parallel`) a rank reads its own experts' tensors alone.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import xxhash
from safetensors import safe_open
from torch import nn

from engine.config import ModelConfig
from engine.head_split import HeadShard
from engine.model import HybridForCausalLM, SparseMoe
from engine.parallel import ExpertShard
from engine.quant import fp8 as fp8_quant
from engine.weights import aligned, cat_rows, one_way, stack

IGNORED_PREFIXES = ("mtp.", "model.visual.", "visual.", "model.mtp.")
EXPERT_KEY = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
EXPERT_TENSOR = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(.+)$")  # a weight, or its FP8 scale
EXPERT_STACK = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)$")


class CheckpointError(ValueError):
    """The model folder's weights do not match its config."""


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({folder / name for name in weight_map.values()})
    else:
        files = sorted(folder.glob("*.safetensors"))
    missing = [f.name for f in files if not f.is_file()]
    if not files or missing:
        raise CheckpointError(f"{folder}: no safetensors weights found" + (f" (missing {missing})" if missing else ""))
    return files


def read_state_dict(
    folder: Path, dtype: torch.dtype | None, keep_quantized: bool = False, shard: ExpertShard | None = None
) -> dict[str, Any]:
    """Every tensor of the text model; FP8 checkpoints (`engine.quant.fp8`) are dequantized to
    `dtype`, by default the checkpoint's own (`dtype` / `torch_dtype` in config.json), or with
    `keep_quantized` packed (`QuantWeight`, engine/ops/gpu/quant.py) standing for that dtype.
    With `shard`, of the routed experts only the shard's (numbered from 0)."""
    tensors = _checkpoint_tensors(folder) if shard is None else _shard_tensors(folder, shard)
    return state_dict_of(tensors, fp8_pairing(folder, dtype, keep_quantized), dtype)


def _checkpoint_names(folder: Path) -> Iterator[tuple[Any, str, str]]:
    """(the open file, the name in it, our name) of each text model tensor of an HF folder."""
    for path in safetensors_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                name_out = name.replace("model.language_model.", "model.", 1)
                if not name_out.startswith(IGNORED_PREFIXES):
                    yield f, name, name_out


def _checkpoint_tensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The text model's tensors of an HF folder, under our names, one at a time."""
    for f, name, name_out in _checkpoint_names(folder):
        yield name_out, f.get_tensor(name)


def _shard_tensors(folder: Path, shard: ExpertShard) -> Iterator[tuple[str, torch.Tensor]]:
    """`_checkpoint_tensors` with the routed experts of `shard` alone, renumbered from 0: the
    others' per-expert tensors are not read, a stacked one is read in the shard's rows only."""
    for f, name, name_out in _checkpoint_names(folder):
        if (match := EXPERT_TENSOR.match(name_out)) is not None:
            prefix, expert, rest = match.group(1), int(match.group(2)), match.group(3)
            if shard.holds(expert):
                yield f"{prefix}.{expert - shard.first}.{rest}", f.get_tensor(name)
        elif EXPERT_STACK.match(name_out):
            yield name_out, f.get_slice(name)[shard.first : shard.first + shard.count]
        else:
            yield name_out, f.get_tensor(name)


def state_dict_of(
    tensors: Iterable[tuple[str, torch.Tensor]], fp8: fp8_quant.Pairing | None, dtype: torch.dtype | None
) -> dict[str, Any]:
    """A checkpoint's tensors as they are on disk (HF names, per-expert weights, FP8 weights beside
    their `weight_scale_inv`, paired by `fp8`) → the state dict `build_model` takes: FP8 weights
    dequantized or packed (`fp8`'s choice), the rest in `dtype`, experts stacked."""
    raw: dict[str, Any] = {}
    for name, tensor in tensors:
        if fp8 is not None and fp8.holds(name, tensor):
            if (paired := fp8.take(name, tensor)) is None:
                continue
            name, tensor = paired
        elif tensor.dtype == torch.float8_e4m3fn:
            raise CheckpointError(f"{name}: an fp8 tensor, but config.json has no fp8 quantization_config")
        if isinstance(tensor, torch.Tensor):
            tensor = tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor
            tensor = aligned(tensor)
        raw[name] = tensor
    if fp8 is not None and fp8.unpaired():
        raise CheckpointError(f"fp8 weights and scales without their other half: {', '.join(fp8.unpaired()[:8])}")
    return stack_experts(raw)


def fp8_pairing(folder: Path, dtype: torch.dtype | None, keep_quantized: bool = False) -> fp8_quant.Pairing | None:
    """The FP8 reader for a folder whose config.json says `quant_method: fp8`, else None."""
    path = folder / "config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    try:
        block = fp8_quant.block_size(config)
    except fp8_quant.FP8ConfigError as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    if block is None:
        return None
    text = config.get("text_config") or config
    default = text.get("dtype") or text.get("torch_dtype") or config.get("torch_dtype") or "bfloat16"
    pack = None
    if keep_quantized:
        from engine.ops.gpu.quant import pack_fp8  # noqa: PLC0415 (Triton: only for kept weights)

        pack = pack_fp8
    return fp8_quant.Pairing(block, dtype or getattr(torch, default), pack)


def stack_experts(raw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert tensors -> stacked gate_up_proj [E, 2I, H] and down_proj [E, H, I]."""
    out: dict[str, torch.Tensor] = {}
    groups: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name, tensor in raw.items():
        match = EXPERT_KEY.match(name)
        if match is None:
            out[name] = tensor
            continue
        prefix, expert, proj = match.group(1), int(match.group(2)), match.group(3)
        groups.setdefault(prefix, {}).setdefault(proj, {})[expert] = tensor
    for prefix, projs in groups.items():
        if set(projs) != {"gate_proj", "up_proj", "down_proj"} or len({len(p) for p in projs.values()}) != 1:
            raise CheckpointError(f"{prefix}: incomplete expert tensors ({ {k: len(v) for k, v in projs.items()} })")
        order = sorted(projs["gate_proj"])
        if order != list(range(len(order))) or any(sorted(p) != order for p in projs.values()):
            raise CheckpointError(f"{prefix}: expert indices are not 0..{len(order) - 1}")
        gate_up = stack([cat_rows([projs["gate_proj"][e], projs["up_proj"][e]]) for e in order])
        down = stack([projs["down_proj"][e] for e in order])
        out[f"{prefix}.gate_up_proj"], out[f"{prefix}.down_proj"] = one_way(gate_up, down)
    return out


def build_model(
    config: ModelConfig, state_dict: dict[str, Any], shard: ExpertShard | None = None, heads: HeadShard | None = None
) -> HybridForCausalLM:
    """Check names and shapes against the architecture, then adopt the tensors without copying.
    A `QuantWeight` (a weight kept quantized) takes its parameter's place under the same name.
    With `shard`, the expert stacks hold that shard's experts (`SparseMoe.shard_experts`); with
    `heads`, the attention and DeltaNet layers that share of their heads (cut from the whole
    model's `state_dict`, which is left as it is)."""
    if heads is not None:
        config, state_dict = heads.local_config, heads.take(state_dict)
    with torch.device("meta"):
        model = HybridForCausalLM(config)
        if shard is not None:
            for module in model.modules():
                if isinstance(module, SparseMoe):
                    module.shard_experts(shard)
    expected = {name: p.shape for name, p in model.state_dict().items()}
    if config.tie_word_embeddings and "lm_head.weight" not in state_dict and "model.embed_tokens.weight" in state_dict:
        state_dict = {**state_dict, "lm_head.weight": state_dict["model.embed_tokens.weight"]}
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    if missing:
        raise CheckpointError(f"missing tensor(s): {', '.join(missing[:8])}" + (" …" if len(missing) > 8 else ""))
    if unexpected:
        raise CheckpointError(f"unexpected tensor(s): {', '.join(unexpected[:8])}" + (" …" if len(unexpected) > 8 else ""))
    for name, shape in expected.items():
        if tuple(state_dict[name].shape) != tuple(shape):
            raise CheckpointError(f"{name}: shape {tuple(state_dict[name].shape)}, expected {tuple(shape)}")
    packed = {name: w for name, w in state_dict.items() if not isinstance(w, torch.Tensor)}
    for name, w in packed.items():
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner)
        delattr(module, attr)
        module.add_module(attr, w)
    tensors = {name: t for name, t in state_dict.items() if name not in packed}
    model.load_state_dict(tensors, assign=True, strict=not packed)  # strict: the names were checked above
    model.requires_grad_(False).fuse_projections()
    if heads is not None:
        model.split_heads(heads)
    return model.eval()


def place(model: HybridForCausalLM, device: torch.device) -> HybridForCausalLM:
    """`model` on `device`, each host storage copied once and its tensors made views of the copy
    as they were of it: the fused projections stay fused, with no second copy of a weight at any
    time (`Module.to` copies each tensor on its own: a fused weight and its views twice, past a
    memory budget while they are fused again). Only the bytes the tensors use are copied."""
    if model.lm_head.weight.device == device:
        return model
    return copy_storages(model, device)


def copy_storages(model: nn.Module, device: torch.device) -> nn.Module:
    """`place`'s move (to any device, the same one included: a copy)."""
    tensors = [
        (module, kind, name, t)
        for module in model.modules()
        for kind in ("_parameters", "_buffers")
        for name, t in getattr(module, kind).items()
        if t is not None
    ]
    spans: dict[int, tuple[int, int]] = {}  # host storage -> the byte range its tensors use
    for *_, t in tensors:
        key, (lo, hi) = t.untyped_storage().data_ptr(), _extent(t)
        old = spans.get(key, (lo, hi))
        spans[key] = (min(old[0], lo), max(old[1], hi))
    copies: dict[int, tuple[torch.UntypedStorage, int]] = {}
    for module, kind, name, t in tensors:
        key = t.untyped_storage().data_ptr()
        if key not in copies:
            lo, hi = spans[key]
            lo -= lo % 16  # every dtype's offset stays whole
            host = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage(), lo, (hi - lo,), (1,))
            copies[key] = (torch.empty(hi - lo, dtype=torch.uint8, device=device).copy_(host).untyped_storage(), lo)
        storage, lo = copies[key]
        offset = (t.storage_offset() * t.element_size() - lo) // t.element_size()
        moved = torch.empty(0, dtype=t.dtype, device=device).set_(storage, offset, t.shape, t.stride())
        getattr(module, kind)[name] = nn.Parameter(moved, requires_grad=False) if kind == "_parameters" else moved
    return model


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """The byte range of its storage that `t` reads."""
    start = t.storage_offset() * t.element_size()
    if t.numel() == 0:
        return start, start
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return start, start + (last + 1) * t.element_size()


def fingerprint(config: ModelConfig, state_dict: dict[str, Any], shard: ExpertShard | None = None) -> str:
    """Stable id of config + weights: names, shapes, dtypes and the first bytes of every tensor.
    With `shard`, the expert stacks count as the whole model's: rank 0's shard, whose stacks start
    with expert 0 as the whole ones do, gives the fingerprint of the model (`ExpertShard.agree`)."""
    h = xxhash.xxh3_128(repr(config).encode())
    for name in sorted(state_dict):
        weight = state_dict[name]
        shape = tuple(weight.shape)
        if shard is not None and EXPERT_STACK.match(name):
            shape = (shard.num_experts, *shape[1:])
        h.update(f"{name}:{shape}:{weight.dtype}".encode())
        parts = (weight,) if isinstance(weight, torch.Tensor) else weight.parts  # kept quantized: its arrays
        for tensor in parts:
            head = tensor.detach().flatten()[:256].float().cpu()
            h.update(head.numpy().tobytes())
    return h.hexdigest()
