"""A step that decodes B running sequences while another sequence prefills a chunk: one forward over
both (`engine.batch.Mixed`, the default) against the decode step and the prefill forward apart
(FT_MIXED_STEPS=0's path), in the same process; the prefill alone and the decode step alone beside.

    FT_MATERIALISE=1 python bench/mixed_step.py --preset qwen3.6-35b-a3b-e64 --batch 4 --json out.json

Chunks start above the largest captured prefill bucket (shorter ones run as slot graphs beside the
decode graph, not in a mixed forward). Prints a table (median ms a step over --reps) and writes JSON."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import engine.engine as engine_module
from engine import Engine, Feed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3.6-35b-a3b-e64")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=4, help="decoding sequences (default 4)")
    parser.add_argument("--context", type=int, default=2048, help="their tokens before the steps")
    parser.add_argument("--chunks", default="600,2048,8192", help="prefill chunk sizes (tokens)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    eng = Engine.from_preset(args.preset, device=args.device)
    states = [eng.new_state() for _ in range(args.batch)]
    for i, state in enumerate(states):
        eng.prefill(state, [1000 + (i * 7919 + j) % 50_000 for j in range(args.context)])
    sync = torch.cuda.synchronize if eng.device.type == "cuda" else (lambda: None)
    token = iter(range(3000, 1 << 30))

    def timed(mixed: bool, chunk: int, decode: bool = True, prefill: bool = True) -> float:
        engine_module.MIXED_STEPS = mixed
        parts = [(Feed(s, [next(token) % 50_000]), 1) for s in states] if decode else []
        if prefill:
            parts.append((Feed(eng.new_state(), [(5000 + j) % 50_000 for j in range(chunk)]), chunk))
        sync()
        start = time.perf_counter()
        eng.step(parts)
        sync()
        return (time.perf_counter() - start) * 1e3

    rows = []
    for chunk in (int(c) for c in args.chunks.split(",")):
        cases = {"mixed": dict(mixed=True), "apart": dict(mixed=False),
                 "prefill alone": dict(mixed=True, decode=False), "decode alone": dict(mixed=True, prefill=False)}
        times: dict[str, list[float]] = {name: [] for name in cases}
        for kw in cases.values():
            timed(chunk=chunk, **kw)  # untimed: kernels specialised for this chunk
        for _ in range(args.reps):  # interleaved, so drift hits every case alike
            for name, kw in cases.items():
                times[name].append(timed(chunk=chunk, **kw))
        row = {"chunk": chunk, **{name: statistics.median(t) for name, t in times.items()}}
        row["apart / mixed"] = row["apart"] / row["mixed"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    engine_module.MIXED_STEPS = True
    device = torch.cuda.get_device_name() if eng.device.type == "cuda" else "cpu"
    print(f"\n{args.preset} on {device}: {args.batch} sequences decoding at ~{args.context} tokens, "
          f"median ms a step over {args.reps}\n")
    print("| prefill chunk | mixed (one forward) | apart (decode step + prefill forward) | apart / mixed "
          "| prefill alone | decode alone |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['chunk']} | {r['mixed']:.1f} | {r['apart']:.1f} | {r['apart / mixed']:.3f} "
              f"| {r['prefill alone']:.1f} | {r['decode alone']:.1f} |")
    if args.json:
        args.json.write_text(json.dumps({"preset": args.preset, "device": device, "batch": args.batch,
                                         "context": args.context, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
