"""The RAM tier's eviction order is a store setting: the anchor order keeps a shared prefix's
state under pressure, plain LRU gives up whatever was used least recently."""

import pytest

from checkpoint_store import CheckpointStore, StoreConfig

from .synth import make_snapshot


def sessions_on_one_prefix(eviction: str) -> CheckpointStore:
    """A system-prompt record, then ten sessions of three records each on it, in a RAM tier of six."""
    shared = make_snapshot(1, 0, 4, with_state=True)
    store = CheckpointStore(StoreConfig(ram_bytes=6 * (shared.nbytes + 256), eviction=eviction))
    store.put(b"sys", None, shared)
    for s in range(10):
        for t in range(3):
            parent = b"sys" if t == 0 else b"s%d-%d" % (s, t - 1)
            store.put(b"s%d-%d" % (s, t), parent, make_snapshot(100 * s + t, 4 + t, 5 + t, with_state=True))
    return store


def test_lru_evicts_the_least_recent_record_whole() -> None:
    with sessions_on_one_prefix("lru") as store:
        stats = store.stats()
        assert stats.ram_states_dropped == 0 and stats.ram_evictions == 31 - stats.ram_records
        assert store.longest_restorable([b"sys"]) == 0  # the oldest record, shared or not
        assert store.longest_restorable([b"sys", b"s9-0", b"s9-1", b"s9-2"]) == 0  # a hole at its root


def test_anchor_order_keeps_the_shared_prefix() -> None:
    with sessions_on_one_prefix("anchor") as store:
        assert store.longest_restorable([b"sys"]) == 1
        assert store.longest_restorable([b"sys", b"s9-0", b"s9-1", b"s9-2"]) == 4


def test_unknown_order_is_refused() -> None:
    with pytest.raises(ValueError, match="eviction order"):
        CheckpointStore(StoreConfig(eviction="fifo"))
