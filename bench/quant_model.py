"""A quantized GGUF model on the GPU, weights kept quantized (the Triton kernels) against the same
file dequantized to bf16 at load: resident weight bytes, prefill tokens/s and batch-1 decode
tokens/s (CUDA graphs), and the largest logit difference between the two. The model: a GGUF file,
or a preset written as the tests' Q4_K_M-like mix (tests/engine/kquants.py; no llama-quantize).

    python bench/quant_model.py --preset small [--gguf FILE] [--prefill 4096] [--decode 64] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from gpu import wall

from engine import Engine
from engine.gguf_file import read_gguf
from engine.warmup import warm_up


def preset_file(preset: str, out: Path) -> Path:
    from engine.presets import materialise  # noqa: PLC0415
    from tests.engine.kquants import write_kquant_gguf  # noqa: PLC0415

    if out.is_file():
        return out
    config, raw, state_dict = materialise(preset)
    return write_kquant_gguf(config, raw, state_dict, out)


def measure(engine: Engine, prompt: list[int], steps: int) -> dict:
    warm_up(engine)
    engine.prefill(engine.new_state(), prompt)  # kernels tuned for this length
    prefill_s = wall(lambda: engine.prefill(engine.new_state(), prompt))
    state = engine.new_state()
    logits = engine.prefill(state, prompt).logits
    tokens = [1000 + i for i in range(steps)]
    engine.feed(state, tokens[:4])
    decode_s = wall(lambda: engine.feed(state, tokens[4:]))
    return {
        "weights_bytes": engine.memory()["weights"],
        "prefill_tok_s": len(prompt) / prefill_s,
        "decode_tok_s": (steps - 4) / decode_s,
        "logits": logits.float().cpu(),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--gguf", type=Path, help="a GGUF file (default: the preset's Q4_K_M-like mix)")
    p.add_argument("--prefill", type=int, default=4096)
    p.add_argument("--decode", type=int, default=64)
    p.add_argument("--json", type=Path, default=Path("bench/results/quant-model.json"))
    args = p.parse_args(argv)
    path = args.gguf or preset_file(args.preset, Path("/tmp") / f"{args.preset}-kmix.gguf")
    prompt = [1000 + (7 * i) % 50_000 for i in range(args.prefill)]
    rows = {}
    for name, keep in (("quantized", True), ("bf16", False)):
        engine = Engine.load(path, device="cuda", keep_quantized=keep, max_running=1)
        rows[name] = measure(engine, prompt, args.decode)
        del engine
        torch.cuda.empty_cache()
    diff = (rows["quantized"].pop("logits") - rows["bf16"].pop("logits")).abs().max().item()
    file_bytes = sum(t.n_bytes for t in read_gguf(path).tensors.values())
    print(f"{path.name}: tensor data {file_bytes / 2**20:.1f} MiB; last-position |logits diff| {diff:.3e}")
    print(f"{'weights':<10} {'MiB':>10} {'x file':>8} {'prefill tok/s':>14} {'decode tok/s':>13}")
    for name, r in rows.items():
        print(
            f"{name:<10} {r['weights_bytes'] / 2**20:>10.1f} {r['weights_bytes'] / file_bytes:>8.3f} "
            f"{r['prefill_tok_s']:>14.0f} {r['decode_tok_s']:>13.1f}"
        )
    result = {
        "file": str(path),
        "file_tensor_bytes": file_bytes,
        "prefill_tokens": args.prefill,
        "decode_tokens": args.decode,
        "max_abs_logit_diff": diff,
        "device": torch.cuda.get_device_name(),
        **rows,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
