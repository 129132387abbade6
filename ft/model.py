"""`ft model init --preset NAME [--format FMT] --out PATH`: write a preset as an HF-format folder
(`hf`, or `fp8` as Qwen's FP8 releases), or as a GGUF file (`gguf-q8_0`, `gguf-q4_k_m`, …)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from engine import presets

GGUF_DTYPES = ("f32", "bf16", "q8_0", "q4_k_m", "q5_k_m", "q6_k")  # peer.gguf_export.DTYPES; that module loads only to write one


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    init = sub.add_parser("init", help="write a preset model (deterministic random weights) as an HF folder")
    init.add_argument("--preset", required=True, choices=sorted(presets.PRESETS), help="which preset shape")
    init.add_argument(
        "--format",
        default="hf",
        choices=[*presets.FORMATS, *(f"gguf-{d}" for d in GGUF_DTYPES)],
        help="hf (default), fp8 (Qwen's block-scaled FP8 layout), or a GGUF file type (K-quants are written by "
        "llama.cpp's llama-quantize, built into .peer/ on first use)",
    )
    init.add_argument("--out", type=Path, help="output folder or .gguf file (default: under $FT_HOME/models/)")
    init.add_argument("--seed", type=int, default=0, help="weights seed (default 0)")
    sub.add_parser("list", help="list presets and their shapes")


def run(args: argparse.Namespace) -> int:
    if args.model_command == "list":
        for name, cfg in presets.PRESETS.items():
            print(f"{name:20} layers={cfg['num_hidden_layers']:<3} hidden={cfg['hidden_size']:<5} "
                  f"experts={cfg['num_experts']}x top-{cfg['num_experts_per_tok']} dtype={cfg['dtype']}")
        return 0
    if args.format.startswith("gguf-"):
        return write_gguf_preset(args)
    out = args.out or presets.default_model_dir(args.preset, args.format)
    if (out / "config.json").is_file():
        print(f"{out}: already holds a model; not overwriting", file=sys.stderr)
        return 1
    if args.preset.startswith("qwen3.6-35b-a3b"):
        print("note: 21-70 GB of bf16 weights; on a GPU prefer FT_MATERIALISE=1 (built in device memory)", file=sys.stderr)
    presets.write_preset(args.preset, out, seed=args.seed, fmt=args.format)
    print(f"wrote preset {args.preset!r} ({args.format}) to {out}")
    return 0


def write_gguf_preset(args: argparse.Namespace) -> int:
    from peer.gguf_export import export_gguf, preset_gguf  # noqa: PLC0415

    dtype = args.format.removeprefix("gguf-")
    if args.seed != 0:
        print("--seed: GGUF presets are written from the seed-0 preset", file=sys.stderr)
        return 2
    if args.out is None:
        out = preset_gguf(args.preset, presets.default_model_dir(args.preset).parent, dtype)
    elif args.out.exists():
        print(f"{args.out}: already exists; not overwriting", file=sys.stderr)
        return 1
    else:
        from engine.engine import ensure_preset  # noqa: PLC0415

        out = export_gguf(ensure_preset(args.preset), args.out, dtype)
    print(f"wrote preset {args.preset!r} ({args.format}) to {out}")
    return 0
