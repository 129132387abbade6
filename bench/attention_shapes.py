"""A prefill's causal attention at new sequence lengths, per SDPA backend: the first call at each
length (what a server pays, meeting a new length at nearly every prefill) against the next calls
at it (the steady state), at the attention shape of a preset (default qwen3.6-35b-a3b: 16 query
heads, 2 KV heads of 256).

    python bench/attention_shapes.py --json out.json [--lengths 600,1014,2252,8192] [--preset NAME]

Backends: torch's own choice ("auto"; cuDNN where it takes the shape on the H200), cuDNN alone,
flash alone, the engine's (`engine.ops.gpu.attention.causal_attention`: flash, from PREFILL_CUDNN_ROWS
on cuDNN over rows padded to PREFILL_BUCKET, every bucket's graph built first as warm-up does), and a
suffix's bottom-right mask
(512 queries after the length: flash through torch's causal bias). Prints a table, writes JSON."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from torch.nn.attention.bias import causal_lower_right  # noqa: E402

from engine.ops.gpu import attention  # noqa: E402
from engine.presets import PRESETS  # noqa: E402

BACKENDS = {
    "auto": None,
    "cudnn": [SDPBackend.CUDNN_ATTENTION],
    "flash": [SDPBackend.FLASH_ATTENTION],
}
SUFFIX = 512


def call(backend, q, k, v) -> torch.Tensor:
    """One causal attention, q's rows the last of k's."""
    if backend == "engine":
        return attention.causal_attention(*(x[0].transpose(0, 1) for x in (q, k, v)))
    if q.shape[2] != k.shape[2]:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[2], k.shape[2]),
                                              enable_gqa=True)  # fmt: skip
    if backend is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def timed(backend, q, k, v) -> float:
    """ms from the call to its result on the device (host setup included)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    call(backend, q, k, v)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen3.6-35b-a3b")
    p.add_argument("--lengths", default="600,777,1014,2252,4097,6000,8192")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    cfg = PRESETS[args.preset]
    hq, hkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    torch.manual_seed(0)
    lengths = [int(x) for x in args.lengths.split(",")]
    for backend in BACKENDS.values():  # each backend's one-time setup at a length not timed
        q = torch.randn(1, hq, 128, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, hkv, 128, d, device="cuda", dtype=torch.bfloat16)
        call(backend, q, k, k)
    start = time.perf_counter()
    attention.prepare_prefill(hq, hkv, d, max(lengths), torch.device("cuda"), torch.bfloat16)
    print(f"the engine's buckets up to {max(lengths)} rows built in {time.perf_counter() - start:.2f} s")
    rows = []
    for length in lengths:
        for name, backend in [("engine", "engine"), *BACKENDS.items(), ("suffix (bottom-right)", None)]:
            queries = SUFFIX if name.startswith("suffix") else length
            total = length + SUFFIX if name.startswith("suffix") else length
            q = torch.randn(1, hq, queries, d, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(1, hkv, total, d, device="cuda", dtype=torch.bfloat16)
            v = torch.randn_like(k)
            try:
                first = timed(backend, q, k, v)
                steady = statistics.median(timed(backend, q, k, v) for _ in range(args.reps))
            except RuntimeError as e:  # a backend that does not take the shape
                rows.append({"length": length, "backend": name, "error": str(e).splitlines()[0]})
                continue
            rows.append({"length": length, "backend": name, "queries": queries, "keys": total,
                         "first_ms": first, "steady_ms": steady})  # fmt: skip
            print(f"{length:>6} {name:<22} first {first:8.2f} ms  steady {steady:7.3f} ms", flush=True)
    gpu = torch.cuda.get_device_name()
    print(f"\n{args.preset} attention ({hq} query heads, {hkv} KV heads of {d}), bf16, {gpu}\n")
    print("| length | backend | first call ms | steady ms | first - steady |")
    print("|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['length']} | {r['backend']} | {r['error']} | | |")
        else:
            print(f"| {r['length']} | {r['backend']} | {r['first_ms']:.2f} | {r['steady_ms']:.3f} | "
                  f"{r['first_ms'] - r['steady_ms']:.2f} |")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"preset": args.preset, "device": gpu,
                                         "torch": torch.__version__, "rows": rows}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
