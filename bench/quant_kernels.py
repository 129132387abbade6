"""Quantized-weight kernels (engine/ops/gpu/quant.py) against bf16 torch matmuls, at the shapes of the
35B-A3B model, on a GPU: decode GEMV (1 row), prefill GEMM (4096 rows), and the expert-grouped GEMM
of an MoE layer (4096 tokens x top-8 of 256 experts). Resident bytes per format, time per call,
weight bytes read per second, and the largest relative error against `x @ w.dequantize().T`.

    python bench/quant_kernels.py [--json bench/quant-kernels.json]   (or: python bench/quant.py --kernels …)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # bench/engine.py would shadow the `engine` package

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton.testing  # noqa: E402

from engine.ops.gpu import quant  # noqa: E402
from engine.ops.gpu.moe import group_by_expert  # noqa: E402
from engine.quant import fp8  # noqa: E402
from engine.quant.ggml import T, block_shape  # noqa: E402

LINEARS = {"attn q_proj [8192, 2048]": (8192, 2048), "shared gate_up [1024, 2048]": (1024, 2048),
           "lm_head [248320, 2048]": (248320, 2048)}  # fmt: skip
EXPERTS = (256, 1024, 2048)  # gate_up of one MoE layer: [E, 2I, H]


def random_weight(fmt, shape, device) -> quant.QuantWeight:
    """Random quants with sane scales (speed does not depend on the values)."""
    gen = np.random.default_rng(0)
    if fmt == "fp8":
        w = torch.randn(shape, device=device)
        return quant.pack_fp8(*fp8.quantize(w))
    block, size = block_shape(fmt)
    raw = gen.integers(0, 256, (int(np.prod(shape)) // block, size), dtype=np.uint8)
    at = {T.Q8_0: [0], T.Q4_K: [0, 2], T.Q6_K: [208]}[fmt]
    for a in at:
        raw[:, a : a + 2] = (
            (gen.random((raw.shape[0], 1), dtype=np.float32) * 0.01).astype(np.float16).view(np.uint8)
        )
    return quant.pack_ggml(torch.from_numpy(raw).reshape(*shape[:-1], -1), fmt, shape).to(device)


def bench_one(fn, reference, weight_bytes):
    ms = triton.testing.do_bench(fn, warmup=5, rep=50)
    out = fn()
    err = ((out.float() - reference).abs().max() / reference.abs().max()).item()
    return {"ms": ms, "GB/s": weight_bytes / ms / 1e6, "max_rel_err": err}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    dev = "cuda"
    rows = []
    for name, shape in LINEARS.items():
        for m in (1, 4096):
            x = torch.randn(m, shape[1], device=dev, dtype=torch.bfloat16)
            bf16 = torch.randn(shape, device=dev, dtype=torch.bfloat16)
            r = bench_one(lambda x=x, bf16=bf16: x @ bf16.T, (x @ bf16.T).float(), bf16.numel() * 2)
            rows.append({"op": name, "rows": m, "format": "bf16", "bytes": bf16.numel() * 2, **r})
            for fmt in (T.Q8_0, T.Q4_K, T.Q6_K, "fp8"):
                w = random_weight(fmt, shape, dev)
                ref = x.float() @ w.dequantize().T
                r = bench_one(lambda x=x, w=w: quant.linear(x, w), ref, w.nbytes)
                rows.append(
                    {"op": name, "rows": m, "format": getattr(fmt, "name", fmt), "bytes": w.nbytes, **r}
                )
            del bf16
    tokens, top_k = 4096, 8
    x = torch.randn(tokens, EXPERTS[2], device=dev, dtype=torch.bfloat16)
    ids = torch.rand(tokens, EXPERTS[0], device=dev).topk(top_k, dim=-1).indices
    order, offs = group_by_expert(ids, EXPERTS[0])
    bf16 = torch.randn(EXPERTS, device=dev, dtype=torch.bfloat16)
    xs = x[order // top_k]
    grouped_mm = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
    ref = grouped_mm(xs, bf16.transpose(1, 2), offs=offs).float()
    r = bench_one(lambda b=bf16: grouped_mm(xs, b.transpose(1, 2), offs=offs), ref, bf16.numel() * 2)
    rows.append(
        {
            "op": "experts gate_up [256, 1024, 2048]",
            "rows": tokens * top_k,
            "format": "bf16",
            "bytes": bf16.numel() * 2,
            **r,
        }
    )
    del bf16
    for fmt in (T.Q8_0, T.Q4_K, "fp8"):
        w = random_weight(fmt, EXPERTS, dev)
        deq = w.dequantize()
        ref = torch.cat(
            [
                xs[s:e].float() @ deq[i].T
                for i, (s, e) in enumerate(zip([0, *offs[:-1].tolist()], offs.tolist(), strict=True))
            ]
        )
        del deq
        r = bench_one(lambda w=w: quant.grouped(x, w, order, offs, top_k), ref, w.nbytes)
        rows.append(
            {
                "op": "experts gate_up [256, 1024, 2048]",
                "rows": tokens * top_k,
                "format": getattr(fmt, "name", fmt),
                "bytes": w.nbytes,
                **r,
            }
        )
    print(f"{'op':36} {'rows':>6} {'format':>6} {'MB':>8} {'ms':>9} {'GB/s':>8} {'rel err':>9}")
    for row in rows:
        print(
            f"{row['op']:36} {row['rows']:>6} {row['format']:>6} {row['bytes'] / 1e6:>8.1f} {row['ms']:>9.4f} "
            f"{row['GB/s']:>8.0f} {row['max_rel_err']:>9.2e}"
        )
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
