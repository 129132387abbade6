"""`ft serve`: serve a model to coding agents (Anthropic Messages, OpenAI Responses and Chat
Completions) with semantic checkpoints, on http://127.0.0.1:1919 by default."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

from engine.engine_config import EngineConfig
from engine.parallel import ExpertParallel
from ft import env, servers
from gateway.capture_policy import CAPTURE_POLICIES
from gateway.http_server import ServerLimits
from gateway.pins import PinConfig
from gateway.ports import LOOPBACK, free_port, hold
from gateway.serve_prepare import prepare, rank_devices
from gateway.service import GiB, ServeConfig, Service, build_service
from gateway.tenants import TenantKey, parse_keys

KEY_ENV = env.API_KEY


def count(text: str) -> int:
    """argparse type: a whole number >= 0."""
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}")
    return int(text)


def at_least(low: int) -> Callable[[str], int]:
    """argparse type: a whole number >= `low`."""

    def parse(text: str) -> int:
        if count(text) < low:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {low}, got {text!r}")
        return int(text)

    return parse


positive = at_least(1)


def gpu_list(text: str) -> list[int]:
    """argparse type: GPU indices, comma-separated, at least two, each once."""
    parts = text.split(",")
    if not all(p.strip().isdigit() for p in parts) or len(set(parts)) != len(parts) or len(parts) < 2:
        raise argparse.ArgumentTypeError(f"expected two or more GPU indices like 0,1, got {text!r}")
    return [int(p) for p in parts]


def gib(text: str) -> float:
    """argparse type: a size in GiB > 0."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a size in GiB > 0, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--model", help="HF model folder (config.json + safetensors + tokenizer), a GGUF model (a "
                       ".gguf file, the first part of a split, a folder of parts), or a Hugging Face repo id, with "
                       ":QUANT for a GGUF repo (unsloth/Qwen3.6-35B-A3B-GGUF:Q4_K_M): downloaded on first use")
    model.add_argument("--preset", help="preset model, written on first use (default: tiny)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: local only)")
    parser.add_argument("--port", type=int, default=1919, help="port (default 1919)")
    parser.add_argument("--fd", type=int, help=argparse.SUPPRESS)  # an inherited socket bound to --port (--replicas, serve_process)
    parser.add_argument("--device", default=None, help="torch device: cpu or cuda (default: cuda when there is one)")
    parser.add_argument("--gpu-memory", type=gib, metavar="GiB",
                        help="device memory budget: everything on the device where it fits, else the routed experts "
                             "stay in host memory and the device holds the dense weights, the decode slots and an "
                             "expert cache within it (default: the device's free memory, less a margin); under "
                             "--gpus or --ranks, each one's")
    ranks = parser.add_mutually_exclusive_group()
    ranks.add_argument("--gpus", type=gpu_list, metavar="LIST",
                       help="expert parallel over these GPUs (0,1 or 0,1,2,3), one process each (NCCL): each holds its "
                            "share of the routed experts, the rest of the model replicated; the number of GPUs must "
                            "divide the experts. Each GPU has a memory plan of its own (--plan prints them): its "
                            "experts resident, or offloaded within its budget with an expert cache of its own")
    ranks.add_argument("--ranks", type=at_least(2), metavar="N",
                       help="expert parallel over N processes on the CPU (gloo), as --gpus splits the experts over "
                            "GPUs: the same engine code on one machine, for tests")
    parser.add_argument("--split", choices=["auto", "heads", "replicated"], default="auto",
                        help="under --gpus or --ranks, the attention and DeltaNet layers: split by heads over the ranks, "
                             "replicated on each, or auto (default): both timed at warm-up on one short prefill and a "
                             "few decode steps, the faster kept and logged (replicated where the heads do not divide)")
    parser.set_defaults(rank_gpu_memory=None)  # each rank's budget under expert parallel: its plan's (serve_prepare)
    parser.add_argument("--plan", action="store_true",
                        help="print how the model would fit (--gpu-memory, or the GPU's free memory) and exit: "
                             "nothing is loaded, no GPU is needed")
    parser.add_argument("--ram-cache", type=float, default=None, metavar="GiB",
                        help="RAM checkpoint budget (default: half the host memory the model leaves, at most 32)")
    parser.add_argument("--disk-cache", type=Path, metavar="DIR", help="LMDB checkpoint folder (survives restarts)")
    parser.add_argument("--disk-cache-size", type=float, default=64.0, metavar="GiB", help="disk cap (default 64)")
    parser.add_argument("--policy", choices=CAPTURE_POLICIES, default="anchor",
                        help="where recurrent states are checkpointed (default anchor; see gateway/capture_policy.py)")
    key = parser.add_mutually_exclusive_group()
    key.add_argument("--api-key", help="require this key (Authorization: Bearer or x-api-key); visible in ps: "
                                       f"prefer --api-key-file or ${KEY_ENV}")
    key.add_argument("--api-key-file", type=Path, metavar="FILE",
                     help="require the key in FILE, or one of several: NAME:KEY a line, each name with checkpoints "
                          "of its own (NAME:KEY:public also shares the system prompt and tools)")
    parser.add_argument("--record", type=Path, metavar="DIR", help="write every request and its timings as JSONL")
    parser.add_argument("--replay-outputs", type=Path, metavar="FILE",
                        help="JSONL of outputs to teacher-force for successive tool-carrying requests")
    parser.add_argument("--keep-volatile", action="store_true",
                        help="do not normalise per-request nonces (Claude Code's billing header)")
    parser.add_argument("--max-tokens", type=int, default=2048,
                        help="output tokens for requests that set no limit (default 2048)")
    parser.add_argument("--max-tokens-cap", type=int, metavar="N",
                        help="cap every request's output tokens at N (like llama.cpp's --n-predict)")
    parser.add_argument("--forced-decode", choices=["prefill", "steps"], default="prefill",
                        help="teacher-forced outputs (ft_forced_output, --replay-outputs): fed in one prefill "
                             "pass (default) or one decode step per token")
    parser.add_argument("--live-sequences", type=count, default=4, metavar="N",
                        help="sequences kept on the device after their answer; a request that extends one continues "
                             "it in place instead of restoring it from the checkpoint store (default 4; 0: always "
                             "restore)")
    parser.add_argument("--max-running", type=positive, default=None, metavar="N",
                        help="requests decoded together: every engine step runs one batched forward over their "
                             "decode tokens and a chunk of pending prefill (default 4, fewer where a GPU's memory "
                             "needs the room for experts)")
    parser.add_argument("--max-context", type=at_least(2), default=None, metavar="TOKENS",
                        help="tokens a sequence may reach, prompt and output; a longer prompt is answered with the "
                             "protocol's context-length error (default: what the memory plan leaves room for, at "
                             "most the model's context)")
    parser.add_argument("--decode-step-prefill", type=at_least(256), metavar="N",
                        help="prefill tokens a step carries beside sequences that are decoding: a long prompt goes "
                             "in chunks of N while others decode, so their tokens keep coming at a short step's pace "
                             "(default: the step's whole token budget)")
    parser.add_argument("--pin-ttl-max", type=count, default=int(PinConfig.ttl_max_s), metavar="SECONDS",
                        help="longest time an answer that ends in a tool call keeps its session's state pinned in "
                             "the live and RAM tiers (and prefetched from disk) while the tool runs; each session's "
                             "pin lasts the 90th percentile of its own tool times up to this (default 300; 0: no pins)")
    parser.add_argument("--max-queue", type=count, default=64, metavar="N",
                        help="requests that may wait beyond --max-running; more are answered with the protocol's "
                             "overloaded error (default 64)")
    parser.add_argument("--max-connections", type=positive, default=ServerLimits.max_connections, metavar="N",
                        help="open connections at most (kept below the open-file limit); one more is answered 503 "
                             f"(default {ServerLimits.max_connections})")
    parser.add_argument("--shutdown-grace", type=float, default=ServerLimits.shutdown_grace_s, metavar="SECONDS",
                        help="on SIGTERM/Ctrl-C, answers already running get this long to finish before they end with "
                             "the protocol's error; queued ones get it at once (default "
                             f"{ServerLimits.shutdown_grace_s:g})")
    parser.add_argument("--header-timeout", type=float, default=ServerLimits.head_timeout_s, metavar="SECONDS",
                        help="a request's head must arrive within this long of its first byte (or of the "
                             f"connection's opening), else the connection is closed (default {ServerLimits.head_timeout_s:g})")
    parser.add_argument("--body-timeout", type=float, default=ServerLimits.body_timeout_s, metavar="SECONDS",
                        help=f"a request's body must arrive within this long (default {ServerLimits.body_timeout_s:g})")
    parser.add_argument("--write-timeout", type=float, default=ServerLimits.write_timeout_s, metavar="SECONDS",
                        help="an answer its client reads nothing of for this long is cut and its generation stopped "
                             f"(default {ServerLimits.write_timeout_s:g})")
    parser.add_argument("--served-model-name", help="model id to report (default: folder or preset name)")
    parser.add_argument("--step-log", type=count, metavar="MS",
                        help="log every engine step slower than MS (engine, resuming its requests, the worker's time "
                             "before it) and every prefill forward slower than MS (host time by part, then the "
                             "device's rest; on a GPU also its allocator retries and capture slabs pinned: a sync "
                             "per forward, so a diagnostic, not for serving)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--replicas", type=at_least(2), metavar="N",
                        help="N servers of the model on the ports after --port, sharing one --disk-cache (default: a "
                             "folder in the ft home), behind the smg router on --port (pip install smg), which keeps "
                             "each agent session on one of them; stopped together (see gateway/replicas.py)")


def api_key(args: argparse.Namespace) -> str | tuple[TenantKey, ...] | None:
    """The keys to require: --api-key, --api-key-file (one unnamed key, or named tenants: see
    gateway/tenants.py), or $FT_API_KEY. An empty key is an error (it would disable the check while
    looking like it set one)."""
    if args.api_key is not None:
        key, source = args.api_key, "--api-key"
    elif args.api_key_file is not None:
        keys = parse_keys(args.api_key_file.read_text(encoding="utf-8"), str(args.api_key_file))
        if isinstance(keys, tuple) and keys:
            return keys
        key, source = keys or "", str(args.api_key_file)
    elif (from_env := env.api_key()) is not None:
        key, source = from_env, f"${KEY_ENV}"
    else:
        return None
    if not key.strip():
        raise ValueError(f"{source}: the API key is empty (leave it out to serve without a key)")
    return key.strip()


def limits_from_args(args: argparse.Namespace) -> ServerLimits:
    if not args.shutdown_grace >= 0:
        raise ValueError(f"--shutdown-grace: expected seconds >= 0, got {args.shutdown_grace}")
    timeouts = {"--header-timeout": args.header_timeout, "--body-timeout": args.body_timeout,
                "--write-timeout": args.write_timeout}
    for flag, value in timeouts.items():
        if not value > 0:
            raise ValueError(f"{flag}: expected seconds > 0, got {value}")
    return ServerLimits(head_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
                        write_timeout_s=args.write_timeout, max_connections=args.max_connections,
                        shutdown_grace_s=args.shutdown_grace)


def engine_config_from_args(args: argparse.Namespace, rank: int = 0) -> EngineConfig:
    """How the engine runs the model, from the flags and the memory plan (built once, handed to the
    engine); under expert parallel, rank `rank`'s: its device and its plan's budget."""
    devices = rank_devices(args)
    budgets = args.rank_gpu_memory or [args.gpu_memory] * len(devices)
    return EngineConfig(
        device=devices[rank], max_running=args.max_running or EngineConfig.max_running, gpu_memory_gib=budgets[rank],
        max_context=args.max_context,
        decode_step_prefill=args.decode_step_prefill, step_log_ms=args.step_log,
        expert_parallel=ExpertParallel(rank, len(devices)) if len(devices) > 1 else None,
        head_split=len(devices) > 1 and args.split == "heads",
    )


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    return ServeConfig(
        model_dir=args.model, preset=args.preset or "tiny", engine=engine_config_from_args(args),
        rank_engines=tuple(engine_config_from_args(args, rank) for rank in range(1, len(rank_devices(args)))),
        host=args.host, port=args.port,
        ram_cache_gib=args.ram_cache, disk_cache=args.disk_cache, disk_cache_gib=args.disk_cache_size,
        policy=args.policy, api_key=api_key(args), record_dir=args.record, replay_outputs=args.replay_outputs,
        keep_volatile=args.keep_volatile, default_max_tokens=args.max_tokens, max_tokens_cap=args.max_tokens_cap,
        forced_decode=args.forced_decode, model_name=args.served_model_name, live_sequences=args.live_sequences,
        max_queue=args.max_queue, pins=PinConfig(ttl_max_s=float(args.pin_ttl_max)),
    )


def run(args: argparse.Namespace) -> int:
    if args.replicas:
        from gateway import replicas  # noqa: PLC0415

        return replicas.run(args, add_arguments)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = args.model or args.preset or "tiny"
    try:
        if prepare(args):  # --plan: printed, nothing loaded
            return 0
        config, limits = config_from_args(args), limits_from_args(args)
    except (ValueError, OSError) as exc:
        print(f"ft serve: {exc}", file=sys.stderr)
        return 2
    if args.model is not None and not (args.model.is_dir() or args.model.suffix == ".gguf" and args.model.is_file()):
        print(f"ft serve: {args.model}: no such folder or .gguf file", file=sys.stderr)
        return 2
    try:  # the port is this process's from before the load until uvicorn listens on it
        listener = socket.socket(fileno=args.fd) if args.fd is not None else hold(config.host, config.port)
    except OSError as exc:
        print(f"ft serve: cannot listen on {config.host}:{config.port}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    with listener:
        return _load_and_serve(args, config, limits, spec, listener)


def _load_and_serve(args: argparse.Namespace, config: ServeConfig, limits: ServerLimits, spec: str,
                    listener: socket.socket) -> int:
    try:
        claimed, listed = servers.claim_start(config.port), True
    except OSError as exc:  # an FT home it cannot write: serve all the same, unlisted
        print(f"ft serve: warning: {exc.strerror or exc}: {exc.filename or servers.folder()}: this server is not "
              f"listed for ft ps, ft stop and ft launch (FT_HOME: a folder it can write)", file=sys.stderr, flush=True)
        claimed, listed = True, False
    if not claimed:
        pid = servers.starting_pid(config.port)
        print(f"ft serve: an ft launch is starting a server on port {config.port}"
              f"{f' (pid {pid})' if pid else ''}: use that one, or pass another --port", file=sys.stderr)
        return 2
    devices = rank_devices(args)
    print(f"ft serve: loading {spec} on {', '.join(devices)}, then warming up", flush=True)
    ranks, runtime = None, None  # ranks: under expert parallel, rank 0's engine and the others' processes
    try:
        if config.engine.expert_parallel is not None:
            ranks = start_ranks(config, choose_split=args.split == "auto")
        runtime = build_service(config, ranks[0] if ranks else None)
    except (ValueError, KeyError, OSError) as exc:
        print(f"ft serve: {exc}", file=sys.stderr)
        return 2
    finally:
        if ranks is not None and runtime is None:  # no service: the other ranks stop too
            stop_ranks(ranks)
    try:
        return _serve(args, config, limits, runtime, spec, listener, listed)
    finally:
        if ranks is not None:
            stop_ranks(ranks)


def start_ranks(config: ServeConfig, choose_split: bool = False):
    """Rank 0's engine here, loaded with the other ranks' in their processes (`engine.parallel_worker`),
    each with its own config (`config.rank_engines`); `choose_split`: replicated or head split,
    whichever runs faster (`engine.split_choice`)."""
    from engine import parallel_worker  # noqa: PLC0415

    devices = [config.engine.device, *(engine.device for engine in config.rank_engines)]
    backend = "nccl" if devices[0].startswith("cuda") else "gloo"
    rank_spec = parallel_worker.RankSpec(config.model_dir, config.preset, config.engine,
                                         f"tcp://{LOOPBACK}:{free_port()}", backend, choose_split)
    ranks = parallel_worker.start(rank_spec, config.rank_engines)
    layers = "split by heads" if ranks[0].engine_config.head_split else "replicated"
    why = "the faster at warm-up (--log-level info: both timings)" if choose_split else "--split"
    print(f"ft serve: attention and DeltaNet layers {layers} over {len(devices)} ranks ({why})", flush=True)
    return ranks


def stop_ranks(ranks) -> None:
    from engine import parallel_worker  # noqa: PLC0415

    parallel_worker.stop(*ranks)


def _serve(args: argparse.Namespace, config: ServeConfig, limits: ServerLimits, runtime: Service, spec: str,
           listener: socket.socket, listed: bool) -> int:
    from gateway.app import create_app  # noqa: PLC0415
    from gateway.http_server import make_server, raise_open_file_limit  # noqa: PLC0415

    url = f"http://{config.host}:{config.port}"
    print(f"ft serve: model {runtime.model_id!r} ({runtime.engine.config.arch}, {runtime.engine.device}), "
          f"policy {config.policy}, listening on {url}", flush=True)
    memory = runtime.memory()
    print(f"  memory: weights {memory['weights'] / GiB:.2f} GiB and decode slots {memory['decode_slots'] / GiB:.2f} GiB "
          f"({runtime.engine.runner.slots} sequences x {runtime.engine.runner.capacity} tokens, growing) on "
          f"{runtime.engine.device}; checkpoint RAM cache up to {memory['ram_cache_budget'] / GiB:.1f} GiB", flush=True)
    if "device_reserved" in memory:
        print(f"  {memory['device_reserved'] / GiB:.2f} GiB reserved on {runtime.engine.device} in all, "
              f"{memory['workspace'] / GiB:.2f} GiB of it workspace (activations, CUDA graphs, free blocks)", flush=True)
    if (offload := runtime.engine.offload) is not None:
        print(f"  expert offload: {offload.plan.slots} of {offload.experts} experts per layer "
              f"resident ({memory['expert_cache'] / GiB:.2f} GiB on {runtime.engine.device}), all "
              f"{memory['experts_host'] / GiB:.2f} GiB in host memory; budget {config.engine.gpu_memory_gib:g} GiB", flush=True)
    print(f"  Claude Code:  ft launch claude --server {url}\n  Codex:        ft launch codex --server {url}\n"
          f"  OpenCode:     ft launch opencode --server {url}", flush=True)
    raise_open_file_limit()
    record = servers.ServerRecord(os.getpid(), config.host, config.port, str(spec), runtime.model_id, time.time())
    with servers.registered(record) if listed else contextlib.nullcontext():
        make_server(create_app(runtime), config.host, config.port, limits, args.log_level).run(sockets=[listener])
    return 0
