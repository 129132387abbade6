"""The model runtime: hybrid MoE models with exact state capture and restore.

The package's exports load on first use (``__getattr__``), so that importing one engine module, or a
package below the engine, does not load the model, the kernels and torch's GPU stack.
"""

import importlib
import os

# fla's kernels choose their launch settings by timing each (triton.autotune) in every new process, and
# timing noise may change that choice, and with it the last bits of bf16 results, from one process to the
# next. Kept in Triton's cache on disk, the first process's choice is every later one's on this machine
# (tests/engine/test_gpu.py::test_two_processes_give_the_same_bf16_bits). fla is imported only under this
# package (engine.ops.gpu.deltanet), so this runs before it: its autotuners read the variable when they
# are made. TRITON_CACHE_AUTOTUNING=0 times them afresh.
os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")

_EXPORTS = {
    "CheckpointError": "engine.loader",
    "ConfigError": "engine.config",
    "Decoding": "engine.sampling",
    "Engine": "engine.engine",
    "Feed": "engine.feed",
    "ModelConfig": "engine.config",
    "PrefillResult": "engine.feed",
    "SamplingParams": "engine.sampling",
    "SequenceState": "engine.state",
    "TokenEvent": "engine.sampling",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    """An export, imported from its module on first access and kept in the package's namespace."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
