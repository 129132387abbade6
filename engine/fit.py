"""Fitting a model to the memory there is, before loading it: on the device, everything resident
or the routed experts offloaded with the largest expert cache that fits (`engine.offload`'s plan);
decode slots and context from what remains; the checkpoint RAM tier from free host memory.

The result fills `ft serve`'s open flags (`gateway/serve_prepare.py`): `EngineConfig`'s `max_running`,
`max_context` and `gpu_memory_gib`, and the RAM cache; it says what it chose and what it traded, part
by part. A model that cannot fit is a `FitError` naming the numbers and what would make it fit. Under
expert parallel (`fit_ranks`) each GPU has a plan of its own: the dense weights and its share of the
experts, resident or offloaded within its budget.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from engine.engine_config import DEFAULT_CHUNK, EngineConfig
from engine.footprint import Footprint
from engine.offload import BudgetError, kv_bytes, plan, state_bytes, workspace_bytes
from engine.offload.plan import least_slots
from engine.parallel import ExpertParallel
from engine.runner import starting_capacity

GiB = 1 << 30
RESERVE = (1 * GiB, 0.05)  # of free device memory kept back: the CUDA context, kernels' buffers, fragmentation
MIN_CONTEXT = 32768  # tokens per running sequence a plan keeps room for: else the experts are offloaded, then fewer run
RAM_SHARE, RAM_CAP, RAM_MIN = 0.5, 32 * GiB, GiB // 4  # of the host memory left: the checkpoint RAM tier
DEFAULT_RUNNING = 4
# a long prompt prefills outside the decode slots, into the sequence's own KV buffer, which grows by
# doubling: while it copies, the old buffer and the new one twice its size are both held
PREFILL_COPIES = 3
CONTEXT_STEP = 256  # tokens: a plan's context is a multiple of it


def decoded(n: int) -> str:
    return "1 sequence decoded at a time" if n == 1 else f"{n} sequences decoded together"


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
    context: int  # tokens each running sequence can reach within the budget (`EngineConfig.max_context`)
    ram_cache: int
    traded: tuple[str, ...] = ()
    device: str = "cuda"
    parallel: ExpertParallel | None = None  # expert parallel: this GPU's rank, holding its share of the experts

    @property
    def world(self) -> int:
        return 1 if self.parallel is None else self.parallel.world

    @property
    def experts_held(self) -> int:
        """Routed experts a layer holds (all, or the rank's share)."""
        return self.footprint.config.num_experts // self.world

    @property
    def experts_bytes(self) -> int:
        """Bytes of the routed experts held, all layers."""
        return self.footprint.experts // self.world

    @property
    def loaded(self) -> int:
        return self.footprint.dense + self.experts_bytes

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

    def lines(self) -> list[str]:
        """The plan as `ft serve` prints it (under expert parallel, one GPU's: `ParallelPlan.lines`)."""
        how = ("everything resident" if self.resident else
               f"experts offloaded: {self.expert_slots} of {self.experts_held} per layer on the device, all "
               f"{self.experts_bytes / GiB:.2f} GiB in host memory")
        what = self.footprint.source if self.parallel is None else f"{self.device} (rank {self.parallel.rank})"
        out = [f"plan: {what} ({self.loaded / GiB:.2f} GiB loaded) in {self.budget.bytes / GiB:.2f} GiB "
               f"({self.budget.source}): {how}"]
        out += [f"  {name:<15} {n / GiB:8.2f} GiB" for name, n in self.parts.items() if n]
        out.append(f"  {'free':<15} {(self.budget.bytes - sum(self.parts.values())) / GiB:8.2f} GiB")
        ram = f"; checkpoint RAM cache {self.ram_cache / GiB:.2f} GiB" if self.parallel is None else ""
        out.append(f"  {decoded(self.max_running)}, each up to {self.context:,} tokens of "
                   f"context{ram}")
        out += [f"  traded: {t}" for t in self.traded]
        return out


@dataclass(frozen=True)
class ParallelPlan:
    """Expert parallel's plan: one `MemoryPlan` a GPU, in rank order, and how the model would fit
    the first GPU's budget alone (None: it would not)."""

    ranks: tuple[MemoryPlan, ...]
    alone: MemoryPlan | None

    def lines(self) -> list[str]:
        """The plans as `ft serve` prints them: the split, each GPU's, and the one GPU they compare with."""
        first = self.ranks[0]
        fp, world = first.footprint, first.world
        gpus = torch.device(first.device).type == "cuda"
        out = [f"plan: {fp.source} ({fp.total / GiB:.2f} GiB loaded) over {world} {'GPUs' if gpus else 'CPU processes'}, "
               f"expert parallel: each "
               f"holds the dense weights ({fp.dense / GiB:.2f} GiB) and {first.experts_held} of the "
               f"{fp.config.num_experts} routed experts of each layer ({first.experts_bytes / GiB:.2f} GiB); "
               f"{decoded(first.max_running)}; checkpoint RAM cache {first.ram_cache / GiB:.2f} GiB"]
        for rank in self.ranks:
            out += rank.lines()
        one = f"on one {'GPU' if gpus else 'device'} of {first.budget.bytes / GiB:.2f} GiB"
        if self.alone is None:
            out.append(f"{one} it does not fit")
        elif not self.alone.resident:
            out.append(f"{one} its experts are offloaded ({self.alone.expert_slots} of {fp.config.num_experts} "
                       f"per layer on the device)")
        else:
            out.append(f"{one} everything is resident too")
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
        host_free: int | None = None, ram_cache_bytes: int | None = None,
        parallel: ExpertParallel | None = None) -> MemoryPlan:
    """The plan for `fp` within `budget`: everything resident when it fits with `MIN_CONTEXT` tokens
    for each running sequence, else the experts offloaded; `max_running` (None: `DEFAULT_RUNNING`,
    halved while the experts need the room) sequences; the RAM tier from `host_free` unless given.
    With `parallel`, the plan of that rank's GPU, which holds its share of the experts."""
    host_free = host_available() if host_free is None else host_free
    running = [max_running] if max_running else [DEFAULT_RUNNING >> i for i in range(DEFAULT_RUNNING.bit_length())]
    chunk = DEFAULT_CHUNK.get(torch.device(device).type, 4096)
    world = 1 if parallel is None else parallel.world
    where = dict(device=device, parallel=parallel)
    resident = _resident(fp, budget, device, running[0], chunk, world)
    if resident is not None:
        ram = ram_cache_bytes if ram_cache_bytes is not None else ram_cache(host_free, 0)
        return MemoryPlan(**resident, ram_cache=ram, **where)
    fitting, failure = [], None
    for n in running:
        try:
            fitting.append((n, _offloaded(fp, budget, device, n, chunk, world)))
        except BudgetError as exc:
            failure = exc
    if not fitting:
        raise FitError(_cannot_fit(fp, budget, device, failure, world))
    # the most sequences that leave each MIN_CONTEXT tokens (or the model's context), else the fewest
    goal = min(MIN_CONTEXT, fp.config.max_position_embeddings)
    n, offloaded = next(((n, o) for n, o in fitting if o["context"] >= goal), fitting[-1])
    held = fp.experts // world
    traded = (f"experts offloaded: {'all' if world == 1 else 'its'} {held / GiB:.2f} GiB do not fit beside the "
              f"dense weights with {MIN_CONTEXT:,} tokens of context for {running[0]} sequences",)
    if n != running[0]:
        traded += (f"{decoded(n)} instead of {running[0]}: more leave the experts too little "
                   f"room or each sequence less than {MIN_CONTEXT:,} tokens of context",)
    ram = ram_cache_bytes if ram_cache_bytes is not None else ram_cache(host_free, held)
    return MemoryPlan(**offloaded, ram_cache=ram, traded=traded, **where)


def fit_ranks(fp: Footprint, budgets: list[Budget], devices: list[str], max_running: int | None = None,
              host_free: int | None = None, ram_cache_bytes: int | None = None) -> ParallelPlan:
    """Expert parallel's plan: rank r on `devices[r]` within `budgets[r]` holds the dense weights and
    its share of the experts, resident or offloaded (`fit` of each). Every rank runs every sequence,
    so all decode the fewest sequences any rank's plan allows; the RAM tier is planned once, beside
    the experts every offloading rank holds in host memory. A rank that cannot fit is a `FitError`."""
    host_free = host_available() if host_free is None else host_free
    world = len(devices)

    def each(running: int | None) -> list[MemoryPlan]:
        plans = []
        for rank, (budget, device) in enumerate(zip(budgets, devices, strict=True)):
            try:
                plans.append(fit(fp, budget, device, running, host_free, 0, ExpertParallel(rank, world)))
            except FitError as exc:
                raise FitError(f"{device} (rank {rank} of {world}): {exc}") from exc
        return plans

    plans = each(max_running)
    running = min(p.max_running for p in plans)
    if any(p.max_running != running for p in plans):
        fewer = f"{decoded(running)}: the most every GPU's plan allows"
        plans = [dataclasses.replace(p, traded=(*p.traded, fewer)) for p in each(running)]
    held = sum(p.experts_bytes for p in plans if not p.resident)
    ram = ram_cache_bytes if ram_cache_bytes is not None else ram_cache(host_free, held)
    try:
        alone = fit(fp, budgets[0], devices[0], max_running, host_free, ram)
    except FitError:
        alone = None
    return ParallelPlan(tuple(dataclasses.replace(p, ram_cache=ram) for p in plans), alone)


def _resident(fp: Footprint, budget: Budget, device: str, running: int, chunk: int, world: int = 1) -> dict | None:
    c, slots = fp.config, EngineConfig(max_running=running).decode_slots
    capacity = starting_capacity(torch.device(device))
    states = state_bytes(c, fp.dtype, slots, capacity)
    workspace = workspace_bytes(c, fp.dtype, chunk, slots)
    left = budget.bytes - fp.dense - fp.experts // world - states - workspace
    if left < context_bytes(fp, slots) * MIN_CONTEXT:
        return None
    context = _context(fp, capacity, slots, left)
    return dict(footprint=fp, budget=budget, resident=True, max_running=running, decode_slots=states,
                workspace=workspace, expert_slots=c.num_experts // world, stream=0, context=context)


def _offloaded(fp: Footprint, budget: Budget, device: str, running: int, chunk: int, world: int = 1) -> dict:
    c, slots = fp.config, EngineConfig(max_running=running).decode_slots
    capacity = starting_capacity(torch.device(device))
    experts = c.num_experts // world
    p = plan(c, fp.dense, budget.bytes, fp.dtype, sequences=slots, capacity=capacity, tokens=chunk,
             expert_bytes=fp.expert, experts=experts)
    # the decode slots grow into the expert cache (engine.offload.runtime's make_room) down to top_k experts a layer
    spare = (p.slots - least_slots(c, experts)) * fp.expert * c.num_hidden_layers
    context = _context(fp, capacity, slots, spare)
    return dict(footprint=fp, budget=budget, resident=False, max_running=running, decode_slots=p.states,
                workspace=p.workspace, expert_slots=p.slots, stream=p.stream, context=context)


def context_bytes(fp: Footprint, slots: int) -> int:
    """Device bytes a token of context costs: its KV in each of `slots` decode slots and the scratch
    slot, and in a prefilled sequence's own buffer while it grows (`PREFILL_COPIES`)."""
    return kv_bytes(fp.config, fp.dtype, 1) * (slots + 1 + PREFILL_COPIES)


def _context(fp: Footprint, capacity: int, slots: int, spare: int) -> int:
    """Tokens each sequence reaches: `spare` bytes beside the slots' KV at their starting `capacity`
    (the plan's decode slots) hold the slots' growth and a prefill's own buffer; at least `capacity`."""
    in_slots = kv_bytes(fp.config, fp.dtype, capacity) * (slots + 1)
    tokens = max(capacity, (spare + in_slots) // context_bytes(fp, slots))
    return min(fp.config.max_position_embeddings, tokens) // CONTEXT_STEP * CONTEXT_STEP


def smallest_budget(fp: Footprint, device: str, world: int = 1) -> int:
    """The least device memory the offload plan accepts for one sequence (top_k experts a layer, of a
    rank's share under expert parallel over `world` GPUs), in steps of 1/10 GiB."""
    low, high = 0, math.ceil((fp.total + 16 * GiB) / (GiB / 10))
    chunk = DEFAULT_CHUNK.get(torch.device(device).type, 4096)
    while low < high:
        mid = (low + high) // 2
        try:
            _offloaded(fp, Budget(mid * GiB // 10, ""), device, 1, chunk, world)
            high = mid
        except BudgetError:
            low = mid + 1
    return low * GiB // 10


def _cannot_fit(fp: Footprint, budget: Budget, device: str, failure: Exception | None, world: int = 1) -> str:
    need = smallest_budget(fp, device, world)
    experts = f"its routed experts {fp.experts / GiB:.2f} GiB"
    if world > 1:
        experts += f" ({fp.experts // world / GiB:.2f} GiB on each of {world} GPUs)"
    return (f"{fp.source} does not fit {budget.bytes / GiB:.2f} GiB ({budget.source}): its dense weights are "
            f"{fp.dense / GiB:.2f} GiB and {experts}; with the experts offloaded "
            f"it needs {need / GiB:.1f} GiB on the device for one sequence ({failure}). Options: a device with more "
            f"free memory or --gpu-memory {need / GiB:.1f} or more; a smaller quant of the model; --device cpu")
