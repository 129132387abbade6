"""Where a batched decode step's time goes: B sequences at a context, one engine step each token.

    FT_MATERIALISE=1 python bench/profile_batch.py --preset qwen3.6-35b-a3b-e64 --batch 4

Prints the step time over several warm-up lengths, then the torch profiler's top ops by host time
and by device time for a few steps."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from engine import Engine, Feed  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="qwen3.6-35b-a3b-e64")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    eng = Engine.from_preset(args.preset, device="cuda")
    states = [eng.new_state() for _ in range(args.batch)]
    for i, state in enumerate(states):
        eng.prefill(state, [1000 + (i * 7919 + j) % 50_000 for j in range(args.context)])

    def steps(n: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for t in range(n):
            eng.step([(Feed(s, [2000 + t + i]), 1) for i, s in enumerate(states)])
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / n * 1e3

    for n in (1, 4, 16, 16):
        print(f"B={args.batch}: {steps(n):.2f} ms/step over {n} steps", flush=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        steps(3)
    table = prof.key_averages()
    print(table.table(sort_by="cpu_time_total", row_limit=args.top, max_name_column_width=60))
    print(table.table(sort_by="self_cuda_time_total", row_limit=args.top, max_name_column_width=60))


if __name__ == "__main__":
    main()
