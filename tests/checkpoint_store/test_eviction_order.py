"""The RAM tier's eviction order is a store setting: the anchor order keeps a shared prefix's
state under pressure, plain LRU gives up whatever was used least recently. The store tells a
listener every part put and every part a restore reads, with the tier it reads it from."""

import pytest

from checkpoint_store import CheckpointStore, StoreConfig
from checkpoint_store.store import Access

from .synth import linear_chain, make_snapshot, put_chain


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


def test_every_put_and_restored_part_is_told_with_its_tier(tmp_path) -> None:
    anchors, snaps = linear_chain(4, state_every=4)
    log: list[Access] = []
    with CheckpointStore(StoreConfig(ram_bytes=2 * snaps[0].nbytes, disk_dir=tmp_path)) as store:
        store.on_access = log.append
        put_chain(store, anchors, snaps)
        store.flush()
        assert store.load_chain(anchors) is not None
    puts = [a for a in log if a.kind == "put"]
    gets = [a for a in log if a.kind == "get"]
    assert [(a.anchor, a.part) for a in puts] == [(a, "kv") for a in anchors] + [(anchors[-1], "state")]
    assert [(a.anchor, a.part) for a in gets] == [(a, "kv") for a in anchors] + [(anchors[-1], "state")]
    assert {a.source for a in gets} == {"ram", "disk"}  # the RAM tier holds only part of the chain
    assert all(a.nbytes > 0 for a in puts) and all((a.nbytes > 0) == (a.source != "disk") for a in gets)
