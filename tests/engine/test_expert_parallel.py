"""Expert parallel on gloo: 2 and 4 processes on this machine, each holding its share of the
routed experts (`engine.parallel`), give the single process's logits (fp32, 1e-5) for a prefill with
captures, batched decode through the engine's step loop, and restores: of a snapshot taken at
the same world size, and of one the single process took (the state is replicated, so a restore
at another world size is exact). Rank 0's snapshots are the single process's. The same with the
attention and DeltaNet layers split by heads (`engine.head_split`, 2 processes: the tiny presets'
2 KV and 2 DeltaNet key heads split over 2 ranks, not 4), whose snapshots are gathered whole and
restore in one process."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from checkpoint_store import Snapshot
from engine import Engine
from engine.config import ModelConfig
from engine.engine import materialised_shard
from engine.engine_config import EngineConfig
from engine.feed import Feed
from engine.head_split import HeadShard
from engine.load import load_folder
from engine.offload import GiB, budget_for, dense_bytes, plan
from engine.parallel import ExpertParallel, ExpertParallelError
from engine.runner import starting_capacity
from gateway.ports import LOOPBACK, free_port

TOL = 1e-5
PRESETS = ("tiny", "tiny-next")
MODES = [(2, False), (4, False), (2, True)]  # (world, split_heads)
MODE_IDS = ["2", "4", "2-heads"]
# small prefill chunks: the prompts take several steps, decode rows ride in prefill forwards and run alone
CONFIG = EngineConfig(dtype=torch.float32, prefill_chunk=32, max_running=4)
PROMPTS = [[(1000 + 37 * i * (s + 1)) % 240_000 for i in range(n)] for s, n in enumerate((60, 23, 41))]
CAPTURES = [10, 25, 60]  # of PROMPTS[0]
RESTORED_AT = 1  # the chain up to CAPTURES[1]
FED = [[11, 12, 13, 14], [21, 22], [31, 32, 33]]  # decode tokens after each prompt (teacher-forced)
# offload at world 2: 2 of a rank's 4 experts (tiny's 8, top 2) resident; the single process's
# reference keeps 6 of 8 (with fewer, long chunks stream every expert): neither streams, so both take
# the same path (fetch or read in place) for every forward and count each expert's uses alike
OFFLOAD_WORLD, OFFLOAD_SLOTS = 2, {1: 6, 2: 2}


def batched_decode(engine: Engine) -> list[torch.Tensor]:
    """The prompts prefilled and their FED tokens decoded together, one `Engine.run` of the
    scheduler's plan a step; per sequence the logits after its prompt and after each fed token."""
    feeds = {i: Feed(engine.new_state(), prompt) for i, prompt in enumerate(PROMPTS)}
    logits: list[list[torch.Tensor]] = [[] for _ in PROMPTS]
    while feeds:
        engine.run(engine.scheduler.schedule(list(feeds.values())))
        for i, feed in list(feeds.items()):
            if feed.result is None:
                continue
            logits[i].append(feed.result.logits)
            fed = FED[i][len(logits[i]) - 1 : len(logits[i])]
            if fed:
                feeds[i] = Feed(feed.state, fed)
            else:
                del feeds[i]
    return [torch.stack(out) for out in logits]


def continued(engine: Engine, chain: list[Snapshot]) -> torch.Tensor:
    """PROMPTS[0] and FED[0] from a restore of `chain`: the logits after the prompt and each token."""
    state = engine.restore(chain)
    prefilled = engine.prefill(state, PROMPTS[0][chain[-1].end :]).logits
    return torch.cat([prefilled[None], engine.feed(state, FED[0])])


def scenario(engine: Engine, theirs: list[Snapshot]) -> dict:
    """What each test compares, from one engine; `theirs`: the single process's snapshots of PROMPTS[0]."""
    first = engine.prefill(engine.new_state(), PROMPTS[0], capture_at=CAPTURES)
    experts = engine.model.model.layers[0].mlp.experts
    return {
        "fingerprint": engine.fingerprint,
        "experts": experts.gate_up_proj.detach().clone(),
        "kv_heads": {layer: cache.k.shape[1] for layer, cache in engine.new_state().kv.items()},
        "prefill": first.logits,
        "snapshots": first.snapshots,
        "decode": batched_decode(engine),
        "restore": continued(engine, first.snapshots[: RESTORED_AT + 1]),
        "restore_theirs": continued(engine, theirs[: RESTORED_AT + 1]),
    }


def offload_gib(folder: str, world: int) -> float:
    """The budget that leaves `OFFLOAD_SLOTS[world]` of a rank's experts per layer on the device
    (half an expert spare), from the plan's own parts."""
    model, _ = load_folder(folder, torch.device("cpu"), torch.float32)
    c = model.config
    p = plan(c, dense_bytes(model), 1 << 50, torch.float32, CONFIG.decode_slots, starting_capacity(torch.device("cpu")),
             CONFIG.chunk_tokens, experts=c.num_experts // world)
    return (budget_for(c, p, OFFLOAD_SLOTS[world]) + p.expert_bytes // 2) / GiB


def offloaded(engine: Engine) -> dict:
    """A prefill with captures and batched decode (`batched_decode`) under offload, and what the
    expert cache counted: per layer and expert, the forwards that fetched for it and the assignments
    read in place or from a slot."""
    first = engine.prefill(engine.new_state(), PROMPTS[0], capture_at=CAPTURES)
    decode = batched_decode(engine)
    offload = engine.offload
    assert offload is not None
    stats = engine.offload_stats()
    return {"prefill": first.logits, "snapshots": first.snapshots, "decode": decode, "stats": stats,
            "slots": offload.plan.slots, "held": offload.experts, "host_bytes": offload.host_bytes,
            "uses": [cache.uses for cache in offload.order], "assigned": offload.seen[:, 0].tolist()}


def _rank(rank: int, world: int, split_heads: bool, port: int, dirs: dict[str, str], references: str, out: str) -> None:
    torch.set_num_threads(1)  # the ranks share this machine's cores
    dist.init_process_group("gloo", init_method=f"tcp://{LOOPBACK}:{port}", rank=rank, world_size=world)
    try:
        theirs = torch.load(references, weights_only=False)  # our own file: Snapshots
        results = {}
        for preset, folder in dirs.items():
            engine = Engine.load(folder, CONFIG, expert_parallel=ExpertParallel.of_group(), head_split=split_heads)
            results[preset] = scenario(engine, theirs[preset])
            model, fp = materialised_shard(preset, "cpu", torch.float32, ExpertParallel.of_group(), split_heads)
            results[preset]["materialised"] = fp, model.model.layers[0].mlp.experts.gate_up_proj.clone()
            if world == OFFLOAD_WORLD and not split_heads:  # each rank offloads its own experts within its budget
                budget = offload_gib(folder, world)
                engine = Engine.load(folder, CONFIG, expert_parallel=ExpertParallel.of_group(), gpu_memory_gib=budget)
                results[preset]["offload"] = offloaded(engine)
        torch.save(results, Path(out) / f"{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def single(preset_dirs) -> dict[str, Engine]:
    """The single process's engines (no group)."""
    return {preset: Engine.load(preset_dirs[preset], CONFIG) for preset in PRESETS}


@pytest.fixture(scope="module")
def reference(single) -> dict[str, dict]:
    """The single process's results."""
    out = {}
    for preset, engine in single.items():
        theirs = engine.prefill(engine.new_state(), PROMPTS[0], capture_at=CAPTURES).snapshots
        out[preset] = scenario(engine, theirs)
    return out


@pytest.fixture(scope="module")
def ranks(preset_dirs, reference, tmp_path_factory):
    """`ranks(world, split_heads)`: each rank's results, the world's processes spawned once."""
    runs: dict[tuple[int, bool], list[dict]] = {}
    folder = tmp_path_factory.mktemp("expert_parallel")
    references = folder / "references.pt"
    torch.save({preset: reference[preset]["snapshots"] for preset in PRESETS}, references)

    def run(world: int, split_heads: bool = False) -> list[dict]:
        if (world, split_heads) not in runs:
            out = folder / f"{world}-{split_heads}"
            out.mkdir()
            dirs = {preset: preset_dirs[preset] for preset in PRESETS}
            mp.spawn(_rank, args=(world, split_heads, free_port(), dirs, str(references), str(out)), nprocs=world)
            runs[world, split_heads] = [torch.load(out / f"{rank}.pt", weights_only=False) for rank in range(world)]
        return runs[world, split_heads]

    return run


def _close(ours, theirs) -> None:
    torch.testing.assert_close(ours, theirs, rtol=0, atol=TOL)


def _same_snapshots(ours: list[Snapshot], theirs: list[Snapshot]) -> None:
    assert [(s.start, s.end, sorted(s.tensors)) for s in ours] == [(s.start, s.end, sorted(s.tensors)) for s in theirs]
    for mine, other in zip(ours, theirs, strict=True):
        for name, tensor in mine.tensors.items():
            assert tensor.dtype == other.tensors[name].dtype
            _close(tensor, other.tensors[name])


@pytest.mark.parametrize(("world", "split_heads"), MODES, ids=MODE_IDS)
@pytest.mark.parametrize("preset", PRESETS)
def test_each_rank_holds_its_experts_and_the_whole_models_fingerprint(ranks, reference, preset, world, split_heads):
    """Loaded from the folder, and generated in memory (`FT_MATERIALISE`'s path) on the CPU,
    whose random draws are the folder's; under head split a state holds the rank's KV heads."""
    whole, fp = reference[preset]["experts"], reference[preset]["fingerprint"]
    count = whole.shape[0] // world
    kv_heads = {layer: n // world if split_heads else n for layer, n in reference[preset]["kv_heads"].items()}
    for rank, results in enumerate(ranks(world, split_heads)):
        mine = whole[rank * count : (rank + 1) * count]
        assert torch.equal(results[preset]["experts"], mine) and results[preset]["fingerprint"] == fp
        assert results[preset]["materialised"][0] == fp and torch.equal(results[preset]["materialised"][1], mine)
        assert results[preset]["kv_heads"] == kv_heads


@pytest.mark.parametrize(("world", "split_heads"), MODES, ids=MODE_IDS)
@pytest.mark.parametrize("preset", PRESETS)
def test_a_prefill_with_captures_gives_the_single_process_logits_and_snapshots(ranks, reference, preset, world,
                                                                               split_heads):
    theirs = reference[preset]
    for results in ranks(world, split_heads):
        _close(results[preset]["prefill"], theirs["prefill"])
        _same_snapshots(results[preset]["snapshots"], theirs["snapshots"])


@pytest.mark.parametrize(("world", "split_heads"), MODES, ids=MODE_IDS)
@pytest.mark.parametrize("preset", PRESETS)
def test_batched_decode_through_the_step_loop_gives_the_single_process_logits(ranks, reference, preset, world,
                                                                              split_heads):
    assert [len(out) for out in reference[preset]["decode"]] == [1 + len(fed) for fed in FED]
    for results in ranks(world, split_heads):
        for ours, theirs in zip(results[preset]["decode"], reference[preset]["decode"], strict=True):
            _close(ours, theirs)


@pytest.mark.parametrize(("world", "split_heads"), MODES, ids=MODE_IDS)
@pytest.mark.parametrize("preset", PRESETS)
def test_a_snapshot_restores_exactly_at_its_world_size_and_at_another(ranks, reference, single, preset, world,
                                                                      split_heads):
    """Restored from its own rank's snapshot, from the single process's, and (the ranks' snapshots)
    in the single process: the single process's continuation, itself that of the whole prefill."""
    theirs = reference[preset]
    _close(theirs["restore"][0], theirs["prefill"])
    for results in ranks(world, split_heads):
        _close(results[preset]["restore"], theirs["restore"])
        _close(results[preset]["restore_theirs"], theirs["restore"])
        _close(continued(single[preset], results[preset]["snapshots"][: RESTORED_AT + 1]), theirs["restore"])


@pytest.fixture(scope="module")
def offload_reference(preset_dirs) -> dict[str, dict]:
    """The single process offloaded (`OFFLOAD_SLOTS[1]`)."""
    budgets = {preset: offload_gib(preset_dirs[preset], 1) for preset in PRESETS}
    return {preset: offloaded(Engine.load(preset_dirs[preset], CONFIG, gpu_memory_gib=budgets[preset]))
            for preset in PRESETS}


@pytest.mark.parametrize("preset", PRESETS)
def test_offload_on_each_rank_gives_the_single_process_logits(ranks, reference, preset):
    """Each rank offloads its own experts within its budget, fewer resident than it holds: a prefill
    with captures and batched decode give the logits and snapshots of the single process without offload."""
    theirs = reference[preset]
    for results in ranks(OFFLOAD_WORLD):
        ours = results[preset]["offload"]
        assert (ours["slots"], ours["held"]) == (OFFLOAD_SLOTS[OFFLOAD_WORLD], 4)
        _close(ours["prefill"], theirs["prefill"])
        _same_snapshots(ours["snapshots"], theirs["snapshots"])
        for mine, other in zip(ours["decode"], theirs["decode"], strict=True):
            _close(mine, other)


@pytest.mark.parametrize("preset", PRESETS)
def test_each_rank_fetches_and_counts_its_own_experts_alone(ranks, offload_reference, preset):
    """Rank r's cache holds experts [4r, 4r + 4) in host memory, half the single process's bytes; the
    uses it counted for its expert j (forwards that fetched for it, assignments read in place or from
    a slot) are the single process's for expert 4r + j, and the experts needed on the ranks add up to
    the single process's: the other ranks' assignments were never fetched or counted."""
    single = offload_reference[preset]
    ranked = [results[preset]["offload"] for results in ranks(OFFLOAD_WORLD)]
    assert single["slots"] == OFFLOAD_SLOTS[1]
    assert sum(r["stats"]["fetched"] for r in ranked) > 0 and sum(r["stats"]["mapped"] for r in ranked) > 0
    for rank, ours in enumerate(ranked):
        mine = slice(rank * ours["held"], (rank + 1) * ours["held"])
        assert 2 * ours["host_bytes"] == single["host_bytes"]
        assert ours["uses"] == [uses[mine] for uses in single["uses"]]
        assert ours["assigned"] == [assigned[mine] for assigned in single["assigned"]]
    for phase in ("prefill", "decode"):
        needed = f"phase_needed_{phase}"
        assert sum(r["stats"][needed] for r in ranked) == single["stats"][needed] > 0


def test_a_world_that_does_not_split_the_experts_evenly_is_refused():
    with pytest.raises(ExpertParallelError, match="8 experts do not split evenly over 3 ranks"):
        ExpertParallel(0, 3).shard(8)
    with pytest.raises(ExpertParallelError, match="rank 2 outside a world of 2"):
        ExpertParallel(2, 2)


def test_a_world_that_does_not_split_the_heads_evenly_is_refused(preset_dirs):
    config = ModelConfig.from_folder(preset_dirs["tiny"])
    with pytest.raises(ExpertParallelError, match="2 KV heads do not split evenly over 4 ranks"):
        HeadShard.of(ExpertParallel(0, 4), config)
    with pytest.raises(ValueError, match="head_split: the heads are split over the ranks of expert parallel"):
        dataclasses.replace(CONFIG, head_split=True)
    with pytest.raises(ValueError, match="head_split: not with offloaded experts"):
        dataclasses.replace(CONFIG, expert_parallel=ExpertParallel(0, 2), head_split=True, gpu_memory_gib=4.0)


def test_expert_parallel_refuses_gguf(tmp_path):
    with pytest.raises(ExpertParallelError, match="not GGUF models"):
        load_folder(tmp_path / "model.gguf", torch.device("cpu"), parallel=ExpertParallel(0, 2))
