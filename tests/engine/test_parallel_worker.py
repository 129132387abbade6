"""The mirror of expert parallel (`engine.parallel_worker`) on gloo: rank 0's `MirroredEngine`
runs the engine's calls (prefill with captures, batched steps, restores of its own and of the
single process's snapshots, a rewind, growth ahead, snapshots and KV deltas read back) while
rank 1 only follows, and rank 0 gets the single process's logits and snapshots; rank 1 holds no
state or feed once rank 0's are gone. With the layers replicated, split by heads, and chosen by
timing both at warm-up (`engine.split_choice`)."""

from __future__ import annotations

import dataclasses
import gc
import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from checkpoint_store import Snapshot
from engine import Engine
from engine.parallel import ExpertParallel
from engine.parallel_worker import Follower, MirroredEngine, RankSpec, join, load, stop
from gateway.ports import LOOPBACK, free_port
from tests.engine.test_expert_parallel import (
    CAPTURES,
    CONFIG,
    FED,
    PROMPTS,
    RESTORED_AT,
    _close,
    _same_snapshots,
    scenario,
)

WORLD = 2
MODES = ("replicated", "heads", "auto")


def rewound(engine: Engine) -> torch.Tensor:
    """PROMPTS[0] prefilled with captures, rewound to its capture RESTORED_AT, then continued."""
    state = engine.new_state()
    snapshots = engine.prefill(state, PROMPTS[0], capture_at=CAPTURES).snapshots
    state = engine.rewind(state, snapshots[RESTORED_AT])
    prefilled = engine.prefill(state, PROMPTS[0][CAPTURES[RESTORED_AT] :]).logits
    return torch.cat([prefilled[None], engine.feed(state, FED[0])])


def read_back(engine: Engine) -> list[Snapshot]:
    """A snapshot and a KV delta of PROMPTS[1] and its FED tokens (the engine's reads)."""
    state = engine.new_state()
    engine.prefill(state, PROMPTS[1])
    engine.feed(state, FED[1])
    return [engine.snapshot(state, 5), engine.kv_delta(state, 3, 12)]


def _rank(rank: int, mode: str, port: int, folder: str, references: str, out: str) -> None:
    config = dataclasses.replace(CONFIG, expert_parallel=ExpertParallel(rank, WORLD), head_split=mode == "heads")
    spec = RankSpec(Path(folder), "tiny", config, f"tcp://{LOOPBACK}:{port}", "gloo", choose_split=mode == "auto")
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
    results["read_back"] = read_back(engine)
    results["head_split"] = engine.engine_config.head_split
    engine.grow_ahead()
    torch.save(results, Path(out, "0.pt"))
    del results
    gc.collect()  # rank 0's states and feeds gone: the stop message tells rank 1 to forget its own
    stop(engine, [])


@pytest.fixture(scope="module")
def reference(preset_dirs) -> dict:
    """The single process's results."""
    single = Engine.load(preset_dirs["tiny"], CONFIG)
    theirs = single.prefill(single.new_state(), PROMPTS[0], capture_at=CAPTURES).snapshots
    return {**scenario(single, theirs), "rewind": rewound(single), "read_back": read_back(single)}


@pytest.fixture(scope="module")
def mirrored(preset_dirs, reference, tmp_path_factory):
    """`mirrored(mode)`: (rank 0's results, how many states and feeds rank 1 held at the end), spawned once a mode."""
    runs: dict[str, tuple[dict, int]] = {}

    def run(mode: str) -> tuple[dict, int]:
        if mode not in runs:
            out = tmp_path_factory.mktemp(f"mirror-{mode}")
            torch.save(reference["snapshots"], out / "references.pt")
            args = (mode, free_port(), preset_dirs["tiny"], str(out / "references.pt"), str(out))
            mp.spawn(_rank, args=args, nprocs=WORLD)
            held = json.loads((out / "held.json").read_text())
            runs[mode] = torch.load(out / "0.pt", weights_only=False), held
        return runs[mode]

    return run


@pytest.mark.parametrize("mode", MODES)
def test_rank_0_mirrored_gives_the_single_process_logits_and_snapshots(mirrored, reference, mode):
    ours, theirs = mirrored(mode)[0], reference
    assert ours["head_split"] is (mode == "heads") or mode == "auto"
    _close(ours["prefill"], theirs["prefill"])
    _same_snapshots(ours["snapshots"], theirs["snapshots"])
    for mine, other in zip(ours["decode"], theirs["decode"], strict=True):
        _close(mine, other)
    _close(ours["restore"], theirs["restore"])
    _close(ours["restore_theirs"], theirs["restore"])
    _close(ours["rewind"], theirs["restore"])
    _close(theirs["rewind"], theirs["restore"])
    _same_snapshots(ours["read_back"], theirs["read_back"])


@pytest.mark.parametrize("mode", MODES)
def test_a_follower_forgets_what_rank_0_no_longer_holds(mirrored, mode):
    assert mirrored(mode)[1] == 0
