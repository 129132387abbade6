"""Expert parallel: the routed experts of every MoE layer split across the ranks of a
`torch.distributed` group (NCCL on GPUs, gloo on the CPU); the attention and DeltaNet layers
replicated or split by heads; everything else replicated.

Rank r of W holds experts [r * E / W, (r + 1) * E / W). The router, the shared expert, the
embeddings and the head run on every rank over the same tokens, so every rank routes alike; each
runs its own experts (the others' assignments at -1: no expert, `engine.ops.moe`) and one
all-reduce sums the routed outputs. With the attention and DeltaNet layers replicated, the
sequences' states are the same on every rank: a snapshot of any rank is the single process's.
Split by heads (`engine.head_split`), each rank's states hold its heads, and snapshots are
gathered whole as they leave the engine and cut to the rank's heads on restore (not per-rank
snapshots): either way the gateway stores one snapshot, the single process's, which restores at
any world size and in either mode. The collectives go over the default process group, which the
caller sets up before loading.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


class ExpertParallelError(ValueError):
    """A world that cannot split the model's experts, or a load that cannot run sharded."""


@dataclass(frozen=True)
class ExpertParallel:
    """Where this process stands: rank `rank` of `world` (`EngineConfig.expert_parallel`)."""

    rank: int
    world: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world:
            raise ExpertParallelError(f"rank {self.rank} outside a world of {self.world}")

    @classmethod
    def of_group(cls) -> ExpertParallel:
        """This process's place in the initialised default process group."""
        return cls(dist.get_rank(), dist.get_world_size())

    def shard(self, num_experts: int) -> ExpertShard:
        """This rank's share of `num_experts` routed experts (an even split)."""
        if num_experts % self.world:
            raise ExpertParallelError(
                f"{num_experts} experts do not split evenly over {self.world} ranks: "
                f"choose a world size that divides {num_experts}")
        count = num_experts // self.world
        return ExpertShard(self.rank, self.world, self.rank * count, count)


@dataclass(frozen=True)
class ExpertShard:
    """Experts [first, first + count) of a layer, held by rank `rank` of `world`."""

    rank: int
    world: int
    first: int
    count: int

    @property
    def num_experts(self) -> int:
        """The model's routed experts, all ranks together."""
        return self.count * self.world

    def holds(self, expert: int) -> bool:
        return self.first <= expert < self.first + self.count

    def local(self, ids: torch.Tensor) -> torch.Tensor:
        """Routed expert ids [T, k] → this rank's stack indices, -1 (no expert) for the others'."""
        local = ids - self.first
        return torch.where((local >= 0) & (local < self.count), local, -1)

    def take(self, stack: torch.Tensor) -> torch.Tensor:
        """This rank's experts of a full stack [E, ...], a copy (the full one can then go)."""
        return stack[self.first : self.first + self.count].clone()

    def combine(self, routed: torch.Tensor) -> torch.Tensor:
        """The routed outputs [T, H] of this rank's experts → those of all experts (summed in place)."""
        dist.all_reduce(routed)
        return routed

    def agree(self, value: str) -> str:
        """Rank 0's `value` on every rank (a model fingerprint: rank 0 holds expert 0, as one process does)."""
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]
