"""What the engine hands to the checkpoint store, and takes back on restore.

A snapshot names its tensors so that the store needs no model code:

- ``kv.{layer}.k`` / ``kv.{layer}.v``: the attention KV of positions ``[start, end)`` only,
  shaped ``[end - start, num_kv_heads, head_dim]`` (tokens first, so a chain of deltas is
  concatenated along dim 0);
- ``conv.{layer}``: the DeltaNet conv state at ``end``, ``[conv_dim, kernel - 1]``;
- ``rec.{layer}``: the DeltaNet recurrent state at ``end``, ``[num_v_heads, k_dim, v_dim]``, fp32.

A snapshot without ``conv.*``/``rec.*`` tensors carries only its KV delta (``has_state`` is
False): it can extend a chain but cannot end one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

KV_PREFIX = "kv."


def is_kv(name: str) -> bool:
    return name.startswith(KV_PREFIX)


@dataclass
class Snapshot:
    start: int
    end: int
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def has_state(self) -> bool:
        return any(not is_kv(name) for name in self.tensors)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def without_state(self) -> Snapshot:
        return Snapshot(self.start, self.end, {n: t for n, t in self.tensors.items() if is_kv(n)})

    def without_kv(self) -> Snapshot:
        return Snapshot(self.start, self.end, {n: t for n, t in self.tensors.items() if not is_kv(n)})


def concat_chain(snapshots: list[Snapshot]) -> Snapshot:
    """KV deltas of consecutive snapshots concatenated; the last snapshot's state."""
    if not snapshots:
        raise ValueError("empty chain")
    for prev, nxt in zip(snapshots, snapshots[1:], strict=False):
        if prev.end != nxt.start:
            raise ValueError(f"chain has a hole: {prev.end} != {nxt.start}")
    last = snapshots[-1]
    if not last.has_state:
        raise ValueError("the last snapshot of a chain must hold a state")
    kv_names = {n for n in last.tensors if is_kv(n)}
    for s in snapshots:
        names = {n for n in s.tensors if is_kv(n)}
        if names != kv_names:
            raise ValueError(f"KV tensors differ along the chain: {sorted(names ^ kv_names)[:4]}")
    tensors = {n: t for n, t in last.tensors.items() if not is_kv(n)}
    for name in sorted(kv_names):
        parts = [s.tensors[name] for s in snapshots]
        if len({(p.dtype, p.shape[1:]) for p in parts}) != 1:
            raise ValueError(f"{name}: dtype or row shape differs along the chain")
        tensors[name] = torch.cat(parts, dim=0)
    return Snapshot(snapshots[0].start, last.end, tensors)
