"""GPU benchmark at the 35B-A3B preset (bf16 weights built in GPU memory), against the machine's
own ceilings measured in the same run: a large bf16 matmul, a device-to-device copy (bytes read +
written) and a pinned host-to-device copy.

    FT_MATERIALISE=1 python bench/gpu.py [--contexts 2048,8192,32768] [--json bench/gpu.json]

Prints one table per part and writes all numbers to JSON (and a markdown table with --markdown).
Ratios: prefill FLOP/s (2 x active matmul params per token + causal attention) over the matmul
rate; decode bytes/s (active weights + KV + recurrent state read per token) over the copy rate;
restore bytes/s over the pinned host-to-device rate.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from engine import Engine, Feed, SamplingParams
from engine.config import ModelConfig

GIB = 1 << 30


def cuda_time(fn, warmup: int = 2, repeat: int = 10) -> float:
    """Median seconds of `fn` on the device, by CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def wall(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


# -- ceilings


def ceilings() -> dict[str, float]:
    n = 8192
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    matmul = 2 * n**3 / cuda_time(lambda: a @ b, warmup=3, repeat=20)
    src = torch.randn(GIB // 2, device="cuda", dtype=torch.bfloat16)  # 1 GiB
    dst = torch.empty_like(src)
    d2d = 2 * src.numel() * 2 / cuda_time(lambda: dst.copy_(src))
    pinned = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
    pinned.copy_(src)
    h2d = src.numel() * 2 / cuda_time(lambda: src.copy_(pinned, non_blocking=True), repeat=5)
    d2h = src.numel() * 2 / cuda_time(lambda: pinned.copy_(src, non_blocking=True), repeat=5)
    pageable = pinned.clone()  # plain (pageable) host memory
    h2d_pageable = src.numel() * 2 / cuda_time(lambda: src.copy_(pageable), warmup=1, repeat=3)
    return {
        "matmul_bf16_flops": matmul,
        "d2d_bytes_per_s": d2d,
        "h2d_pinned_bytes_per_s": h2d,
        "d2h_pinned_bytes_per_s": d2h,
        "h2d_pageable_bytes_per_s": h2d_pageable,
    }


# -- what the model must do per token


def matmul_params(c: ModelConfig) -> int:
    """Weights multiplied per token (routed experts: only the top-k), excluding the embedding."""
    h = c.hidden_size
    attn = h * c.num_attention_heads * c.head_dim * 2 + 2 * h * c.num_key_value_heads * c.head_dim
    attn += c.num_attention_heads * c.head_dim * h
    gdn = h * (c.conv_dim + c.linear_value_dim + 2 * c.linear_num_value_heads) + c.linear_value_dim * h
    expert = 3 * h * c.moe_intermediate_size
    moe = c.num_experts * h + c.num_experts_per_tok * expert + 3 * h * c.shared_expert_intermediate_size + h
    layers = len(c.attention_layers) * attn + len(c.deltanet_layers) * gdn + c.num_hidden_layers * moe
    return layers + c.vocab_size * h


def prefill_flops(c: ModelConfig, start: int, tokens: int) -> float:
    """2 x matmul params per token (lm_head once: only the last position's logits are computed),
    plus causal attention QK^T and PV (2 * 2 * Hq * D per visible key)."""
    per_token = 2 * (matmul_params(c) - c.vocab_size * c.hidden_size)
    visible = tokens * start + tokens * (tokens + 1) / 2
    attn = len(c.attention_layers) * 4 * c.num_attention_heads * c.head_dim * visible
    return per_token * tokens + 2 * c.vocab_size * c.hidden_size + attn


def decode_bytes(c: ModelConfig, context: int, weight_bytes: int = 2) -> float:
    kv = len(c.attention_layers) * 2 * context * c.num_key_value_heads * c.head_dim * weight_bytes
    state = (
        len(c.deltanet_layers)
        * 2
        * 4
        * c.linear_num_value_heads
        * c.linear_key_head_dim
        * c.linear_value_head_dim
    )
    return matmul_params(c) * weight_bytes + kv + state


# -- the engine


def ids_for(n: int, seed: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(248_000) for _ in range(n)]


def bench_prefill(eng: Engine, contexts: list[int], ceil: dict) -> list[dict]:
    rows = []
    for ctx in contexts:
        ids = ids_for(ctx, ctx)
        seconds = min(
            wall(lambda ids=ids: eng.prefill(eng.new_state(), ids)) for _ in range(2 if ctx <= 8192 else 1)
        )
        flops = prefill_flops(eng.config, 0, ctx)
        rows.append(
            {
                "context": ctx,
                "seconds": seconds,
                "tok_s": ctx / seconds,
                "tflops": flops / seconds / 1e12,
                "ratio_matmul": flops / seconds / ceil["matmul_bf16_flops"],
            }
        )
        print(
            f"prefill {ctx}: {seconds * 1e3:.1f} ms, {ctx / seconds:.0f} tok/s, {rows[-1]['ratio_matmul']:.1%} of matmul",
            flush=True,
        )
    return rows


def bench_capture(eng: Engine, ctx: int, captures: int) -> dict:
    ids = ids_for(ctx, 1)
    step = ctx // captures
    positions = list(range(step, ctx + 1, step))[:captures]
    eng.prefill(eng.new_state(), ids, capture_at=positions)  # pinned host blocks get cached
    plain = min(wall(lambda: eng.prefill(eng.new_state(), ids)) for _ in range(2))
    result = {}
    captured = min(
        wall(lambda: result.update(r=eng.prefill(eng.new_state(), ids, capture_at=positions)))
        for _ in range(2)
    )
    nbytes = sum(s.nbytes for s in result["r"].snapshots)
    row = {
        "context": ctx,
        "captures": captures,
        "plain_s": plain,
        "captured_s": captured,
        "overhead": captured / plain - 1,
        "snapshot_bytes": nbytes,
    }
    print(
        f"capture: {captures} at {ctx}: {plain * 1e3:.1f} -> {captured * 1e3:.1f} ms ({row['overhead']:+.1%}), "
        f"{nbytes / GIB:.2f} GiB to host",
        flush=True,
    )
    return row


def bench_restore(eng: Engine, ctx: int, ceil: dict, suffix: int = 512) -> dict:
    ids = ids_for(ctx + suffix, 2)
    snap = eng.prefill(eng.new_state(), ids[:ctx], capture_at=[ctx]).snapshots[0]

    def restore_only():
        eng.restore(snap).wait_all()

    seconds = statistics.median(wall(restore_only) for _ in range(5))
    pageable = type(snap)(
        snap.start, snap.end, {n: t.clone() for n, t in snap.tensors.items()}
    )  # plain host memory
    seconds_pageable = statistics.median(wall(lambda: eng.restore(pageable).wait_all()) for _ in range(3))
    states = [eng.restore(snap) for _ in range(3)]
    for s in states:
        s.wait_all()
    torch.cuda.synchronize()
    suffix_only = statistics.median(wall(lambda s=s: eng.prefill(s, ids[ctx:])) for s in states)
    together = statistics.median(wall(lambda: eng.prefill(eng.restore(snap), ids[ctx:])) for _ in range(3))
    row = {
        "context": ctx,
        "bytes": snap.nbytes,
        "restore_s": seconds,
        "bytes_per_s": snap.nbytes / seconds,
        "ratio_h2d": snap.nbytes / seconds / ceil["h2d_pinned_bytes_per_s"],
        "restore_pageable_s": seconds_pageable,
        "suffix": suffix,
        "suffix_prefill_s": suffix_only,
        "restore_plus_suffix_s": together,
        "hidden_s": seconds + suffix_only - together,
    }
    print(
        f"restore {ctx}: {snap.nbytes / GIB:.2f} GiB in {seconds * 1e3:.1f} ms ({row['ratio_h2d']:.0%} of pinned H2D); "
        f"pageable {seconds_pageable * 1e3:.1f} ms; +{suffix} suffix: {suffix_only * 1e3:.1f} ms alone, "
        f"{together * 1e3:.1f} ms restore+suffix",
        flush=True,
    )
    return row


def bench_decode(eng: Engine, ctx: int, steps: int, ceil: dict) -> dict:
    state = eng.new_state()
    logits = eng.prefill(state, ids_for(ctx, 3)).logits
    forced = ids_for(steps, 4)
    list(eng.generate(state, logits, SamplingParams(), forced=forced[:8]))  # capture the graph
    torch.cuda.synchronize()
    start = time.perf_counter()
    list(eng.generate(state, logits, SamplingParams(), forced=forced))
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / (steps - 1)  # the last forced token is not fed
    nbytes = decode_bytes(eng.config, ctx + steps // 2)
    row = {
        "context": ctx,
        "steps": steps,
        "ms_per_token": seconds * 1e3,
        "tok_s": 1 / seconds,
        "bytes_per_token": nbytes,
        "ratio_copy": nbytes / seconds / ceil["d2d_bytes_per_s"],
    }
    print(
        f"decode at {ctx}: {1 / seconds:.1f} tok/s ({seconds * 1e3:.2f} ms), {row['ratio_copy']:.0%} of copy bandwidth",
        flush=True,
    )
    return row


def bench_batched_decode(eng: Engine, ctx: int, batches: list[int], steps: int) -> list[dict]:
    """B sequences at `ctx` tokens decoded together, one engine step (one graph replay of the
    batch bucket) per token of each: tokens/s per sequence and in aggregate."""
    rows = []
    for batch in batches:
        states = [eng.new_state() for _ in range(batch)]
        for i, state in enumerate(states):
            eng.prefill(state, ids_for(ctx, 10 + i))

        def run(n: int, states=states) -> None:
            for t in range(n):
                eng.step([(Feed(s, [1000 + t + i]), 1) for i, s in enumerate(states)])

        run(4)
        torch.cuda.synchronize()
        start = time.perf_counter()
        run(steps)
        torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / steps
        rows.append(
            {
                "batch": batch,
                "context": ctx,
                "ms_per_step": seconds * 1e3,
                "tok_s_per_sequence": 1 / seconds,
                "tok_s_aggregate": batch / seconds,
            }
        )
        print(
            f"batched decode B={batch} at {ctx}: {seconds * 1e3:.2f} ms/step, {batch / seconds:.1f} tok/s in all",
            flush=True,
        )
        del states
    for row in rows:
        row["aggregate_vs_batch1"] = row["tok_s_aggregate"] / rows[0]["tok_s_aggregate"]
    return rows


def exactness(eng: Engine, ctx: int) -> dict:
    """Restore at a random split + suffix vs one full prefill, at this preset in bf16."""
    ids = ids_for(ctx, 5)
    split = random.Random(6).randrange(ctx // 4, ctx - 16)
    full = eng.prefill(eng.new_state(), ids).logits
    snap = eng.prefill(eng.new_state(), ids[:split], capture_at=[split]).snapshots[0]
    rest = eng.prefill(eng.restore(snap), ids[split:]).logits
    err = ((rest.double() - full.double()).norm() / full.double().norm()).item()
    top2 = full.topk(2).values
    row = {
        "context": ctx,
        "split": split,
        "rel_err": err,
        "max_abs": (rest - full).abs().max().item(),
        "top2_margin": (top2[0] - top2[1]).item(),
        "same_greedy": int(rest.argmax()) == int(full.argmax()),
    }
    print(
        f"exactness at {ctx} split {split}: rel {err:.2e}, max abs {row['max_abs']:.3f}, margin {row['top2_margin']:.3f}, "
        f"same greedy {row['same_greedy']}",
        flush=True,
    )
    return row


MOVES = (
    "aten::copy_",
    "aten::cat",
    "aten::index_select",
    "aten::index_copy_",
    "aten::gather",
)  # data movement


def profile_prefill(eng: Engine, ctx: int, top: int = 18, host_top: int = 0) -> list[dict]:
    """The kernels of one `ctx` prefill by self CUDA time; with `host_top`, also the host's operators
    by self CPU time (rows with "host": True), where a prefill's wall time exceeds its device time,
    and the copies and concatenations by the engine's source lines that made them (rows with "moves")."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    ids = ids_for(ctx, 7)
    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if host_top else [])
    stacks = (
        torch._C._profiler._ExperimentalConfig(verbose=True) if host_top else None
    )  # (without: no frames)
    with profile(activities=activities, with_stack=bool(host_top), experimental_config=stacks) as prof:
        eng.prefill(eng.new_state(), ids)
        torch.cuda.synchronize()
    events = prof.key_averages()
    total = sum(e.self_device_time_total for e in events)
    rows = [
        {
            "kernel": e.key[:90],
            "ms": e.self_device_time_total / 1e3,
            "share": e.self_device_time_total / total,
            "calls": e.count,
        }
        for e in sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:top]
    ]
    print(f"profile of one {ctx} prefill (self CUDA time, total {total / 1e3:.1f} ms):")
    for r in rows:
        print(f"  {r['ms']:8.2f} ms {r['share']:6.1%} x{r['calls']:<5} {r['kernel']}")
    if host_top:
        host = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:host_top]
        print(
            f"host operators (self CPU time, total {sum(e.self_cpu_time_total for e in events) / 1e3:.1f} ms):"
        )
        for e in host:
            rows.append(
                {"kernel": e.key[:90], "ms": e.self_cpu_time_total / 1e3, "calls": e.count, "host": True}
            )
            print(f"  {e.self_cpu_time_total / 1e3:8.2f} ms x{e.count:<5} {e.key[:90]}")
        moves: dict[
            tuple[str, str], list
        ] = {}  # (op, the engine's frames) -> [device us, calls], layers summed
        for e in prof.key_averages(group_by_stack_n=8):
            if e.key in MOVES:
                where = " < ".join([f for f in e.stack if "engine/" in f or "fla/" in f][:3])
                total = moves.setdefault((e.key, where), [0.0, 0])
                total[0] += e.device_time_total
                total[1] += e.count
        print("copies and concatenations by where the engine made them (device time):")
        for (op, where), (us, calls) in sorted(moves.items(), key=lambda kv: kv[1][0], reverse=True)[
            :host_top
        ]:
            rows.append({"kernel": op, "ms": us / 1e3, "calls": calls, "moves": where})
            print(f"  {us / 1e3:8.2f} ms x{calls:<5} {op} {where}")
        rows += profile_host(lambda: eng.prefill(eng.new_state(), ids), host_top)
    return rows


def profile_host(run, top: int) -> list[dict]:
    """The Python functions one `run` spends its host time in (cProfile, by own time; its overhead
    inflates every figure alike): where a host-bound prefill's wall time goes between launches."""
    import cProfile  # noqa: PLC0415
    import pstats  # noqa: PLC0415

    torch.cuda.synchronize()
    with cProfile.Profile() as prof:
        run()
        torch.cuda.synchronize()
    stats = pstats.Stats(
        prof
    ).stats  # (file, line, name) -> (calls, primitive calls, own s, cumulative s, callers)
    ranked = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    total = sum(v[2] for v in stats.values())
    print(f"host Python by own time (cProfile, total {total * 1e3:.1f} ms):")
    rows = []
    for (file, line, name), (calls, _, own, cumulative, _) in ranked:
        where = f"{'/'.join(file.split('/')[-2:])}:{line} {name}"
        rows.append({"python": where, "ms": own * 1e3, "cumulative_ms": cumulative * 1e3, "calls": calls})
        print(f"  {own * 1e3:8.2f} ms (cum {cumulative * 1e3:8.2f}) x{calls:<6} {where}")
    return rows


def profile_decode(eng: Engine, ctx: int, top: int = 12) -> dict:
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    from engine.runner import Runner  # noqa: PLC0415

    eager = Runner(eng.model, eng.kernels, use_graph=False)  # the graph's kernels, launched one by one
    state = eng.new_state()
    eng.prefill(state, ids_for(ctx, 8))
    eager.decode([state], [5])
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for t in range(4):
            eager.decode([state], [t])
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: e.self_device_time_total, reverse=True)
    total = sum(e.self_device_time_total for e in events)
    launches = sum(e.count for e in events) / 4  # what a graph replay still runs one after another
    rows = [
        {
            "kernel": e.key[:90],
            "ms_per_token": e.self_device_time_total / 4e3,
            "share": e.self_device_time_total / total,
        }
        for e in events[:top]
    ]
    print(
        f"profile of eager decode steps at {ctx} (self CUDA time per token, total {total / 4e3:.2f} ms, "
        f"{launches:,.0f} kernels per token):"
    )
    for r in rows:
        print(f"  {r['ms_per_token']:7.3f} ms {r['share']:6.1%} {r['kernel']}")
    return {"kernels_per_token": launches, "ms_per_token": total / 4e3, "top": rows}


def fast_kernel_verdicts() -> dict[str, bool | None]:
    """Which Triton kernels passed their first-use check against plain torch (engine.ops.gpu.checked):
    every `Checked` of the GPU kernel modules (None: never called)."""
    import dataclasses  # noqa: PLC0415

    from engine.ops.gpu import KERNELS, conv, gates, moe, norm  # noqa: PLC0415
    from engine.ops.gpu.checked import Checked  # noqa: PLC0415

    bundled = [
        getattr(KERNELS, f.name) for f in dataclasses.fields(KERNELS)
    ]  # made per bundle, as the slotted step
    checked = [v for m in (conv, gates, moe, norm) for v in vars(m).values()] + bundled
    return {c.name: c.verdict for c in checked if isinstance(c, Checked)}


def markdown(result: dict) -> str:
    c = result["ceilings"]
    lines = [
        f"Command: `{result['command']}`  ",
        f"Date: {result['date']}; device: {result['device']}; torch {result['torch']}; preset {result['preset']} (bf16, materialised on the GPU)",
        "",
        "| ceiling | measured |",
        "| --- | --- |",
        f"| bf16 matmul 8192³ | {c['matmul_bf16_flops'] / 1e12:.0f} TFLOP/s |",
        f"| device-to-device copy (read + write) | {c['d2d_bytes_per_s'] / 1e12:.2f} TB/s |",
        f"| pinned host-to-device | {c['h2d_pinned_bytes_per_s'] / 1e9:.1f} GB/s |",
        f"| pinned device-to-host | {c['d2h_pinned_bytes_per_s'] / 1e9:.1f} GB/s |",
        f"| pageable host-to-device | {c['h2d_pageable_bytes_per_s'] / 1e9:.1f} GB/s |",
        "",
        "| measure | result | vs ceiling | target |",
        "| --- | --- | --- | --- |",
    ]
    for r in result["prefill"]:
        target = " ≥ 25%" if r["context"] == 8192 else ""
        lines.append(
            f"| prefill {r['context']} | {r['tok_s']:.0f} tok/s ({r['seconds'] * 1e3:.0f} ms, {r['tflops']:.0f} TFLOP/s) "
            f"| {r['ratio_matmul']:.1%} of matmul |{target} |"
        )
    for r in result["decode"]:
        lines.append(
            f"| decode batch 1 at {r['context']} | {r['tok_s']:.0f} tok/s ({r['ms_per_token']:.2f} ms/token, "
            f"{r['bytes_per_token'] / 1e9:.2f} GB/token) | {r['ratio_copy']:.1%} of copy | ≥ 40% |"
        )
    cap = result["capture"]
    lines.append(
        f"| capture overhead, {cap['captures']} states at {cap['context']} | {cap['overhead']:+.1%} "
        f"({cap['plain_s'] * 1e3:.0f} → {cap['captured_s'] * 1e3:.0f} ms, {cap['snapshot_bytes'] / GIB:.2f} GiB to pinned host) | | |"
    )
    for r in result["restore"]:
        lines.append(
            f"| restore {r['context']} from pinned host | {r['restore_s'] * 1e3:.1f} ms ({r['bytes'] / GIB:.2f} GiB, "
            f"{r['bytes_per_s'] / 1e9:.1f} GB/s) | {r['ratio_h2d']:.0%} of pinned H2D | ≥ 70% |"
        )
        lines.append(
            f"| restore {r['context']} + {r['suffix']}-token suffix | {r['restore_plus_suffix_s'] * 1e3:.1f} ms "
            f"(suffix alone {r['suffix_prefill_s'] * 1e3:.1f} ms; pageable restore {r['restore_pageable_s'] * 1e3:.1f} ms) | | |"
        )
    e = result["exactness"]
    lines.append(
        f"| exactness, restore at {e['split']} + suffix vs full {e['context']} | rel {e['rel_err']:.1e}, "
        f"max abs {e['max_abs']:.3f}, top-2 margin {e['top2_margin']:.3f}, same greedy: {e['same_greedy']} | | |"
    )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="qwen3.6-35b-a3b")
    parser.add_argument("--contexts", default="2048,8192,32768")
    parser.add_argument("--restore", default="8192,32768")
    parser.add_argument("--decode", default="8192,32768")
    parser.add_argument("--decode-steps", type=int, default=128)
    parser.add_argument("--captures", type=int, default=8)
    parser.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        help="tokens of one prefill forward (default: the device's)",
    )
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--batches", default="1,4,8,16", help="batched decode: sequences decoded together")
    parser.add_argument(
        "--only",
        default="",
        help="comma list of parts to run (prefill,capture,restore,decode,batched,exactness); default all",
    )
    parser.add_argument("--json", type=Path, default=Path("bench/gpu.json"))
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args()
    os.environ.setdefault("FT_MATERIALISE", "1")
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731

    ceil = ceilings()
    print({k: f"{v:.3e}" for k, v in ceil.items()}, flush=True)
    start = time.perf_counter()
    eng = Engine.from_preset(args.preset, device="cuda", prefill_chunk=args.prefill_chunk)
    print(
        f"materialised {args.preset} in {time.perf_counter() - start:.1f} s; kernels {eng.kernels.name}; "
        f"{torch.cuda.memory_allocated() / GIB:.1f} GiB on the GPU",
        flush=True,
    )
    eng.prefill(eng.new_state(), ids_for(2048, 0))  # compile / autotune
    result = {
        "command": " ".join(["python", *sys.argv]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "preset": args.preset,
        "ceilings": ceil,
        "matmul_params_per_token": matmul_params(eng.config),
        "prefill_chunk": eng.engine_config.chunk_tokens,
    }
    parts = (
        set(args.only.split(","))
        if args.only
        else {"prefill", "capture", "restore", "decode", "batched", "exactness"}
    )
    if "prefill" in parts:
        result["prefill"] = bench_prefill(eng, ints(args.contexts), ceil)
    if "capture" in parts:
        result["capture"] = bench_capture(eng, 8192, args.captures)
    if "restore" in parts:
        result["restore"] = [bench_restore(eng, ctx, ceil) for ctx in ints(args.restore)]
    if "decode" in parts:
        result["decode"] = [bench_decode(eng, ctx, args.decode_steps, ceil) for ctx in ints(args.decode)]
        from timeline import decode_timeline, show  # noqa: PLC0415

        result["decode_timeline"] = decode_timeline(eng, ids_for(8192, 3))  # host, launch, device per token
        show("decode at 8192", result["decode_timeline"])
    if "batched" in parts:
        result["batched_decode"] = bench_batched_decode(eng, 8192, ints(args.batches), 32)
    if "exactness" in parts:
        result["exactness"] = exactness(eng, 8192)
    if args.profile:
        result["profile_prefill_8k"] = profile_prefill(eng, 8192)
        result["profile_decode"] = profile_decode(eng, 8192)
    result["fast_kernels"] = fast_kernel_verdicts()
    print("fast kernels in use:", result["fast_kernels"], flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    table = (
        markdown(result) if not args.only else json.dumps(result.get("batched_decode"), indent=1)
    )  # the table needs every part
    if args.markdown:
        args.markdown.write_text(table)
    print(table)


if __name__ == "__main__":
    main()
