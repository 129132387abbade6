"""What `ft serve` settles before it loads anything: the model's files (a Hugging Face repo id is
resolved and downloaded by `ft.hub`), the device (the GPU when there is one), and the memory plan
(`engine.fit`): on a GPU, resident or offloaded experts, the sequences decoded together and the
checkpoint RAM tier, printed before loading; on the CPU, the RAM tier from the host's free memory.
Under expert parallel (--gpus, --ranks) each rank's device has a plan of its own."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import torch

from engine import fit, footprint

GiB = 1 << 30
GPU_PACKAGES = {"fla": "fla-core"}  # import name -> the package the GPU path needs (the `gpu` extra)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def model_path(spec: str) -> Path:
    """A local folder or file as it is; else a hub repo id (`owner/name[:QUANT]`), downloaded into
    the Hugging Face cache on first use (`ft.hub.resolve`: a `HubError` names what exists)."""
    path = Path(spec).expanduser()
    if path.exists():
        return path
    from ft import hub  # noqa: PLC0415 (huggingface_hub only for models by name)

    if not hub.is_repo_id(spec):
        raise FileNotFoundError(f"{spec}: no such folder or .gguf file (nor a Hugging Face repo id: owner/name)")
    return hub.resolve(spec)


def missing_gpu_packages() -> list[str]:
    return [package for module, package in GPU_PACKAGES.items() if importlib.util.find_spec(module) is None]


def rank_devices(args: argparse.Namespace) -> list[str]:
    """Each rank's device under expert parallel (--gpus: one GPU a rank, --ranks: the CPU); one device without."""
    if args.gpus:
        return [f"cuda:{gpu}" for gpu in args.gpus]
    return ["cpu"] * args.ranks if args.ranks else [args.device or "cpu"]


def budgets(args: argparse.Namespace, devices: list[str]) -> list[fit.Budget] | None:
    """Each device's: --gpu-memory, else a GPU's free memory less a margin; None on the CPU."""
    if args.gpu_memory is not None:
        return [fit.Budget(int(args.gpu_memory * GiB), "--gpu-memory")] * len(devices)
    if torch.device(devices[0]).type == "cuda" and torch.cuda.is_available():
        return [fit.device_budget(device) for device in devices]
    return None


def memory_plan(args: argparse.Namespace) -> fit.MemoryPlan | fit.ParallelPlan | None:
    """The device plan, or under expert parallel each rank's (None on the CPU without --gpu-memory);
    fills --max-running, --max-context, --gpu-memory (`rank_gpu_memory`: each rank's) and --ram-cache
    where they were left open."""
    devices = rank_devices(args)
    given = budgets(args, devices)
    ram = None if args.ram_cache is None else int(args.ram_cache * GiB)
    if given is None:
        if args.plan:
            raise ValueError("--plan without a GPU needs --gpu-memory GiB (the device to plan for)")
        model = footprint.of(args.model, args.preset or "tiny", args.device)
        args.ram_cache = (ram if ram is not None else fit.ram_cache(fit.host_available(), model.total)) / GiB
        args.max_running = args.max_running or fit.DEFAULT_RUNNING
        return None
    model = footprint.of(args.model, args.preset or "tiny", args.device)
    if len(devices) == 1:
        plan = fit.fit(model, given[0], args.device, args.max_running, ram_cache_bytes=ram)
        plans = [plan]
    else:
        plan = fit.fit_ranks(model, given, devices, args.max_running, ram_cache_bytes=ram)
        plans = list(plan.ranks)
    args.max_running, args.ram_cache = plans[0].max_running, plans[0].ram_cache / GiB
    room = min(p.context for p in plans)
    if args.max_context is not None and args.max_context > room:
        print(f"ft serve: --max-context {args.max_context:,} is past the {room:,} tokens the plan leaves room for: "
              "a prompt that long may be answered out of device memory", flush=True)
    args.max_context = args.max_context or room
    args.gpu_memory, args.rank_gpu_memory = plans[0].gpu_memory_gib, [p.gpu_memory_gib for p in plans]
    return plan


def expert_parallel(args: argparse.Namespace) -> None:
    """--gpus and --ranks: the device is rank 0's; what they cannot run with is an error."""
    if args.gpus:
        args.device = f"cuda:{args.gpus[0]}"
    elif args.ranks:
        if args.device not in (None, "cpu"):
            raise ValueError("--ranks: processes on the CPU (--gpus for GPUs)")
        args.device = "cpu"
    elif args.split == "heads":
        raise ValueError("--split heads: the heads are split over the ranks of --gpus or --ranks")


def prepare(args: argparse.Namespace) -> bool:
    """Fill what the flags left open, in place: `args.model` becomes a local path (the repo spec
    the served name), `args.device` a device, the memory choices the plan's. True for --plan:
    the plan is printed and nothing is to be loaded."""
    if args.model is not None:
        spec = args.model
        args.model = model_path(spec)
        if args.served_model_name is None and not Path(spec).expanduser().exists():
            args.served_model_name = spec
    expert_parallel(args)
    if args.device is None:
        args.device = "cuda" if args.plan else default_device()
    if torch.device(args.device).type == "cuda" and not args.plan and (missing := missing_gpu_packages()):
        print(f"ft serve: the GPU path misses {', '.join(missing)} (Gated DeltaNet then runs its slow reference "
              f"kernels); install it with `pip install {' '.join(missing)}` or `pip install -e '.[gpu]'`", flush=True)
    plan = memory_plan(args)
    if plan is not None:
        print("ft serve: " + "\n".join(plan.lines()), flush=True)
    return bool(args.plan)
