"""The model runtime: hybrid MoE models with exact state capture and restore."""

import os

# fla's kernels choose their launch settings by timing each (triton.autotune), so the choice, and with it
# the last bits of bf16 results, can change from one process to the next (the H200, session 30: one
# test's bf16 error 0.013 in one process and 0.071 in the next, same inputs). Kept in Triton's cache on
# disk, the first process's choice is every later one's on this machine: the same bits run after run,
# and no re-timing at start. Set before fla is imported (its autotuners read it when they are made).
os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")

from engine.config import ConfigError, ModelConfig
from engine.engine import Engine
from engine.feed import Feed, PrefillResult
from engine.loader import CheckpointError
from engine.sampling import Decoding, SamplingParams, TokenEvent
from engine.snapshot import Snapshot, concat_chain
from engine.state import SequenceState

__all__ = [
    "CheckpointError",
    "ConfigError",
    "Decoding",
    "Engine",
    "Feed",
    "ModelConfig",
    "PrefillResult",
    "SamplingParams",
    "SequenceState",
    "Snapshot",
    "TokenEvent",
    "concat_chain",
]
