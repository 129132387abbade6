"""`ft`: one command line for the project; each subcommand lives beside the code it drives."""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> module exposing `add_arguments(parser)` and `run(args) -> int`
SUBCOMMANDS = {
    "model": ("ft.model", "Write model presets (deterministic random weights in HF format)."),
    "serve": ("gateway.serve", "Serve a model to agents over Anthropic / OpenAI APIs."),
    "launch": ("adapters.launch", "Start Claude Code, Codex or OpenCode on a local server (started if none runs)."),
    "pull": ("ft.pull", "Download a model by its Hugging Face repo id (owner/name[:QUANT])."),
    "models": ("ft.models", "List the models on this machine and their size."),
    "ps": ("ft.ps", "List the ft servers running on this machine."),
    "stop": ("ft.stop", "Stop running ft servers gracefully (the checkpoint store flushed)."),
    "top": ("ft.top", "Watch a running server live: sessions, requests, caches, steps."),
    "replay": ("adapters.replay", "Replay recorded agent sessions and report TTFT per capture policy."),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ft", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue
        module.add_arguments(sub_parser)
        sub_parser.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not hasattr(args, "run"):
        print(f"ft {args.command}: not available in this build", file=sys.stderr)
        return 2
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
