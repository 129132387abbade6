"""`ft pull MODEL`: download a model named by its Hugging Face repo id (`owner/name`, with
`:QUANT` for a GGUF repo) into the Hugging Face cache, without serving it (`ft.hub`)."""

from __future__ import annotations

import argparse
import sys

from ft import hub


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="owner/name or owner/name:QUANT (e.g. unsloth/Qwen3.6-35B-A3B-GGUF:Q4_K_M)")


def run(args: argparse.Namespace) -> int:
    try:
        path = hub.resolve(args.model)
    except hub.HubError as exc:
        print(f"ft pull: {exc}", file=sys.stderr)
        return 1
    size = sum(p.stat().st_size for p in hub.model_files(path))
    print(f"{args.model}: {path} ({size / hub.GB:.2f} GB)")
    return 0
