"""The model runtime: hybrid MoE models with exact state capture and restore."""

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
