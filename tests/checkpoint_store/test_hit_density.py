"""The anchor eviction order's decisions on constructed tiers: what a part's class says before any
reuse is seen, and what the tier learns from the reuse it sees (checkpoint_store/hit_density.py)."""

import pytest

from checkpoint_store.hit_density import HALF_LIFE, HitDensity, bucket, bucket_age
from checkpoint_store.index import TierIndex
from checkpoint_store.record import KV_PART, STATE_PART, RecordMeta

KV, STATE = 100, 1000  # bytes of each record's parts


def put(index: TierIndex, anchor: bytes, parent: bytes | None, clock: int, state: bool = True) -> None:
    start = 0 if parent is None else index.metas[parent].end
    index.add(RecordMeta(anchor, parent, start, start + 4), KV, STATE if state else 0, clock)


def restore(index: TierIndex, chain: list[bytes], clock: int) -> None:
    """What a restore tells the tier: every record of the chain used, the last one's state read."""
    for anchor in chain:
        index.touch(anchor, clock, with_state=anchor == chain[-1])


def test_before_any_reuse_an_old_turns_state_goes_before_a_shared_prefix_and_the_tips():
    index = TierIndex()
    put(index, b"sys", None, 1)  # the oldest: plain LRU would give it up first
    put(index, b"a0", b"sys", 2)
    put(index, b"a1", b"a0", 3)  # a0 is an old turn now: its state restores only an edited history
    put(index, b"b0", b"sys", 4)
    assert index.victim() == (b"a0", STATE_PART)
    index.set_state(b"a0", 0)
    assert index.victim() == (b"a1", STATE_PART)  # then the least recent tip's, before the shared prefix's
    index.set_state(b"a1", 0)
    assert index.victim() == (b"a1", KV_PART)  # a tip's KV goes once its state has
    assert index.density.evictions[(STATE_PART, "inner")][bucket(2)] == 1  # each victim counted at its age


def test_a_deeper_state_makes_a_shallower_one_redundant():
    """Restores end at the chain's tip, never at the turn before it: that state goes first though it
    was put later than other sessions' tips."""
    index = TierIndex()
    put(index, b"sys", None, 0)
    put(index, b"x0", b"sys", 1)
    put(index, b"a0", b"sys", 2)
    put(index, b"a1", b"a0", 3)
    for clock in range(4, 40, 4):
        restore(index, [b"sys", b"a0", b"a1"], clock)
        restore(index, [b"sys", b"x0"], clock + 2)
    assert index.victim() == (b"a0", STATE_PART)


def test_the_counts_overrule_a_class_prior():
    """Where histories are edited at their last turn, restores read inner states and tip states go
    unread: inner states are then worth more, the opposite of the classes' priors."""
    density = HitDensity()
    assert density.density((STATE_PART, "tip"), 4) > density.density((STATE_PART, "inner"), 4)
    for _ in range(4):
        density.hit((STATE_PART, "inner"), 8)
        density.evicted((STATE_PART, "tip"), 8)
    assert density.density((STATE_PART, "inner"), 4) > density.density((STATE_PART, "tip"), 4) == 0.0


def test_when_reuse_comes_soon_the_old_tip_goes_and_the_fresh_one_stays():
    index = TierIndex()
    put(index, b"old", None, 0)
    clock = 1
    for s in range(6):  # sessions that come back one tick after each answer, then end
        put(index, b"s%d" % s, None, clock)
        restore(index, [b"s%d" % s], clock + 1)
        clock += 2
    put(index, b"fresh", None, clock)
    assert index.victim(keep=tuple(b"s%d" % s for s in range(6))) == (b"old", STATE_PART)


def test_when_sessions_take_turns_the_chain_used_last_goes_and_the_one_due_next_stays():
    """Round robin over four sessions on a shared prefix: each chain is read again four restores later.
    The chain just restored waits longest, so its state goes first; plain LRU would give up the one
    due next."""
    index = TierIndex()
    put(index, b"sys", None, 0)
    sessions = [b"s%d" % s for s in range(4)]
    for s, anchor in enumerate(sessions):
        put(index, anchor, b"sys", 1 + s)
    clock = 5
    for _ in range(10):
        for anchor in sessions:
            restore(index, [b"sys", anchor], clock)
            clock += 1
    assert index.victim() == (sessions[-1], STATE_PART)  # used at clock - 1; sessions[0] is due next
    lru = TierIndex("lru")
    for anchor, entry in index.entries.items():
        lru.add(index.metas[anchor], entry.kv_bytes, entry.state_bytes, entry.last_used)
    assert lru.victim() == (sessions[0], KV_PART)


def test_density_is_hits_over_the_ticks_spent_until_them():
    density = HitDensity()
    for _ in range(3):
        density.hit((KV_PART, "tip"), 100)
    density.evicted((KV_PART, "tip"), 10)
    young, due = density.density((KV_PART, "tip"), 0), density.density((KV_PART, "tip"), 90)
    assert 0 < young < due  # a part close to the age of its reuse is worth more than a fresh one
    assert young == pytest.approx(3 / (3 * bucket_age(bucket(100) + 0.5) + bucket_age(bucket(10) + 0.5)))
    assert density.density((KV_PART, "tip"), 1000) == 0.0  # nothing seen lives that long
    assert density.density((STATE_PART, "shared"), 50) > density.density((STATE_PART, "inner"), 50) > 0


def test_counts_halve_so_the_estimate_follows_the_workload():
    density = HitDensity()
    for _ in range(HALF_LIFE - 1):
        density.hit((KV_PART, "tip"), 5)
    density.evicted((KV_PART, "tip"), 5)
    assert sum(density.hits[(KV_PART, "tip")]) == (HALF_LIFE - 1) / 2
    assert sum(density.evictions[(KV_PART, "tip")]) == 0.5
