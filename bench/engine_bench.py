"""Engine benchmark on the CPU (or any device): prefill tokens/s at several contexts, decode
tokens/s, and capture overhead (prefill with 0 vs 32 capture positions).

    python bench/engine_bench.py --preset small [--contexts 1024,4096,16384] [--json bench/engine_bench.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from engine import Engine, SamplingParams


def timed(fn, repeat: int = 1) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def prefill_pair(engine: Engine, ids: list[int], captures: list[int], repeat: int) -> tuple[float, float]:
    """Median seconds without and with captures, runs interleaved so machine drift hits both."""
    plain, captured = [], []
    for _ in range(repeat):
        plain.append(timed(lambda: engine.prefill(engine.new_state(), ids)))
        captured.append(timed(lambda: engine.prefill(engine.new_state(), ids, capture_at=captures)))
    return statistics.median(plain), statistics.median(captured)


def decode_tokens_per_s(engine: Engine, context: int, steps: int) -> float:
    state = engine.new_state()
    logits = engine.prefill(state, list(range(1000, 1000 + context))).logits
    forced = [7] * steps  # teacher-forced so every step runs, whatever the random model emits
    return steps / timed(lambda: list(engine.generate(state, logits, SamplingParams(), forced=forced)))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="small")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--contexts", default="1024,4096,16384")
    parser.add_argument("--captures", type=int, default=32)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3, help="interleaved runs per context (median)")
    parser.add_argument("--json", type=Path, default=Path("bench/engine_bench.json"))
    args = parser.parse_args()

    engine = Engine.from_preset(args.preset, device=args.device)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        ids = torch.randint(0, 248_000, (context,), generator=gen).tolist()
        step = max(1, context // args.captures)
        captures = list(range(step, context + 1, step))[: args.captures]
        plain, captured = prefill_pair(engine, ids, captures, args.repeat)
        rows.append(
            {
                "context": context,
                "prefill_s": plain,
                "prefill_tok_s": context / plain,
                "captures": len(captures),
                "prefill_captured_s": captured,
                "capture_overhead": captured / plain - 1,
            }
        )
    decode = decode_tokens_per_s(engine, 1024, args.decode_steps)
    result = {
        "preset": args.preset,
        "device": args.device,
        "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "rows": rows,
        "decode_tok_s_at_1k": decode,
    }
    table = Table(title=f"engine: preset {args.preset} on {args.device} ({torch.get_num_threads()} threads)")
    for col in (
        "context",
        "prefill tok/s",
        "prefill s",
        f"with {args.captures} captures s",
        "capture overhead",
    ):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            str(r["context"]),
            f"{r['prefill_tok_s']:.0f}",
            f"{r['prefill_s']:.2f}",
            f"{r['prefill_captured_s']:.2f}",
            f"{100 * r['capture_overhead']:+.1f}%",
        )
    console = Console()
    console.print(table)
    console.print(f"decode at 1K context: {decode:.1f} tok/s")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
