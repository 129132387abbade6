"""Checkpoint records by anchor: a RAM tier over an LMDB tier; bytes in, bytes out."""

from .config import StoreConfig
from .record import CorruptRecord
from .snapshot import KV_PREFIX, Snapshot, concat_chain, is_kv
from .stats import StoreStats
from .store import CheckpointStore

__all__ = [
    "KV_PREFIX",
    "CheckpointStore",
    "CorruptRecord",
    "Snapshot",
    "StoreConfig",
    "StoreStats",
    "concat_chain",
    "is_kv",
]
