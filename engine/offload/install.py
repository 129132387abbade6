"""Moving a model's routed experts into host memory and giving each MoE layer its `ExpertCache`."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch

from engine.offload.cache import ExpertCache, Lane, Parts
from engine.offload.plan import OffloadPlan
from engine.offload.runtime import ExpertOffload
from engine.offload.stats import OffloadStats

if TYPE_CHECKING:
    from engine.model import DecoderLayer, HybridForCausalLM

log = logging.getLogger(__name__)


def expert_store(model: HybridForCausalLM, layer: int) -> tuple[tuple[torch.Tensor, ...], Callable]:
    """One layer's routed experts as (stacked parts, leading dim the expert; their `assemble`):
    the bf16 pair itself, or the parts of quantized stacks (`quantized_store`)."""
    experts = cast("DecoderLayer", model.model.layers[layer]).mlp.experts
    assert experts is not None
    gate_up, down = experts.gate_up_proj, experts.down_proj
    if hasattr(gate_up, "parts"):
        return quantized_store(gate_up, down)
    return (gate_up.detach(), down.detach()), tuple


def expert_bytes(model: HybridForCausalLM) -> int:
    """Bytes of one routed expert (every part's row)."""
    return sum(p[0].nbytes for p in expert_store(model, 0)[0])


def held_experts(model: HybridForCausalLM) -> int:
    """Routed experts a layer holds: all the model's, or an expert-parallel rank's share (`engine.parallel`)."""
    return expert_store(model, 0)[0][0].shape[0]


def quantized_store(gate_up: Any, down: Any) -> tuple[tuple[torch.Tensor, ...], Callable]:
    """Quantized stacks (`QuantWeight`s of engine/ops/gpu/quant.py, whose `parts` lead with the
    expert) as one expert store for `ExpertCache`: every part in one tuple, and the `assemble`
    that makes them `QuantWeight`s again over any number of experts (the slots, or one expert on
    the host, where `dequantize` gives the host path its weights)."""
    split = len(gate_up.parts)

    def like(w: Any, parts: tuple[torch.Tensor, ...]) -> Any:
        return type(w)(w.fmt, (parts[0].shape[0], *w.shape[1:]), parts, w.dtype, w.columns)

    def assemble(parts: tuple[torch.Tensor, ...]) -> tuple[Any, Any]:
        return like(gate_up, parts[:split]), like(down, parts[split:])

    return (*gate_up.parts, *down.parts), assemble


class _Pinned:
    """Pinned host memory described to torch as device memory (`__cuda_array_interface__`)."""

    def __init__(self, t: torch.Tensor):
        self.t = t  # kept alive by the device tensor, which keeps this object
        self.__cuda_array_interface__ = {
            "shape": (t.nbytes,),
            "typestr": "|u1",
            "data": (t.data_ptr(), False),
            "version": 3,
        }


def in_place(parts: Parts, device: torch.device) -> Parts | None:
    """The host `parts` as tensors `device` reads in place: on the CPU the parts themselves; on
    CUDA, device tensors over their pinned memory (unified addressing maps it into the device's
    address space: a kernel's loads cross the link), checked once by a kernel reading the last
    expert back; None where the device cannot (then experts are copied in before use)."""
    if device.type != "cuda":
        return parts
    try:
        views = tuple(torch.as_tensor(_Pinned(p), device=device).view(p.dtype).view(p.shape) for p in parts)
        for view, p in zip(views, parts, strict=True):
            read, want = (t.view(torch.uint8)[-1].sum(dtype=torch.long).item() for t in (view, p))
            if read != want:
                return None
    except (RuntimeError, TypeError, ValueError):
        return None
    return views


def stages(mapped: Parts) -> bool:
    """Whether decode gathers the experts it reads from host memory into device rows before running
    them (engine/ops/gpu/gather.py: whole words, long runs), rather than their kernels reading them
    where they lie."""
    if mapped[0].device.type != "cuda":
        return True
    from engine.ops.gpu.gather import gather_fits  # noqa: PLC0415 (Triton)

    return gather_fits(mapped)


def expandable_segments() -> None:
    """Within a budget the allocator must not fragment: transient tensors of varying sizes (a
    streamed piece's dequantized experts, live sequences' KV) left 0.8 GiB reserved but unusable
    at a tight budget, and a forward ran out of memory. Expandable segments map and
    unmap pages instead of holding whole segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True);
    set here unless the environment configures the allocator itself."""
    if "PYTORCH_CUDA_ALLOC_CONF" in os.environ:
        return
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    try:
        if setter is None:
            torch.cuda.memory._set_allocator_settings("expandable_segments:True")
        else:
            setter("expandable_segments:True")
    except (RuntimeError, AttributeError):  # not on this platform: the cap still holds, less tightly
        pass


def install(
    model: HybridForCausalLM, device: torch.device, plan: OffloadPlan, mapped: bool = True, staged: bool = True
) -> ExpertOffload:
    """Move each MoE layer's routed experts out of `model` (still on the host) into host tensors,
    pinned when `device` is CUDA, and give the layer an `ExpertCache` of `plan.slots` slots on
    `device` (with `mapped`, reading the host tensors in place for decode where the device can:
    `in_place`; without, decode copies the experts it needs into the slots first; with `staged`,
    gathering them into staging rows first where `stages` allows, else reading them where they lie).
    The model then holds only the dense parts, to be moved to `device` as usual."""
    stats, lane = OffloadStats(), Lane(device)
    outside = 0  # what the process holds on the device before this engine's parts
    if device.type == "cuda":
        expandable_segments()
        torch.cuda.empty_cache()
        outside = torch.cuda.memory_reserved(device)
    caches: dict[int, ExpertCache] = {}
    staging: dict[tuple, Parts] = {}  # by the parts' layout: the layers share their staging rows
    for layer in cast("list[DecoderLayer]", model.model.layers):
        parts, assemble = expert_store(model, layer.layer)
        if device.type == "cuda":
            parts = tuple(p.pin_memory() for p in parts)
        reads = in_place(parts, device) if mapped else None
        stage = None
        if reads is not None and staged and stages(reads):
            layout = tuple((p.shape[1:], p.dtype) for p in parts)
            if layout not in staging:
                staging[layout] = tuple(
                    torch.empty((plan.rows, *p.shape[1:]), dtype=p.dtype, device=device) for p in parts
                )
            stage = staging[layout]
        # a rank's share: the others' assignments come as -1
        cache = ExpertCache(parts, plan.slots, device, stats, lane, assemble, reads, stage, layer.mlp.shard is not None)
        layer.mlp.offload = caches[layer.layer] = cache
        layer.mlp.experts = None
    offload = ExpertOffload(caches, stats, plan, model.config, outside)
    offload.cap()
    return offload
