import torch

from checkpoint_store import CheckpointStore, StoreConfig

from .synth import assert_same, expected_chain, linear_chain, make_snapshot, put_chain

MiB = 1 << 20


def ram_store(ram_bytes: int = 64 * MiB) -> CheckpointStore:
    return CheckpointStore(StoreConfig(ram_bytes=ram_bytes, fingerprint="fp"))


def test_longest_restorable_ends_at_the_last_state() -> None:
    anchors, snaps = linear_chain(6, state_every=2)  # states at records 1, 3, 5
    with ram_store() as store:
        put_chain(store, anchors[:5], snaps[:5])
        assert store.longest_restorable(anchors) == 4
        assert store.longest_restorable(anchors[:3]) == 2
        assert store.longest_restorable(anchors[:1]) == 0
        assert store.longest_restorable([]) == 0
        assert_same(store.load_chain(anchors[:4]), expected_chain(snaps[:4]))
        assert store.load_chain(anchors[:3]) is None  # ends without a state


def test_missing_parent_delta_ends_the_match() -> None:
    anchors, snaps = linear_chain(4)
    with ram_store() as store:
        for i in (0, 1, 3):
            store.put(anchors[i], anchors[i - 1] if i else None, snaps[i])
        assert store.longest_restorable(anchors) == 2
        assert store.load_chain(anchors) is None


def test_records_must_agree_on_parents_and_positions() -> None:
    anchors, snaps = linear_chain(3)
    with ram_store() as store:
        put_chain(store, anchors, snaps)
        assert store.longest_restorable([anchors[0], anchors[2]]) == 1  # anchors[2]'s parent is anchors[1]
        assert store.longest_restorable(anchors[1:]) == 0  # a chain starts at position 0
        store.put(b"gap", anchors[0], make_snapshot(7, 4, 6, with_state=True))  # parent ends at 3
        assert store.longest_restorable([anchors[0], b"gap"]) == 1
        assert store.load_chain([anchors[0], b"gap"]) is None
        assert not store.has_kv(b"gap")  # contradicts its own parent: deleted


def test_put_copies_so_callers_may_reuse_tensors() -> None:
    anchors, snaps = linear_chain(1)
    want = expected_chain([make_snapshot(0, 0, 3, with_state=True)])
    with ram_store() as store:
        put_chain(store, anchors, snaps)
        for t in snaps[0].tensors.values():
            t.zero_()
        got = store.load_chain(anchors)
        assert_same(got, want)
        for t in got.tensors.values():
            t.zero_()  # the restored copy is the caller's own
        assert_same(store.load_chain(anchors), want)


def test_ram_budget_drops_states_before_kv() -> None:
    anchors, snaps = linear_chain(8, state_every=1)
    budget = 4 * (snaps[0].nbytes + 256)  # 8 KV deltas (packed: 64-byte aligned tensors) and 2 states
    with ram_store(ram_bytes=budget) as store:
        put_chain(store, anchors, snaps)
        stats = store.stats()
        assert stats.ram_bytes <= budget
        assert stats.ram_states_dropped > 0
        assert store.longest_restorable(anchors) == 8  # the tip kept its state
        assert_same(store.load_chain(anchors), expected_chain(snaps))


def test_shared_prefix_state_outlives_older_session_states() -> None:
    """A system-prompt record extended by many sessions keeps its state under pressure."""
    shared = make_snapshot(1, 0, 4, with_state=True)
    per_record = shared.nbytes + 256
    with ram_store(ram_bytes=6 * per_record) as store:
        store.put(b"sys", None, shared)
        for s in range(10):
            for t in range(3):
                parent = b"sys" if t == 0 else b"s%d-%d" % (s, t - 1)
                store.put(
                    b"s%d-%d" % (s, t), parent, make_snapshot(100 * s + t, 4 + t, 5 + t, with_state=True)
                )
        assert store.longest_restorable([b"sys"]) == 1
        assert store.longest_restorable([b"sys", b"s9-0", b"s9-1", b"s9-2"]) == 4
        assert store.stats().ram_bytes <= 6 * per_record


def test_oversized_record_is_not_held_in_ram_only_mode() -> None:
    anchors, snaps = linear_chain(1)
    with ram_store(ram_bytes=100) as store:
        put_chain(store, anchors, snaps)
        assert store.longest_restorable(anchors) == 0
        assert store.stats().ram_bytes == 0


def test_disk_tier_survives_restart_and_counts_hits(tmp_path) -> None:
    anchors, snaps = linear_chain(5, state_every=2)
    config = StoreConfig(ram_bytes=64 * MiB, disk_dir=tmp_path, disk_bytes=64 * MiB, fingerprint="fp")
    with CheckpointStore(config) as store:
        put_chain(store, anchors, snaps)
        store.flush()
        assert store.stats().write_queue_depth == 0
    with CheckpointStore(config) as store:
        assert store.longest_restorable(anchors) == 4
        assert_same(store.load_chain(anchors[:4]), expected_chain(snaps[:4]))
        stats = store.stats()
        assert stats.disk_hits == 5 and stats.ram_hits == 0 and stats.disk_records == 5
        assert stats.bytes_restored == expected_chain(snaps[:4]).nbytes


def test_state_tier_names_where_a_restore_reads_the_state(tmp_path) -> None:
    anchors, snaps = linear_chain(4, state_every=2)  # states at records 1 and 3
    config = StoreConfig(ram_bytes=64 * MiB, disk_dir=tmp_path, disk_bytes=64 * MiB, fingerprint="fp")
    with CheckpointStore(config) as store:
        put_chain(store, anchors, snaps)
        assert [store.state_tier(a) for a in anchors] == [None, "ram", None, "ram"]
        store.flush()
    with CheckpointStore(config) as store:  # a new process: the RAM tier starts empty
        assert [store.state_tier(a) for a in anchors] == [None, "disk", None, "disk"]
        assert store.state_tier(b"unknown") is None


def test_ram_evictions_spill_to_disk(tmp_path) -> None:
    anchors, snaps = linear_chain(10)
    config = StoreConfig(
        ram_bytes=2 * snaps[0].nbytes, disk_dir=tmp_path, disk_bytes=64 * MiB, fingerprint="fp"
    )
    with CheckpointStore(config) as store:
        put_chain(store, anchors, snaps)
        store.flush()
        for n in range(1, 11):
            assert store.longest_restorable(anchors[:n]) == n
            assert_same(store.load_chain(anchors[:n]), expected_chain(snaps[:n]))
        stats = store.stats()
        assert stats.disk_hits > 0 and stats.ram_hits > 0


def test_full_disk_evicts_old_records_instead_of_failing(tmp_path) -> None:
    config = StoreConfig(ram_bytes=0, disk_dir=tmp_path, disk_bytes=4 * MiB, fingerprint="fp")
    with CheckpointStore(config) as store:
        for s in range(40):  # 40 x ~200 KiB into a 4 MiB map
            store.put(b"r%d" % s, None, make_snapshot(s, 0, 2, with_state=True, state_numel=50_000))
        store.flush()
        stats = store.stats()
        assert stats.write_errors == 0 and stats.disk_evictions + stats.disk_states_dropped > 0
        assert stats.disk_bytes <= 4 * MiB
        assert store.longest_restorable([b"r39"]) == 1
        assert_same(store.load_chain([b"r39"]), make_snapshot(39, 0, 2, with_state=True, state_numel=50_000))


def test_record_larger_than_the_map_is_dropped_with_a_log_line(tmp_path, caplog) -> None:
    config = StoreConfig(ram_bytes=0, disk_dir=tmp_path, disk_bytes=4 * MiB, fingerprint="fp")
    with CheckpointStore(config) as store:
        store.put(b"big", None, make_snapshot(0, 0, 2, with_state=True, state_numel=2_000_000))
        store.flush()
        assert store.stats().write_errors == 1
        assert store.longest_restorable([b"big"]) == 0
    assert "do not fit" in caplog.text


def test_state_added_later_to_a_kv_only_record(tmp_path) -> None:
    config = StoreConfig(ram_bytes=64 * MiB, disk_dir=tmp_path, disk_bytes=64 * MiB, fingerprint="fp")
    full = make_snapshot(3, 0, 5, with_state=True)
    with CheckpointStore(config) as store:
        store.put(b"a", None, full.without_state())
        assert store.longest_restorable([b"a"]) == 0
        store.put(b"a", None, full)
        store.put(b"a", None, full.without_state())  # does not take the state away
        store.flush()
    with CheckpointStore(config) as store:
        assert_same(store.load_chain([b"a"]), full)


def test_load_longest_and_stats_struct() -> None:
    anchors, snaps = linear_chain(3)
    with ram_store() as store:
        put_chain(store, anchors[:2], snaps[:2])
        n, snap = store.load_longest(anchors)
        assert n == 2 and snap is not None and snap.end == snaps[1].end
        assert store.load_longest([b"nope"]) == (0, None)
        stats = store.stats()
        assert stats.restores == 1 and stats.ram_hits == 3 and stats.puts == 2
        assert isinstance(stats.ram_bytes, int)


def test_restored_state_is_fresh_memory() -> None:
    anchors, snaps = linear_chain(1)
    with ram_store() as store:
        put_chain(store, anchors, snaps)
        a, b = store.load_chain(anchors), store.load_chain(anchors)
        assert a.tensors["rec.1"].data_ptr() != b.tensors["rec.1"].data_ptr()
        assert torch.equal(a.tensors["rec.1"], b.tensors["rec.1"])


def test_load_records_gives_the_chain_unjoined_from_both_tiers(tmp_path) -> None:
    anchors, snaps = linear_chain(4, state_every=2)
    config = StoreConfig(
        ram_bytes=2 * snaps[0].nbytes, disk_dir=tmp_path, disk_bytes=64 * MiB, fingerprint="fp"
    )
    with CheckpointStore(config) as store:
        put_chain(store, anchors, snaps)
        store.flush()
        records = store.load_records(anchors)
        assert records is not None and len(records) == 4
        assert_same(expected_chain(records), expected_chain(snaps))
        assert not any(records[i].has_state for i in range(3)) and records[3].has_state
        assert store.load_records(anchors[:3]) is None
        stats = store.stats()
        assert stats.ram_hits > 0 and stats.disk_hits > 0
