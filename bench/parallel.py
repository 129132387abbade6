"""Expert parallel with the attention and DeltaNet layers replicated or split by heads: prefill
and decode timings of each at world 2 (`engine.split_choice.probe`: one prefill of `--prompt`
tokens, the median decode step of `--batches` sequences), with one process as the baseline.

    python bench/parallel.py --preset small [--world 2] [--prompt 512] [--batches 1,8] [--json FILE]

On the CPU the ranks are gloo processes sharing the machine's cores (each gets cores / world
threads; the single process gets them all); on GPUs (`--device cuda`) NCCL, one GPU a rank.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rich.console import Console
from rich.table import Table

from engine import Engine
from engine.engine_config import EngineConfig
from engine.parallel import ExpertParallel
from engine.split_choice import probe
from engine.warmup import warm_up
from gateway.ports import LOOPBACK, free_port

MODES = ("replicated", "heads")


def timings(engine: Engine, args: argparse.Namespace) -> dict:
    """The prefill's seconds and, per decode batch (by its size as a string), a step's: the best of
    `--repeat` probes of each batch size (every probe prefills once)."""
    runs = {str(b): [probe(engine, args.prompt, args.steps, b) for _ in range(args.repeat)] for b in args.batches}
    return {"prefill_s": min(r["prefill_s"] for per in runs.values() for r in per),
            "decode_step_s": {b: min(r["decode_step_s"] for r in per) for b, per in runs.items()}}


def config(args: argparse.Namespace, device: str, parallel: ExpertParallel | None, heads: bool) -> EngineConfig:
    return EngineConfig(device=device, dtype=getattr(torch, args.dtype), max_running=max(args.batches),
                        expert_parallel=parallel, head_split=heads)


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    device = f"cuda:{rank}" if args.device == "cuda" else "cpu"
    if args.device == "cuda":
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{LOOPBACK}:{port}", rank=rank, world_size=world)
    try:
        results = {}
        for mode in MODES:
            engine = Engine.from_preset(args.preset, config(args, device, ExpertParallel(rank, world), mode == "heads"))
            warm_up(engine)
            results[mode] = timings(engine, args)
            del engine
        if rank == 0:
            Path(out).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")], default=[1, 8])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--json", type=Path, default=Path("bench/results/parallel-small-cpu.json"))
    args = parser.parse_args()

    single = Engine.from_preset(args.preset, config(args, "cuda:0" if args.device == "cuda" else "cpu", None, False))
    warm_up(single)
    figures = {"single": timings(single, args)}
    del single
    out = args.json.with_suffix(".ranks.tmp")
    mp.spawn(_rank, args=(args.world, free_port(), args, str(out)), nprocs=args.world)
    figures.update(json.loads(out.read_text()))
    out.unlink()

    table = Table(title=f"{args.preset}, {args.dtype}, world {args.world} on {args.device} "
                        f"({'NCCL' if args.device == 'cuda' else 'gloo'}), prefill of {args.prompt} tokens")
    table.add_column("layers")
    table.add_column(f"prefill {args.prompt} tokens, ms", justify="right")
    for batch in args.batches:
        table.add_column(f"decode step, batch {batch}, ms", justify="right")
    for mode, label in (("single", "one process"), ("replicated", "replicated"), ("heads", "split by heads")):
        t = figures[mode]
        steps = [f"{1e3 * t['decode_step_s'][str(b)]:.2f}" for b in args.batches]
        table.add_row(label, f"{1e3 * t['prefill_s']:.1f}", *steps)
    Console().print(table)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    meta = {k: v for k, v in vars(args).items() if k != "json"}
    args.json.write_text(json.dumps({"args": meta, "host": platform.node(), "cpus": os.cpu_count(),
                                     "torch": torch.__version__, "figures": figures}, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
