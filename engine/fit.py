"""Fitting a model to the memory there is, before loading it: on the device, everything resident
or the routed experts offloaded with the largest expert cache that fits (`engine.offload`'s plan);
decode slots and context from what remains; the checkpoint RAM tier from free host memory.

The result gives `EngineConfig` its `max_running` and `gpu_memory_gib` and `ft serve` its RAM
cache, and says what it chose and what it traded, part by part. A model that cannot fit is a
`FitError` naming the numbers and what would make it fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.engine_config import DEFAULT_CHUNK, EngineConfig
from engine.footprint import Footprint
from engine.offload import BudgetError, kv_bytes, plan, state_bytes, workspace_bytes
from engine.runner import starting_capacity

GiB = 1 << 30
RESERVE = (1 * GiB, 0.05)  # of free device memory kept back: the CUDA context, kernels' buffers, fragmentation
MIN_CONTEXT = 32768  # tokens per running sequence a resident plan keeps room for (else: offload the experts)
RAM_SHARE, RAM_CAP, RAM_MIN = 0.5, 32 * GiB, GiB // 4  # of the host memory left: the checkpoint RAM tier
DEFAULT_RUNNING = 4


class FitError(ValueError):
    """The model cannot fit the memory there is (the message names the numbers and the options)."""


@dataclass(frozen=True)
class Budget:
    """Device bytes to plan within and where the figure came from."""

    bytes: int
    source: str


@dataclass(frozen=True)
class MemoryPlan:
    """How a device budget and the host's memory are spent (bytes)."""

    footprint: Footprint
    budget: Budget
    resident: bool
    max_running: int
    decode_slots: int  # bytes of the decode slots at their starting capacity
    workspace: int
    expert_slots: int  # routed experts per layer on the device
    stream: int  # buffers long prefill chunks stream experts through (offload only)
    context: int  # tokens each running sequence can reach within the budget
    ram_cache: int
    traded: tuple[str, ...] = ()

    @property
    def experts_device(self) -> int:
        return self.expert_slots * self.footprint.expert * self.footprint.config.num_hidden_layers

    @property
    def parts(self) -> dict[str, int]:
        """Device bytes by part (they sum to at most the budget)."""
        return {"dense weights": self.footprint.dense, "routed experts": self.experts_device,
                "decode slots": self.decode_slots, "workspace": self.workspace, "expert stream": self.stream}

    @property
    def gpu_memory_gib(self) -> float | None:
        """`EngineConfig.gpu_memory_gib`: the budget when experts are offloaded or the user set one."""
        return None if self.resident and self.budget.source != "--gpu-memory" else self.budget.bytes / GiB

    def engine_config(self, device: str) -> EngineConfig:
        return EngineConfig(device=device, max_running=self.max_running, gpu_memory_gib=self.gpu_memory_gib)

    def lines(self) -> list[str]:
        """The plan as `ft serve` prints it."""
        c, fp = self.footprint.config, self.footprint
        how = ("everything resident" if self.resident else
               f"experts offloaded: {self.expert_slots} of {c.num_experts} per layer on the device, all "
               f"{fp.experts / GiB:.2f} GiB in host memory")
        out = [f"plan: {fp.source} ({fp.total / GiB:.2f} GiB loaded) in {self.budget.bytes / GiB:.2f} GiB "
               f"({self.budget.source}): {how}"]
        out += [f"  {name:<15} {n / GiB:8.2f} GiB" for name, n in self.parts.items() if n]
        out.append(f"  {'free':<15} {(self.budget.bytes - sum(self.parts.values())) / GiB:8.2f} GiB")
        out.append(f"  {self.max_running} sequences decoded together, each up to {self.context:,} tokens of context; "
                   f"checkpoint RAM cache {self.ram_cache / GiB:.2f} GiB")
        out += [f"  traded: {t}" for t in self.traded]
        return out


def device_budget(device: str, reserve: tuple[int, float] = RESERVE) -> Budget:
    """The free memory of a CUDA device less what is kept back for the runtime."""
    free, _ = torch.cuda.mem_get_info(torch.device(device))
    kept = max(reserve[0], int(free * reserve[1]))
    return Budget(max(free - kept, 0), f"free on {device}: {free / GiB:.2f} GiB, {kept / GiB:.2f} kept back")


def host_available() -> int:
    """MemAvailable of /proc/meminfo (Linux), else the free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os  # noqa: PLC0415

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def ram_cache(host_free: int, held_on_host: int) -> int:
    """The checkpoint RAM tier: a share of the host memory left beside what the model holds there, capped."""
    return int(min(RAM_CAP, max(RAM_MIN, (host_free - held_on_host) * RAM_SHARE)))


def fit(fp: Footprint, budget: Budget, device: str = "cuda", max_running: int | None = None,
        host_free: int | None = None, ram_cache_bytes: int | None = None) -> MemoryPlan:
    """The plan for `fp` within `budget`: everything resident when it fits with `MIN_CONTEXT` tokens
    for each running sequence, else the experts offloaded; `max_running` (None: `DEFAULT_RUNNING`,
    halved while the experts need the room) sequences; the RAM tier from `host_free` unless given."""
    host_free = host_available() if host_free is None else host_free
    running = [max_running] if max_running else [DEFAULT_RUNNING >> i for i in range(DEFAULT_RUNNING.bit_length())]
    chunk = DEFAULT_CHUNK.get(torch.device(device).type, 4096)
    resident = _resident(fp, budget, device, running[0], chunk)
    if resident is not None:
        ram = ram_cache_bytes if ram_cache_bytes is not None else ram_cache(host_free, 0)
        return MemoryPlan(**resident, ram_cache=ram)
    failure = None
    for n in running:
        try:
            offloaded = _offloaded(fp, budget, device, n, chunk)
        except BudgetError as exc:
            failure = exc
            continue
        traded = (f"experts offloaded: all {fp.experts / GiB:.2f} GiB do not fit beside the dense weights with "
                  f"{MIN_CONTEXT:,} tokens of context for {running[0]} sequences",)
        if n != running[0]:
            traded += (f"{n} sequences decoded together instead of {running[0]}, for experts' room",)
        ram = ram_cache_bytes if ram_cache_bytes is not None else ram_cache(host_free, fp.experts)
        return MemoryPlan(**offloaded, ram_cache=ram, traded=traded)
    raise FitError(_cannot_fit(fp, budget, device, failure))


def _resident(fp: Footprint, budget: Budget, device: str, running: int, chunk: int) -> dict | None:
    c, slots = fp.config, EngineConfig(max_running=running).decode_slots
    capacity = starting_capacity(torch.device(device))
    states = state_bytes(c, fp.dtype, slots, capacity)
    workspace = workspace_bytes(c, fp.dtype, chunk, slots)
    left = budget.bytes - fp.total - states - workspace
    per_token = kv_bytes(c, fp.dtype, 1) * (slots + 1)
    if left < per_token * MIN_CONTEXT:
        return None
    context = min(c.max_position_embeddings, capacity + left // per_token)
    return dict(footprint=fp, budget=budget, resident=True, max_running=running, decode_slots=states,
                workspace=workspace, expert_slots=c.num_experts, stream=0, context=context)


def _offloaded(fp: Footprint, budget: Budget, device: str, running: int, chunk: int) -> dict:
    c, slots = fp.config, EngineConfig(max_running=running).decode_slots
    capacity = starting_capacity(torch.device(device))
    p = plan(c, fp.dense, budget.bytes, fp.dtype, sequences=slots, capacity=capacity, tokens=chunk,
             expert_bytes=fp.expert)
    # the decode slots grow into the expert cache (engine.offload.runtime's make_room) down to top_k experts a layer
    spare = (p.slots - c.num_experts_per_tok) * fp.expert * c.num_hidden_layers
    context = min(c.max_position_embeddings, capacity + spare // (kv_bytes(c, fp.dtype, 1) * (slots + 1)))
    return dict(footprint=fp, budget=budget, resident=False, max_running=running, decode_slots=p.states,
                workspace=p.workspace, expert_slots=p.slots, stream=p.stream, context=context)


def smallest_budget(fp: Footprint, device: str) -> int:
    """The least device memory the offload plan accepts for one sequence (top_k experts a layer), in
    steps of 1/10 GiB."""
    low, high = 0, math.ceil((fp.total + 16 * GiB) / (GiB / 10))
    while low < high:
        mid = (low + high) // 2
        try:
            _offloaded(fp, Budget(mid * GiB // 10, ""), device, 1, DEFAULT_CHUNK.get(torch.device(device).type, 4096))
            high = mid
        except BudgetError:
            low = mid + 1
    return low * GiB // 10


def _cannot_fit(fp: Footprint, budget: Budget, device: str, failure: Exception | None) -> str:
    need = smallest_budget(fp, device)
    return (f"{fp.source} does not fit {budget.bytes / GiB:.2f} GiB ({budget.source}): its dense weights are "
            f"{fp.dense / GiB:.2f} GiB and its routed experts {fp.experts / GiB:.2f} GiB; with the experts offloaded "
            f"it needs {need / GiB:.1f} GiB on the device for one sequence ({failure}). Options: a device with more "
            f"free memory or --gpu-memory {need / GiB:.1f} or more; a smaller quant of the model; --device cpu")
