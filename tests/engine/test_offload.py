"""Expert offload on the CPU: the host/device split simulated with plain CPU tensors, an expert
cache smaller than the experts, and the same logits as without offload."""

from __future__ import annotations

import dataclasses
import functools
import random

import pytest
import torch

from checkpoint_store.snapshot import concat_chain
from engine import Engine, SamplingParams
from engine import offload as expert_offload
from engine.feed import Feed
from engine.offload import (
    BudgetError,
    GiB,
    OffloadStats,
    budget_for,
    dense_bytes,
    hit_ratio,
    plan,
    state_bytes,
)
from engine.offload.cache import ExpertCache, Lane
from engine.offload.stream import STREAM_BUFFERS, ExpertStream
from engine.ops.moe import experts_loop
from engine.runner import starting_capacity

TOL = 1e-5


def budget_gib(engine: Engine, slots: int, max_running: int = 4) -> float:
    """The budget that leaves `slots` experts per layer for `engine`'s model (half an expert spare;
    below half the experts, the buffers long chunks stream them through included: `offload.budget_for`)."""
    p = plan(
        engine.config,
        dense_bytes(engine.model),
        1 << 50,
        engine.dtype,
        max_running,
        capacity=starting_capacity(engine.device),
        tokens=4096,
    )
    return (budget_for(engine.config, p, slots) + p.expert_bytes // 2) / GiB


@pytest.fixture(scope="module", params=["staged", "in-place", "fetch"])
def offloaded(request, preset_dirs, tiny) -> Engine:
    """The tiny preset with 3 of its 8 experts per layer resident; decode reads the others from
    host memory, gathered into staging rows first (staged) or where they lie (in-place), or copies
    them into slots first (fetch)."""
    install = functools.partial(
        expert_offload.install, mapped=request.param != "fetch", staged=request.param == "staged"
    )
    with pytest.MonkeyPatch.context() as env:
        env.setattr(expert_offload, "install", install)
        engine = Engine.load(preset_dirs["tiny"], gpu_memory_gib=budget_gib(tiny, 3))
    offload = engine.offload
    assert offload is not None and offload.plan.slots == 3 and offload.stream is not None
    assert offload.mapped == (request.param != "fetch")
    assert (offload.staging_bytes > 0) == (request.param == "staged")
    return engine


def test_offload_keeps_only_dense_weights_in_the_model(tiny, offloaded):
    c = tiny.config
    expert_bytes = 3 * c.moe_intermediate_size * c.hidden_size * 4
    assert (
        offloaded.memory()["weights"]
        == tiny.memory()["weights"] - c.num_hidden_layers * c.num_experts * expert_bytes
    )
    assert offloaded.memory()["expert_cache"] == c.num_hidden_layers * 3 * expert_bytes
    assert offloaded.fingerprint == tiny.fingerprint  # checkpoints stay interchangeable


def test_prefill_captures_decode_and_restore_match_no_offload(tiny, offloaded):
    rng = random.Random(7)
    tokens = [rng.randrange(100, 5000) for _ in range(200)]
    cut = rng.randrange(20, 180)
    results = {}
    for name, engine in (("plain", tiny), ("offload", offloaded)):
        state = engine.new_state()
        res = engine.prefill(state, tokens, capture_at=[cut, len(tokens)])
        events = list(engine.generate(state, res.logits, SamplingParams(temperature=0.0, max_tokens=6)))
        decoded = engine.feed(state, [e.token_id for e in events[:-1]])  # decode steps through the runner
        restored = engine.restore(concat_chain(res.snapshots[:1]))  # continue from the first capture
        resumed = engine.prefill(restored, tokens[cut:], all_logits=True).logits
        results[name] = (res.logits, [e.token_id for e in events], decoded, resumed)
    plain, off = results["plain"], results["offload"]
    assert off[1] == plain[1]
    for a, b in ((plain[0], off[0]), (plain[2], off[2]), (plain[3], off[3])):
        assert (a - b).abs().max().item() <= TOL


def test_batched_decode_matches_no_offload(tiny, offloaded):
    """Two sequences decoded in one runner step, each as without offload."""
    out = {}
    for name, engine in (("plain", tiny), ("offload", offloaded)):
        states = [engine.new_state(), engine.new_state()]
        for state, prompt in zip(states, ([5, 6, 7, 8], [900, 901]), strict=True):
            engine.prefill(state, prompt)
        feeds = [Feed(states[0], [11]), Feed(states[1], [12])]
        engine.step([(f, 1) for f in feeds])
        out[name] = torch.stack([f.result.logits for f in feeds])
    assert (out["plain"] - out["offload"]).abs().max().item() <= TOL


def test_two_prefills_in_one_streamed_forward_match_no_offload(tiny, offloaded):
    """Two sequences' chunks in one forward (long enough to stream every layer's experts), and
    a decode step after: each as without offload."""
    out = {}
    for name, engine in (("plain", tiny), ("offload", offloaded)):
        states = [engine.new_state(), engine.new_state()]
        feeds = [Feed(states[0], list(range(400, 430))), Feed(states[1], list(range(900, 925)))]
        engine.step([(f, len(f.token_ids)) for f in feeds])
        decoded = [Feed(states[0], [11]), Feed(states[1], [12])]
        engine.step([(f, 1) for f in decoded])
        out[name] = torch.stack([f.result.logits for f in [*feeds, *decoded]])
    assert (out["plain"] - out["offload"]).abs().max().item() <= TOL


def test_the_step_log_names_a_slow_streamed_forward_its_parts_and_link_bytes(offloaded, caplog):
    """`EngineConfig.step_log_ms`: a forward past the threshold is logged with its parts, the bytes its
    streamed experts moved and the slots; one under it, or with the log off, is not."""
    state = offloaded.new_state()
    config = offloaded.engine_config
    try:
        with caplog.at_level("INFO", logger="engine.step_log"):
            for threshold, start, capture_at in ((0.0, 300, [20, 40]), (1e9, 400, []), (None, 500, [])):
                offloaded.engine_config = dataclasses.replace(config, step_log_ms=threshold)
                offloaded.prefill(state, list(range(start, start + 40)), capture_at=capture_at)
    finally:
        offloaded.engine_config = config
    lines = [r.getMessage() for r in caplog.records if r.name == "engine.step_log"]
    assert len(lines) == 1, lines
    line = lines[0]
    assert line.startswith("prefill forward of 40 tokens (1 sequences, 2 captures): ")
    assert "fit " in line and "queue " in line and "device " in line and "expert slots 3 -> 3" in line
    assert "link 0.0 MiB" not in line  # the experts not resident streamed in (40 tokens: a whole stream)


@pytest.mark.parametrize("mapped", [True, False])
def test_counters_under_the_smallest_cache(preset_dirs, tiny, monkeypatch, mapped):
    """top_k slots per layer: a long chunk streams every expert of every layer once (filling the
    empty slots from the stream, nothing more over the link); in a short one and a decode step
    every expert needed is counted once, as a hit, a copy or (mapped) a read in place; the bytes
    moved are those copies and reads."""
    monkeypatch.setattr(expert_offload, "install", functools.partial(expert_offload.install, mapped=mapped))
    engine = Engine.load(preset_dirs["tiny"], gpu_memory_gib=budget_gib(tiny, 2))
    offload = engine.offload
    assert offload is not None and offload.plan.slots == tiny.config.num_experts_per_tok
    c = tiny.config
    layers, expert = c.num_hidden_layers, offload.plan.expert_bytes
    state = engine.new_state()
    engine.prefill(state, list(range(300, 340)))  # past the policy's stream_tokens: streamed
    stats = engine.offload_stats()
    assert stats["misses"] == stats["fetched"] == layers * c.num_experts and stats["evictions"] == stats["hits"] == 0
    assert all(cache.expert_in == [0, 1] for cache in offload.order)  # the first piece's, into empty slots
    assert all(cache.slot_table.tolist()[:3] == [0, 1, -1] for cache in offload.order)
    engine.prefill(state, [5, 6, 7])  # a short chunk: only the experts it routes to
    short = {k: v - stats[k] for k, v in engine.offload_stats().items()}
    if mapped:  # as few assignments as a decode step: read where they lie, each counted
        assert short["misses"] == 0 and short["hits"] + short["mapped"] == layers * 3 * c.num_experts_per_tok
    else:  # copied into the slots (full: each copy evicts), each for the forward that needed it
        assert short["misses"] + short["hits"] >= layers * c.num_experts_per_tok
        assert short["evictions"] == short["misses"] == short["fetched"]
    stats = engine.offload_stats()
    moved = stats["misses"] + stats["mapped"]
    assert stats["bytes_in_prefill"] == moved * expert and stats["bytes_in_decode"] == 0
    assert stats["tokens_prefill"] == 43
    before = engine.offload_stats()
    engine.decode(state, 77)
    after = engine.offload_stats()
    moved, read = after["misses"] - before["misses"], after["mapped"] - before["mapped"]
    assert read == 0 or mapped
    # one token: exactly top_k experts per layer, each a hit or fetched (copied or read in place) for it
    fetched = after["fetched"] - before["fetched"]
    assert after["hits"] - before["hits"] + (read if mapped else moved) == layers * 2
    assert fetched == (0 if mapped else moved)
    delta = {k: after[k] - before[k] for k in before}
    assert hit_ratio(delta) == hit_ratio(delta, "decode") == (after["hits"] - before["hits"]) / (layers * 2)
    assert delta["phase_needed_decode"] == layers * 2 and delta["phase_needed_prefill"] == 0
    needed = after["hits"] + after["fetched"] + after["on_host"] + after["mapped"]
    assert after["phase_needed_prefill"] + after["phase_needed_decode"] == needed  # each need counted once, in its phase
    assert after["bytes_in_decode"] == (moved + read) * expert and after["tokens_decode"] == 1


def _cache(num_experts: int, slots: int, stats: OffloadStats) -> ExpertCache:
    torch.manual_seed(0)
    gate_up, down = torch.randn(num_experts, 16, 8), torch.randn(num_experts, 8, 8)
    return ExpertCache((gate_up, down), slots, torch.device("cpu"), stats, Lane(torch.device("cpu")))


def _counts(num_experts: int, *experts: int) -> list[int]:
    return [int(e in experts) for e in range(num_experts)]


def test_eviction_by_recency_then_frequency_never_a_needed_expert():
    stats = OffloadStats()
    cache = _cache(8, 3, stats)

    def step(*experts: int) -> None:
        groups, on_host = cache.prepare(_counts(8, *experts))
        assert len(groups) == 1 and not on_host
        cache._load(groups[0], busy=[])

    step(0, 1)
    step(0, 2)  # 0 and 2 used last, 0 twice
    step(3)  # the least recent (1) goes
    assert cache.slot_of[1] < 0 and sorted(cache.expert_in) == [0, 2, 3]
    step(4)  # 0 and 2 equally recent: the less used (2) goes
    assert cache.slot_of[2] < 0 and sorted(cache.expert_in) == [0, 3, 4]
    step(0, 5, 6)  # 0 is needed: 3 and 4 go, although 0 is older
    assert sorted(cache.expert_in) == [0, 5, 6]
    assert (stats.hits, stats.fetched, stats.misses, stats.evictions) == (2, 7, 7, 4)
    assert stats.bytes_in["prefill"] == 7 * cache.expert_bytes


def _routing(tokens: int, num_experts: int, top_k: int, seed: int):
    torch.manual_seed(seed)
    x = torch.randn(tokens, 8)
    weights = torch.rand(tokens, top_k)
    ids = torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(tokens)])
    return x, weights, ids


def test_a_chunk_routed_to_more_experts_than_slots_runs_in_double_buffered_groups():
    cache = _cache(8, 4, OffloadStats())
    x, weights, ids = _routing(50, 8, 3, seed=1)
    groups, _ = cache.prepare(torch.bincount(ids.flatten(), minlength=8).tolist())
    assert [len(g) for g in groups] == [2, 2, 2, 2]  # halves of the slots, alternating
    want = experts_loop(x, weights, ids, *cache.host)
    torch.testing.assert_close(
        cache.run(x, weights, ids, experts_loop), want, rtol=1e-6, atol=1e-6
    )  # summation order


def test_a_group_never_evicts_the_group_computed_before_it():
    """While group j computes, group j+1's copies go to the other half of the slots."""
    cache = _cache(8, 4, OffloadStats())
    loads = []
    real_load = cache._load

    def load(group, busy):
        before = {e: cache.slot_of[e] for e in busy}
        real_load(group, busy)
        assert {e: cache.slot_of[e] for e in busy} == before  # busy experts kept their slots
        loads.append((list(group), list(busy)))

    cache._load = load
    x, weights, ids = _routing(40, 8, 2, seed=2)
    cache.run(x, weights, ids, experts_loop)
    assert [busy for _, busy in loads[1:]] == [group for group, _ in loads[:-1]]


def test_budget_below_the_dense_weights_is_a_clear_error(preset_dirs, tiny):
    dense = dense_bytes(tiny.model)
    with pytest.raises(BudgetError) as info:
        Engine.load(preset_dirs["tiny"], gpu_memory_gib=dense / 2 / GiB)
    assert f"{dense:,} bytes" in str(info.value) and "dense weights" in str(info.value)
    assert f"{dense // 2:,} bytes" in str(info.value)


def test_budget_without_room_for_top_k_experts_is_a_clear_error(preset_dirs, tiny):
    """Room for one expert per layer, and none with the stream buffers: the plain plan's error."""
    with pytest.raises(BudgetError, match=r"room for 1 experts per layer, fewer than top_k = 2"):
        Engine.load(preset_dirs["tiny"], gpu_memory_gib=budget_gib(tiny, 1))


def test_planned_decode_slots_are_the_runners(tiny):
    """The budget's decode slots are what the runner allocates for max_running sequences."""
    engine = Engine.load(tiny.model_dir)
    engine.runner.warmup(4)
    assert (
        state_bytes(engine.config, engine.dtype, engine.runner.slots, engine.runner.capacity)
        == engine.runner.nbytes
    )


@pytest.mark.parametrize("staged", [True, False], ids=["staged", "in-place"])
def test_mapped_decode_reads_misses_from_host_and_refresh_swaps_hot_experts_in(staged):
    """Decode-sized forwards run resident experts from their slots and the others from the host
    copy, gathered into staging rows first or where they lie (the same result as every expert
    resident); `refresh` brings in the hottest experts, at most `limit` per call, empty slots
    first, and never swaps one for an expert as hot as it."""
    torch.manual_seed(0)
    host = (torch.randn(8, 16, 8), torch.randn(8, 8, 8))
    stats = OffloadStats()
    staging = tuple(torch.full((4, *p.shape[1:]), float("nan")) for p in host) if staged else None
    cpu = torch.device("cpu")
    cache = ExpertCache(host, 2, cpu, stats, Lane(cpu), mapped=host, staging=staging)
    x, weights = torch.randn(3, 8), torch.rand(3, 2)

    def step(*pairs: tuple[int, int]) -> torch.Tensor:
        ids = torch.tensor(pairs)
        got = cache.run(x[: len(ids)], weights[: len(ids)], ids, experts_loop)
        want = experts_loop(x[: len(ids)], weights[: len(ids)], ids, *host)
        torch.testing.assert_close(got, want, rtol=0, atol=TOL)
        return ids

    def uses(ids: torch.Tensor):
        return torch.bincount(ids.flatten(), minlength=8).numpy()

    ids = step((3, 5), (3, 1))
    assert cache.counters[0].tolist() == [0, 1, 0, 2, 0, 1, 0, 0] and not cache.counters[1].any()
    assert cache.refresh(uses(ids), limit=1) == 1 and cache.slot_of[3] >= 0  # the hottest, into an empty slot
    assert cache.refresh(uses(step((3, 5), (5, 1))), limit=1) == 1 and cache.slot_of[5] >= 0
    assert cache.counters[1].tolist() == [0, 0, 0, 1, 0, 0, 0, 0]  # 3 was resident for the second step
    assert cache.slot_table.tolist()[:-1] == cache.slot_of
    # 1 is hotter than the coldest resident (3), but not by more than SWAP_MARGIN: no swap yet
    assert cache.refresh(uses(step((1, 6))), limit=1) == 0
    assert cache.refresh(uses(step((1, 6), (1, 7))), limit=2) == 1 and cache.slot_of[1] >= 0
    assert sorted(e for e in cache.expert_in) == [1, 5]  # 3, the coldest, went
    step((1, 3), (0, 2))  # every combination of slots and host still gives the plain result
    step((0, 4), (2, 6), (7, 3))  # more assignments than staging rows: read where they lie
    assert (stats.misses, stats.evictions) == (3, 1)  # the refreshes' copies: none was fetched for a forward
    assert stats.fetched == 0 and stats.bytes_in["prefill"] == 3 * cache.expert_bytes


class RecordingLane(Lane):
    """The CPU's lane, with each copy's `after` events, each compute's waits and each recorded
    read kept in order (tokens stand for the events a CUDA lane would make)."""

    def __init__(self):
        super().__init__(torch.device("cpu"))
        self.log: list[tuple[str, object]] = []

    def copy(self, pairs, after):
        super().copy(pairs, after)
        token = object()
        self.log.append(("copy", (token, [a for a in after if a is not None])))
        return token

    def record(self):
        token = object()
        self.log.append(("read", token))
        return token

    def wait(self, events):
        self.log.append(("wait", [e for e in events if e is not None]))


def test_a_streamed_forward_copies_each_piece_after_its_buffer_was_read_and_runs_it_after_its_copy():
    """Three layers of 8 experts in pieces of 2, a ring of B buffers: piece j's copy waits for the
    read of piece j - B (the buffer's last use), piece j's experts wait for piece j's copy; every piece runs
    the assignments routed to it, so the sum is every expert's; the empty slots take the first
    piece's experts as it passes, and the next forward runs those from the slots, copying the
    other three pieces only."""
    torch.manual_seed(0)
    cpu, stats, lane = torch.device("cpu"), OffloadStats(), RecordingLane()
    hosts = [(torch.randn(8, 16, 8), torch.randn(8, 8, 8)) for _ in range(3)]
    caches = [ExpertCache(h, 2, cpu, stats, lane) for h in hosts]
    stream = ExpertStream(caches, lane, stats)
    assert (stream.size, stream.pieces) == (2, 4)
    x, weights = torch.randn(5, 8), torch.rand(5, 2)
    ids = torch.tensor([[0, 7], [3, 4], [5, 1], [2, 6], [7, 0]])
    stream.begin()
    for cache, host in zip(caches, hosts, strict=True):
        got = stream.run(cache, x, weights, ids, experts_loop)
        torch.testing.assert_close(got, experts_loop(x, weights, ids, *host), rtol=0, atol=TOL)
    stream.end()
    copies = [v for k, v in lane.log if k == "copy"]
    reads = [v for k, v in lane.log if k == "read"]
    waits = [v for k, v in lane.log if k == "wait"]
    assert len(copies) == len(reads) == len(waits) == 12  # 3 layers x 4 pieces
    for j, (token, after) in enumerate(copies):
        assert after == ([reads[j - STREAM_BUFFERS]] if j >= STREAM_BUFFERS else [])
        assert waits[j] == [token]
    assert stats.misses == stats.fetched == 24 and stats.bytes_in["prefill"] == 24 * caches[0].expert_bytes
    assert all(c.expert_in == [0, 1] and c.slot_of[:3] == [0, 1, -1] for c in caches)  # from the stream
    # again, the second layer holding experts 0 and 5: the resident experts run from their slots,
    # a piece copies the span of those it lacks (the second layer's piece of 4 and 5: only 4)
    caches[1]._load([5], busy=[0])
    lane.log.clear()
    stream.begin()
    for cache, host in zip(caches, hosts, strict=True):
        got = stream.run(cache, x, weights, ids, experts_loop)
        torch.testing.assert_close(got, experts_loop(x, weights, ids, *host), rtol=0, atol=TOL)
    stream.end()
    assert len([v for k, v in lane.log if k == "copy"]) == 3 + 4 + 3 and stats.misses == 24 + 1 + 18
    # needed by the forward: the two resident a layer hits, the other six fetched (the copy of 5 was not for it)
    assert (stats.hits, stats.fetched) == (3 * 2, 24 + 18)
    assert stats.hits == 3 * 2  # the resident experts, served from the slots
    with pytest.raises(RuntimeError, match="out of order"):
        stream.begin()
        stream.run(caches[1], x, weights, ids, experts_loop)
