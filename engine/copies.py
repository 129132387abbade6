"""Copies of sequence states between the engine's device and host memory: snapshots out (the KV
of position ranges, the DeltaNet states at capture points) and restores in.

On a GPU the copies run on the device runtime's copy stream (`runtime`, `engine.ops.gpu`); on
the CPU they are plain tensor copies. A decode slot's tensors are reused by the next sequence
bound to it, so what is read from a slot is copied before the slot can change hands. Under head
split (`engine.head_split`) the states hold this rank's heads: snapshots leave whole (gathered)
and are cut to this rank's heads on the way in."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from checkpoint_store.snapshot import Snapshot
from engine.config import ModelConfig
from engine.head_split import HeadShard
from engine.runner import Runner
from engine.state import KVCache, SequenceState


class StateCopies:
    def __init__(self, config: ModelConfig, device: torch.device, dtype: torch.dtype, runner: Runner,
                 runtime: Any | None = None, heads: HeadShard | None = None):
        self.config, self.device, self.dtype = config, device, dtype
        self.runner, self.runtime, self.heads = runner, runtime, heads

    def new_state(self) -> SequenceState:
        c = self.config
        kv = {i: KVCache(c.num_key_value_heads, c.head_dim, self.dtype, self.device) for i in c.attention_layers}
        return SequenceState(kv=kv)

    def states(self, state: SequenceState) -> dict[str, torch.Tensor]:
        """Copies of the DeltaNet states of `state` (a slot's are overwritten by its next step):
        every layer's conv states in one buffer, its recurrent states in another (two launches, and
        their copy to host memory goes in a few runs, not one copy a tensor)."""
        layers = self.config.deltanet_layers
        conv = torch.stack([state.conv[layer] for layer in layers])  # [L, C, K-1]
        rec = torch.stack([state.rec[layer] for layer in layers])  # [L, Hv, Dk, Dv]
        conv_parts = {f"conv.{layer}": conv[i] for i, layer in enumerate(layers)}
        return {**conv_parts, **{f"rec.{layer}": rec[i] for i, layer in enumerate(layers)}}

    def to_host(self, tensors: dict[str, Any]) -> dict[str, torch.Tensor]:
        return self.to_host_many([tensors])[0]

    def to_host_many(self, groups: list[dict[str, Any]]) -> list[dict[str, torch.Tensor]]:
        """On a GPU, snapshot tensors go to pinned host memory on a side stream (each group behind
        one wait: a layer's captures of every sequence)."""
        return groups if self.runtime is None else self.runtime.to_host_many(groups)

    def snapshots(self, state: SequenceState, positions: Sequence[int], captured: dict[int, dict],
                  kv_start: int, state_at: set[int] | None) -> list[Snapshot]:
        """A snapshot at each of `positions`: the KV since the one before (one copy to host memory
        for all of them: a layer's ranges lie side by side in its cache) and, where `state_at`
        wants it, the DeltaNet states `captured` there."""
        bounds = list(zip([kv_start, *positions], positions, strict=False))
        kv = self.to_host_many([self.kv_views(state, start, end) for start, end in bounds])
        snapshots = []
        for (start, end), tensors in zip(bounds, kv, strict=True):
            if state_at is None or end in state_at:
                tensors.update(captured[end])
            snapshots.append(Snapshot(start, end, tensors))
        return self._whole(snapshots)

    def _whole(self, snapshots: list[Snapshot]) -> list[Snapshot]:
        """Under head split, every rank's heads of `snapshots` joined (their host copies landed first)."""
        if self.heads is None:
            return snapshots
        if self.runtime is not None:
            self.runtime.sync()
        return self.heads.gather(snapshots)

    def _local(self, snapshot: Snapshot) -> Snapshot:
        return snapshot if self.heads is None else self.heads.local(snapshot)

    def kv_views(self, state: SequenceState, start: int, end: int) -> dict[str, torch.Tensor]:
        """The KV of positions [start, end) of every attention layer, [end - start, Hkv, D] each."""
        tensors = {}
        for layer, cache in state.kv.items():
            k, v = cache.slice(start, end)  # a private cache is append-only: its views stay valid
            if self.runtime is None and self.runner.holds(cache.k):  # a decode slot is reused: copy now
                k, v = k.clone(), v.clone()  # (a GPU copies to the host before the slot is reused)
            tensors[f"kv.{layer}.k"], tensors[f"kv.{layer}.v"] = k, v
        return tensors

    def kv_delta(self, state: SequenceState, start: int, end: int) -> Snapshot:
        if not 0 <= start <= end <= state.length:
            raise ValueError(f"KV range [{start}, {end}) outside the state's {state.length} tokens")
        return self._whole([Snapshot(start, end, self.to_host(self.kv_views(state, start, end)))])[0]

    def snapshot(self, state: SequenceState, start: int) -> Snapshot:
        state.wait_all()
        tensors = self.to_host({**self.kv_views(state, start, state.length), **self.states(state)})
        if self.runtime is not None:
            self.runtime.sync()
        return self._whole([Snapshot(start, state.length, tensors)])[0]

    def restore(self, chain: Sequence[Snapshot]) -> SequenceState:
        if not chain or chain[0].start != 0 or not chain[-1].has_state:
            raise ValueError("restore needs a chain from position 0 that ends with a state")
        if any(a.end != b.start for a, b in zip(chain, chain[1:], strict=False)):
            raise ValueError("chain has a hole")
        chain = [self._local(part) for part in chain]
        if self.runtime is not None:
            return self.runtime.restore(self.new_state(), chain)
        state = self.new_state()
        for layer, cache in state.kv.items():
            cache.reserve(chain[-1].end)
            for part in chain:  # each delta copied into place once (store views are read-only)
                cache.append(part.tensors[f"kv.{layer}.k"].to(self.dtype), part.tensors[f"kv.{layer}.v"].to(self.dtype))
        return self._load_states(state, chain[-1])

    def rewind(self, state: SequenceState, record: Snapshot) -> SequenceState:
        if not record.has_state or record.end > state.length:
            raise ValueError("rewind needs a record with a state at or before the sequence's end")
        record = self._local(record)
        if self.runtime is not None:
            return self.runtime.restore(state, [Snapshot(record.end, record.end, record.without_kv().tensors)])
        for cache in state.kv.values():
            cache.length = record.end
        return self._load_states(state, record)

    def _load_states(self, state: SequenceState, record: Snapshot) -> SequenceState:
        """On the CPU: `record`'s DeltaNet states copied into `state`, which ends where `record` does."""
        for layer in self.config.deltanet_layers:
            state.conv[layer] = record.tensors[f"conv.{layer}"].to(self.device, self.dtype, copy=True)
            state.rec[layer] = record.tensors[f"rec.{layer}"].to(self.device, torch.float32, copy=True)
        state.length = record.end
        return state
