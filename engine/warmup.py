"""Warm-up: every path of an engine run once before the first request (kernel compilation and
checks, the CUDA graphs of decode batches up to `max_running`, capture and restore copies), so
that no request pays for it. Under a memory budget, what the forward and the graphs allocate is
measured here, and the expert slots keep room for it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine import offload as expert_offload
from engine.feed import Feed
from engine.runner import PREFILL_BUCKETS
from engine.sampling import SamplingParams
from engine.scheduler import SLOT_PREFILL_ALONE

if TYPE_CHECKING:
    from engine.engine import Engine

# captured states per sequence of a step that warm-up pins host memory for ahead: a step of
# several prompts, each split at a few segment boundaries, captures a few states each
PINNED_CAPTURES = 3


def warm_up(engine: Engine) -> None:
    if engine.device.type == "cuda":  # kernels tuned per shape: full and unaligned prefill chunks as well
        _warm_device(engine)
    else:
        _warm_graphs(engine)
    state = engine.new_state()
    result = engine.prefill(state, list(range(1000, 1160)), capture_at=[64, 160])
    list(engine.generate(state, result.logits, SamplingParams(), forced=[11, 12, 13, 14]))
    restored = engine.restore(result.snapshots)
    engine.prefill(restored, [15, 16, 17])
    if engine.offload is not None:
        _warm_graphs(engine)  # those dropped if the slots shrank since
        engine.offload.reset_stats()


def _warm_graphs(engine: Engine) -> None:
    engine.runner.warmup(engine.engine_config.max_running, prefill=engine.scheduler.slot_prefill)


def _warm_device(engine: Engine) -> None:
    running, tokens = engine.engine_config.max_running, engine.step_tokens
    if engine.runtime is not None:
        captures = PINNED_CAPTURES * max(running, 2)  # 2: warm-up's own step of two sequences, below
        states = captures * expert_offload.recurrent_bytes(engine.config, engine.dtype)
        kv = expert_offload.kv_bytes(engine.config, engine.dtype, tokens)  # a step's, snapshotted too
        engine.runtime.reserve_pinned(states + kv)
        engine.runtime.prepare_attention(tokens)

    def chunk() -> None:
        engine.prefill(engine.new_state(), [1000 + i % 50_000 for i in range(tokens)])

    if engine.offload is None:
        _warm_graphs(engine)
        chunk()
    else:  # what both allocate is measured: the expert slots keep room for them within the budget
        offload = engine.offload

        def calibrated() -> None:
            chunk()
            if offload.stream is not None:  # it filled the empty slots: the next runs them too
                chunk()
            _warm_graphs(engine)

        offload.calibrate_workspace(calibrated)
        offload.calibrate_stream(lambda n: engine.prefill(engine.new_state(), [1000 + i for i in range(n)]))
    # A first request's eager prefill: unaligned lengths split at captures (the aligned runs
    # above leave other kernel specialisations to it, which a cold first request would pay for)
    engine.prefill(engine.new_state(), [1000 + i for i in range(SLOT_PREFILL_ALONE + 733)], capture_at=[1_001])
    # several sequences in one forward (the varlen conv and scan), one of them split at a capture
    sizes = ((77, [300]), (301, []))
    feeds = [Feed(engine.new_state(), [1000 + i for i in range(PREFILL_BUCKETS[-1] + n)], capture_at=caps)
             for n, caps in sizes]
    engine.step([(feed, feed.remaining) for feed in feeds])
