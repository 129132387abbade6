"""How a checkpoint store is sized and where it keeps its files."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

GiB = 1 << 30


@dataclass(frozen=True)
class StoreConfig:
    """``ram_bytes``: payload budget of the RAM tier. ``disk_dir``: the LMDB directory
    (None: RAM only). ``disk_bytes``: LMDB map size, the hard cap of the disk tier.
    ``fingerprint``: the model's; records of another model are misses (and deleted).
    ``max_batch_bytes``: most payload per write transaction. ``max_queue_bytes``: ``put``
    blocks while more than this waits for the disk (memory held beyond ``ram_bytes``).
    ``eviction``: the RAM tier's order (``eviction.ORDERS``: ``anchor``, or plain ``lru`` to compare
    against); the disk tier always evicts in the ``anchor`` order."""

    ram_bytes: int = 4 * GiB
    disk_dir: str | Path | None = None
    disk_bytes: int = 64 * GiB
    fingerprint: str = ""
    max_batch_bytes: int = 256 << 20
    max_queue_bytes: int = 2 * GiB
    eviction: str = "anchor"
