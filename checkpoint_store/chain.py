"""Chain rules: which records may follow which, and how a chain becomes one snapshot."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .record import Packed, RecordMeta, allocate, copy_bytes
from .snapshot import Snapshot, concat_chain, is_kv


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

    ``concat_chain`` defines the result (it runs on meta tensors: names, shapes, dtypes,
    no data); the bytes are then copied once into two allocations, one for all KV and one
    for all state, so a caller that keeps only the state does not keep the KV alive.
    """
    layout = concat_chain([_meta(s) for s in snapshots])
    kv = allocate({n: t for n, t in layout.tensors.items() if is_kv(n)}).views()
    state = allocate({n: t for n, t in layout.tensors.items() if not is_kv(n)}).views()
    for name, dst in kv.items():  # [T_total, H, D] <- each record's [T_i, H, D] rows
        for snap in snapshots:
            copy_bytes(dst[snap.start - layout.start : snap.end - layout.start], snap.tensors[name])
    for name, dst in state.items():
        copy_bytes(dst, snapshots[-1].tensors[name])
    return Snapshot(layout.start, layout.end, {n: state[n] if n in state else kv[n] for n in layout.tensors})


def _meta(snapshot: Snapshot) -> Snapshot:
    tensors = {n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in snapshot.tensors.items()}
    return Snapshot(snapshot.start, snapshot.end, tensors)


def fresh_copy(t: torch.Tensor) -> torch.Tensor:
    out = allocate({"": t}).views()[""]
    copy_bytes(out, t)
    return out
