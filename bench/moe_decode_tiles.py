"""The bf16 decode experts' two kernels (`engine.ops.gpu.moe._experts_triton`) per launch setting
(`DecodeTiles`), at a preset's MoE shape, for batches of 1 to 16 tokens, beside the per-assignment
kernels they replaced (an expert read once per token that chose it, the repeats from L2 at best).

Session 27 (H200, e64 shape, bench/results/moe-tiles-*-s27*.json): per layer at batch 1 / 4 / 8 / 16,
the per-assignment kernels 25.2 / 54.9 / 89.7 / 144.3 us (2.2-3.2 TB/s of the distinct experts' bytes;
a copy of those bytes 15.3 / 43.2 / 63.7 / 87.3 us), the grouped ones (the default) 24.2 / 54.2 / 75.6 /
99.6. A grid of a few programs an SM looping over the work items (the last wave spread over every SM)
and other per-assignment tiles gained nothing (within 5%) and were not kept.

Each setting runs as a CUDA graph of one call per layer over LAYERS layers' own weights (every call's
experts come from HBM, as in a decode step: no layer's stacks fit the L2 beside the next's), the best of
three replays; per batch the distinct experts' bytes over the time (TB/s) beside a copy of as many bytes.
Each setting's output is checked against the default's (a sum in another order: within 2e-2 of the
largest). `--best` prints the `FT_MOE_TILES` value of the setting with the least time over the batches
named by `--score` (default 1, 4 and 8), for the decode benches to run it.

    python bench/moe_decode_tiles.py --preset qwen3.6-35b-a3b-e64 --json OUT.json   # on a GPU
    python bench/moe_decode_tiles.py --preset qwen3.6-35b-a3b --router --router-dtype float32   # the router's

`--router` times the fused router kernel per `RouterTiles` setting instead (session 12: 7 us a layer at
batch 1, ~8% of a Q4_K_M decode token; `FT_ROUTER_TILES` runs a setting in the engine); `--dense` the
decode step's plain projections at 2-16 rows, `engine.ops.gpu.dense` against cuBLAS (the engine runs
the former; `FT_SMALL_GEMM=0` the latter).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from functools import partial
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # bench/engine.py would shadow the `engine` package

import torch  # noqa: E402

from engine import presets  # noqa: E402
from engine.config import ModelConfig  # noqa: E402
from engine.ops.gpu import moe  # noqa: E402

LAYERS = 6
VARIANTS = {  # name: DecodeTiles fields changed from the default (the grouped kernels)
    "default": {},
    "per-assignment": {"grouped": 0},  # the kernels before session 27: an expert read once per token choosing it
    "warps-2": {"up_warps": 2, "down_warps": 2},
    "up_i-16": {"up_i": 16},
    "up_i-64": {"up_i": 64},
    "up_h-128": {"up_h": 128},
    "down_n-32": {"down_n": 32},
    "down_i-64": {"down_i": 64},
    "stages-2": {"stages": 2},
    "stages-4": {"stages": 4},
}
ROUTER_VARIANTS = {  # `--router`: RouterTiles fields changed from the default
    "default": {},
    "before-s28": {"warps": 4, "block_h": 1024},
    "warps-2": {"warps": 2},
    "block_h-1024": {"block_h": 1024},
    "block_e-1": {"block_e": 1},
    "block_e-4": {"block_e": 4},
}
TOKEN_LAYERS = 40  # `--router`, `--dense`: a decode token's calls, each its own weight (past the L2: 84 MB of f32 routers)


def timed_graph(fn, replays: int = 3) -> float:
    """Seconds of one replay of a graph of `fn` (captured after a warm call), the best of `replays`."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    best = float("inf")
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


def timed_calls(calls: list) -> tuple[float, list]:
    """Seconds a call of `calls` (one per layer, each over its own weights) run as one graph, and
    their outputs."""
    outs = [None] * len(calls)

    def run() -> None:
        for i, call in enumerate(calls):
            outs[i] = call()

    return timed_graph(run) / len(calls), outs


def routing(batch: int, experts: int, top_k: int, gen: torch.Generator) -> torch.Tensor:
    """[batch, top_k + 1]: each token's top_k distinct routed experts (uniform, as the random presets
    route), then the shared expert (folded in as expert `experts`)."""
    routed = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(batch)])
    return torch.cat([routed, torch.full((batch, 1), experts)], dim=1)


def bench_router(args, c: ModelConfig, dev: torch.device) -> list[dict]:
    """`_router_kernel` (the router's GEMV, then softmax and top-k in the last program) per RouterTiles
    setting: a CUDA graph of TOKEN_LAYERS calls over their own weights, per batch; the routing checked
    against the default's."""
    dtype = getattr(torch, args.router_dtype)
    gen = torch.Generator().manual_seed(1)
    weights = [(torch.randn(c.num_experts + 1, c.hidden_size, generator=gen) / 45).to(dev, dtype) for _ in range(TOKEN_LAYERS)]
    rows = []
    for batch in [int(b) for b in args.batches.split(",") if int(b) <= moe.ROUTER_ROWS]:
        x = torch.randn(batch, c.hidden_size, generator=gen).to(dev, torch.bfloat16)
        want = None
        for name, fields in ROUTER_VARIANTS.items():
            tiles = dataclasses.replace(moe.RouterTiles(), **fields)
            seconds, outs = timed_calls([partial(moe._router_triton, x, w, c.num_experts, c.num_experts_per_tok, True, tiles)
                                         for w in weights])  # fmt: skip
            ids = torch.stack([o[1] for o in outs])
            want = ids if want is None else want
            same = bool(torch.equal(ids, want))
            rows.append({"batch": batch, "variant": name, "tiles": dataclasses.asdict(tiles), "us": seconds * 1e6, "same_routing": same})
            print(f"router B={batch:>2} {name:<22} {seconds * 1e6:6.2f} us{'' if same else '  OTHER ROUTING'}", flush=True)
    return rows


def dense_shapes(c: ModelConfig) -> dict[str, tuple[int, int]]:
    """The decode step's plain projections (N, K): DeltaNet's fused in_proj and out_proj, attention's
    fused q (with its gate), k, v and o_proj."""
    keys, values = c.linear_num_key_heads * c.linear_key_head_dim, c.linear_num_value_heads * c.linear_value_head_dim
    q = c.num_attention_heads * c.head_dim
    return {"deltanet in_proj": (2 * keys + 2 * values + 2 * c.linear_num_value_heads, c.hidden_size),
            "deltanet out_proj": (c.hidden_size, values),
            "attention qkv": (2 * q + 2 * c.num_key_value_heads * c.head_dim, c.hidden_size),
            "attention o_proj": (c.hidden_size, q)}  # fmt: skip


def bench_dense(args, c: ModelConfig, dev: torch.device) -> list[dict]:
    """`engine.ops.gpu.dense.small_linear` against `F.linear` (cuBLAS) per projection and batch: a CUDA
    graph of TOKEN_LAYERS calls over their own bf16 weights, and the weight's bytes over the time."""
    import torch.nn.functional as F  # noqa: PLC0415

    from engine.ops.gpu import dense  # noqa: PLC0415

    gen = torch.Generator().manual_seed(2)
    rows = []
    for name, (n, k) in dense_shapes(c).items():
        weights = [(torch.randn(n, k, generator=gen) / 45).to(dev, torch.bfloat16) for _ in range(TOKEN_LAYERS)]
        for batch in [int(b) for b in args.batches.split(",") if 1 < int(b) <= dense.ROWS]:
            x = torch.randn(batch, k, generator=gen).to(dev, torch.bfloat16)
            times = {}
            for kernel, fn in (("cublas", F.linear), ("small", dense.small_linear)):
                times[kernel], outs = timed_calls([partial(fn, x, w) for w in weights])
                if kernel == "cublas":
                    want = torch.stack(outs).float()
            err = ((torch.stack(outs).float() - want).abs().max() / want.abs().max()).item()
            row = {"projection": name, "n": n, "k": k, "batch": batch, "split": dense.split_for(n, k), "max_rel_err": err,
                   **{f"{kernel}_us": t * 1e6 for kernel, t in times.items()},
                   **{f"{kernel}_tb_s": n * k * 2 / t / 1e12 for kernel, t in times.items()}}  # fmt: skip
            rows.append(row)
            print(f"{name:<18} B={batch:>2} [{n}, {k}]: cuBLAS {row['cublas_us']:6.2f} us ({row['cublas_tb_s']:.2f} TB/s), "
                  f"small {row['small_us']:6.2f} us ({row['small_tb_s']:.2f} TB/s, split {row['split']}), err {err:.1e}",
                  flush=True)  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3.6-35b-a3b-e64")
    parser.add_argument("--batches", default="1,2,4,8,16")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="names from VARIANTS")
    parser.add_argument("--score", default="1,4,8", help="batches whose summed time picks --best")
    parser.add_argument("--best", type=Path, help="write the best setting's FT_MOE_TILES value here")
    parser.add_argument("--router", action="store_true", help="time the fused router's settings instead")
    parser.add_argument("--router-dtype", default="bfloat16", help="the router weight's dtype (a GGUF's: float32)")
    parser.add_argument("--dense", action="store_true", help="time the small-batch projections against cuBLAS instead")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    dev = torch.device("cuda")
    c = ModelConfig.from_dict(presets.preset_config(args.preset))
    if args.router or args.dense:
        rows = bench_router(args, c, dev) if args.router else bench_dense(args, c, dev)
        if args.json:
            args.json.write_text(json.dumps({"preset": args.preset, "router_dtype": args.router_dtype, "dense": args.dense,
                                             "gpu": torch.cuda.get_device_name(), "rows": rows}, indent=1))  # fmt: skip
        return
    experts, hidden, inter, top_k = c.num_experts + 1, c.hidden_size, c.moe_intermediate_size, c.num_experts_per_tok
    gen = torch.Generator().manual_seed(0)
    layers = [((torch.randn(experts, 2 * inter, hidden, generator=gen) / 45).to(dev, torch.bfloat16),
               (torch.randn(experts, hidden, inter, generator=gen) / 23).to(dev, torch.bfloat16)) for _ in range(LAYERS)]  # fmt: skip
    expert_bytes = 3 * inter * hidden * 2
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        x = torch.randn(batch, hidden, generator=gen).to(dev, torch.bfloat16)
        ids = [routing(batch, experts - 1, top_k, gen).to(dev) for _ in range(LAYERS)]
        weights = torch.rand(batch, top_k + 1, generator=gen).to(dev, torch.bfloat16)
        distinct = sum(int(i.unique().numel()) for i in ids) / LAYERS
        nbytes = distinct * expert_bytes
        half = int(nbytes) // 2
        src, dst = torch.empty(2, half, dtype=torch.uint8, device=dev)  # a copy reading half, writing half
        copy = timed_graph(lambda src=src, dst=dst: [dst.copy_(src) for _ in range(LAYERS)]) / LAYERS
        want = None
        for name in args.variants.split(","):
            tiles = dataclasses.replace(moe.DecodeTiles(), **VARIANTS[name])
            seconds, outs = timed_calls([partial(moe._experts_triton, x, weights, ids_l, gu, dn, tiles)
                                         for (gu, dn), ids_l in zip(layers, ids, strict=True)])  # fmt: skip
            got = torch.stack(outs).float()
            want = got if want is None else want
            err = ((got - want).abs().max() / want.abs().max()).item()
            row = {"batch": batch, "variant": name, "tiles": dataclasses.asdict(tiles), "us": seconds * 1e6,
                   "distinct_experts": distinct, "tb_s": nbytes / seconds / 1e12, "copy_us": copy * 1e6, "max_rel_err": err}  # fmt: skip
            rows.append(row)
            flag = "" if err < 2e-2 else "  WRONG"
            print(f"B={batch:>2} {name:<28} {seconds * 1e6:7.1f} us  {row['tb_s']:.2f} TB/s of {distinct:.1f} distinct "
                  f"experts (copy {copy * 1e6:.1f} us)  err {err:.1e}{flag}", flush=True)  # fmt: skip
    score = [int(b) for b in args.score.split(",")]
    totals = {}
    for row in rows:
        if row["batch"] in score and row["max_rel_err"] < 2e-2:
            totals[row["variant"]] = totals.get(row["variant"], 0.0) + row["us"]
    best = min(totals, key=totals.get)
    print(f"best over batches {args.score}: {best} ({totals[best]:.1f} us against the default's {totals['default']:.1f})")
    if args.best:
        fields = {**dataclasses.asdict(moe.DecodeTiles()), **VARIANTS[best]}
        args.best.write_text(",".join(f"{k}={v}" for k, v in fields.items()))
    if args.json:
        args.json.write_text(json.dumps({"preset": args.preset, "gpu": torch.cuda.get_device_name(), "rows": rows,
                                         "best": best, "score_batches": score}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
