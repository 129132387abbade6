"""Which bf16 bound tells a correct restore from a wrong one on the random-weight presets? For N draws
(on the CPU or a GPU, the `small` preset): a prompt, a capture at a random split, the bf16 restore then the
suffix (correct), and the same restore fed the suffix one token late (the context shifted: wrong), each
against fp32. Two bounds are judged: the GPU tests' (`tests/engine/test_gpu.py::_within_bf16_noise` as
`restore_then_suffix` uses it: the last position within 8x the one-pass bf16 run's last position + 0.01)
and `tests/engine/bf16_bounds.py`'s (every position within the one-pass run's worst position + 0.01).
Prints how often each fails the correct restore and catches the wrong one, and writes JSON.

    python bench/bf16_bounds.py --draws 40 --json OUT.json            # CPU, ~15 min on 2 cores
    python bench/bf16_bounds.py --draws 40 --device cuda --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # bench/engine.py would shadow the `engine` package

import torch  # noqa: E402

from engine import Engine  # noqa: E402
from engine.loader import build_model, fingerprint  # noqa: E402
from engine.presets import materialise  # noqa: E402
from tests.engine.bf16_bounds import position_errors, worst_position_bound  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--draws", type=int, default=40)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    config, _, state_dict = materialise("small", args.device, torch.float32)
    e32, e16 = (Engine(build_model(config, moved), fingerprint(config, moved))
                for moved in ({n: t.to(d) for n, t in state_dict.items()} for d in (torch.float32, torch.bfloat16)))  # fmt: skip
    rows = []
    for draw in range(args.draws):
        rng = random.Random(draw)
        n = rng.randrange(200, 700)
        ids = [rng.randrange(248_000) for _ in range(n)]
        split = rng.randrange(1, n - 1)
        exact = e32.prefill(e32.new_state(), ids, all_logits=True).logits
        one = e16.prefill(e16.new_state(), ids, all_logits=True).logits
        snaps = e16.prefill(e16.new_state(), ids, capture_at=[split]).snapshots
        right = position_errors(e16.prefill(e16.restore(snaps), ids[split:], all_logits=True).logits, exact[split:])
        wrong = position_errors(e16.prefill(e16.restore(snaps), ids[split + 1 :], all_logits=True).logits, exact[split + 1 :])
        one_last = position_errors(one[-1:], exact[-1:]).item()
        last_bound, worst_bound = 8 * one_last + 0.01, worst_position_bound(one, exact)
        rows.append({"draw": draw, "tokens": n, "split": split, "one_pass_last": one_last, "one_pass_worst": worst_bound - 0.01,
                     "right_last": right[-1].item(), "right_worst": right.max().item(),
                     "wrong_last": wrong[-1].item(), "wrong_worst": wrong.max().item(),
                     "last_bound_fails_right": right[-1].item() > last_bound, "last_bound_catches_wrong": wrong[-1].item() > last_bound,
                     "worst_bound_fails_right": right.max().item() > worst_bound,
                     "worst_bound_catches_wrong": wrong.max().item() > worst_bound})  # fmt: skip
        print(f"draw {draw:3}: one pass last {one_last:.3f} worst {worst_bound - 0.01:.3f}; right last "
              f"{right[-1]:.3f} worst {right.max():.3f}; shifted last {wrong[-1]:.3f} worst {wrong.max():.3f}", flush=True)
    print(f"\n{'bound':58} {'fails the right restore':>24} {'catches the shifted one':>24}")
    for name, key in (("last position <= 8 x one pass's last + 0.01 (GPU tests)", "last_bound"),
                      ("every position <= one pass's worst position + 0.01", "worst_bound")):  # fmt: skip
        fails = sum(r[f"{key}_fails_right"] for r in rows)
        catches = sum(r[f"{key}_catches_wrong"] for r in rows)
        print(f"{name:58} {fails:>17} of {len(rows):<4} {catches:>17} of {len(rows):<4}")
    if args.json:
        args.json.write_text(json.dumps({"device": args.device, "preset": "small", "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
