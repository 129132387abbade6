"""The model runtime: hybrid MoE models with exact state capture and restore."""

import os

# fla's kernels choose their launch settings by timing each (triton.autotune) in every new process: time
# at each start, and a choice that timing noise may change from one process to the next, and with it
# the last bits of bf16 results. Kept in Triton's cache on disk, the first process's choice is every later
# one's on this machine (tests/engine/test_gpu.py::test_two_processes_give_the_same_bf16_bits; uncached, three
# processes on the H200 gave the same bits too, bench/autotune_bits.py). Set before fla is imported: its
# autotuners read it when they are made. TRITON_CACHE_AUTOTUNING=0 times them afresh.
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
