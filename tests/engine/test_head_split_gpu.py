"""Head split on a CUDA device, one NCCL rank (the GPU paths a CPU cannot run: the all-reduce inside
the decode steps' CUDA graphs, the gather of snapshot copies in pinned memory once the copy stream
has them, restores through the copy stream): the single process's logits and snapshots for a
prefill with captures, batched decode, restores, and the snapshots and KV deltas read back. Several
GPUs (the split itself) run the same code over `tests/engine/test_expert_parallel.py`'s gloo ranks.

    pytest -m gpu tests/engine/test_head_split_gpu.py
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from checkpoint_store import Snapshot
from engine import Engine
from engine.parallel import ExpertParallel
from engine.warmup import warm_up
from gateway.ports import LOOPBACK, free_port
from tests.engine.test_expert_parallel import CAPTURES, CONFIG, FED, PROMPTS, scenario

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
PRESET = "small"  # tiny's expert shapes are below the GPU expert kernels' blocks
FP32_TOL = 1e-4
GPU = dataclasses.replace(CONFIG, device="cuda:0")


def results(engine: Engine, theirs: list[Snapshot]) -> dict:
    warm_up(engine)
    out = scenario(engine, theirs)
    state = engine.new_state()
    engine.prefill(state, PROMPTS[1])
    engine.feed(state, FED[1])
    out["read_back"] = [engine.snapshot(state, 5), engine.kv_delta(state, 3, 12)]
    return {k: v for k, v in out.items() if k not in ("experts", "kv_heads")}


def _rank(rank: int, port: int, references: str, out: str) -> None:
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://{LOOPBACK}:{port}", rank=rank, world_size=1)
    try:
        engine = Engine.from_preset(PRESET, GPU, expert_parallel=ExpertParallel(0, 1), head_split=True)
        assert engine.model.heads is not None and engine.runner.use_graph
        torch.save(results(engine, torch.load(references, weights_only=False)), out)
    finally:
        dist.destroy_process_group()


def _close(ours, theirs) -> None:
    if isinstance(ours, Snapshot):
        assert (ours.start, ours.end, sorted(ours.tensors)) == (theirs.start, theirs.end, sorted(theirs.tensors))
        for name, tensor in ours.tensors.items():
            _close(tensor, theirs.tensors[name])
    elif isinstance(ours, list):
        assert len(ours) == len(theirs)
        for mine, other in zip(ours, theirs, strict=True):
            _close(mine, other)
    elif isinstance(ours, torch.Tensor):
        torch.testing.assert_close(ours.float().cpu(), theirs.float().cpu(), rtol=0, atol=FP32_TOL)
    else:
        assert ours == theirs


def test_one_rank_split_by_heads_gives_the_single_process_logits_and_snapshots(tmp_path: Path):
    single = Engine.from_preset(PRESET, GPU)
    theirs = single.prefill(single.new_state(), PROMPTS[0], capture_at=CAPTURES).snapshots
    reference = results(single, theirs)
    torch.save(theirs, tmp_path / "references.pt")
    mp.spawn(_rank, args=(free_port(), str(tmp_path / "references.pt"), str(tmp_path / "ours.pt")), nprocs=1)
    ours = torch.load(tmp_path / "ours.pt", weights_only=False)
    assert sorted(ours) == sorted(reference)
    for key, value in reference.items():
        _close(ours[key], value)
