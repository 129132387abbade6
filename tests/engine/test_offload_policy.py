"""What a forward does with the host link under offload, on the CPU (the split simulated): the next
layer's experts prefetched in long chunks, misses computed on the host in short ones, the expert
cache shrinking as the decode slots grow, and experts stored as any tuple of per-expert parts."""

from __future__ import annotations

import dataclasses
import functools
import random

import pytest
import torch

from engine import Engine, SamplingParams
from engine import offload as expert_offload
from engine.config import ModelConfig
from engine.offload import ExpertCachePolicy, Link, OffloadPlan, OffloadStats, state_bytes
from engine.offload.cache import ExpertCache, Lane
from engine.ops.moe import experts_loop
from engine.presets import preset_config
from engine.runner import starting_capacity
from engine.state import KVCache
from tests.engine.test_offload import budget_gib

TOL = 1e-5


def _load(preset_dirs, tiny, slots: int, max_running: int = 4) -> Engine:
    engine = Engine.load(
        preset_dirs["tiny"], gpu_memory_gib=budget_gib(tiny, slots, max_running), max_running=max_running
    )
    assert engine.offload is not None and engine.offload.plan.slots == slots
    return engine


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 5000) for _ in range(n)]


def _trace(engine: Engine) -> list[tuple[str, int]]:
    """Log each layer's expert run and prefetch, in order."""
    log: list[tuple[str, int]] = []
    assert engine.offload is not None
    for layer, cache in engine.offload.caches.items():
        run, prefetch = cache.run, cache.prefetch
        cache.run = lambda *a, _run=run, _l=layer: (log.append(("run", _l)), _run(*a))[1]
        cache.prefetch = lambda n, _p=prefetch, _l=layer: (log.append(("prefetch", _l)), _p(n))[1]
    return log


def test_coverage_tokens():
    c = ModelConfig.from_dict(preset_config("qwen3.6-35b-a3b"))
    assert ExpertCachePolicy.coverage_tokens(c) == 73  # 1 - (1 - 8/256)^73 >= 0.9 > 1 - (1 - 8/256)^72
    tiny = ModelConfig.from_dict(preset_config("tiny"))
    assert ExpertCachePolicy.coverage_tokens(tiny) == 9


def test_policy_from_the_link():
    c = ModelConfig.from_dict(preset_config("qwen3.6-35b-a3b"))
    policy = ExpertCachePolicy.measured(c, Link(h2d_bytes_per_s=50e9, host_expert_s=1e-3, host_row_s=1e-4), 6 << 20)
    assert policy.costs == ((6 << 20) / 50e9, 1e-3, 1e-4) and policy.stream_tokens == 73


def test_stream_threshold_where_fetching_costs_as_much_as_streaming():
    """Fetching a 24-token chunk's experts (54% of a layer's) took 0.94 s and streaming them all
    0.35 s: fetching costs as much as the stream at 7 tokens (20% of the experts). Never below what
    a decode step of 4 sequences reads in place (5 tokens), never above 90% coverage (73)."""
    c = ModelConfig.from_dict(preset_config("qwen3.6-35b-a3b"))
    policy = ExpertCachePolicy(ExpertCachePolicy.coverage_tokens(c))
    assert policy.crossover(c, 24, 0.94, 0.35).stream_tokens == 7
    assert policy.crossover(c, 24, 0.35, 0.35).stream_tokens == 24
    assert policy.crossover(c, 24, 0.2, 0.35).stream_tokens == 73  # fetching cheaper up to 90% coverage
    assert policy.crossover(c, 24, 5.0, 0.35).stream_tokens == 5
    assert policy.crossover(c, 24, 0.94, 0.35).costs == policy.costs


def test_the_stream_threshold_measured_both_ways(preset_dirs, tiny):
    """`calibrate_stream` runs the chunk fetched then streamed, twice each (the first untimed)."""
    engine = _load(preset_dirs, tiny, slots=2)
    offload = engine.offload
    assert offload is not None and offload.stream is not None
    began, streamed = [], []
    begin = offload.stream.begin
    offload.stream.begin = lambda: (began.append(1), begin())[1]

    def prefill(n: int) -> None:
        before = len(began)
        engine.prefill(engine.new_state(), _prompt(n, 3))
        streamed.append(len(began) > before)

    policy = offload.calibrate_stream(prefill, tokens=6)
    assert streamed == [False, False, True, True]
    assert policy is offload.policy and policy.stream_tokens <= ExpertCachePolicy.coverage_tokens(offload.config)


def test_host_and_copies_balanced():
    """Misses go to the host, fewest rows first, while the host's total stays within the time of
    the copies left: here copies of 1 s, the host 2 s an expert and 0.5 s a further row."""
    cache = ExpertCache(
        (torch.randn(8, 16, 8), torch.randn(8, 8, 8)),
        4,
        torch.device("cpu"),
        OffloadStats(),
        Lane(torch.device("cpu")),
    )
    cache.cpu_rows, cache.costs = 1 << 16, (1.0, 2.0, 0.5)
    counts = [1, 1, 3, 1, 1, 1, 1, 1]
    assert cache.split(list(range(8)), counts) == [0, 1]  # 2 <= 7 copies left, 4 <= 6, 6 > 5
    assert cache.split([2, 5], counts) == []  # 2 s on the host against 1 s of copies
    cache.costs = (1.0, 0.1, 0.1)
    assert cache.split(list(range(8)), counts) == [0, 1, 3, 4, 5, 6, 7]  # 0.7 s <= one copy left
    cache.costs = None
    no_costs = cache.split([0, 1, 2, 3], [1, 1, 3, 2, 0, 0, 0, 0])
    assert no_costs == [0, 1, 3, 2]  # every miss of at most cpu_rows rows, fewest first


def test_long_chunks_prefetch_the_next_layer_before_its_routing(preset_dirs, tiny):
    """Half the experts or more resident (no stream buffers): a long chunk's layers prefetch."""
    engine = _load(preset_dirs, tiny, slots=6)
    offload = engine.offload
    assert offload is not None and offload.policy.stream_tokens == 9
    log = _trace(engine)
    state = engine.new_state()
    engine.prefill(state, _prompt(40, 1))
    layers = sorted(offload.caches)
    want = [("prefetch", layers[0])]
    for layer, following in zip(layers, [*layers[1:], None], strict=True):
        want += [("run", layer)] + ([("prefetch", following)] if following is not None else [])
    assert log == want
    log.clear()
    engine.prefill(state, _prompt(5, 2))  # below stream_tokens: only routed experts, after routing
    engine.decode(state, 77)
    assert log == [("run", layer) for layer in layers] * 2


def test_prefetch_and_double_buffered_groups_match_no_offload(preset_dirs, tiny):
    """Prefill chunks long enough to prefetch, with groups of half the slots, then decode."""
    engine = _load(preset_dirs, tiny, slots=6)
    tokens = _prompt(300, 3)
    out = {}
    for name, eng in (("plain", tiny), ("offload", engine)):
        state = eng.new_state()
        res = eng.prefill(state, tokens, all_logits=True)
        events = list(eng.generate(state, res.logits[-1], SamplingParams(temperature=0.0, max_tokens=5)))
        out[name] = (res.logits, [e.token_id for e in events])
    assert out["offload"][1] == out["plain"][1]
    assert (out["plain"][0] - out["offload"][0]).abs().max().item() <= TOL
    stats = engine.offload.stats
    assert stats.misses > 0 and stats.on_host == 0


def test_misses_computed_on_the_host_match_no_offload(preset_dirs, tiny, monkeypatch):
    # short forwards fetch (else they read misses in place)
    monkeypatch.setattr(expert_offload, "install", functools.partial(expert_offload.install, mapped=False))
    engine = _load(preset_dirs, tiny, slots=2)
    offload = engine.offload
    offload.policy = ExpertCachePolicy(stream_tokens=offload.policy.stream_tokens, cpu_rows=3)
    tokens = _prompt(6, 4)  # a short suffix: below stream_tokens
    out = {}
    for name, eng in (("plain", tiny), ("offload", engine)):
        state = eng.new_state()
        logits = eng.prefill(state, tokens, all_logits=True).logits
        out[name] = torch.cat([logits, eng.feed(state, [11, 12, 13, 14])])
    assert (out["plain"] - out["offload"]).abs().max().item() <= TOL
    stats = offload.stats.as_dict()
    assert stats["on_host"] > 0
    needed = stats["hits"] + stats["misses"] + stats["on_host"]
    assert needed >= 5 * len(offload.caches) * 2  # each of the 5 forwards: top_k or more per layer


def test_host_rows_only_for_misses_with_few_rows():
    cache = ExpertCache(
        (torch.randn(8, 16, 8), torch.randn(8, 8, 8)),
        4,
        torch.device("cpu"),
        OffloadStats(),
        Lane(torch.device("cpu")),
    )
    cache.cpu_rows = 2
    cache._load([0], busy=[])
    groups, on_host = cache.prepare([5, 1, 2, 3, 0, 0, 0, 1])
    assert on_host == [1, 7, 2]  # misses with at most two rows, fewest first; 0 is resident, 3 has three rows
    assert groups == [[0, 3]]


def test_experts_as_any_tuple_of_parts():
    """Gate, up and down as three parts, assembled into what `moe_experts` takes (as quantized
    stacks' field arrays are assembled into `QuantWeight`s: views of the slots, assembled once)."""
    torch.manual_seed(5)
    gate, up, down = torch.randn(8, 8, 8), torch.randn(8, 8, 8), torch.randn(8, 8, 8)

    class GateUp:  # over its parts as a `QuantWeight` is over its field arrays
        dtype = torch.float32

        def __init__(self, gate: torch.Tensor, up: torch.Tensor):
            self.gate, self.up = gate, up

        def dequantize(self) -> torch.Tensor:
            return torch.cat([self.gate, self.up], dim=1)

    def split_experts(x, weights, ids, gate_up: GateUp, down):
        return experts_loop(x, weights, ids, gate_up.dequantize(), down)

    cache = ExpertCache(
        (gate, up, down),
        3,
        torch.device("cpu"),
        OffloadStats(),
        Lane(torch.device("cpu")),
        assemble=lambda p: (GateUp(p[0], p[1]), p[2]),
    )
    assert cache.expert_bytes == 3 * 8 * 8 * 4
    cache.cpu_rows = 1
    x, weights = torch.randn(30, 8), torch.rand(30, 2)
    ids = torch.stack([torch.randperm(7)[:2] for _ in range(30)])
    ids[0, 0] = 7  # expert 7 on one row only: on the host
    want = experts_loop(x, weights, ids, torch.cat([gate, up], dim=1), down)
    torch.testing.assert_close(cache.run(x, weights, ids, split_experts), want, rtol=1e-5, atol=1e-5)
    assert cache.stats.on_host == 1


def test_decode_slots_growing_shrink_the_expert_cache(preset_dirs, tiny):
    """One running sequence past the slots' first capacity: the expert slots shrink first, the
    plan's total stays within the budget, the slots left keep experts (the hottest stay), and the
    logits stay those without offload."""
    engine = _load(preset_dirs, tiny, slots=8, max_running=1)
    offload = engine.offload
    engine.runner.warmup(1)  # the slots the plan counted: capacity for the largest prefill bucket
    budget, start = offload.plan.budget, engine.runner.capacity
    assert start == starting_capacity(engine.device) == 512 and offload.plan.slots == 8
    tokens = _prompt(start - 10, 6)
    out = {}
    for name, eng in (("plain", tiny), ("offload", engine)):
        state = eng.new_state()
        eng.prefill(state, tokens)
        out[name] = eng.feed(state, list(range(300, 320)))  # past 512 tokens: capacity 512 -> 1024
    assert engine.runner.capacity == 2 * start
    assert not offload.holds_all  # 8 of 8 slots before the growth: fetching from now on
    p = offload.plan
    assert (
        p.states
        == state_bytes(engine.config, engine.dtype, engine.runner.slots, 2 * start)
        == engine.runner.nbytes
    )
    grown = p.states - state_bytes(engine.config, engine.dtype, 1, start)
    assert p.slots == 8 - -(-grown // (p.expert_bytes * p.layers)) >= 2  # the fewest slots given up
    assert p.budget_for(p.slots) <= budget and offload.nbytes == p.slots * p.expert_bytes * p.layers
    assert (out["plain"] - out["offload"]).abs().max().item() <= TOL
    for cache in offload.caches.values():  # the hottest experts stayed resident through the shrink
        assert -1 not in cache.expert_in
        assert cache.slot_table.tolist()[:-1] == cache.slot_of


def test_growth_beyond_the_budget_is_a_clear_error(preset_dirs, tiny):
    from engine.offload import BudgetError

    engine = _load(preset_dirs, tiny, slots=2, max_running=1)
    engine.runner.warmup(1)
    state = engine.new_state()
    engine.prefill(state, _prompt(engine.runner.capacity - 10, 7))
    with pytest.raises(BudgetError, match="fewer than top_k = 2"):
        engine.feed(state, list(range(20)))


def test_fit_gives_up_the_fewest_slots_that_cover_the_excess(preset_dirs, tiny):
    """What a forward will need past the budget (measured on a GPU: live tensors, a chunk's
    workspace, KV growth) comes out of the expert slots, the fewest that cover it; the logits stay
    those without offload; a need that leaves fewer than top_k slots is a clear error."""
    from engine.offload import BudgetError

    engine = _load(preset_dirs, tiny, slots=8)
    offload = engine.offload
    per_slot = offload.plan.expert_bytes * offload.plan.layers
    shrunk = []
    offload.on_change = lambda: shrunk.append(offload.plan.slots)  # the engine's hook (graphs off)
    offload.fit(offload.plan.budget, "nothing over")  # exactly the budget: nothing given up
    assert offload.plan.slots == 8 and shrunk == []
    offload.fit(offload.plan.budget + 2 * per_slot + 1, "three slots' worth")
    assert offload.plan.slots == 5 and offload.nbytes == 5 * per_slot and shrunk == [5]
    assert all(cache.slots == 5 for cache in offload.caches.values())
    tokens = _prompt(200, 11)
    want = tiny.prefill(tiny.new_state(), tokens).logits
    torch.testing.assert_close(engine.prefill(engine.new_state(), tokens).logits, want, rtol=TOL, atol=TOL)
    with pytest.raises(BudgetError, match="the KV of a long prompt leave room for 1 experts per layer"):
        offload.fit(offload.plan.budget + 4 * per_slot, "the KV of a long prompt")
    assert offload.plan.slots == 5  # refused before anything was freed


def test_a_prefill_forward_out_of_device_memory_is_undone_and_run_again(preset_dirs, tiny):
    """Driven by a test double (the CPU has no device memory to run out of): a forward that fails in
    its last layer, after the others appended KV and replaced DeltaNet states, is undone and run
    again with an eighth fewer expert slots; its logits and captured states are those without
    offload, and the sequence goes on from the right place."""
    engine = _load(preset_dirs, tiny, slots=8)
    tokens = _prompt(120, 5)
    state, plain = engine.new_state(), tiny.new_state()
    engine.prefill(state, tokens[:40])
    tiny.prefill(plain, tokens[:40])
    last = engine.model.model.layers[-1]
    calls = []

    def failing(*args, **kwargs):
        calls.append(len(calls))
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (a test double)")
        return type(last).forward(last, *args, **kwargs)

    last.forward = failing
    counted = engine.offload.stats.tokens["prefill"]
    got = engine.prefill(state, tokens[40:], capture_at=[60, 80])
    want = tiny.prefill(plain, tokens[40:], capture_at=[60, 80])
    assert calls == [0, 1] and engine.offload.plan.slots == 7 and state.length == plain.length == 120
    assert engine.offload.stats.tokens["prefill"] == counted + 80  # the undone forward's tokens once
    torch.testing.assert_close(got.logits, want.logits, rtol=TOL, atol=TOL)
    for a, b in zip(got.snapshots, want.snapshots, strict=True):
        assert a.tensors.keys() == b.tensors.keys()
        for name, tensor in a.tensors.items():
            torch.testing.assert_close(tensor, b.tensors[name], rtol=TOL, atol=TOL, msg=name)
    del last.forward
    torch.testing.assert_close(engine.decode(state, 7), tiny.decode(plain, 7), rtol=TOL, atol=TOL)
    last.forward = lambda *a, **k: (_ for _ in ()).throw(torch.OutOfMemoryError("again"))
    with pytest.raises(torch.OutOfMemoryError):  # twice in a row: raised (the request fails)
        engine.prefill(engine.new_state(), tokens[:30])


def test_a_short_chunk_keeps_room_for_its_share_of_the_workspace():
    """Before `calibrate_stream` measured a short chunk (`small`), every forward keeps a full chunk's
    workspace free; after it, a chunk keeps the short chunks' plus its share of the full one's,
    never more than the full chunk's."""
    p = OffloadPlan(
        budget=1 << 30, dense=0, states=0, workspace=8_192_000, expert_bytes=1, layers=1, slots=8, rows=0, chunk=8192
    )
    assert p.workspace_for(9) == p.workspace_for(8192) == 8_192_000
    p = dataclasses.replace(p, small=50_000)
    assert p.workspace_for(9) == 50_000 + 9_000
    assert p.workspace_for(4096) == 50_000 + 4_096_000
    assert p.workspace_for(8192) == p.workspace_for(20_000) == 8_192_000


def test_kv_growth_is_what_the_next_append_allocates():
    cache = KVCache(2, 4, torch.float32, torch.device("cpu"))
    per_token = 2 * 4 * 4
    assert cache.growth(10) == 2 * 256 * per_token  # a first append: at least 256 tokens
    cache.append(torch.zeros(10, 2, 4), torch.zeros(10, 2, 4))
    assert cache.growth(246) == 0 and cache.growth(247) == 2 * 512 * per_token  # doubles
    assert cache.growth(2000) == 2 * 2010 * per_token  # or takes what the append needs


class DeferredLane(Lane):
    """A copy stream simulated on the CPU: copies land only when the compute side waits for their
    event (in issue order, as on one stream), so a compute that reads a slot without waiting for
    its copy reads the slot's previous expert."""

    def __init__(self):
        super().__init__(torch.device("cpu"))
        self.queue: list[tuple[object, list]] = []

    def copy(self, pairs, after):
        event = object()
        self.queue.append((event, [(dst, src.clone()) for dst, src in pairs]))
        return event

    def done(self, event):
        return all(e is not event for e, _ in self.queue)

    def wait(self, events):
        wanted = {id(e) for e in events if e is not None}
        while wanted and self.queue:
            event, pairs = self.queue.pop(0)
            for dst, src in pairs:
                dst.copy_(src)
            wanted.discard(id(event))


def test_every_compute_waits_for_the_copies_into_its_slots(preset_dirs, tiny):
    engine = _load(preset_dirs, tiny, slots=6)
    lane = DeferredLane()
    for cache in engine.offload.caches.values():
        cache.lane = lane
    tokens = _prompt(120, 8)
    out = {}
    for name, eng in (("plain", tiny), ("offload", engine)):
        state = eng.new_state()
        logits = eng.prefill(state, tokens, all_logits=True).logits  # prefetch + double-buffered groups
        out[name] = torch.cat(
            [logits, eng.prefill(state, tokens[:5], all_logits=True).logits, eng.feed(state, [21, 22, 23])]
        )
    assert (out["plain"] - out["offload"]).abs().max().item() <= TOL


def test_quantized_stacks_as_the_expert_store():
    """FP8 stacks (`QuantWeight`): their parts are the store, slots and host path alike."""
    quant = pytest.importorskip("engine.ops.gpu.quant")
    from engine.offload import quantized_store

    torch.manual_seed(9)
    experts, hidden, inter = 8, 128, 128
    gate_up = quant.pack_fp8(
        torch.randn(experts, 2 * inter, hidden).to(torch.float8_e4m3fn), torch.rand(experts, 2, 1) + 0.5
    )
    down = quant.pack_fp8(
        torch.randn(experts, hidden, inter).to(torch.float8_e4m3fn), torch.rand(experts, 1, 1) + 0.5
    )
    parts, assemble = quantized_store(gate_up, down)
    cache = ExpertCache(
        parts, 3, torch.device("cpu"), OffloadStats(), Lane(torch.device("cpu")), assemble=assemble
    )
    assert cache.expert_bytes * experts == gate_up.nbytes + down.nbytes
    cache.cpu_rows = 1

    def dequantizing(x, weights, ids, gu, dn):  # what quant.grouped computes, in plain torch
        assert gu.shape[0] == dn.shape[0] == 3  # run on the slots
        return experts_loop(x, weights, ids, gu.dequantize(), dn.dequantize())

    x, weights = torch.randn(40, hidden), torch.rand(40, 2)
    ids = torch.stack([torch.randperm(7)[:2] for _ in range(40)])
    ids[0, 0] = 7  # one row: on the host, from the dequantized host copy
    want = experts_loop(x, weights, ids, gate_up.dequantize(), down.dequantize())
    torch.testing.assert_close(cache.run(x, weights, ids, dequantizing), want, rtol=1e-5, atol=1e-4)
    assert cache.stats.on_host == 1 and cache.stats.misses >= 7


def test_a_budget_for_every_expert_copies_them_once(preset_dirs, tiny):
    """Every expert has a slot: copied in at start, never chosen again (no host sync, so a GPU
    captures decode in graphs again); exact, and fetching resumes once growth takes slots away."""
    engine = _load(preset_dirs, tiny, slots=8)
    offload = engine.offload
    layers = len(offload.caches)
    assert offload.holds_all and all(c.holds_all for c in offload.caches.values())
    assert offload.stats.misses == 8 * layers
    tokens = _prompt(60, 10)
    out = {}
    for name, eng in (("plain", tiny), ("offload", engine)):
        state = eng.new_state()
        logits = eng.prefill(state, tokens, all_logits=True).logits
        out[name] = torch.cat([logits, eng.feed(state, [31, 32, 33])])
    assert (out["plain"] - out["offload"]).abs().max().item() <= TOL
    assert (offload.stats.hits, offload.stats.misses) == (0, 8 * layers)  # nothing chosen, nothing copied
