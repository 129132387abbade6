"""What a model will occupy once loaded, read without loading it: from a GGUF file's tensor index,
an HF folder's safetensors headers, or a preset's config. `engine.fit` plans the device memory
from it before anything is loaded (`ft serve --plan` runs without a GPU).

Sizes are those of the loaded form on the target device, as the loaders make it: on a GPU a GGUF
model's Q8_0 and K-quant matrices stay packed (their file bytes) and the rest becomes bf16; an
FP8 checkpoint's weights stay FP8 beside their scales; on the CPU everything is dequantized (a
GGUF to fp32, an FP8 checkpoint to its config's dtype).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import ModelConfig

GGUF_EXPERTS = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down|gate_up)_exps\.weight$")
HF_EXPERTS = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.")
IGNORED = ("mtp.", "model.visual.", "visual.", "model.mtp.")
DTYPES = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1, "I64": 8, "I32": 4, "U8": 1, "I8": 1, "BOOL": 1}


@dataclass(frozen=True)
class Footprint:
    """A model's loaded size by part: `dense` bytes of everything but the routed experts, `expert`
    bytes of one routed expert (layer 0's, as the offload plan counts them), `dtype` of its
    activations and sequence states on the device."""

    config: ModelConfig
    dense: int
    expert: int
    dtype: torch.dtype
    source: str

    @property
    def experts(self) -> int:
        """Bytes of every routed expert of every layer."""
        return self.expert * self.config.num_experts * self.config.num_hidden_layers

    @property
    def total(self) -> int:
        return self.dense + self.experts


def of(model: str | Path | None, preset: str, device: str) -> Footprint:
    """The footprint of a model folder or GGUF file (else of preset `preset`) loaded on `device`."""
    on_gpu = torch.device(device).type == "cuda"
    if model is None:
        return of_preset(preset)
    from engine.gguf_loader import is_gguf  # noqa: PLC0415 (it imports the loader)

    return of_gguf(Path(model), on_gpu) if is_gguf(model) else of_folder(Path(model), on_gpu)


def of_preset(name: str) -> Footprint:
    from engine.model import HybridForCausalLM  # noqa: PLC0415
    from engine.presets import preset_config  # noqa: PLC0415

    raw = preset_config(name)
    c = ModelConfig.from_dict(raw)
    dtype = getattr(torch, raw.get("dtype", "float32"))
    with torch.device("meta"):
        params = dict(HybridForCausalLM(c).named_parameters())
    size = torch.empty(0, dtype=dtype).element_size()
    routed = sum(p.numel() for n, p in params.items() if ".mlp.experts." in n)
    dense = sum(p.numel() for p in params.values()) - routed
    return Footprint(c, dense * size, routed * size // (c.num_experts * c.num_hidden_layers), dtype, f"preset {name}")


def of_gguf(path: Path, on_gpu: bool) -> Footprint:
    """From the tensor index of every part (no tensor is read)."""
    from engine.gguf_loader import PACKED, config_dict, num_layers, open_gguf  # noqa: PLC0415

    model = open_gguf(path)
    c = ModelConfig.from_dict(config_dict(model))
    layers = num_layers(model)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    size = torch.empty(0, dtype=dtype).element_size()
    dense = expert0 = 0
    for name, t in model.tensors.items():
        block = re.match(r"^blk\.(\d+)\.", name)
        if block is not None and int(block[1]) >= layers:
            continue  # multi-token-prediction blocks are not loaded
        kept = on_gpu and t.tensor_type in PACKED and len(t.shape) >= 2
        loaded = t.n_bytes if kept else math.prod(t.shape) * size
        if (expert := GGUF_EXPERTS.match(name)) is None:
            dense += loaded
        elif int(expert[1]) == 0:
            expert0 += loaded
    return Footprint(c, dense, expert0 // c.num_experts, dtype, str(path))


def of_folder(folder: Path, on_gpu: bool) -> Footprint:
    """From the safetensors headers (no tensor is read)."""
    from engine.loader import safetensors_files  # noqa: PLC0415

    raw = json.loads((folder / "config.json").read_text())
    c = ModelConfig.from_folder(folder)
    text = raw.get("text_config") or raw
    dtype_name = text.get("dtype") or text.get("torch_dtype") or raw.get("torch_dtype") or "bfloat16"
    dtype = getattr(torch, dtype_name)
    size = torch.empty(0, dtype=dtype).element_size()
    dense = expert0 = 0
    for path in safetensors_files(folder):
        for name, (kind, shape) in _header(path).items():
            name = name.replace("model.language_model.", "model.", 1)
            if name.startswith(IGNORED):
                continue
            kept = kind == "F8_E4M3" and on_gpu or name.endswith("weight_scale_inv") and on_gpu
            if name.endswith("weight_scale_inv") and not on_gpu:
                continue  # dequantized into its weight
            loaded = math.prod(shape) * (DTYPES.get(kind, 2) if kept else size)
            if (expert := HF_EXPERTS.match(name)) is None:
                dense += loaded
            elif int(expert[1]) == 0:
                expert0 += loaded
    return Footprint(c, dense, expert0 // c.num_experts, dtype, str(folder))


def _header(path: Path) -> dict[str, tuple[str, list[int]]]:
    """A safetensors file's tensor index: name -> (dtype, shape)."""
    with path.open("rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
    return {k: (v["dtype"], v["shape"]) for k, v in header.items() if k != "__metadata__"}
