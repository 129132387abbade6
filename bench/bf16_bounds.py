"""Which bf16 bound tells a correct restore from a wrong one on the random-weight presets? For N draws
(on the CPU or a GPU, the `small` preset): a prompt, a capture at a random split, the bf16 restore then the
suffix (correct), and the same restore fed the suffix one token late (the context shifted: wrong), each
against fp32 (`tests/engine/bf16_bounds.restore_and_shift`). Two bounds are judged: the GPU tests'
(`tests/engine/test_gpu.py::_within_bf16_noise` as `restore_then_suffix` uses it: the last position within
8x the one-pass bf16 run's last position + 0.01) and `worst_position_bound`'s (every position within the
one-pass run's worst position + 0.01). Prints how often each fails the correct restore and catches the
wrong one, and writes JSON.

    python bench/bf16_bounds.py --draws 40 --json OUT.json            # CPU, ~9 min on 2 cores
    python bench/bf16_bounds.py --draws 40 --device cuda --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # bench/engine.py would shadow the `engine` package

from tests.engine.bf16_bounds import restore_and_shift, small_pair, worst_position_bound  # noqa: E402

BOUNDS = {"last_bound": "last position <= 8 x one pass's last + 0.01 (GPU tests)",
          "worst_bound": "every position <= one pass's worst position + 0.01"}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--draws", type=int, default=40)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    engines = small_pair(args.device)
    rows = []
    for draw in range(args.draws):
        case = restore_and_shift(*engines, draw)
        one, right, wrong = case["one_pass"], case["right"], case["shifted"]
        last_bound, worst_bound = 8 * one[-1].item() + 0.01, worst_position_bound(one)
        rows.append({"draw": draw, "tokens": case["tokens"], "split": case["split"],
                     "one_pass_last": one[-1].item(), "one_pass_worst": one.max().item(),
                     "right_last": right[-1].item(), "right_worst": right.max().item(),
                     "wrong_last": wrong[-1].item(), "wrong_worst": wrong.max().item(),
                     "last_bound_fails_right": right[-1].item() > last_bound, "last_bound_catches_wrong": wrong[-1].item() > last_bound,
                     "worst_bound_fails_right": right.max().item() > worst_bound,
                     "worst_bound_catches_wrong": wrong.max().item() > worst_bound})  # fmt: skip
        print(f"draw {draw:3}: one pass last {one[-1]:.3f} worst {one.max():.3f}; right last {right[-1]:.3f} "
              f"worst {right.max():.3f}; shifted last {wrong[-1]:.3f} worst {wrong.max():.3f}", flush=True)
    print(f"\n{'bound':58} {'fails the right restore':>24} {'catches the shifted one':>24}")
    for key, name in BOUNDS.items():
        fails = sum(r[f"{key}_fails_right"] for r in rows)
        catches = sum(r[f"{key}_catches_wrong"] for r in rows)
        print(f"{name:58} {fails:>17} of {len(rows):<4} {catches:>17} of {len(rows):<4}")
    if args.json:
        args.json.write_text(json.dumps({"device": args.device, "preset": "small", "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
