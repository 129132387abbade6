"""Deterministic synthetic snapshots for the store's tests (no model needed)."""

from __future__ import annotations

import torch

from checkpoint_store import CheckpointStore
from checkpoint_store.snapshot import Snapshot, concat_chain


def make_snapshot(
    seed: int, start: int, end: int, with_state: bool, state_numel: int = 64, kv_dim: int = 4
) -> Snapshot:
    """KV deltas of [start, end) (bf16 K, fp32 V) and, optionally, a bf16 conv and fp32 rec state."""
    g = torch.Generator().manual_seed(seed)
    n = end - start
    tensors = {
        "kv.0.k": torch.randn(n, 2, kv_dim, generator=g).to(torch.bfloat16),  # [T, H, D]
        "kv.0.v": torch.randn(n, 2, kv_dim, generator=g),
        "kv.3.k": torch.randn(n, 1, kv_dim, generator=g).to(torch.bfloat16),
        "kv.3.v": torch.randn(n, 1, kv_dim, generator=g).to(torch.bfloat16),
    }
    if with_state:
        tensors["conv.1"] = torch.randn(8, 3, generator=g).to(torch.bfloat16)
        tensors["rec.1"] = torch.randn(state_numel, generator=g).reshape(-1, 4)
    return Snapshot(start, end, tensors)


def expected_chain(snapshots: list[Snapshot]) -> Snapshot:
    return concat_chain(snapshots)


def assert_same(a: Snapshot, b: Snapshot) -> None:
    assert (a.start, a.end) == (b.start, b.end)
    assert a.tensors.keys() == b.tensors.keys()
    for name, t in a.tensors.items():
        u = b.tensors[name]
        assert t.dtype == u.dtype and t.shape == u.shape, name
        assert torch.equal(t, u), name


def put_chain(store: CheckpointStore, anchors: list[bytes], snapshots: list[Snapshot]) -> None:
    for i, (anchor, snap) in enumerate(zip(anchors, snapshots, strict=True)):
        store.put(anchor, anchors[i - 1] if i else None, snap)


def linear_chain(
    n: int, seed: int = 0, tokens: int = 3, state_every: int = 1
) -> tuple[list[bytes], list[Snapshot]]:
    anchors = [b"anchor-%d-%d" % (seed, i) for i in range(n)]
    snaps = [
        make_snapshot(seed * 1000 + i, i * tokens, (i + 1) * tokens, with_state=(i + 1) % state_every == 0)
        for i in range(n)
    ]
    return anchors, snaps
