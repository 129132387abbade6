"""Where the time of a short suffix prefill goes (the anchor policy's common case: a tool result
of ~100 tokens after a restored 8K state): wall time per phase, then the top ops.

    FT_MATERIALISE=1 python bench/profile_suffix.py --preset qwen3.6-35b-a3b --device cuda
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # bench/engine.py would shadow the package

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from engine import Engine  # noqa: E402


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--new", type=int, default=128)
    args = parser.parse_args()
    engine = Engine.from_preset(args.preset, device=args.device)
    engine.warmup()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 200_000, (args.context + args.new,), generator=gen).tolist()
    base = engine.prefill(engine.new_state(), ids[: args.context], capture_at=[args.context]).snapshots
    timings = {}
    for phase in range(3):
        sync(args.device)
        t0 = time.perf_counter()
        state = engine.restore(base)
        sync(args.device)
        t1 = time.perf_counter()
        engine.prefill(state, ids[args.context :])
        sync(args.device)
        t2 = time.perf_counter()
        engine.prefill(engine.restore(base), ids[args.context :], capture_at=[args.context + args.new])
        sync(args.device)
        t3 = time.perf_counter()
        timings = {"restore_ms": 1e3 * (t1 - t0), "suffix_prefill_ms": 1e3 * (t2 - t1),
                   "restore+prefill+capture_ms": 1e3 * (t3 - t2)}
        print(f"run {phase}: " + ", ".join(f"{k} {v:.1f}" for k, v in timings.items()), flush=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with profile(activities=activities) as prof:
        engine.prefill(engine.restore(base), ids[args.context :])
        sync(args.device)
    key = "self_cuda_time_total" if args.device == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=18, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))


if __name__ == "__main__":
    main()
