"""Host time of one offloaded MoE layer's decode step (`ExpertCache.run`): choosing the experts,
evicting, issuing the copies, at the 35B-A3B shape's routing (256 experts, top 8), per slot count
and per number of parts an expert has (bf16: 2; Q4_K_M: 8). With every layer of a decode token
paying it, it bounds decode under `--gpu-memory` before any byte moves (40 layers x 100 us = 4 ms).

    python bench/expert_cache.py [--slots 16,64,128] [--parts 2,8] [--steps 3000] [--json out.json]

The parts are a few bytes on the CPU, so a copy costs only its dispatch; the same run times that
floor (the same number of `copy_` calls on views made beforehand) and reports run / floor.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from engine.offload import OffloadStats
from engine.offload.cache import ExpertCache, Lane

EXPERTS, TOP_K = 256, 8


def measure(slots: int, parts: int, steps: int, seed: int = 0) -> dict:
    host = tuple(torch.zeros(EXPERTS, 4, 8, dtype=torch.uint8) for _ in range(parts))
    cache = ExpertCache(host, slots, torch.device("cpu"), OffloadStats(), Lane(torch.device("cpu")))
    rng = random.Random(seed)
    x, weights = torch.zeros(1, 16), torch.ones(1, TOP_K)
    times = []
    for _ in range(steps):
        ids = torch.tensor([rng.sample(range(EXPERTS), TOP_K)])
        start = time.perf_counter()
        cache.run(x, weights, ids, lambda x, *_: x)
        times.append(time.perf_counter() - start)
    warm = times[steps // 5 :]  # past the cache's filling
    misses = cache.stats.misses / steps
    dst, src = torch.zeros(4, 8, dtype=torch.uint8), torch.zeros(4, 8, dtype=torch.uint8)
    copies = max(1, round(misses * parts))
    floor = []
    for _ in range(steps // 5):
        start = time.perf_counter()
        for _ in range(copies):
            dst.copy_(src)
        floor.append(time.perf_counter() - start)
    run_us, floor_us = statistics.median(warm) * 1e6, statistics.median(floor) * 1e6
    return {
        "slots": slots,
        "parts": parts,
        "misses_per_step": misses,
        "run_us": run_us,
        "copy_floor_us": floor_us,
        "run_over_floor": run_us / floor_us,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--slots", default="16,64,128")
    p.add_argument("--parts", default="2,8")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--json", type=Path, default=Path("bench/expert_cache.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = [
        measure(s, n, args.steps)
        for n in map(int, args.parts.split(","))
        for s in map(int, args.slots.split(","))
    ]
    table = Table(title=f"ExpertCache.run host time per decode layer ({EXPERTS} experts, top {TOP_K})")
    for col in ("slots", "parts", "misses/step", "run us", "copy floor us", "run / floor"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            str(r["slots"]),
            str(r["parts"]),
            f"{r['misses_per_step']:.2f}",
            f"{r['run_us']:.0f}",
            f"{r['copy_floor_us']:.0f}",
            f"{r['run_over_floor']:.2f}",
        )
    Console().print(table)
    args.json.write_text(
        json.dumps({"experts": EXPERTS, "top_k": TOP_K, "steps": args.steps, "rows": rows}, indent=2)
    )
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
