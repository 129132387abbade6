"""The mirror of expert parallel (`engine.parallel_worker`) on gloo: rank 0's `MirroredEngine`
runs the engine's calls (prefill with captures, batched steps, restores of its own and of the
single process's snapshots, a rewind, growth ahead) while rank 1 only follows, and rank 0 gets
the single process's logits; rank 1 holds no state or feed once rank 0's are gone."""

from __future__ import annotations

import dataclasses
import gc
import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from engine import Engine
from engine.parallel import ExpertParallel
from engine.parallel_worker import Follower, MirroredEngine, RankSpec, join, load, stop
from gateway.ports import LOOPBACK, free_port
from tests.engine.test_expert_parallel import CAPTURES, CONFIG, FED, PROMPTS, RESTORED_AT, _close, scenario

WORLD = 2


def rewound(engine: Engine) -> torch.Tensor:
    """PROMPTS[0] prefilled with captures, rewound to its capture RESTORED_AT, then continued."""
    state = engine.new_state()
    snapshots = engine.prefill(state, PROMPTS[0], capture_at=CAPTURES).snapshots
    state = engine.rewind(state, snapshots[RESTORED_AT])
    prefilled = engine.prefill(state, PROMPTS[0][CAPTURES[RESTORED_AT] :]).logits
    return torch.cat([prefilled[None], engine.feed(state, FED[0])])


def _rank(rank: int, port: int, folder: str, references: str, out: str) -> None:
    config = dataclasses.replace(CONFIG, expert_parallel=ExpertParallel(rank, WORLD))
    spec = RankSpec(Path(folder), "tiny", config, f"tcp://{LOOPBACK}:{port}", "gloo")
    control = join(spec)
    if rank > 0:
        follower = Follower(load(Engine, spec), control)
        follower.follow()
        Path(out, "held.json").write_text(json.dumps(len(follower.held)))
        torch.distributed.destroy_process_group()
        return
    engine = load(MirroredEngine, spec)
    assert isinstance(engine, MirroredEngine)
    engine.start_mirroring(control)
    results = scenario(engine, torch.load(references, weights_only=False))
    results["rewind"] = rewound(engine)
    engine.grow_ahead()
    torch.save(results, Path(out, "0.pt"))
    del results
    gc.collect()  # rank 0's states and feeds gone: the stop message tells rank 1 to forget its own
    stop(engine, [])


@pytest.fixture(scope="module")
def mirrored(preset_dirs, tmp_path_factory) -> tuple[dict, dict, int]:
    """(rank 0's results, the single process's, how many states and feeds rank 1 held at the end)."""
    single = Engine.load(preset_dirs["tiny"], CONFIG)
    theirs = single.prefill(single.new_state(), PROMPTS[0], capture_at=CAPTURES).snapshots
    reference = scenario(single, theirs)
    out = tmp_path_factory.mktemp("mirror")
    torch.save(theirs, out / "references.pt")
    mp.spawn(_rank, args=(free_port(), preset_dirs["tiny"], str(out / "references.pt"), str(out)), nprocs=WORLD)
    held = json.loads((out / "held.json").read_text())
    return torch.load(out / "0.pt", weights_only=False), reference, held


def test_rank_0_mirrored_gives_the_single_process_logits(mirrored):
    ours, theirs, _ = mirrored
    _close(ours["prefill"], theirs["prefill"])
    for mine, other in zip(ours["decode"], theirs["decode"], strict=True):
        _close(mine, other)
    _close(ours["restore"], theirs["restore"])
    _close(ours["restore_theirs"], theirs["restore"])
    _close(ours["rewind"], theirs["restore"])


def test_a_follower_forgets_what_rank_0_no_longer_holds(mirrored):
    assert mirrored[2] == 0
