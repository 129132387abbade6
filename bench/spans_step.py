"""A step that prefills several sequences at once (e.g. four sessions' tool results landing together):
their conv in one launch and their scan as fla's varlen rounds (the default) against the conv and
the scan run sequence by sequence (the kernels' per-sequence path), in the same process.

    FT_MATERIALISE=1 python bench/spans_step.py --preset qwen3.6-35b-a3b-e64 --json out.json

Each case is a step over N new sequences of `length` tokens, each with `captures` capture points
(a conversation's anchors); lengths start above the largest captured prefill bucket (shorter ones
run as slot graphs, not in one forward). Prints a table (median ms a step over --reps; the host's
time to enqueue the step beside it) and writes JSON."""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import functools
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402

from engine import Engine, Feed  # noqa: E402
from engine.ops import conv, deltanet  # noqa: E402


def per_sequence(kernels):
    """The bundle with the spans ops running its own single-sequence conv and scan one by one."""
    return dataclasses.replace(
        kernels,
        causal_conv_spans=functools.partial(conv.causal_conv_spans, conv=kernels.causal_conv),
        chunk_gated_delta_rule_spans=functools.partial(deltanet.chunk_gated_delta_rule_spans,
                                                       scan=kernels.chunk_gated_delta_rule),
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3.6-35b-a3b-e64")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--cases", default="2x600x0,4x600x0,4x600x2,8x600x0,4x2048x2",
                        help="sequences x tokens x captures, comma-separated")  # fmt: skip
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--hold", action="store_true",
                        help="keep every step's snapshots (as the store's RAM tier does), not free them")
    parser.add_argument("--profile", action="store_true", help="then profile one varlen step of the last case")
    parser.add_argument("--profile-cold", action="store_true",
                        help="profile the first case's first (cold) varlen step: ops by host and by device time")
    parser.add_argument("--cprofile", action="store_true",
                        help="then one warm varlen step of each case under cProfile: the host's Python by function")
    parser.add_argument("--warmup", action="store_true",
                        help="warm the engine up as `ft serve` does first, and report each case's first step (cold)")
    args = parser.parse_args()
    eng = Engine.from_preset(args.preset, device=args.device)
    if args.warmup:
        start = time.perf_counter()
        eng.warmup(max_batch=4)
        print(f"warm-up {time.perf_counter() - start:.1f} s", flush=True)
    kernels = {"varlen": eng.kernels, "per sequence": per_sequence(eng.kernels)}
    sync = torch.cuda.synchronize if eng.device.type == "cuda" else (lambda: None)
    held: list = []

    def timed(name: str, count: int, length: int, captures: int) -> tuple[float, float]:
        eng.kernels = kernels[name]
        cuts = [length * (i + 1) // (captures + 1) for i in range(captures)]
        feeds = [Feed(eng.new_state(), [(5000 + 31 * s + j) % 50_000 for j in range(length)], capture_at=cuts)
                 for s in range(count)]  # fmt: skip
        sync()
        start = time.perf_counter()
        eng.step([(f, length) for f in feeds])
        queued = time.perf_counter()
        sync()
        end = time.perf_counter()
        for f in feeds:
            f.result.ready()
            if args.hold:
                held.append(f.result.snapshots)
        return (end - start) * 1e3, (queued - start) * 1e3

    rows = []
    for case in args.cases.split(","):
        count, length, captures = (int(x) for x in case.split("x"))
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in kernels}
        if args.profile_cold and not rows:
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=activities) as prof:
                cold_ms = timed("varlen", count, length, captures)[0]
            print(f"first varlen step of {case}, profiled: {cold_ms:.1f} ms")
            for key in ("self_cpu_time_total", "self_device_time_total"):
                print(prof.key_averages().table(sort_by=key, row_limit=25), flush=True)
        cold = {name: timed(name, count, length, captures)[0] for name in kernels}  # kernels specialised for these shapes
        for _ in range(args.reps):  # interleaved, so drift hits every case alike
            for name in kernels:
                times[name].append(timed(name, count, length, captures))
        row = {"sequences": count, "tokens": length, "captures": captures, "first varlen step": cold["varlen"]}
        for name, t in times.items():
            row[name] = statistics.median(w for w, _ in t)
            row[f"{name} host"] = statistics.median(h for _, h in t)
        row["per sequence / varlen"] = row["per sequence"] / row["varlen"]
        if args.cprofile:  # where a warm step's host time goes, by Python function (cumulative and own)
            profiler = cProfile.Profile()
            profiler.enable()
            timed("varlen", count, length, captures)
            profiler.disable()
            print(f"varlen step of {case} under cProfile:")
            for key in ("cumulative", "tottime"):
                pstats.Stats(profiler).sort_stats(key).print_stats(25)
        if eng.runtime is not None:  # pinned slabs the captures were cut from, all cases so far
            row["pinned slabs"] = len(eng.runtime.transfers.slabs.slabs)
        rows.append(row)
        print(json.dumps(row), flush=True)
    eng.kernels = kernels["varlen"]
    device = torch.cuda.get_device_name() if eng.device.type == "cuda" else "cpu"
    print(f"\n{args.preset} on {device}: one step prefilling N new sequences, median ms over {args.reps}\n")
    print("| sequences x tokens | captures each | varlen | per sequence | per sequence / varlen | host: varlen "
          "| host: per sequence | first varlen step |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['sequences']} x {r['tokens']} | {r['captures']} | {r['varlen']:.1f} | {r['per sequence']:.1f} "
              f"| {r['per sequence / varlen']:.3f} | {r['varlen host']:.1f} | {r['per sequence host']:.1f} "
              f"| {r['first varlen step']:.1f} |")
    if args.json:
        args.json.write_text(json.dumps({"preset": args.preset, "device": device, "hold": args.hold, "rows": rows},
                                        indent=1))  # fmt: skip
    if args.profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            timed("varlen", count, length, captures)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))


if __name__ == "__main__":
    main()
