"""Checkpoint records by anchor: a RAM tier over an LMDB tier; bytes in, bytes out."""

from .config import StoreConfig
from .record import CorruptRecord
from .stats import StoreStats
from .store import CheckpointStore

__all__ = ["CheckpointStore", "CorruptRecord", "StoreConfig", "StoreStats"]
