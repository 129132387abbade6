"""What the engine asks of a CUDA device beyond kernels: snapshot copies to pinned host memory
and restores from host memory, on a copy stream of their own."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from checkpoint_store.snapshot import Snapshot
from engine.config import ModelConfig
from engine.ops.gpu import attention
from engine.state import SequenceState
from engine.transfer import Transfers


class HostTransfers:
    """A CUDA engine's copies between device and host: snapshots to pinned memory, restores back."""

    def __init__(self, config: ModelConfig, device: torch.device, dtype: torch.dtype):
        self.config, self.device, self.dtype = config, device, dtype
        self.transfers = Transfers(device)

    def to_host_many(self, groups: Sequence[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
        return self.transfers.to_host_many(groups)

    def sync(self) -> None:
        self.transfers.sync()

    @property
    def capture_slabs(self) -> int:
        """Pinned slabs snapshot copies are cut from so far (each new one a slow cudaHostAlloc)."""
        return len(self.transfers.slabs.slabs)

    def prepare_attention(self, max_tokens: int) -> None:
        """The prefill attention's setup for every chunk length up to `max_tokens` (warm-up)."""
        c = self.config
        heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
        attention.prepare_prefill(heads, kv_heads, c.head_dim, max_tokens, self.device, self.dtype)

    def reserve_pinned(self, nbytes: int) -> None:
        """Pinned host memory for `nbytes` of captures, pinned now rather than in a request's forward."""
        self.transfers.reserve(nbytes)

    def fence(self) -> torch.cuda.Event:
        return self.transfers.fence()

    def restore(self, state: SequenceState, chain: Sequence[Snapshot]) -> SequenceState:
        self.transfers.restore(state, chain, self.config, self.dtype)
        return state

    @property
    def restored_bytes(self) -> int:
        """Bytes restores copied host -> device so far."""
        return self.transfers.restored_bytes

    def wait_copies(self) -> None:
        """The compute stream waits for every host copy issued so far (before memory they read is overwritten)."""
        torch.cuda.current_stream(self.device).wait_stream(self.transfers.stream)
