"""Under a GPU memory budget: what capture points cost a prefill forward. The anchor policy keeps the
DeltaNet states at each boundary inside a suffix; the prefix policy keeps KV only there. In the 8 GiB
replays the anchor policy's 3,838-token suffix took 513-643 ms against prefix's 358-473 ms, for the
same tokens and link bytes. This times one prefill of `--tokens` tokens three ways, alternating, on
fresh sequences: no captures, `--captures` KV-only captures, the same positions with their states.
Per run: wall time, the CUDA allocator's retries (a capped allocator freeing its cache mid-forward
synchronises the device) and the expert slots before and after. `--hold N` keeps the last N runs'
snapshots alive, as the server's store queue holds a request's until it has packed them: their
pinned slabs cannot be cut again, so later captures pin new ones (engine/ops/gpu/transfer.py).

    FT_MATERIALISE=1 python bench/offload_captures.py --q4-k-m --budget 8 --tokens 2800 --captures 4 [--hold 2]
    python bench/offload_captures.py --preset tiny --device cpu --budget 0.148 --tokens 200   # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # bench/engine.py would shadow the `engine` package

import torch  # noqa: E402

from bench.offload import ids_for, q4_k_m_file, sync  # noqa: E402


def retries(device: str) -> int:
    return torch.cuda.memory_stats().get("num_alloc_retries", 0) if device == "cuda" else 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen3.6-35b-a3b")
    p.add_argument("--q4-k-m", action="store_true", help="the preset's random Q4_K_M GGUF (peer.gguf_random)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--budget", type=float, default=8.0, help="--gpu-memory GiB")
    p.add_argument("--tokens", type=int, default=2800)
    p.add_argument("--captures", type=int, default=4)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--hold", type=int, default=0, help="runs whose snapshots stay alive (0: each freed at once)")
    p.add_argument("--json", default="bench/offload_captures.json")
    args = p.parse_args()

    from engine import Engine  # noqa: PLC0415

    if args.q4_k_m:
        engine = Engine.load(q4_k_m_file(args.preset), args.device, gpu_memory_gib=args.budget, max_running=1)
    else:
        engine = Engine.from_preset(args.preset, device=args.device, gpu_memory_gib=args.budget, max_running=1)
    engine.warmup(max_batch=1)
    ids = ids_for(args.tokens)
    positions = [args.tokens * (i + 1) // (args.captures + 1) for i in range(args.captures)]
    kinds = {"none": ([], None), "kv-only": (positions, set()), "states": (positions, None)}
    rows, held = [], []
    for rep in range(args.reps + 1):  # the first round untimed in the summary (first calls)
        for kind, (capture_at, state_at) in kinds.items():
            state = engine.new_state()
            slots, before = engine.offload.plan.slots, retries(args.device)
            sync(args.device)
            start = time.perf_counter()
            result = engine.prefill(state, ids, capture_at=capture_at, state_at=state_at)
            sync(args.device)
            ms = (time.perf_counter() - start) * 1e3
            row = {"rep": rep, "kind": kind, "ms": round(ms, 1), "alloc_retries": retries(args.device) - before,
                   "slots": [slots, engine.offload.plan.slots]}  # fmt: skip
            print(json.dumps(row), flush=True)
            rows.append(row)
            held = [*held, result.snapshots][-args.hold :] if args.hold else []
            del state, result
    timed = [r for r in rows if r["rep"] > 0]
    medians = {kind: sorted(r["ms"] for r in timed if r["kind"] == kind) for kind in kinds}
    medians = {kind: ms[len(ms) // 2] for kind, ms in medians.items()}
    print("median ms:", medians)
    Path(args.json).write_text(json.dumps({"args": vars(args), "positions": positions, "rows": rows, "median_ms": medians},
                                          indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
