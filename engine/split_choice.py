"""Which way the attention and DeltaNet layers run under expert parallel: replicated on every
rank or split by heads (`engine.head_split`), chosen by timing both on the ranks at warm-up.

`choose` takes a warmed-up replicated engine (every rank at once), builds the head-split model
from its weights (the whole weights are on every rank: the split is a cut, not a second load),
times one short prefill and a few decode steps of `max_running` sequences each way (`probe`),
and keeps the faster by rank 0's timings (every rank keeps the same). The loser's model and
decode slots are dropped; while both exist, a rank holds its attention and DeltaNet weights
1 + 1/W times over and two engines' decode slots. `bench/parallel.py` times the same `probe`
at more sizes.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from typing import TypeVar

import torch
import torch.distributed as dist

from engine.engine import Engine
from engine.feed import Feed
from engine.head_split import HeadShard
from engine.loader import CheckpointError, build_model
from engine.model import HybridForCausalLM
from engine.parallel import ExpertParallel, ExpertParallelError
from engine.warmup import warm_up

log = logging.getLogger(__name__)
E = TypeVar("E", bound=Engine)
PROBE_PROMPT = 256  # tokens of the probe's prefill
PROBE_STEPS = 8  # decode steps timed (the median counts)


def split_heads(model: HybridForCausalLM, parallel: ExpertParallel) -> HybridForCausalLM:
    """The head-split model of a replicated `model` (this rank's experts, the whole heads), built
    of its weights: the experts and the other weights shared, the attention and DeltaNet weights cut."""
    config = model.config
    heads = HeadShard.of(parallel, config)
    shard = parallel.shard(config.num_experts)
    return build_model(config, dict(model.state_dict()), shard, heads)


def _sync(engine: Engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def probe(engine: Engine, prompt: int = PROBE_PROMPT, steps: int = PROBE_STEPS, batch: int | None = None) -> dict:
    """Seconds of one prefill of `prompt` tokens, and the median of `steps` decode steps of
    `batch` sequences (default `max_running`) after a short prompt each. Every rank runs it at once."""
    batch = batch or engine.engine_config.max_running
    ids = [1000 + 37 * i % 50_000 for i in range(max(prompt, steps + 8))]
    _sync(engine)
    start = time.perf_counter()
    engine.prefill(engine.new_state(), ids[:prompt])
    _sync(engine)
    prefill_s = time.perf_counter() - start
    states = [engine.new_state() for _ in range(batch)]
    for state in states:
        engine.prefill(state, ids[:8])
    times = []
    for step in range(steps + 1):  # the first step binds the sequences to their slots: not counted
        feeds = [Feed(state, [ids[8 + step]]) for state in states]
        start = time.perf_counter()
        engine.run(engine.scheduler.schedule(feeds))
        _sync(engine)
        times.append(time.perf_counter() - start)
    return {"prefill_s": prefill_s, "prompt": prompt, "decode_step_s": statistics.median(times[1:]), "batch": batch}


def score(timing: dict) -> float:
    """What `choose` compares: the probe's prefill plus its decode steps."""
    return timing["prefill_s"] + PROBE_STEPS * timing["decode_step_s"]


def choose(engine: E) -> E:
    """`engine` (replicated, warmed up; every rank at once) or its head-split twin, whichever ran
    `probe` faster on rank 0; replicated where the heads cannot be split (logged)."""
    parallel = engine.engine_config.expert_parallel
    assert parallel is not None and not engine.engine_config.head_split
    if engine.offload is not None:
        log.info("split: replicated (the experts are offloaded: head split is not built for offload)")
        return engine
    try:
        model = split_heads(engine.model, parallel)
    except (ExpertParallelError, CheckpointError) as exc:
        log.info("split: replicated (the heads cannot be split: %s)", exc)
        return engine
    replicated = probe(engine)
    config = dataclasses.replace(engine.engine_config, head_split=True)
    split = type(engine)(model, engine.fingerprint, engine.model_dir, config=config)
    warm_up(split)
    heads = probe(split)
    box = [score(heads) < score(replicated)]
    dist.broadcast_object_list(box, src=0)  # rank 0's timings decide for every rank
    keep, drop = (split, engine) if box[0] else (engine, split)
    log.info("split: %s (rank 0 probe, prefill %d tokens + %d decode steps of %d: replicated %.1f + %d x %.2f ms, "
             "heads %.1f + %d x %.2f ms)", "heads" if box[0] else "replicated", replicated["prompt"], PROBE_STEPS,
             replicated["batch"], 1e3 * replicated["prefill_s"], PROBE_STEPS, 1e3 * replicated["decode_step_s"],
             1e3 * heads["prefill_s"], PROBE_STEPS, 1e3 * heads["decode_step_s"])
    del drop, model, split, engine
    if keep.device.type == "cuda":
        torch.cuda.empty_cache()
    return keep
