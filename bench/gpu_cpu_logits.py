"""Our GPU kernels against our CPU reference at a preset's full shape, both in fp32 on the same
values: log-probabilities at every position of a prompt plus a greedy continuation (the GPU's),
all positions in one prefill on each device.

    FT_MATERIALISE=1 python bench/gpu_cpu_logits.py --preset qwen3.6-35b-a3b-e64

Reports the largest |Δ log-prob| over each position's top-5 ids, top-1 agreement, and the
smallest top-2 margin, as JSON. (This is how far GPU kernel precision alone moves the logits,
to set against the llama.cpp identity check in bench/RESULTS.md.)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from engine import Engine
from engine.loader import build_model, fingerprint
from engine.presets import materialise
from gateway.tokenizer import QwenTokenizer
from peer.identity import PROMPT


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3.6-35b-a3b-e64")
    p.add_argument("--tokens", type=int, default=16, help="greedy tokens after the prompt")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    prompt = QwenTokenizer().encode(PROMPT)

    # the same values on both devices: built once on the GPU (a CUDA generator's stream is not the CPU's)
    config, _, weights = materialise(args.preset, "cuda", torch.float32)
    gpu = Engine(build_model(config, weights), fingerprint(config, weights))
    state, ids = gpu.new_state(), list(prompt)
    logits = gpu.prefill(state, ids).logits
    for _ in range(args.tokens):
        ids.append(int(logits.argmax()))
        logits = gpu.feed(state, ids[-1:])[0]
    on_gpu = gpu.prefill(gpu.new_state(), ids, all_logits=True).logits.float().cpu().log_softmax(-1)
    weights = {name: t.cpu() for name, t in weights.items()}
    del gpu, state
    torch.cuda.empty_cache()
    cpu = Engine(build_model(config, weights), fingerprint(config, weights))
    on_cpu = cpu.prefill(cpu.new_state(), ids, all_logits=True).logits.float().log_softmax(-1)

    top = on_cpu.topk(5, dim=-1)
    diff = (on_gpu.gather(-1, top.indices) - top.values).abs()
    result = {
        "preset": args.preset,
        "positions": len(ids),
        "top1_agree": int((on_gpu.argmax(-1) == on_cpu.argmax(-1)).sum()),
        "max_abs_logprob_diff_top5": float(diff.max()),
        "median_abs_logprob_diff_top5": float(diff.median()),
        "min_top2_margin_cpu": float((top.values[:, 0] - top.values[:, 1]).min()),
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
