"""`ft model init --preset NAME --out DIR`: write a preset as an HF-format folder."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from engine import presets


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    init = sub.add_parser("init", help="write a preset model (deterministic random weights) as an HF folder")
    init.add_argument("--preset", required=True, choices=sorted(presets.PRESETS), help="which preset shape")
    init.add_argument("--out", type=Path, help="output folder (default: $FT_HOME/models/NAME)")
    init.add_argument("--seed", type=int, default=0, help="weights seed (default 0)")
    sub.add_parser("list", help="list presets and their shapes")


def run(args: argparse.Namespace) -> int:
    if args.model_command == "list":
        for name, cfg in presets.PRESETS.items():
            print(f"{name:20} layers={cfg['num_hidden_layers']:<3} hidden={cfg['hidden_size']:<5} "
                  f"experts={cfg['num_experts']}x top-{cfg['num_experts_per_tok']} dtype={cfg['dtype']}")
        return 0
    out = args.out or presets.default_model_dir(args.preset)
    if (out / "config.json").is_file():
        print(f"{out}: already holds a model; not overwriting", file=sys.stderr)
        return 1
    if args.preset.startswith("qwen3.6-35b-a3b"):
        print("note: 21-70 GB of bf16 weights; on a GPU prefer FT_MATERIALISE=1 (built in device memory)", file=sys.stderr)
    presets.write_preset(args.preset, out, seed=args.seed)
    print(f"wrote preset {args.preset!r} to {out}")
    return 0
