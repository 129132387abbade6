"""Identity check: the same prompt ids through our engine and llama-server (same weights, GGUF
f32), greedy tokens and top-k log-probabilities compared step by step. With a quantized GGUF
(`--dtype q8_0`, `q4_k_m`, …) both sides load that same file: ours dequantizes it at load; and
llama.cpp also runs an f32 file of the weights as we dequantized them (`dequantized_f32`), which
tells its own quantized arithmetic apart from what the file says.

    python -m peer.identity --preset tiny [--tokens 16] [--dtype f32]
    python -m peer.identity --preset small --dtype q4_k_m
    python -m peer.identity --preset small --dtype random-q4_k_m   # random blocks, no llama-quantize
    FT_MATERIALISE=1 python -m peer.identity --preset qwen3.6-35b-a3b-e64 --device cuda --dtype bf16
    FT_MATERIALISE=1 python -m peer.identity --preset qwen3.6-35b-a3b-e64 --device cuda --dtype f32 --engine-dtype float32

On the CPU our engine runs in fp32; on a GPU in the preset's dtype, against a CUDA llama-server
with every layer offloaded.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from engine import Engine
from ft import env
from gateway.tokenizer import QwenTokenizer
from peer.gguf_export import LLAMA_QUANTIZE, export_dequantized, preset_gguf
from peer.gguf_random import random_gguf
from peer.llama_server import PEER_HOME, LlamaServer, build

RANDOM = "random-q4_k_m"  # a Q4_K_M file of random blocks at the preset's shape (peer.gguf_random)
QUANTIZED = ("q8_0", *LLAMA_QUANTIZE, RANDOM)
PROMPT = "<|im_start|>user\nWrite a short poem about the sea.<|im_end|>\n<|im_start|>assistant\n"


def ours(engine: Engine, ids: list[int], n: int, k: int) -> list[dict]:
    """Greedy steps: the chosen id, its logprob, the top-k (id, logprob), and the top-2 margin."""
    state = engine.new_state()
    logits = engine.prefill(state, ids).logits
    steps = []
    for _ in range(n):
        logp = torch.log_softmax(logits.float(), -1)
        top = torch.topk(logp, k)
        token = int(top.indices[0])
        steps.append(
            {
                "id": token,
                "logprob": float(top.values[0]),
                "margin": float(top.values[0] - top.values[1]),
                "top": [(int(i), float(v)) for i, v in zip(top.indices, top.values, strict=True)],
            }
        )
        logits = engine.feed(state, [token])[0]
    return steps


def theirs(server: LlamaServer, ids: list[int], n: int, k: int) -> list[dict]:
    """llama-server's greedy ids (`tokens`) with their top-k where it reports them: it folds the
    probabilities of a token that ends inside a UTF-8 character into the next entry, so entries
    are matched to steps by id, and a step without its own entry has an empty top-k."""
    out = server.complete_ids(ids, n, n_probs=k)
    probs = iter(out["completion_probabilities"])
    entry = next(probs, None)
    steps = []
    for token in out["tokens"]:
        if entry is not None and entry["id"] == token:
            top = [(t["id"], t["logprob"]) for t in entry["top_logprobs"]]
            steps.append({"id": token, "logprob": entry["logprob"], "top": top})
            entry = next(probs, None)
        else:
            steps.append({"id": token, "logprob": None, "top": []})
    return steps


def compare(a: list[dict], b: list[dict]) -> dict:
    """Steps until the first different greedy token; max |Δ logprob| over ids in both top-k lists."""
    same, max_diff, first_diff = 0, 0.0, None
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        theirs_top = dict(y["top"])
        diffs = [abs(lp - theirs_top[t]) for t, lp in x["top"] if t in theirs_top]
        max_diff = max([max_diff, *diffs])
        if x["id"] != y["id"]:
            first_diff = {"step": i, "ours": x["id"], "theirs": y["id"], "our_margin": x["margin"]}
            break
        same += 1
    return {
        "steps": min(len(a), len(b)),
        "same_tokens": same,
        "first_difference": first_diff,
        "max_abs_logprob_diff": max_diff,
        "min_margin": min(s["margin"] for s in a[: same + 1]),
    }


def run(
    preset: str, n: int, k: int, dtype: str, device: str = "cpu", engine_dtype: str | None = None
) -> dict:
    cuda = device != "cpu"
    materialise = env.materialise()
    if dtype == RANDOM:
        gguf_path = random_gguf(preset, PEER_HOME / "models")
    else:
        gguf_path = preset_gguf(preset, PEER_HOME / "models", dtype, device if materialise else None)
    binary = build(cuda=cuda)
    ids = QwenTokenizer().encode(PROMPT)
    # our engine: fp32 on the CPU; on a GPU the preset's dtype unless asked (a f32 GGUF of a bf16
    # preset holds the bf16 values exactly, so --engine-dtype float32 compares like with like)
    engine_dtype = engine_dtype or (None if cuda else "float32")
    torch_dtype = getattr(torch, engine_dtype) if engine_dtype else None
    if dtype in QUANTIZED:  # the same quantized file on both sides
        engine = Engine.load(gguf_path, device=device, dtype=torch_dtype)
    else:
        engine = Engine.from_preset(preset, device=device, dtype=torch_dtype)

    def llama(path: Path) -> list[dict]:
        server = LlamaServer(
            path,
            ctx_size=4096,
            gpu_layers=999 if cuda else None,
            binary=binary,
            log_path=PEER_HOME / f"identity-{preset}.log",
            # the CPU backend's repacking of quantized weights (interleaved layouts for its own kernels)
            # crashed llama-server 11434 at start on this project's CPU machine; values are unaffected
            extra=("--no-repack",) if dtype in QUANTIZED and not cuda else (),
        )
        with server:
            assert server.tokenize(PROMPT) == ids, "llama.cpp tokenizes the prompt differently"
            return theirs(server, ids, n, k)

    b = llama(gguf_path)
    a = ours(engine, ids, n, k)
    result = {
        "preset": preset,
        "device": device,
        "engine_dtype": str(engine.dtype),
        "gguf_dtype": dtype,
        "gguf_bytes": gguf_path.stat().st_size,
        "prompt_tokens": len(ids),
        **compare(a, b),
        "ours": [s["id"] for s in a],
        "theirs": [s["id"] for s in b],
    }
    if dtype in QUANTIZED:
        # llama.cpp's quantized dot products also round the activations (to 8 bits on the CPU), so
        # the comparison above carries that noise; llama.cpp on an f32 file of the dequantized
        # weights separates it from what the file says
        plain = export_dequantized(gguf_path, gguf_path.with_name(gguf_path.stem + "-dequantized-f32.gguf"))
        result["dequantized_f32"] = compare(a, llama(plain))
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--top", type=int, default=5)
    p.add_argument("--dtype", default="f32", choices=["f32", "bf16", "f16", *QUANTIZED])
    p.add_argument("--device", default="cpu", help="our engine's device; cuda also runs a CUDA llama-server")
    p.add_argument(
        "--engine-dtype",
        choices=["float32", "bfloat16"],
        help="our engine's dtype (default: fp32 on the CPU, the preset's on a GPU)",
    )
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    result = run(args.preset, args.tokens, args.top, args.dtype, args.device, args.engine_dtype)
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
