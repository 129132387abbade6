"""Quantized-weight kernels (engine/ops/gpu/quant.py) against bf16 torch matmuls, at the shapes of the
35B-A3B model, on a GPU: decode GEMV (1 row), prefill GEMM (4096 rows), and the expert-grouped GEMM
of an MoE layer (4096 tokens x top-8 of 256 experts). Resident bytes per format, time per call,
weight bytes read per second, and the largest relative error against `x @ w.dequantize().T`.

    python bench/quant_kernels.py [--json bench/quant-kernels.json]   (or: python bench/quant.py --kernels …)
    python bench/quant_kernels.py --fp8-prefill [--fp8-tiles 64:4:3:t,64:4:4:n] [--json …]

`--fp8-prefill`: FP8 prefill's matmuls at 8,192 tokens instead (the DeltaNet and attention projections,
an MoE layer's experts at top-8 of 256): bf16 cuBLAS on a bf16 copy of the weight, FP8 through a
transient bf16 copy (FT_FP8_ACT=0), FP8 on the tensor cores (x quantized in the timing) through cuBLAS's
block-scaled `torch._scaled_mm` (dense) and the Triton kernel per tile setting (`fp8_prefill.Tile.parse`:
rows a tile : warps : stages : n|t); errors against the fp32 product of the unquantized x
and (`vs fp8 x`) of x's FP8 rows.
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

from engine.ops.gpu import fp8_prefill, quant  # noqa: E402
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


FP8_TOKENS = 8192
FP8_LINEARS = {"DeltaNet in_proj_qkvz [12288, 2048]": (12288, 2048), "DeltaNet out_proj [2048, 4096]": (2048, 4096),
               "attn q_proj [8192, 2048]": (8192, 2048)}  # fmt: skip
FP8_EXPERTS = {
    "experts gate_up [256, 1024, 2048]": (256, 1024, 2048),
    "experts down [256, 2048, 512]": (256, 2048, 512),
}


def time_fp8_prefill(tiles: list[str]) -> list[dict]:
    dev, rows = "cuda", []
    gen = torch.Generator(device=dev).manual_seed(0)

    def add(op, m, variant, fn, want, flops, want_fp8=None):
        """`want`: the fp32 product of the unquantized x; `want_fp8`: of x's FP8 rows (the kernel's own error)."""
        try:
            ms = triton.testing.do_bench(fn, warmup=5, rep=50)
            out = fn().float()
            row = {"op": op, "rows": m, "variant": variant, "ms": ms, "TFLOP/s": flops / ms / 1e9,
                   "max_rel_err": ((out - want).abs().max() / want.abs().max()).item()}  # fmt: skip
            if want_fp8 is not None:
                row["vs_fp8_x"] = ((out - want_fp8).abs().max() / want_fp8.abs().max()).item()
            rows.append(row)
        except Exception as e:  # noqa: BLE001 - a variant this GPU or torch does not run
            rows.append({"op": op, "rows": m, "variant": variant, "error": f"{type(e).__name__}: {e}"[:200]})

    def variants(op, m, run, want, want_fp8, flops, cublas=False):
        """`run()` with FT_FP8_ACT off (a bf16 copy), on through cuBLAS (`cublas`), on per Triton tile setting."""
        before = (fp8_prefill.ACT, fp8_prefill.CUBLAS, fp8_prefill.TILE)
        try:
            fp8_prefill.ACT = False
            add(op, m, "fp8 via bf16 copy", run, want, flops)
            fp8_prefill.ACT = True
            if cublas:
                fp8_prefill.CUBLAS = True
                add(op, m, "fp8 cuBLAS (_scaled_mm)", run, want, flops, want_fp8)
            fp8_prefill.CUBLAS = False
            for spec in tiles:
                fp8_prefill.TILE = fp8_prefill.Tile.parse(spec)
                add(op, m, f"fp8 Triton {spec}", run, want, flops, want_fp8)
        finally:
            fp8_prefill.ACT, fp8_prefill.CUBLAS, fp8_prefill.TILE = before

    def fp8_x(x):  # x as the FP8 prefill multiplies it
        return fp8.dequantize(*fp8.quantize(x, fp8_prefill.X_BLOCK, torch.float32), fp8_prefill.X_BLOCK)

    for op, shape in FP8_LINEARS.items():
        x = torch.randn(FP8_TOKENS, shape[1], device=dev, dtype=torch.bfloat16, generator=gen)
        w = random_weight("fp8", shape, dev)
        deq = w.dequantize()
        want, flops = x.float() @ deq.T, 2 * FP8_TOKENS * shape[0] * shape[1]
        want_fp8 = fp8_x(x) @ deq.T
        bf16 = deq.to(torch.bfloat16)
        add(op, FP8_TOKENS, "bf16 cuBLAS", lambda x=x, b=bf16: x @ b.T, want, flops)
        variants(op, FP8_TOKENS, lambda x=x, w=w: quant.linear(x, w), want, want_fp8, flops, cublas=True)
        del bf16, deq, want, want_fp8
    top_k = 8
    for op, shape in FP8_EXPERTS.items():
        experts, n, k = shape
        x = torch.randn(FP8_TOKENS, k, device=dev, dtype=torch.bfloat16, generator=gen)
        ids = torch.rand(FP8_TOKENS, experts, device=dev, generator=gen).topk(top_k, dim=-1).indices
        order, offs, _ = group_by_expert(ids, experts)
        w = random_weight("fp8", shape, dev)
        deq = w.dequantize()
        starts = [0, *offs[:-1].tolist()]
        spans = list(enumerate(zip(starts, offs.tolist(), strict=True)))
        xs = x[order // top_k].float()
        want = torch.cat([xs[s:e] @ deq[i].T for i, (s, e) in spans])
        xs = fp8_x(x)[order // top_k]
        want_fp8 = torch.cat([xs[s:e] @ deq[i].T for i, (s, e) in spans])
        flops = 2 * FP8_TOKENS * top_k * n * k
        bf16, xb = deq.to(torch.bfloat16), x[order // top_k]
        del deq, xs
        add(op, FP8_TOKENS * top_k, "bf16 grouped_mm",
            lambda b=bf16, xb=xb, o=offs: quant.grouped_mm(xb, b.transpose(1, 2), offs=o), want, flops)  # fmt: skip
        del bf16
        run = lambda x=x, w=w, o=order, f=offs: quant.grouped(x, w, o, f, top_k)  # noqa: E731
        variants(op, FP8_TOKENS * top_k, run, want, want_fp8, flops)
    print(f"{'op':40} {'rows':>6} {'variant':>28} {'ms':>8} {'TFLOP/s':>8} {'rel err':>9} {'vs fp8 x':>9}")
    for row in rows:
        if "error" in row:
            print(f"{row['op']:40} {row['rows']:>6} {row['variant']:>28}  {row['error']}")
        else:
            fp8_err = f"{row['vs_fp8_x']:>9.2e}" if "vs_fp8_x" in row else ""
            print(f"{row['op']:40} {row['rows']:>6} {row['variant']:>28} {row['ms']:>8.3f} {row['TFLOP/s']:>8.1f} "
                  f"{row['max_rel_err']:>9.2e} {fp8_err}")  # fmt: skip
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path)
    p.add_argument("--fp8-prefill", action="store_true", help="FP8 prefill's matmuls at 8,192 tokens instead")
    p.add_argument("--fp8-tiles", default="64:4:3:t,64:4:4:t,64:4:4:n,64:8:4:n,128:8:4:n",
                   help="the FP8 Triton GEMM's settings to time (fp8_prefill.Tile.parse), comma-separated")  # fmt: skip
    args = p.parse_args()
    if args.fp8_prefill:
        rows = time_fp8_prefill(args.fp8_tiles.split(","))
        if args.json:
            args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=2))
        return
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
    order, offs, _ = group_by_expert(ids, EXPERTS[0])
    bf16 = torch.randn(EXPERTS, device=dev, dtype=torch.bfloat16)
    xs = x[order // top_k]
    ref = quant.grouped_mm(xs, bf16.transpose(1, 2), offs=offs).float()
    r = bench_one(lambda b=bf16: quant.grouped_mm(xs, b.transpose(1, 2), offs=offs), ref, bf16.numel() * 2)
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
