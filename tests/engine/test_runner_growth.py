"""Growth of the decode slots ahead of need (`Engine.grow_ahead`): counted by kind
(`Engine.growth_events`), done before a sequence's next prefill needs it, exact afterwards.
On the CPU: slot and KV growth happen here; graph captures and pinned slabs stay at zero."""

from __future__ import annotations

import pytest
import torch

from engine import Engine
from engine.sampling import SamplingParams
from engine.warmup import warm_up

FIRST, SECOND = 400, 200  # tokens of a sequence's first prompt and of the turn that crosses the capacity


@pytest.fixture
def engine(preset_dirs) -> Engine:
    engine = Engine.load(preset_dirs["tiny"])  # its own runner: these tests grow its slots
    warm_up(engine)
    return engine


def turn(engine: Engine, state, first: int, count: int) -> torch.Tensor:
    """A prefill of `count` tokens and three forced decode steps; the logits of the last step."""
    result = engine.prefill(state, [first + i for i in range(count)])
    events = list(engine.generate(state, result.logits, SamplingParams(), forced=[11, 12, 13]))
    assert len(events) == 3
    return engine.decode(state, 14)


def since(engine: Engine, before: dict[str, int]) -> dict[str, int]:
    return {kind: n - before[kind] for kind, n in engine.growth_events.items() if n != before[kind]}


def grow_all(engine: Engine) -> int:
    """Run growth ahead until nothing is left; the pieces it took."""
    pieces = 0
    while engine.grow_ahead():
        pieces += 1
        assert pieces < 16
    return pieces


def test_a_crossing_turn_grows_in_its_own_steps_unless_grown_ahead(preset_dirs, engine):
    lagging = Engine.load(preset_dirs["tiny"])
    warm_up(lagging)
    capacity = engine.runner.capacity
    assert FIRST < capacity < FIRST + SECOND
    ahead, late = engine.new_state(), lagging.new_state()
    turn(engine, ahead, 1000, FIRST)
    turn(lagging, late, 1000, FIRST)

    assert grow_all(engine) == 1  # one piece: the slots' capacity, its owner bound again
    assert engine.runner.capacity > capacity and engine.runner.bound(ahead)
    before, lagging_before = engine.growth_events, lagging.growth_events
    grown = turn(engine, ahead, 2000, SECOND)
    assert since(engine, before) == {}
    reference = turn(lagging, late, 2000, SECOND)
    # without it the prefill regrows the sequence's KV (it leaves its slot), its first decode step the slots
    assert since(lagging, lagging_before) == {"kv_growth": 1, "slot_growth": 1}
    torch.testing.assert_close(grown, reference, rtol=0, atol=0)
    assert engine.growth_events["graph_capture"] == engine.growth_events["slab_growth"] == 0  # none on the CPU


def test_a_held_sequence_outside_the_slots_gets_kv_headroom(engine):
    state = engine.new_state()
    result = engine.prefill(state, list(range(1000, 1000 + FIRST)), capture_at=[FIRST])
    restored = engine.restore(result.snapshots)  # a private KV buffer of exactly its tokens
    del state, result
    assert not engine.runner.bound(restored)
    grow_all(engine)
    assert all(cache.k.shape[0] >= FIRST + engine.runner.headroom for cache in restored.kv.values())
    before = engine.growth_events
    engine.prefill(restored, list(range(2000, 2000 + SECOND)))
    assert since(engine, before) == {}


def test_sequences_no_longer_held_ask_for_no_growth(engine):
    capacity = engine.runner.capacity
    state = engine.new_state()
    turn(engine, state, 1000, FIRST)
    del state
    assert grow_all(engine) == 0 and engine.runner.capacity == capacity


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graphs_a_growth_ahead_drops_are_captured_again_before_the_next_turn(preset_dirs):
    """On a GPU the slots' growth drops every graph: growth ahead captures each again, one piece
    each, so the turn that crosses the old capacity (a short prefill on its slot, then decode
    steps) captures and allocates nothing."""
    engine = Engine.load(preset_dirs["tiny"], device="cuda")
    engine.runner.min_capacity = 1024  # a capacity these turns cross (a GPU's default holds 16K tokens)
    warm_up(engine)
    graphs = set(engine.runner.graphs)
    assert engine.runner.capacity == 1024 and ("prefill", 512) in graphs and ("decode", 1) in graphs
    state = engine.new_state()
    turn(engine, state, 1000, 700)
    before = engine.growth_events
    assert grow_all(engine) == 1 + len(graphs)  # the slots, then each graph
    assert since(engine, before) == {"slot_growth": 1, "graph_capture": len(graphs)}
    assert set(engine.runner.graphs) == graphs and engine.runner.capacity == 2048
    before = engine.growth_events
    turn(engine, state, 2000, 400)  # 704 + 400 tokens: past the capacity warm-up left
    assert since(engine, before) == {}
