"""The environment variables the project reads, in one typed place.

Each is read when asked for (a function call), never at import, so a test or a program that sets
one before it asks sees its value. Every other choice is a flag or a config field: the engine's
in `engine.engine_config.EngineConfig`, the server's in `gateway.service.ServeConfig`. This module
imports nothing of the project, so any layer may read it.
"""

from __future__ import annotations

import os
from pathlib import Path

HOME = "FT_HOME"
API_KEY = "FT_API_KEY"
PEER_HOME = "FT_PEER_HOME"
MATERIALISE = "FT_MATERIALISE"
NAMES = (HOME, API_KEY, PEER_HOME, MATERIALISE)


def home() -> Path:
    """FT_HOME: where presets and other generated files are written (default ~/.cache/ft)."""
    return Path(os.environ.get(HOME) or Path.home() / ".cache" / "ft")


def api_key() -> str | None:
    """FT_API_KEY: the key `ft serve` requires and `ft launch` sends; None when unset (an empty
    value is returned as it is: the server rejects it as a key that would check nothing)."""
    return os.environ.get(API_KEY)


def peer_home(default: Path) -> Path:
    """FT_PEER_HOME: where the peer server (llama.cpp) is built and its models kept."""
    return Path(os.environ.get(PEER_HOME) or default)


def materialise() -> bool:
    """FT_MATERIALISE=1: a preset's weights are generated in memory (on the engine's device, or on
    the host under a memory budget) instead of written to disk and loaded."""
    return os.environ.get(MATERIALISE) == "1"
