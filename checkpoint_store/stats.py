"""Counters of a checkpoint store, as the gateway exposes them on /metrics."""

from __future__ import annotations

import msgspec


class StoreStats(msgspec.Struct, frozen=True):
    """A point-in-time copy of the store's counters and gauges.

    Hits and misses count record *parts* (a KV delta or a state) that ``load_chain``
    needed: a RAM miss is a part not in memory (then looked up on disk); a disk miss is a
    part found in neither tier, or found corrupt. ``restores`` / ``restore_misses`` count
    whole ``load_chain`` calls. ``*_bytes`` are payload bytes held (disk: pages used).
    ``ram_rejected`` counts records (or their states) too big for the RAM budget.
    ``write_errors`` / ``read_errors`` count failed disk writes (of checkpoints and of the
    token memo: a full disk, a file-size limit, I/O errors) and reads (then a miss).
    """

    puts: int = 0
    restores: int = 0
    restore_misses: int = 0
    bytes_restored: int = 0
    ram_hits: int = 0
    ram_misses: int = 0
    disk_hits: int = 0
    disk_misses: int = 0
    ram_bytes: int = 0
    ram_records: int = 0
    ram_evictions: int = 0
    ram_states_dropped: int = 0
    ram_rejected: int = 0
    disk_bytes: int = 0
    disk_records: int = 0
    disk_evictions: int = 0
    disk_states_dropped: int = 0
    corrupt_records: int = 0
    write_errors: int = 0
    read_errors: int = 0
    write_queue_depth: int = 0
    write_queue_bytes: int = 0


class Counters:
    """The store's own counters (the tiers keep theirs); guarded by the store's lock."""

    def __init__(self) -> None:
        self.puts = 0
        self.restores = 0
        self.restore_misses = 0
        self.bytes_restored = 0
        self.ram_hits = 0
        self.ram_misses = 0
        self.disk_hits = 0
        self.disk_misses = 0
        self.corrupt = 0
