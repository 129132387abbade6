"""Quantized weights at the full 256-expert 35B-A3B shape: bf16, FP8 and Q4_K_M side by
side in our engine, and llama-server on the same Q4_K_M file.

    FT_MATERIALISE=1 python bench/quant.py [--llama] [--parts bf16,fp8,q4_k_m,replay-ft,llama,replay-llama] \
        [--replay traces/sessions/small-bugfix.recording.jsonl] [--json bench/quant.json]

Weights without downloads. `bf16`: the preset's random weights (FT_MATERIALISE=1 builds them in GPU
memory; on the CPU the preset's own dtype). `fp8`: the same weights block-quantized as Qwen's -FP8
releases are (`presets.fp8_checkpoint`) on the device they were built on, and read by the loader's FP8
path from there (`fp8_engine`: no folder is written). `q4_k_m`: a GGUF of random blocks with
llama-quantize's tensor types and layout (`peer.gguf_random`, ~21 GB at this shape, cached under
.peer/models). Each is loaded by the engine's loading path (`Engine.from_preset` / `Engine.load` /
`loader.state_dict_of`), so this measures what the engine does with them, whatever that is.

Per format: resident weight bytes (`Engine.memory()`), file size, load seconds, prefill tok/s of
one sequence (`--prefill`, 8K), decode tok/s at batch 1 and 4 (runner steps at `--context`).
With `--llama` (or these parts named): `llama`, llama-server (CUDA build, every layer on the GPU)
on the same Q4_K_M file, prefill and batch-1 decode from its /completion timings; `replay-ft` /
`replay-llama`, a committed session replayed on our gateway over the Q4_K_M engine (in this process,
`ft serve --model FILE.gguf`'s runtime; the recorded answers teacher-forced, as the agent ran it)
and on llama-server over the same file (1-token probes, bench/llamacpp.py's way): worst TTFT after
a tool.

Results merge into `--json` part by part, so the parts can run in separate processes (each under a
time limit); the table covers every part the file holds, with the targets beside the figures.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

PARTS = ("bf16", "fp8", "q4_k_m", "replay-ft", "llama", "replay-llama")  # the order they run in
FORMATS = ("bf16", "fp8", "q4_k_m")
LLAMA_PARTS = ("replay-ft", "llama", "replay-llama")  # --llama
GB = 1e9


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def ids_for(n: int, seed: int) -> list[int]:
    """Random ids below Qwen3.6's special tokens."""
    r = random.Random(seed)
    return [r.randrange(248_000) for _ in range(n)]


# -- weights


def folder_bytes(path: Path) -> int:
    return (
        path.stat().st_size
        if path.is_file()
        else sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    )


def fp8_engine(preset: str, device: str):
    """Preset `preset` built on `device` and block-quantized as Qwen's -FP8 releases are
    (`presets.fp8_checkpoint`), tensor by tensor as each bf16 one is dropped, through the FP8 path of
    the loader (`loader.state_dict_of`: weights paired with their scales, packed, experts stacked)
    without a folder between (a ~36 GB folder would take minutes to write):
    (engine, the checkpoint's bytes)."""
    from engine import Engine  # noqa: PLC0415
    from engine.loader import build_model, fingerprint, state_dict_of  # noqa: PLC0415
    from engine.presets import fp8_checkpoint, materialise, unstack_experts  # noqa: PLC0415
    from engine.quant import fp8  # noqa: PLC0415

    config, _, built = materialise(preset, device)
    dtype = built["lm_head.weight"].dtype
    size = 0

    def checkpoint():
        nonlocal size
        for name in list(built):
            for n, t in unstack_experts({name: built.pop(name)}).items():
                for item in fp8_checkpoint({n: t})[0].items():
                    size += item[1].nbytes
                    yield item

    pack = None
    if torch.device(device).type == "cuda":  # as `Engine.load` does on a GPU: the weights stay FP8
        from engine.ops.gpu.quant import pack_fp8  # noqa: PLC0415

        pack = pack_fp8
    state_dict = state_dict_of(checkpoint(), fp8.Pairing(fp8.BLOCK, dtype, pack), None)
    return Engine(build_model(config, state_dict), fingerprint(config, state_dict)), size


def checkpoint_bytes(preset: str) -> int:
    """The preset's weights in its own dtype: what an HF folder of it holds (without writing one)."""
    from engine.config import ModelConfig  # noqa: PLC0415
    from engine.model import HybridForCausalLM  # noqa: PLC0415
    from engine.presets import preset_config  # noqa: PLC0415

    raw = preset_config(preset)
    with torch.device("meta"):
        params = HybridForCausalLM(ModelConfig.from_dict(raw)).state_dict().values()
    return sum(p.numel() for p in params) * getattr(torch, raw["dtype"]).itemsize


def load_format(fmt: str, args) -> tuple[object, int]:
    """(engine, file bytes) for one format, by the engine's loading path (FP8: `fp8_engine`)."""
    from engine import Engine  # noqa: PLC0415
    from peer.gguf_random import random_gguf  # noqa: PLC0415
    from peer.llama_server import PEER_HOME  # noqa: PLC0415

    if fmt == "bf16":
        eng = Engine.from_preset(args.preset, device=args.device)
        source = eng.model_dir
        return eng, folder_bytes(source) if source else checkpoint_bytes(args.preset)
    if fmt == "fp8":
        return fp8_engine(args.preset, args.device)
    path = random_gguf(args.preset, PEER_HOME / "models")
    return Engine.load(path, device=args.device), folder_bytes(path)


# -- our engine


def bench_prefill(eng, tokens: int) -> tuple[dict, torch.Tensor]:
    """Prefill tok/s of a `tokens` prompt (best of two, after one that compiles), and its last logits (fp32)."""
    ids = ids_for(tokens, tokens)
    logits = eng.prefill(eng.new_state(), ids).logits.float()  # compile and autotune at this shape
    seconds = min(timed(eng.device, lambda: eng.prefill(eng.new_state(), ids)) for _ in range(2))
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds}, logits


DECODE_RUNS = 3  # timed decode runs a figure is the best of, ours and llama-server's alike (each run's kept)


def spread(decode: dict) -> str:
    return " / ".join(f"{t:.1f}" for t in decode["runs_tok_s"])


def bench_decode(eng, context: int, batch: int, steps: int) -> dict:
    """`batch` sequences of `context` tokens decoded together, one runner step per token of each:
    the best of DECODE_RUNS runs of `steps` steps."""
    from engine import Feed  # noqa: PLC0415

    states = [eng.new_state() for _ in range(batch)]
    for i, state in enumerate(states):
        eng.prefill(state, ids_for(context, 10 + i))

    def run(n: int) -> None:
        for t in range(n):
            eng.step([(Feed(s, [1000 + t + i]), 1) for i, s in enumerate(states)])

    run(4)  # the batch bucket's graph is captured here
    runs = [timed(eng.device, lambda: run(steps)) / steps for _ in range(DECODE_RUNS)]
    seconds = min(runs)
    return {
        "batch": batch,
        "context": context,
        "steps": steps,
        "ms_per_step": seconds * 1e3,
        "tok_s_per_sequence": 1 / seconds,
        "tok_s": batch / seconds,
        "runs_tok_s": [batch / r for r in runs],
    }


def bench_format(fmt: str, args, keep: dict) -> dict:
    """One format's figures; its engine is left in `keep` when the replay on our side follows."""
    start = time.perf_counter()
    eng, file_bytes = load_format(fmt, args)
    load_s = time.perf_counter() - start
    memory = eng.memory()
    row = {
        "format": fmt,
        "dtype": str(eng.dtype),
        "device": str(eng.device),
        "file_bytes": file_bytes,
        "weights_bytes": memory["weights"],
        "weights_vs_file": memory["weights"] / file_bytes,
        "load_s": load_s,
    }
    print(
        f"{fmt}: loaded in {load_s:.1f} s, {memory['weights'] / GB:.2f} GB resident, file {file_bytes / GB:.2f} GB",
        flush=True,
    )
    row["prefill"], _ = bench_prefill(eng, args.prefill)
    print(f"{fmt}: prefill {args.prefill}: {row['prefill']['tok_s']:.0f} tok/s", flush=True)
    if eng.device.type == "cuda" and fmt in ("bf16", "fp8"):
        if args.profile:  # the kernels of the prefill, by device time
            from gpu import profile_prefill  # noqa: PLC0415

            row["profile_prefill"] = profile_prefill(eng, args.prefill, host_top=15)
    row["decode"] = [bench_decode(eng, args.context, b, args.steps) for b in args.batches]
    for d in row["decode"]:
        print(
            f"{fmt}: decode B={d['batch']} at {d['context']}: {d['tok_s']:.1f} tok/s (runs {spread(d)})",
            flush=True,
        )
    if (
        eng.device.type == "cuda" and args.batches
    ):  # where a generated token's wall time goes (host, launch, device)
        from timeline import decode_timeline, show  # noqa: PLC0415

        row["timeline"] = decode_timeline(eng, ids_for(args.context, 3))
        show(f"{fmt}: generate", row["timeline"])
        if args.profile:  # the kernels of a decode token, by device time
            row["profile_decode"] = profile_generate(eng, ids_for(args.context, 3), fmt)
    row["memory"] = eng.memory()
    if fmt == "q4_k_m" and "replay-ft" in args.parts:
        keep["q4_k_m"] = eng
    del eng
    release()
    if torch.cuda.is_available():  # what the next part starts with (a leak would show here)
        row["gpu_allocated_after_bytes"] = torch.cuda.memory_allocated()
    return row


def profile_generate(eng, prompt: list[int], name: str, steps: int = 8) -> dict:
    """`steps` greedy decode steps under torch's profiler (bench/offload.py's `profiled`)."""
    from offload import profiled, show_profile  # noqa: PLC0415
    from timeline import decoding  # noqa: PLC0415

    from engine import SamplingParams  # noqa: PLC0415

    state, logits = decoding(eng, prompt)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1)
    out = profiled(lambda: list(eng.generate(state, logits, params)), "cuda", steps, top=20)
    show_profile(f"{name}: decode", out, "cuda")
    return out


def release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- llama-server


def llama_server(args, path: Path, ctx: int, parallel: int = 1):
    from peer.llama_server import PEER_HOME, LlamaServer, build  # noqa: PLC0415

    cuda = args.device != "cpu"
    extra = list(args.llama_arg)
    if not cuda:  # its CPU repacking of quantized weights crashed llama-server 11434 at start here
        extra.append("--no-repack")
    return LlamaServer(
        path,
        ctx_size=ctx,
        threads=args.threads,
        parallel=parallel,
        gpu_layers=999 if cuda else None,
        binary=build(cuda=cuda),
        extra=extra,
        log_path=PEER_HOME / "llama-server-quant.log",
    )


def completion_timings(url: str, ids: list[int], n_predict: int) -> dict:
    import httpx  # noqa: PLC0415

    body = {
        "prompt": ids,
        "n_predict": n_predict,
        "temperature": 0,
        "top_k": 1,
        "cache_prompt": False,
        "ignore_eos": True,
    }
    r = httpx.post(url + "/completion", json=body, timeout=3600)
    r.raise_for_status()
    return r.json()["timings"]


def bench_llama(args) -> dict:
    """llama-server on the Q4_K_M file: prompt tok/s of one `--prefill` prompt (best of two) and
    generation tok/s after a `--context` prompt (best of DECODE_RUNS, as ours), after a warm-up request."""
    from peer.gguf_random import random_gguf  # noqa: PLC0415
    from peer.llama_server import PEER_HOME  # noqa: PLC0415

    path = random_gguf(args.preset, PEER_HOME / "models")
    ctx = max(args.prefill, args.context + args.steps) + 256
    start = time.perf_counter()
    with llama_server(args, path, ctx) as server:
        load_s = time.perf_counter() - start
        completion_timings(server.url, ids_for(256, 1), 8)
        prefill = [completion_timings(server.url, ids_for(args.prefill, args.prefill), 1) for _ in range(2)]
        decode = [
            completion_timings(server.url, ids_for(args.context, 3), args.steps) for _ in range(DECODE_RUNS)
        ]
    best_prefill = max(prefill, key=lambda t: t["prompt_per_second"])
    best_decode = max(decode, key=lambda t: t["predicted_per_second"])
    row = {
        "file_bytes": folder_bytes(path),
        "load_s": load_s,
        "llama_args": args.llama_arg,
        "prefill": {
            "tokens": args.prefill,
            "tok_s": best_prefill["prompt_per_second"],
            "timings": best_prefill,
        },
        "decode": {
            "batch": 1,
            "context": args.context,
            "steps": args.steps,
            "tok_s": best_decode["predicted_per_second"],
            "timings": best_decode,
            "runs_tok_s": [t["predicted_per_second"] for t in decode],
        },
    }
    print(
        f"llama.cpp: prefill {args.prefill}: {row['prefill']['tok_s']:.0f} tok/s; decode B=1 at {args.context}: "
        f"{row['decode']['tok_s']:.1f} tok/s (runs {spread(row['decode'])})",
        flush=True,
    )
    return row


# -- replay


def session_traces(args) -> list:
    import msgspec  # noqa: PLC0415

    from adapters.readers import read_trace  # noqa: PLC0415

    traces = [t for t in read_trace(args.replay) if t.protocol == "chat" and t.requests]
    if args.max_requests:
        traces = [msgspec.structs.replace(t, requests=t.requests[: args.max_requests]) for t in traces]
    return traces


def replay_sessions(side: str, args, serve) -> dict:
    """Each session on a fresh server from `serve()` (a context manager with `url`), timed from its start."""
    import msgspec  # noqa: PLC0415

    from peer.compare import gateway_forced_sample, llama_sample, replay, summarise  # noqa: PLC0415

    sessions = {}
    for trace in session_traces(args):
        start = time.perf_counter()
        with serve() as server:
            start_s = time.perf_counter() - start
            if side == "replay-ft":
                samples = replay(server.url, trace, gateway_forced_sample, between=server.wait_idle)
            else:
                samples = replay(server.url, trace, llama_sample)
        summary = msgspec.to_builtins(summarise(samples))
        sessions[trace.session_id] = {
            "server_start_s": start_s,
            "summary": summary,
            "samples": msgspec.to_builtins(samples),
        }
        print(
            f"{side} {trace.session_id}: worst TTFT after a tool {summary['worst_ttft_after_tool_ms']:.0f} ms, "
            f"total {summary['total_ttft_ms'] / 1e3:.1f} s",
            flush=True,
        )
    return {"trace": str(args.replay), "max_requests": args.max_requests, "sessions": sessions}


def replay_ft(args, eng) -> dict:
    """The committed session on our gateway, in this process, over the Q4_K_M engine (`ft serve
    --model FILE.gguf`'s runtime on the loaded model): each request with its recorded answer forced
    and streamed, the next sent once the worker is idle (background precompute done), as the agent ran."""
    from engine.warmup import warm_up  # noqa: PLC0415
    from gateway.embedded import serve_in_thread  # noqa: PLC0415
    from gateway.service import ServeConfig  # noqa: PLC0415

    config = ServeConfig(model_dir=eng.model_dir, engine=eng.engine_config, ram_cache_gib=args.ram_cache)
    warm_up(eng)  # what `ft serve` does before serving
    return replay_sessions("replay-ft", args, lambda: serve_in_thread(config, eng))


def replay_llama(args) -> dict:
    """The committed session on llama-server over the same file, 1-token probes (bench/llamacpp.py's way)."""
    from peer.gguf_random import random_gguf  # noqa: PLC0415
    from peer.llama_server import PEER_HOME  # noqa: PLC0415

    path = random_gguf(args.preset, PEER_HOME / "models")
    return replay_sessions("replay-llama", args, lambda: llama_server(args, path, args.ctx))


# -- report


def worst_after_tool(part: dict | None) -> float | None:
    if not part:
        return None
    return max(s["summary"]["worst_ttft_after_tool_ms"] for s in part["sessions"].values())


def decode_tok_s(row: dict | None, batch: int) -> float | None:
    return next((d["tok_s"] for d in (row or {}).get("decode", []) if d["batch"] == batch), None)


def targets(result: dict) -> list[dict]:
    """The targets, each as measured / reference against the ratio it asks for."""
    f, llama = result.get("formats", {}), result.get("llama")
    bf16, fp8, q4 = f.get("bf16"), f.get("fp8"), f.get("q4_k_m")

    def ratio(name, a, b, goal, at_most=False):
        value = a / b if a is not None and b else None
        met = None if value is None else (value <= goal if at_most else value >= goal)
        return {
            "target": name,
            "measured": a,
            "reference": b,
            "ratio": value,
            "goal": goal,
            "at_most": at_most,
            "met": met,
        }

    pre = lambda row: row["prefill"]["tok_s"] if row else None  # noqa: E731
    return [
        ratio(
            "Q4_K_M decode B=1 vs llama.cpp (tok/s)",
            decode_tok_s(q4, 1),
            llama and llama["decode"]["tok_s"],
            1.5,
        ),
        ratio("Q4_K_M prefill vs llama.cpp (tok/s)", pre(q4), pre(llama), 1.0),
        ratio(
            "Q4_K_M resident weights vs file (bytes)",
            q4 and q4["weights_bytes"],
            q4 and q4["file_bytes"],
            1.05,
            True,
        ),
        ratio("FP8 prefill vs bf16 (tok/s)", pre(fp8), pre(bf16), 1.3),
        ratio("FP8 decode B=1 vs bf16 (tok/s)", decode_tok_s(fp8, 1), decode_tok_s(bf16, 1), 1.5),
        ratio("FP8 decode B=4 vs bf16 (tok/s)", decode_tok_s(fp8, 4), decode_tok_s(bf16, 4), 1.5),
        ratio(
            "replay worst TTFT after a tool, ours vs llama.cpp (ms)",
            worst_after_tool(result.get("replay-ft")),
            worst_after_tool(result.get("replay-llama")),
            1.0,
            True,
        ),
    ]


def table(result: dict) -> str:
    def num(x, fmt=".0f"):
        return "—" if x is None else format(x, fmt)

    lines = [
        f"preset {result['preset']} on {result['device_name']}; prefill {result['prefill']} tokens, decode at "
        f"{result['context']} ({result['steps']} steps)",
        "",
        "| format | activations | file GB | resident GB | resident/file | load s | prefill tok/s | decode B=1 tok/s | decode B=4 tok/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for fmt, r in result.get("formats", {}).items():
        lines.append(
            f"| {fmt} (ours) | {r['dtype'].removeprefix('torch.')} | {r['file_bytes'] / GB:.2f} | {r['weights_bytes'] / GB:.2f} "
            f"| {r['weights_vs_file']:.2f} | {r['load_s']:.0f} | {r['prefill']['tok_s']:.0f} | {num(decode_tok_s(r, 1), '.1f')} "
            f"| {num(decode_tok_s(r, 4), '.1f')} |"
        )
    if llama := result.get("llama"):
        lines.append(
            f"| q4_k_m (llama.cpp) | Q4_K_M | {llama['file_bytes'] / GB:.2f} | — | — | {llama['load_s']:.0f} "
            f"| {llama['prefill']['tok_s']:.0f} | {llama['decode']['tok_s']:.1f} | — |"
        )
    lines += [
        "",
        "| target | measured | reference | ratio | goal | met |",
        "|---|---|---|---|---|---|",
    ]
    for t in targets(result):
        goal = ("≤ " if t["at_most"] else "≥ ") + f"{t['goal']:g}"
        met = "—" if t["met"] is None else ("yes" if t["met"] else "**no**")
        lines.append(
            f"| {t['target']} | {num(t['measured'], '.4g')} | {num(t['reference'], '.4g')} | {num(t['ratio'], '.2f')} | {goal} | {met} |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3.6-35b-a3b")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--parts", default=",".join(FORMATS), help=f"comma list of {', '.join(PARTS)} (default: the formats)"
    )
    p.add_argument(
        "--llama", action="store_true", help=f"also {', '.join(LLAMA_PARTS)}: llama-server on the Q4_K_M file"
    )
    p.add_argument("--prefill", type=int, default=8192, help="prefill: tokens of one sequence")
    p.add_argument(
        "--context", type=int, default=4096, help="decode: tokens of each sequence before decoding"
    )
    p.add_argument("--steps", type=int, default=64, help="decode: timed steps")
    p.add_argument(
        "--batches",
        type=ints,
        default=[1, 4],
        help="decode: sequences decoded together (--batches= : no decode, prefill only)",
    )
    p.add_argument("--replay", type=Path, default=Path("traces/sessions/small-bugfix.recording.jsonl"))
    p.add_argument("--max-requests", type=int, help="replay: the first N requests of each session")
    p.add_argument("--ctx", type=int, default=32768, help="replay: llama-server context size")
    p.add_argument("--threads", type=int, default=8, help="llama-server CPU threads")
    p.add_argument(
        "--llama-arg", action="append", default=[], metavar="ARG", help="extra llama-server argument (repeat)"
    )
    p.add_argument("--ram-cache", type=float, default=48.0, help="replay: our checkpoints' RAM tier, GiB")
    p.add_argument(
        "--json", type=Path, default=Path("bench/quant.json"), help="results, merged into what it holds"
    )
    p.add_argument("--markdown", type=Path)
    p.add_argument(
        "--profile", action="store_true", help="GPU: the kernels of a decode token (torch's profiler)"
    )
    args = p.parse_args(argv)
    args.parts = list(
        dict.fromkeys([x for x in args.parts.split(",") if x] + list(LLAMA_PARTS if args.llama else ()))
    )
    unknown = set(args.parts) - set(PARTS)
    if unknown:
        p.error(f"unknown parts {sorted(unknown)}; parts: {', '.join(PARTS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    os.environ.setdefault("FT_MATERIALISE", "1" if args.device != "cpu" else "0")
    result = json.loads(args.json.read_text()) if args.json.is_file() else {}
    same = {
        "preset": args.preset,
        "device": args.device,
        "prefill": args.prefill,
        "context": args.context,
        "steps": args.steps,
    }
    if any(result.get(k) != v for k, v in same.items()):
        result = {}  # another configuration: start over
    result |= same | {
        "device_name": torch.cuda.get_device_name() if args.device != "cpu" else "cpu",
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    result.setdefault("commands", []).append(" ".join(["python", "bench/quant.py", *argv]))
    keep: dict = {}  # the Q4_K_M engine, from its part to our replay; bf16's last logits for FP8's
    for part in sorted(args.parts, key=PARTS.index):
        if part in FORMATS:
            result.setdefault("formats", {})[part] = bench_format(part, args, keep)
        elif part == "replay-ft":
            result[part] = replay_ft(args, keep.pop("q4_k_m", None) or load_format("q4_k_m", args)[0])
            release()
        elif part == "llama":
            result["llama"] = bench_llama(args)
        else:
            result[part] = replay_llama(args)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**result, "targets": targets(result)}, indent=2))  # after each part
    text = table(result)
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
