"""The prefill forward's step log (`EngineConfig.step_log_ms`): one forward's host time by part,
then (after a sync) the device's rest, logged when the whole passes the threshold."""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol

import torch

log = logging.getLogger(__name__)


class Timed(Protocol):
    """What the timer reads of the engine (typed here, so the engine's module is not imported)."""

    device: torch.device
    offload: Any  # engine.offload.OffloadRuntime | None
    runtime: Any  # engine.host_transfers.HostTransfers | None

    def link_bytes(self, counted: bool = True) -> int | None: ...


class StepTimer:
    def __init__(self, engine: Timed, threshold_ms: float):
        self.engine, self.threshold_ms = engine, threshold_ms
        self.start = self.last = time.perf_counter()
        self.parts: dict[str, float] = {}
        self.slots = engine.offload.plan.slots if engine.offload is not None else None
        self.link = engine.link_bytes(counted=False) or 0
        self.stalls = self._stalls()

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.parts[name], self.last = (now - self.last) * 1e3, now

    def done(self, tokens: int, sequences: int, captures: int) -> None:
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize(self.engine.device)
        self.mark("device")
        total = (self.last - self.start) * 1e3
        if total < self.threshold_ms:
            return
        parts = " ".join(f"{name} {ms:.1f}" for name, ms in self.parts.items())
        log.info(
            "prefill forward of %d tokens (%d sequences, %d captures): %.1f ms (%s)%s",
            tokens,
            sequences,
            captures,
            total,
            parts,
            self._extra(),
        )

    def _extra(self) -> str:
        """The link bytes the forward moved, the expert slots before and after, and on a GPU the
        host waits it may have hidden."""
        engine = self.engine
        extra = f"; link {((engine.link_bytes(counted=False) or 0) - self.link) / 2**20:,.1f} MiB"
        if engine.offload is not None:
            extra += f", expert slots {self.slots} -> {engine.offload.plan.slots}"
        if engine.runtime is not None:
            (retries, slabs), (retries_after, slabs_after) = self.stalls, self._stalls()
            extra += f", allocator retries {retries_after - retries}, capture slabs {slabs} -> {slabs_after}"
        return extra

    def _stalls(self) -> tuple[int, int]:
        """On a GPU, two host waits a forward can hide: the CUDA allocator's retries (each frees its
        cached blocks, synchronising the device) and the pinned slabs captures are cut from."""
        runtime = self.engine.runtime
        if runtime is None:
            return 0, 0
        return torch.cuda.memory_stats(self.engine.device).get("num_alloc_retries", 0), runtime.capture_slabs
