"""Pins and promotion in the RAM tier: a pinned record outlives unpinned ones under pressure and
goes only to a put that can make room no other way (a broken pin, counted); `promote` brings a
disk-only chain up into RAM (the next restore reads nothing from disk) and never breaks a pin."""

from __future__ import annotations

from checkpoint_store import CheckpointStore, StoreConfig

from .synth import assert_same, expected_chain, linear_chain, make_snapshot, put_chain

MiB = 1 << 20


def record_bytes() -> int:
    """What one record of `make_snapshot(.., with_state=True)` takes in the RAM tier (packed)."""
    with CheckpointStore(StoreConfig(ram_bytes=64 * MiB, fingerprint="fp")) as store:
        store.put(b"x", None, make_snapshot(0, 0, 3, with_state=True))
        return store.stats().ram_bytes


def test_a_pinned_tip_outlives_pressure_and_yields_only_to_a_put_with_no_other_room() -> None:
    per = record_bytes()
    with CheckpointStore(StoreConfig(ram_bytes=3 * per, fingerprint="fp")) as store:
        store.put(b"a", None, make_snapshot(1, 0, 3, with_state=True))
        store.pin(b"a")
        for i in range(8):  # other sessions' tips, one record each
            store.put(b"other-%d" % i, None, make_snapshot(10 + i, 0, 3, with_state=True))
        assert store.longest_restorable([b"a"]) == 1
        assert store.longest_restorable([b"other-0"]) == 0  # unpinned: evicted first
        assert store.pins_broken == 0
        store.pin(b"other-7")
        big = make_snapshot(99, 0, 3, with_state=True, state_numel=64 * 3)  # needs more than one record's room
        assert per < big.nbytes < 2 * per
        store.put(b"new", None, big)  # the unpinned records cannot make room: a pin breaks
        assert store.longest_restorable([b"new"]) == 1
        assert store.pins_broken == 1
        assert store.longest_restorable([b"a"]) + store.longest_restorable([b"other-7"]) == 1
        store.unpin(b"a")
        store.unpin(b"other-7")
        store.put(b"newer", None, big)
        assert store.pins_broken == 1  # unpinned records go without breaking anything


def test_promote_brings_a_disk_only_chain_up_into_ram(tmp_path) -> None:
    anchors, snaps = linear_chain(4, state_every=2)  # states at records 1 and 3
    config = StoreConfig(ram_bytes=64 * MiB, disk_dir=tmp_path, disk_bytes=64 * MiB, fingerprint="fp")
    with CheckpointStore(config) as store:
        put_chain(store, anchors, snaps)
        store.flush()
    with CheckpointStore(config) as store:  # a new process: only the disk holds the chain
        assert store.longest_in_ram(anchors) == 0 and store.longest_restorable(anchors) == 4
        assert store.promote(anchors, stop=lambda: True) == 0
        assert store.promote(anchors) == 5  # four KV parts and the last record's state
        assert store.longest_in_ram(anchors) == 4
        assert store.promote(anchors) == 0  # nothing left to bring up
        disk_hits = store.stats().disk_hits
        assert_same(store.load_chain(anchors), expected_chain(snaps))
        assert store.stats().disk_hits == disk_hits


def test_promote_never_breaks_a_pin(tmp_path) -> None:
    anchors, snaps = linear_chain(3)
    config = StoreConfig(ram_bytes=64 * MiB, disk_dir=tmp_path, disk_bytes=64 * MiB, fingerprint="fp")
    with CheckpointStore(config) as store:
        put_chain(store, anchors, snaps)
        store.flush()
    small = StoreConfig(ram_bytes=2 * record_bytes(), disk_dir=tmp_path, disk_bytes=64 * MiB, fingerprint="fp")
    with CheckpointStore(small) as store:
        store.put(b"pinned", None, make_snapshot(7, 0, 5, with_state=True))
        store.pin(b"pinned")
        store.promote(anchors)  # room for part of the chain at most: the pinned record stays
        assert store.longest_in_ram([b"pinned"]) == 1
        assert store.pins_broken == 0
        assert store.longest_restorable(anchors) == 3  # what RAM could not take is still on disk
