"""Generate synthetic coding-agent sessions as Codex rollouts, Claude Code transcripts and ft recordings.

    python -m traces.generate --seed 7 --requests 40 --turns 4 --out /tmp/sessions
    python -m traces.generate --examples          # rewrite the committed sessions in traces/sessions/

Deterministic: the same arguments give byte-identical files.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from adapters.trace import ProtocolName
from traces.formats import write_claude, write_codex, write_recording
from traces.session import Session, simulate

FORMATS = ("codex", "claude", "recording")
SESSIONS_DIR = Path(__file__).parent / "sessions"


@dataclass(frozen=True)
class Example:
    """One committed session: how it is generated and which formats are written."""

    name: str
    seed: int
    requests: int
    turns: int
    scale: float
    formats: tuple[str, ...]


EXAMPLES = (
    Example("small-bugfix", seed=1, requests=24, turns=3, scale=0.8, formats=FORMATS),
    Example("many-turns", seed=4, requests=40, turns=10, scale=0.7, formats=("codex",)),
    Example("feature-medium", seed=2, requests=72, turns=4, scale=1.0, formats=("codex",)),
    Example("long-refactor", seed=3, requests=160, turns=6, scale=1.0, formats=("claude",)),
)


def write(
    session: Session, out: Path, name: str, formats: tuple[str, ...], protocol: ProtocolName = "chat"
) -> list[Path]:
    """Write `session` in each of `formats` under `out` as `<name>.<format>.jsonl`."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for fmt in formats:
        path = out / f"{name}.{fmt}.jsonl"
        if fmt == "codex":
            write_codex(session, path)
        elif fmt == "claude":
            write_claude(session, path)
        elif fmt == "recording":
            write_recording(session, path, protocol)
        else:
            raise ValueError(f"unknown format {fmt!r} (one of {', '.join(FORMATS)})")
        paths.append(path)
    return paths


def write_examples(out: Path = SESSIONS_DIR) -> list[Path]:
    """(Re)write every committed example session."""
    paths = []
    for ex in EXAMPLES:
        paths += write(simulate(ex.seed, ex.requests, ex.turns, ex.scale), out, ex.name, ex.formats)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m traces.generate", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--examples", action="store_true", help="rewrite the committed sessions in traces/sessions/"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--requests", type=int, default=24, help="model calls in the session (20 to 200 is typical)"
    )
    parser.add_argument("--turns", type=int, default=3, help="user turns")
    parser.add_argument("--scale", type=float, default=1.0, help="tool output size multiplier")
    parser.add_argument(
        "--formats", default=",".join(FORMATS), help=f"comma-separated subset of {','.join(FORMATS)}"
    )
    parser.add_argument(
        "--protocol", default="chat", choices=["anthropic", "responses", "chat"], help="recording protocol"
    )
    parser.add_argument("--name", default=None, help="file name stem (default: session-<seed>)")
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args(argv)
    try:
        if args.examples:
            paths = write_examples(args.out if args.out != Path(".") else SESSIONS_DIR)
        else:
            session = simulate(args.seed, args.requests, args.turns, args.scale)
            formats = tuple(f.strip() for f in args.formats.split(",") if f.strip())
            paths = write(session, args.out, args.name or f"session-{args.seed}", formats, args.protocol)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
