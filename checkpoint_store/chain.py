"""Chain rules: which records may follow which, and how a chain becomes one snapshot."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.snapshot import Snapshot, concat_chain, is_kv

from .record import Packed, RecordMeta


@dataclass(frozen=True)
class Located:
    """Where one record's parts are: in memory (``Packed``) or on disk (the flags)."""

    meta: RecordMeta
    kv: Packed | None  # None: the KV part is on disk
    state: Packed | None  # None: on disk if ``state_on_disk``, else nowhere
    state_on_disk: bool

    @property
    def has_state(self) -> bool:
        return self.state is not None or self.state_on_disk


def follows(meta: RecordMeta, prev: RecordMeta | None) -> bool:
    """A chain starts at position 0; each record starts where its parent ends."""
    if prev is None:
        return meta.start == 0
    return meta.parent == prev.anchor and meta.start == prev.end


def first_mismatch(snapshots: list[Snapshot]) -> int | None:
    """Index of the first snapshot whose KV names, dtypes or row shapes differ from the first's."""
    ref = {n: (t.dtype, t.shape[1:]) for n, t in snapshots[0].tensors.items() if is_kv(n)}
    for i, snap in enumerate(snapshots):
        kv = {n: (t.dtype, t.shape[1:]) for n, t in snap.tensors.items() if is_kv(n)}
        if kv != ref:
            return i
    return None


def join(snapshots: list[Snapshot]) -> Snapshot:
    """One snapshot owning fresh memory: one copy per byte of the views it is given.

    ``concat_chain`` copies the KV (``torch.cat``); the state tensors it passes through are
    views into the store (RAM buffers or the LMDB map), so they are cloned here.
    """
    out = concat_chain(snapshots)
    views = {id(t) for s in snapshots for n, t in s.tensors.items() if not is_kv(n)}
    for name, t in out.tensors.items():
        if id(t) in views:
            out.tensors[name] = fresh_copy(t)
    return out


def fresh_copy(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty(t.shape, dtype=t.dtype)
    out.copy_(t)
    return out
