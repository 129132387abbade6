"""Per-sequence state: KV per attention layer, conv + recurrent state per DeltaNet layer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


class KVCache:
    """Keys and values of one attention layer, [length, Hkv, D] each, in a buffer that doubles."""

    def __init__(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.k = torch.empty(0, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.empty_like(self.k)
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add [T, Hkv, D] keys/values; returns views of all keys/values so far."""
        end = self.length + k.shape[0]
        if end > self.k.shape[0]:
            self._grow(self._capacity_for(end))
        self.k[self.length : end] = k
        self.v[self.length : end] = v
        self.length = end
        return self.k[:end], self.v[:end]

    def reserve(self, capacity: int) -> None:
        """Room for `capacity` tokens without regrowing."""
        if capacity > self.k.shape[0]:
            self._grow(capacity)

    def growth(self, tokens: int) -> int:
        """Bytes a further append of `tokens` tokens allocates (a new buffer of each of K and V)."""
        end = self.length + tokens
        if end <= self.k.shape[0]:
            return 0
        return 2 * self._capacity_for(end) * self.k.shape[1] * self.k.shape[2] * self.k.element_size()

    def _capacity_for(self, end: int) -> int:
        """The buffer's next size when `end` tokens outgrow it: doubled, at least 256 tokens."""
        return max(end, 2 * self.k.shape[0], 256)

    def slice(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[start:end], self.v[start:end]

    def _grow(self, capacity: int) -> None:
        k = self.k.new_empty(capacity, *self.k.shape[1:])
        v = self.v.new_empty(capacity, *self.v.shape[1:])
        k[: self.length] = self.k[: self.length]
        v[: self.length] = self.v[: self.length]
        self.k, self.v = k, v


@dataclass
class SequenceState:
    """Everything needed to continue a sequence after `length` tokens.

    kv: layer -> KVCache; conv: layer -> [conv_dim, kernel-1] (model dtype);
    rec: layer -> [Hv, Dk, Dv] (always fp32).
    pending: layer -> an event (with `.wait()`) that a restore's copies into that layer's tensors
    signal; whoever reads a layer's tensors calls `wait_for(layer)` first (empty on the CPU).
    """

    length: int = 0
    kv: dict[int, KVCache] = field(default_factory=dict)
    conv: dict[int, torch.Tensor] = field(default_factory=dict)
    rec: dict[int, torch.Tensor] = field(default_factory=dict)
    pending: dict[int, Any] = field(default_factory=dict)

    def wait_for(self, layer: int) -> None:
        event = self.pending.pop(layer, None)
        if event is not None:
            event.wait()  # the current stream waits; the host does not

    def rewinder(self) -> Callable[[], None]:
        """What puts this state back where it is now, after a forward that failed partway: its
        length and its KV caches' (a forward writes KV past them, harmless once they are back) and
        its DeltaNet states (a forward replaces them layer by layer, never writes into them)."""
        length, kv = self.length, {layer: cache.length for layer, cache in self.kv.items()}
        conv, rec = dict(self.conv), dict(self.rec)

        def rewind() -> None:
            self.length = length
            for layer, at in kv.items():
                self.kv[layer].length = at
            self.conv.clear()
            self.conv.update(conv)
            self.rec.clear()
            self.rec.update(rec)

        return rewind

    def wait_all(self) -> None:
        for layer in list(self.pending):
            self.wait_for(layer)
