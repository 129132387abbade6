"""Expert offload under a GPU memory budget: prefill and decode speed, the expert cache's hit rate,
bytes over the host link, peak reserved memory, and a recorded session replayed per capture policy.

    FT_MATERIALISE=1 python bench/offload.py --preset qwen3.6-35b-a3b --device cuda --budgets 8,12,24
    python bench/offload.py --preset qwen3.6-35b-a3b --q4-k-m --budgets 8    # the experts packed (Q4_K_M)
    python bench/offload.py --preset qwen3.6-35b-a3b --q4-k-m --budgets 8 --no-replay --profile  # where a decode token goes
    python bench/offload.py --preset tiny --device cpu --budgets 0.148 --context 256 --decode-steps 8  # CPU smoke

A budget that cannot hold the dense parts, one sequence's slots and top_k experts per layer (e.g. bf16
experts at 8 GiB) is reported as a row naming the numbers.

Each budget runs in a child process of its own (a fresh engine: peak reserved memory per budget,
and the 256-expert weights are held once in host memory). Per budget: prefill tokens/s of one
`--context`-token prompt, decode tokens/s at batch 1 (where decode gathers the experts it reads
from host memory into staging rows, also with them read where they lie: the same run's baseline),
the expert cache's hit ratio per phase (`engine.offload.hit_ratio`), bytes host -> device per prefill and per decoded
token, and the same times projected to a PCIe 4.0 x16 link (`--pcie` bytes/s, 25 GB/s): every
byte's copy time moved from the link's measured rate (one large pinned copy, `bulk_link`) to that
one, t + bytes x (1/pcie - 1/link) (exact where the copies are on the critical path, as in decode;
an upper bound where they overlap compute). Then `--traces` replayed (`ft replay`'s driver,
recorded answers teacher-forced) with the policies of `--policies` on the same engine: worst TTFT
after a tool and TTFT at new user turns (requests after the first whose last message is not a
tool result), each also projected to the PCIe 4.0 link the same way from the bytes the server moved
until that first token (its `x-link-bytes` header: restored checkpoints and experts). `--llama-server`
adds llama-server with its experts on the CPU (`--n-cpu-moe`, from a GGUF export of the preset: chat
traces only, see bench/llamacpp.py). Prints tables, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import torch
from rich.console import Console
from rich.table import Table

from ft import env

PCIE4_X16 = 25e9  # bytes/s a consumer PCIe 4.0 x16 link sustains host -> device
DEFAULT_TRACE = "traces/sessions/small-bugfix.recording.jsonl"
FIRST_STEPS = 2  # decode steps after the prefill timed apart from the rest (`measure`)


def ids_for(n: int) -> list[int]:
    return [1000 + (i * 7919) % 50_000 for i in range(n)]


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def project(seconds: float, moved: int, link: float, pcie: float) -> float:
    """`seconds` with the copy time of `moved` bytes moved from a `link` to a `pcie` bytes/s link."""
    return seconds + moved * (1 / pcie - 1 / link)


def bulk_link(device: str, nbytes: int = 256 << 20, repeat: int = 3) -> float:
    """Host -> device bytes/s of one large pinned copy (median): the rate the streamed prefill's
    copies and decode's gathered reads run at, which the PCIe projection moves from. (The engine's
    `Link` times one expert's copy in its parts, what a single fetched miss costs, far below it.)"""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(repeat):
        sync(device)
        start = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        sync(device)
        times.append(time.perf_counter() - start)
    return nbytes / sorted(times)[len(times) // 2]


def hit_rate(before: dict, after: dict) -> float | None:
    from engine.offload import hit_ratio  # noqa: PLC0415

    ratio = hit_ratio({k: after[k] - before[k] for k in before})
    return None if ratio is None else round(ratio, 4)


def measure(engine, device: str, context: int, steps: int) -> dict:
    """Prefill of `context` tokens, then `steps` decode steps at batch 1 (after FIRST_STEPS more,
    timed apart)."""
    from engine import SamplingParams  # noqa: PLC0415

    stats = engine.offload_stats
    state = engine.new_state()
    before = stats()
    sync(device)
    start = time.perf_counter()
    result = engine.prefill(state, ids_for(context))
    sync(device)
    prefill_s = time.perf_counter() - start
    mid = stats()
    params = SamplingParams(
        temperature=0.0, max_tokens=steps + FIRST_STEPS + 1
    )  # no stop tokens: every step runs
    sync(device)
    stamps = [time.perf_counter()]
    # the first token comes from the prefill's logits; the first steps after a long prefill grow the
    # decode slots past their capacity (the graphs captured again, the expert slots shrunk): apart
    first, warm = FIRST_STEPS + 1, mid
    for _ in engine.generate(state, result.logits, params):  # each token read back: the step is done
        stamps.append(time.perf_counter())
        if len(stamps) == first + 1:
            warm = stats()
    after = stats()
    decoded = len(stamps) - 1 - first
    decode_s = stamps[-1] - stamps[first]
    return {
        "prefill_tokens": context,
        "prefill_s": prefill_s,
        "prefill_tok_s": context / prefill_s,
        "prefill_bytes": mid["bytes_in_prefill"] - before["bytes_in_prefill"],
        "prefill_hit_rate": hit_rate(before, mid),
        "decode_steps": decoded,
        "decode_first_steps_s": stamps[first] - stamps[1],
        "decode_s": decode_s,
        "decode_tok_s": decoded / decode_s,
        "decode_bytes_per_token": (after["bytes_in_decode"] - warm["bytes_in_decode"]) / max(decoded, 1),
        "decode_hit_rate": hit_rate(warm, after),
        "decode_on_host": after["on_host"] - warm["on_host"],
        "decode_mapped": after["mapped"] - warm["mapped"],
    }


def profiled(fn, device: str, per: int, top: int = 12) -> dict:
    """`fn()` under torch's profiler (host and device), its figures divided by `per` (tokens): the
    wall time, the device's busy time and its copies' part, the copies and kernel launches
    issued, host syncs, and the ops that took the most of each side's time."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        wall = time.perf_counter() - start
    events = prof.key_averages()

    def each(us: float) -> float:
        return us / 1e3 / per

    def ranked(key) -> list[dict]:
        rows = sorted(events, key=key, reverse=True)[:top]
        return [
            {"op": e.key[:80], "ms_per_token": each(key(e)), "calls_per_token": e.count / per} for e in rows
        ]

    count = {e.key: e.count / per for e in events}
    on_device = [e for e in events if e.device_type != torch.autograd.DeviceType.CPU]
    return {
        "wall_ms_per_token": wall * 1e3 / per,
        # the device's own events (kernels, copies): a host op's device time is theirs again
        "device_busy_ms_per_token": each(sum(e.self_device_time_total for e in on_device)),
        "copies_ms_per_token": each(
            sum(e.self_device_time_total for e in on_device if e.key.startswith("Memcpy HtoD"))
        ),
        "memcpy_async_per_token": count.get("cudaMemcpyAsync", 0.0),
        "kernel_launches_per_token": count.get("cudaLaunchKernel", 0.0) + count.get("cuLaunchKernel", 0.0),
        "syncs_per_token": count.get("cudaStreamSynchronize", 0.0),
        "top_device": ranked(lambda e: e.self_device_time_total),
        "top_host": ranked(lambda e: e.self_cpu_time_total),
    }


def show_profile(name: str, out: dict, device: str, unit: str = "token") -> None:
    print(
        f"{name} profile, per {unit}: wall {out['wall_ms_per_token']:.3f} ms, device busy "
        f"{out['device_busy_ms_per_token']:.3f} ms (copies {out['copies_ms_per_token']:.3f}), "
        f"{out['memcpy_async_per_token']:.1f} async copies, {out['kernel_launches_per_token']:.1f} launches, "
        f"{out['syncs_per_token']:.2f} stream syncs"
    )
    for side in ("top_device", "top_host") if device == "cuda" else ("top_host",):
        for r in out[side]:
            print(f"  {side[4:]:6} {r['ms_per_token']:7.3f} ms x{r['calls_per_token']:<7.1f} {r['op']}")


def profile_decode(engine, device: str, steps: int = 4) -> dict:
    """`steps` decode steps under the profiler, per token (where a missed decode target goes:
    link, host, or kernels)."""
    from engine import SamplingParams  # noqa: PLC0415

    state = engine.new_state()
    result = engine.prefill(state, ids_for(512))
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1)
    out = profiled(lambda: list(engine.generate(state, result.logits, params)), device, steps)
    show_profile("decode", out, device)
    return out


def profile_suffix(engine, device: str, tokens: int = 2048) -> dict:
    """A `tokens`-token prefill after a 512-token one (the shape of the worst request after a tool:
    every layer streams nearly all its experts) under the profiler, per 1,000 tokens; with the
    bytes it moved and their rate over the copies' device time."""
    state = engine.new_state()
    engine.prefill(state, ids_for(512))
    before = engine.offload_stats()["bytes_in_prefill"]
    out = profiled(lambda: engine.prefill(state, ids_for(tokens)), device, tokens / 1000)
    out["bytes"] = engine.offload_stats()["bytes_in_prefill"] - before
    copies_s = out["copies_ms_per_token"] * tokens / 1e6
    out["copy_bytes_per_s"] = out["bytes"] / copies_s if copies_s else None
    show_profile(f"{tokens}-token suffix", out, device, "1,000 tokens")
    if out["copy_bytes_per_s"]:
        print(
            f"  {out['bytes'] / 1e9:.2f} GB copied at {out['copy_bytes_per_s'] / 1e9:.1f} GB/s of copy time"
        )
    return out


def q4_k_m_file(preset: str) -> Path:
    """The preset as a random Q4_K_M GGUF (llama-quantize's types and layout), written on first use."""
    from peer.gguf_random import random_gguf  # noqa: PLC0415
    from peer.llama_server import PEER_HOME  # noqa: PLC0415

    return random_gguf(preset, PEER_HOME / "models")


def replay(engine, args, budget: float, link_bw: float | None) -> dict:
    """Each policy over `args.traces` on a fresh store, with this engine (adapters/replay.py). With
    `link_bw` (the measured link), each TTFT is also projected to `args.pcie` from the bytes the
    server moved host -> device until that first token (`x-link-bytes`: restores and experts)."""
    from adapters.replay import load_traces, run_policy, serve_in_thread  # noqa: PLC0415
    from adapters.replay_report import request_table, summarize  # noqa: PLC0415
    from gateway.service import ServeConfig  # noqa: PLC0415

    traces = load_traces([Path(p) for p in args.traces])
    out, runs = {}, []
    for policy in args.policies.split(","):
        config = ServeConfig(  # one live sequence: those kept after their answer hold KV outside the plan
            preset=args.preset,
            model_dir=q4_k_m_file(args.preset) if args.q4_k_m else None,
            engine=engine.engine_config,  # one sequence, the budget, --step-log
            policy=policy,
            live_sequences=1,
        )
        with serve_in_thread(config, engine) as server:
            run = run_policy(server.url, policy, traces, args.limit, server.wait_idle, False, lambda: None)
        runs.append(run)
        users = [r for r in run.rows if r.index > 0 and not r.after_tool_result]
        user = [r.client_ttft_ms for r in users]
        summary = summarize(run)
        out[policy] = {
            "worst_after_tool_ms": summary.worst_after_tool_ms,
            "user_turn_ttft_ms": user,
            "worst_user_turn_ms": max(user, default=None),
            "prefilled_tokens": summary.prefilled_tokens,
            "p50_ttft_ms": summary.p50_ttft_ms,
            "seconds": summary.seconds,
            "requests": [msgspec.to_builtins(r) for r in run.rows],  # each with the server's phases
        }
        if link_bw is not None and all(r.link_bytes is not None for r in run.rows):

            def pcie4(r) -> float:
                return 1000 * project(r.client_ttft_ms / 1000, r.link_bytes, link_bw, args.pcie)

            out[policy]["worst_after_tool_ms_pcie4"] = max(
                (pcie4(r) for r in run.rows if r.after_tool_result), default=None
            )
            out[policy]["user_turn_ttft_ms_pcie4"] = [pcie4(r) for r in users]
    console = Console(width=200)
    console.print(request_table(runs))
    for run in runs:  # where each request's time to first token went, by the server's phases
        for r in run.rows:
            phases = " ".join(f"{k} {v:,.0f}" for k, v in (r.server_timing or {}).items())
            console.print(f"{run.policy} #{r.index} ({r.prefilled_tokens:,} prefilled): {phases}")
    return out


def run_budget(args) -> dict:
    """One budget in this process (the child). Each stage's figures go to `args.json` as soon as
    they are measured (and a line to stdout), so a child stopped part-way still leaves them."""
    from engine import Engine  # noqa: PLC0415
    from engine.offload import BudgetError  # noqa: PLC0415
    from engine.warmup import warm_up  # noqa: PLC0415

    budget = float(args.budgets)
    out: dict = {"budget_gib": budget, "stages": []}

    def done(stage: str, started: float, **figures) -> None:
        seconds = time.perf_counter() - started
        out.update(figures)
        out["stages"].append({"stage": stage, "s": round(seconds, 3)})
        Path(args.json).write_text(json.dumps(out, indent=2))
        shown = ", ".join(f"{k} {v:,.1f}" for k, v in figures.items() if isinstance(v, float))
        print(f"{budget:g} GiB: {stage} in {seconds:.1f} s{': ' + shown if shown else ''}", flush=True)

    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    try:
        if args.q4_k_m:
            engine = Engine.load(
                q4_k_m_file(args.preset),
                device=args.device,
                gpu_memory_gib=budget,
                max_running=1,
                step_log_ms=args.step_log,  # the replay's slow forwards, each split into host and device time
            )
        else:
            engine = Engine.from_preset(
                args.preset,
                device=args.device,
                gpu_memory_gib=budget,
                max_running=1,
                step_log_ms=args.step_log,
            )
    except BudgetError as exc:  # a row saying why
        return {"budget_gib": budget, "error": str(exc)}
    done("load", started, load_s=time.perf_counter() - started)
    started = time.perf_counter()
    warm_up(engine)
    offload = engine.offload
    link = offload.link
    link_bw = bulk_link(args.device) if link is not None else float("nan")
    done(
        "warm-up",
        started,
        plan={k: getattr(offload.plan, k) for k in ("dense", "states", "workspace", "expert_bytes", "slots")},
        experts=engine.config.num_experts,
        policy={
            "stream_tokens": offload.policy.stream_tokens,
            "cpu_rows": offload.policy.cpu_rows,
        },
        link=None
        if link is None
        else {
            "bulk_h2d_bytes_per_s": link_bw,
            "h2d_bytes_per_s": link.h2d_bytes_per_s,
            "host_expert_s": link.host_expert_s,
            "host_row_s": link.host_row_s,
        },
    )
    started = time.perf_counter()
    done("prefill and decode", started, **measure(engine, args.device, args.context, args.decode_steps))
    if link is not None:
        out["prefill_s_pcie4"] = project(out["prefill_s"], out["prefill_bytes"], link_bw, args.pcie)
        per_token = out["decode_s"] / max(out["decode_steps"], 1)
        out["decode_tok_s_pcie4"] = 1 / project(per_token, out["decode_bytes_per_token"], link_bw, args.pcie)
    if args.device == "cuda":  # where a decode token's wall time goes, without the profiler
        from timeline import decode_timeline, show  # noqa: PLC0415

        started = time.perf_counter()
        done("decode timeline", started, timeline=decode_timeline(engine, ids_for(512)))
        show("decode", out["timeline"])
    if args.profile:
        started = time.perf_counter()
        done("decode profile", started, profile=profile_decode(engine, args.device))
        started = time.perf_counter()
        done("suffix profile", started, profile_suffix=profile_suffix(engine, args.device))
    if offload.staging_bytes and not offload.holds_all:  # the same decode reading host memory where it lies
        started = time.perf_counter()
        offload.stage_reads(False)
        baseline = measure(engine, args.device, args.context, args.decode_steps)
        offload.stage_reads(True)
        done("decode in place", started, decode_in_place_tok_s=baseline["decode_tok_s"])
    if args.device == "cuda":  # the plan covers the decode slots, not the KV that sequences keep on their own
        out["peak_reserved_bytes"] = offload.peak_reserved()
        out["within_budget"] = out["peak_reserved_bytes"] <= budget * (1 << 30)
    if args.traces:
        if args.step_log is not None:  # the replay's server logs its slow steps and forwards (replay())
            logging.basicConfig(format="%(message)s")
            for name in ("engine.engine", "engine.step_log", "gateway.scheduler"):
                logging.getLogger(name).setLevel(logging.INFO)
        started = time.perf_counter()
        done("replay", started, replay=replay(engine, args, budget, link_bw if link is not None else None))
        if args.device == "cuda":  # live sequences and restored states included
            out["peak_reserved_replay_bytes"] = offload.peak_reserved()
    return out


def llama_side(args) -> dict:
    """llama-server with every layer's experts on the CPU, the same traces (chat ones)."""
    import msgspec  # noqa: PLC0415

    from adapters.client import http_wait_idle  # noqa: PLC0415
    from adapters.readers import read_trace  # noqa: PLC0415
    from peer.compare import llama_sample, summarise  # noqa: PLC0415
    from peer.compare import replay as llama_replay
    from peer.gguf_export import preset_gguf  # noqa: PLC0415
    from peer.llama_server import PEER_HOME, LlamaServer, build  # noqa: PLC0415

    materialise = args.device if env.materialise() else None
    gguf = (
        q4_k_m_file(args.preset)
        if args.q4_k_m
        else preset_gguf(args.preset, PEER_HOME / "models", args.gguf_dtype, materialise)
    )
    cuda = args.device == "cuda"
    out = {}
    for path in args.traces:
        for trace in read_trace(path):
            if trace.protocol != "chat":
                continue
            if args.limit:  # the requests our side replays
                trace = msgspec.structs.replace(trace, requests=trace.requests[: args.limit])
            server = LlamaServer(
                gguf,
                ctx_size=args.llama_ctx,
                threads=args.threads,
                gpu_layers=999 if cuda else None,
                binary=build(cuda=cuda),
                extra=["--n-cpu-moe", "999"],
                log_path=PEER_HOME / "llama-server-offload.log",
            )
            with server:
                samples = llama_replay(server.url, trace, llama_sample, between=http_wait_idle(server.url))
            s = summarise(samples)
            out[trace.session_id] = {
                "worst_after_tool_ms": s.worst_ttft_after_tool_ms,
                "user_turn_ttft_ms": [x.ttft_ms for x in samples[1:] if not x.after_tool_result],
            }
    return out


def child(args, budget: str) -> dict:
    """Run one budget in a fresh interpreter; its JSON result."""
    out = Path(args.json).with_suffix(f".{budget}.json")
    argv = [sys.executable, __file__, "--child", "--budgets", budget, "--json", str(out)]
    for name in ("preset", "device", "context", "decode_steps", "pcie", "policies", "limit", "step_log"):
        if (value := getattr(args, name)) is not None:
            argv += [f"--{name.replace('_', '-')}", str(value)]
    argv += ["--traces", *args.traces] if args.traces else ["--no-replay"]
    argv += ["--q4-k-m"] if args.q4_k_m else []
    argv += ["--profile"] if args.profile else []
    code = subprocess.run(argv).returncode
    result = json.loads(out.read_text()) if out.exists() else {"budget_gib": float(budget)}
    out.unlink(missing_ok=True)
    if code != 0:  # a crash (out of memory, a kernel failure) is a row, not the end; what it measured stays
        stages = [s["stage"] for s in result.get("stages", [])]
        after = f" after {', '.join(stages)}" if stages else ""
        result["error"] = f"the child process exited with {code}{after} (its output above)"
    return result


def gib(n: float | None) -> str:
    return "-" if n is None else f"{n / (1 << 30):.2f}"


def ms(n: float | None) -> str:
    return "-" if n is None else f"{n:,.0f}"


def tables(results: list[dict], llama: dict | None, console: Console) -> None:
    t = Table(title="expert offload: speed, cache, link")
    for col in (
        "budget GiB",
        "slots/E",
        "prefill tok/s",
        "PCIe4 proj.",
        "prefill GiB moved",
        "prefill hit",
        "decode tok/s",
        "in place",
        "PCIe4 proj.",
        "MiB/token",
        "decode hit",
        "host experts",
        "link GB/s",
        "peak GiB",
        "peak replay",
    ):
        t.add_column(col, justify="right")
    for r in results:
        if "error" in r:
            console.print(f"[bold]{r['budget_gib']:g} GiB[/]: {r['error']}")
        if "prefill_tok_s" not in r:  # stopped before its figures
            continue
        link = r["link"]["bulk_h2d_bytes_per_s"] / 1e9 if r.get("link") else None
        t.add_row(
            f"{r['budget_gib']:g}",
            f"{r['plan']['slots']}/{r['experts']}",
            f"{r['prefill_tok_s']:,.0f}",
            f"{r['prefill_tokens'] / r['prefill_s_pcie4']:,.0f}" if "prefill_s_pcie4" in r else "-",
            gib(r["prefill_bytes"]),
            str(r["prefill_hit_rate"]),
            f"{r['decode_tok_s']:.1f}",
            f"{r['decode_in_place_tok_s']:.1f}" if "decode_in_place_tok_s" in r else "-",
            f"{r['decode_tok_s_pcie4']:.1f}" if "decode_tok_s_pcie4" in r else "-",
            f"{r['decode_bytes_per_token'] / (1 << 20):.1f}",
            str(r["decode_hit_rate"]),
            str(r["decode_on_host"]),
            "-" if link is None else f"{link:.1f}",
            gib(r.get("peak_reserved_bytes")),
            gib(r.get("peak_reserved_replay_bytes")),
        )
    console.print(t)
    if not any("replay" in r for r in results):
        return
    t = Table(title="replay: TTFT (ms) per policy")
    for col in (
        "budget GiB",
        "policy",
        "worst after a tool",
        "PCIe4 proj.",
        "worst at a user turn",
        "user turns",
        "PCIe4 proj.",
        "prefilled",
    ):
        t.add_column(col, justify="right")
    for r in results:
        for policy, p in r.get("replay", {}).items():
            t.add_row(
                f"{r['budget_gib']:g}",
                policy,
                ms(p["worst_after_tool_ms"]),
                ms(p.get("worst_after_tool_ms_pcie4")),
                ms(p["worst_user_turn_ms"]),
                " ".join(ms(x) for x in p["user_turn_ttft_ms"]),
                " ".join(ms(x) for x in p.get("user_turn_ttft_ms_pcie4", [])) or "-",
                f"{p['prefilled_tokens']:,}",
            )
    for session, p in (llama or {}).items():
        t.add_row(
            "-",
            f"llama.cpp --n-cpu-moe ({session})",
            ms(p["worst_after_tool_ms"]),
            "-",
            ms(max(p["user_turn_ttft_ms"], default=None)),
            " ".join(ms(x) for x in p["user_turn_ttft_ms"]),
            "-",
            "-",
        )
    console.print(t)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3.6-35b-a3b")
    p.add_argument(
        "--q4-k-m",
        action="store_true",
        help="the preset's random Q4_K_M GGUF (peer.gguf_random, written once under .peer/models) "
        "instead of its bf16 weights: the experts offloaded in their packed form",
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--budgets", default="8,12,24", help="GiB, comma-separated ('' with --llama-server: its side only)"
    )
    p.add_argument("--context", type=int, default=8192, help="prefill tokens")
    p.add_argument("--decode-steps", type=int, default=64)
    p.add_argument("--pcie", type=float, default=PCIE4_X16, help="bytes/s of the projected link")
    p.add_argument("--traces", nargs="*", default=[DEFAULT_TRACE])
    p.add_argument("--no-replay", action="store_true")
    p.add_argument(
        "--policies",
        default="anchor,prefix,none",
        help="capture policies to replay",
    )
    p.add_argument("--limit", type=int, default=None, help="requests per trace")
    p.add_argument(
        "--step-log",
        type=float,
        default=None,
        metavar="MS",
        help="during the replay, log each prefill forward slower than MS ms: its time fitting the budget, "
        "queueing the forward and on the device after it (a sync after each forward), link bytes, expert slots",
    )
    p.add_argument("--llama-server", action="store_true", help="also llama-server with --n-cpu-moe")
    p.add_argument(
        "--profile",
        action="store_true",
        help="profile 4 decode steps and a 2,048-token suffix's prefill per budget",
    )
    p.add_argument("--gguf-dtype", default="bf16")
    p.add_argument("--llama-ctx", type=int, default=65536)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--json", default="bench/offload.json")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.no_replay:
        args.traces = []
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        Path(args.json).write_text(json.dumps(run_budget(args), indent=2))
        return 0
    console = Console(width=200)
    results = [child(args, budget) for budget in args.budgets.split(",") if budget]
    llama = llama_side(args) if args.llama_server else None
    tables(results, llama, console)
    meta = {
        "preset": args.preset,
        "weights": "random Q4_K_M GGUF" if args.q4_k_m else "bf16",
        "device": args.device,
        "context": args.context,
        "pcie_bytes_per_s": args.pcie,
        "traces": args.traces,
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
    }
    Path(args.json).write_text(
        json.dumps({"meta": meta, "budgets": results, "llama_server": llama}, indent=2)
    )
    console.print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
