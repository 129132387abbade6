"""Loading a model from a path: an HF folder (`engine.loader`) or a GGUF model (`engine.gguf_loader`)."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.gguf_loader import is_gguf, load_gguf
from engine.head_split import HeadShard
from engine.loader import build_model, fingerprint, place, read_state_dict
from engine.model import HybridForCausalLM
from engine.parallel import ExpertParallel, ExpertParallelError


def load_folder(
    folder: str | Path, device: torch.device, dtype: torch.dtype | None = None, keep_quantized: bool | None = None,
    parallel: ExpertParallel | None = None, split_heads: bool = False,
) -> tuple[HybridForCausalLM, str]:
    """An HF folder, or a GGUF model (a `.gguf` file, a split, a folder of them: `engine.gguf_loader`).
    `keep_quantized` (default: on a CUDA device): quantized weights stay packed in memory and run
    through the Triton kernels (engine/ops/gpu/quant.py); else they are dequantized at load.
    `parallel`: this rank's experts alone (an HF folder), the fingerprint the whole model's; with
    `split_heads`, its share of the attention and DeltaNet heads too (`engine.head_split`)."""
    keep = device.type == "cuda" if keep_quantized is None else keep_quantized
    if is_gguf(folder):
        if parallel is not None:
            raise ExpertParallelError(f"{folder}: expert parallel loads HF folders and presets, not GGUF models")
        return load_gguf(folder, device, dtype, keep)
    folder = Path(folder)
    config = ModelConfig.from_folder(folder)
    shard = parallel.shard(config.num_experts) if parallel is not None else None
    heads = HeadShard.of(parallel, config) if parallel is not None and split_heads else None
    state_dict = read_state_dict(folder, dtype, keep, shard)
    model = build_model(config, state_dict, shard, heads)
    fp = fingerprint(config, state_dict, shard)
    return place(model, device), fp if shard is None else shard.agree(fp)
