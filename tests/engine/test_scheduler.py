"""The engine's step scheduler on the CPU, without a model: small fake capacities and feeds."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given
from hypothesis import strategies as st

from engine.scheduler import Limits, Scheduler


@dataclass(eq=False)
class Need:
    """A sequence's pending feed as the scheduler sees it."""

    remaining: int
    is_prefill: bool = True
    all_logits: bool = False


def decode() -> Need:
    return Need(1, is_prefill=False)


def counts(parts) -> list[int]:
    return [count for _, count in parts]


def test_decode_tokens_first_then_the_fewest_remaining_tokens_within_the_budget():
    short, mid, long, d = Need(3), Need(10), Need(100), decode()
    parts = Scheduler(Limits(step_tokens=16)).parts([short, d, long, mid])
    assert [feed for feed, _ in parts] == [d, short, mid, long]
    assert counts(parts) == [1, 3, 10, 2]  # 16 tokens: the decode row takes one of them


def test_the_oldest_prefill_keeps_its_share_of_the_budget_beside_shorter_ones():
    long, short, mid = Need(100), Need(3), Need(10)
    parts = Scheduler(Limits(step_tokens=16)).parts([long, short, mid])  # `long` was admitted first
    assert [feed for feed, _ in parts] == [short, mid, long]
    assert counts(parts) == [3, 9, 4]  # a quarter of the budget is the oldest's; the shortest first in the rest
    alone = Scheduler(Limits(step_tokens=16)).parts([Need(5), Need(100)])
    assert counts(alone) == [5, 11]  # a share it does not need goes to the others


def test_a_long_prompt_finishes_while_short_ones_keep_arriving():
    scheduler, long, steps = Scheduler(Limits(step_tokens=16)), Need(100), 0
    while long.remaining:
        feeds = [long, Need(4), Need(6), Need(12)]  # a fresh wave of short prompts every step
        for feed, count in scheduler.parts(feeds):
            feed.remaining -= count
        steps += 1
    assert steps <= 100 // (16 // 4) + 1


def test_a_step_with_decode_rows_carries_at_most_decode_step_prefill_tokens():
    limits = Limits(step_tokens=64, decode_step_prefill=8)
    long = Need(100)
    assert counts(Scheduler(limits).parts([decode(), long])) == [1, 8]
    assert counts(Scheduler(limits).parts([long])) == [64]  # no decode rows: the whole budget


def test_background_steps_are_short():
    limits = Limits(step_tokens=64, background_tokens=5)
    assert counts(Scheduler(limits).parts([Need(100)], background=True)) == [5]
    assert counts(Scheduler(limits).parts([Need(100)])) == [64]


def test_a_budget_taken_by_decode_rows_leaves_prefills_for_the_next_step():
    parts = Scheduler(Limits(step_tokens=2)).parts([decode(), decode(), Need(5)])
    assert counts(parts) == [1, 1]


def test_decode_tokens_ride_in_the_prefill_forward_only_where_the_engine_mixes():
    d, p = decode(), Need(50)
    mixed = Scheduler(Limits(step_tokens=64), mixes=True).schedule([d, p])
    assert (mixed.decode, mixed.riding, mixed.forward) == ([], [d], [(p, 50)])
    apart = Scheduler(Limits(step_tokens=64), mixes=False).schedule([d, p])
    assert (apart.decode, apart.riding, apart.forward) == ([d], [], [(p, 50)])
    alone = Scheduler(Limits(step_tokens=64), mixes=True).schedule([d])
    assert (alone.decode, alone.riding, alone.forward) == ([d], [], [])


def test_short_last_chunks_run_on_their_slots():
    limits = Limits(step_tokens=64, slot_tokens=8, slot_tokens_alone=20)
    slots = Scheduler(limits, slot_prefill=True)
    alone = Need(20)
    assert slots.schedule([alone]).slotted == [(alone, 20)]  # alone: in pieces up to slot_tokens_alone
    short, long = Need(8), Need(20)
    plan = slots.schedule([short, long])
    assert plan.slotted == [(short, 8)] and plan.forward == [(long, 20)]  # beside another: one bucket
    unfinished = Need(100)
    assert slots.schedule([unfinished]).forward == [(unfinished, 64)]  # not its last chunk
    every = Need(4, all_logits=True)
    assert slots.schedule([every]).forward == [(every, 4)]  # every position's logits: the span forward
    assert Scheduler(limits, slot_prefill=False).schedule([Need(4)]).slotted == []


@given(
    remaining=st.lists(st.integers(1, 40), max_size=6),
    decodes=st.integers(0, 4),
    step_tokens=st.integers(1, 48),
    mixes=st.booleans(),
    slot_prefill=st.booleans(),
)
def test_every_plan_runs_each_part_once_within_the_budget(remaining, decodes, step_tokens, mixes, slot_prefill):
    feeds = [decode() for _ in range(decodes)] + [Need(n) for n in remaining]
    scheduler = Scheduler(Limits(step_tokens=step_tokens, slot_tokens=4, slot_tokens_alone=8), slot_prefill, mixes)
    plan = scheduler.schedule(feeds)
    ran = [feed for feed, _ in plan.parts]
    assert len(ran) == len(set(map(id, ran)))  # no feed twice
    assert all(0 < count <= feed.remaining for feed, count in plan.parts)
    prefill = sum(count for feed, count in plan.parts if feed.is_prefill)
    assert prefill <= max(0, step_tokens - decodes)
    assert sum(1 for feed in ran if not feed.is_prefill) == decodes  # every decode row, every step
    assert not (plan.decode and plan.riding)
    if plan.riding:
        assert mixes and plan.forward
