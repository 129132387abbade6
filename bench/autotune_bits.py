"""Do bf16 results keep their bits from one process to the next? The small preset's bf16 prefill of
1,500 tokens with a capture, in N processes one after another (`tests/engine/test_gpu.py`'s
TWO_PROCESSES), with fla's autotuned launch settings cached on disk (the engine's default,
TRITON_CACHE_AUTOTUNING=1) and not (=0), each way on its own fresh Triton cache (the first process
compiles every kernel, the later ones find them compiled). Prints, per process after the first, how many
of the result's tensors differ from the first process's and the process's wall time (what re-timing
fla's launch settings adds to a start), and writes JSON.

    python bench/autotune_bits.py --processes 3 --json OUT.json   # on a GPU with fla-core
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # bench/engine.py would shadow the `engine` package

import torch  # noqa: E402

from tests.engine.test_gpu import bf16_run_in_a_process, rel  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--processes", type=int, default=3)
    p.add_argument("--seed", type=int, default=533782627, help="the inputs' seed (default: session 30's failing test's)")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    rows = []
    for cached in ("1", "0"):
        tmp = tempfile.mkdtemp()
        env = {**os.environ, "TRITON_CACHE_AUTOTUNING": cached, "TRITON_CACHE_DIR": os.path.join(tmp, "triton")}
        runs, seconds = [], []
        for i in range(args.processes):
            start = time.perf_counter()
            runs.append(bf16_run_in_a_process(os.path.join(tmp, f"r{i}.pt"), args.seed, env))
            seconds.append(time.perf_counter() - start)
        first = runs[0]["tensors"]
        for i, run in enumerate(runs[1:], 1):
            differ = [rel(a, b) for a, b in zip(first, run["tensors"], strict=True) if not torch.equal(a, b)]
            rows.append({"autotune_cached": run["autotune_cached"], "process": i, "tensors": len(first),
                         "differ": len(differ), "largest_rel_diff": max(differ, default=0.0),
                         "seconds": seconds[i], "first_process_seconds": seconds[0]})  # fmt: skip
            print(f"autotune cached={run['autotune_cached']!s:5}  process {i} vs 0: {len(differ)} of {len(first)} "
                  f"tensors differ, largest relative difference {max(differ, default=0.0):.2e}; "
                  f"{seconds[i]:.1f} s (the first process {seconds[0]:.1f} s)", flush=True)  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "seed": args.seed, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
