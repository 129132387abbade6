"""Restore exactness: restore(snapshots up to p) + prefill(rest) == one full prefill (fp32, 1e-4); in bf16,
within the one-pass bf16 run's worst position (`bf16_bounds`)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from checkpoint_store import concat_chain
from engine import SamplingParams
from engine.feed import Feed

TOL = 1e-4
SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@st.composite
def sequence_and_captures(draw):
    length = draw(st.integers(2, 180))
    ids = draw(st.lists(st.integers(0, 248_000), min_size=length, max_size=length))
    captures = draw(st.lists(st.integers(1, length - 1), min_size=1, max_size=6, unique=True))
    return ids, sorted(captures)


@SETTINGS
@given(case=sequence_and_captures(), data=st.data())
def test_restore_then_prefill_equals_full_prefill(tiny, case, data):
    ids, captures = case
    full = tiny.prefill(tiny.new_state(), ids)
    snapshots = tiny.prefill(tiny.new_state(), ids, capture_at=captures).snapshots
    assert [s.end for s in snapshots] == captures
    assert [s.start for s in snapshots] == [0, *captures[:-1]]  # KV deltas, not copies of the prefix
    upto = data.draw(st.integers(1, len(captures)))
    state = tiny.restore(concat_chain(snapshots[:upto]))
    rest = tiny.prefill(state, ids[captures[upto - 1] :])
    assert (rest.logits - full.logits).abs().max().item() <= TOL


@SETTINGS
@given(case=sequence_and_captures(), forced=st.lists(st.integers(0, 248_000), min_size=1, max_size=8))
def test_teacher_forced_decode_then_prefill_equals_full_prefill(tiny, case, forced):
    ids, _ = case
    tail = [11, 22, 33]
    full = tiny.prefill(tiny.new_state(), ids + forced + tail)
    state = tiny.new_state()
    logits = tiny.prefill(state, ids).logits
    events = list(tiny.generate(state, logits, SamplingParams(), forced=forced))
    assert [e.token_id for e in events] == forced
    # the last forced token is not fed yet: it starts the next prefill, as a gateway would do
    snapshot = tiny.snapshot(state, 0)
    restored = tiny.restore(snapshot)
    after = tiny.prefill(restored, [forced[-1], *tail])
    assert (after.logits - full.logits).abs().max().item() <= TOL


@SETTINGS
@given(case=sequence_and_captures(), data=st.data(), decoded=st.lists(st.integers(0, 248_000), max_size=6))
def test_a_sequence_rewound_to_a_capture_continues_as_a_restore(tiny, case, data, decoded):
    """A sequence that went on past a capture (more prompt, decoded tokens on its decode slot) put
    back there with the capture's DeltaNet states (its KV cut in place) continues exactly as a
    restore of the chain up to it (`Engine.rewind`)."""
    ids, captures = case
    state = tiny.new_state()
    snapshots = tiny.prefill(state, ids, capture_at=captures).snapshots
    for token in decoded:
        tiny.decode(state, token)
    upto = data.draw(st.integers(1, len(captures)))
    suffix = data.draw(st.lists(st.integers(0, 248_000), min_size=1, max_size=40))
    restored = tiny.prefill(tiny.restore(snapshots[:upto]), suffix).logits
    rewound_state = tiny.rewind(state, snapshots[upto - 1])
    assert rewound_state is state and state.length == captures[upto - 1]
    assert (tiny.prefill(state, suffix).logits - restored).abs().max().item() <= TOL


def test_rewind_needs_a_state_within_the_sequence(tiny):
    state = tiny.new_state()
    kv_only, with_state = tiny.prefill(state, list(range(1000, 1040)), capture_at=[10, 20], state_at={20}).snapshots
    with pytest.raises(ValueError, match="rewind needs"):
        tiny.rewind(state, kv_only)
    with pytest.raises(ValueError, match="rewind needs"):
        tiny.rewind(tiny.new_state(), with_state)


def test_state_at_limits_which_snapshots_hold_a_state(tiny):
    ids = list(range(1000, 1100))
    snaps = tiny.prefill(tiny.new_state(), ids, capture_at=[10, 50, 100], state_at={50}).snapshots
    assert [s.has_state for s in snaps] == [False, True, False]
    assert snaps[2].tensors["kv.3.k"].shape[0] == 50
    # the forward copies out the states at 50 alone (a KV-only capture's KV is read from the cache)
    feed = Feed(tiny.new_state(), ids, capture_at=[10, 50, 100], state_at={50})
    tiny.step([(feed, len(ids))])
    assert list(feed.captured) == [50]
    assert [s.has_state for s in feed.result.snapshots] == [False, True, False]


def test_recurrent_state_is_fp32_and_kv_delta_is_tokens_first(tiny):
    snap = tiny.prefill(tiny.new_state(), list(range(40)), capture_at=[40]).snapshots[0]
    c = tiny.config
    assert snap.tensors[f"rec.{c.deltanet_layers[0]}"].dtype == torch.float32
    layer = c.attention_layers[0]
    assert snap.tensors[f"kv.{layer}.k"].shape == (40, c.num_key_value_heads, c.head_dim)


def test_concat_chain_rejects_mismatched_parts(tiny):
    import pytest

    from checkpoint_store.snapshot import Snapshot

    snaps = tiny.prefill(tiny.new_state(), list(range(40)), capture_at=[20, 40]).snapshots
    bad = Snapshot(20, 40, {**snaps[1].tensors, "kv.3.k": snaps[1].tensors["kv.3.k"].double()})
    with pytest.raises(ValueError, match="dtype"):
        concat_chain([snaps[0], bad])
    missing = Snapshot(20, 40, {n: t for n, t in snaps[1].tensors.items() if n != "kv.3.v"})
    with pytest.raises(ValueError, match="differ"):
        concat_chain([snaps[0], missing])
    with pytest.raises(ValueError, match="hole"):
        concat_chain([snaps[1], snaps[1]])


@pytest.fixture(scope="module")
def small_pair():
    from tests.engine.bf16_bounds import small_pair

    return small_pair()


@pytest.mark.parametrize("draw", range(3))
def test_a_bf16_restore_resumes_the_one_pass_run_and_a_shift_does_not(small_pair, draw):
    """bf16 on the CPU, each position's relative error against fp32 (`bf16_bounds`): a restore at a random
    capture then the suffix resumes where the one-pass bf16 run was (its first positions' errors are the
    one pass's at the same positions), and over the whole suffix 99% of its positions stay within the one
    pass's worst position (a routing flip moves a single position by 0.2-0.5, so the worst alone is a single
    draw of that). The same restore fed the suffix one token late (the context shifted by one) is off at
    once, far beyond the one pass's error at those positions: the checks have teeth."""
    from tests.engine.bf16_bounds import restore_and_shift, worst_position_bound

    case = restore_and_shift(*small_pair, draw)
    split, right, shifted = case["split"], case["right"], case["shifted"]
    one_pass_here = case["one_pass"][split : split + 8]
    assert (right[:8] <= one_pass_here[: len(right[:8])] + 0.01).all()
    assert right.quantile(0.99).item() <= worst_position_bound(case["one_pass"])
    assert shifted[:8].max().item() > one_pass_here.max().item() + 0.1
