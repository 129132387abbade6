"""Head split: the attention and DeltaNet layers split by heads over the expert-parallel group
(`engine.parallel`), each rank holding 1/W of their heads.

Rank r of W holds query heads [r * Hq / W, (r + 1) * Hq / W) and the KV heads they read, DeltaNet
key heads [r * Hk / W, ...) and the value heads grouped on them (with their conv channels,
gates and decays). The weights are cut at load (`take`): the in-projections by rows (column
parallel), the output projections by columns (row parallel), so each rank's model is the model
of `local_config` (the head counts divided by W) and runs the kernels unchanged; one all-reduce
(`combine`) sums the output projections' partial outputs. The norms, the router, the experts'
split, the embeddings and the head are as without it.

A rank's sequence states hold its heads only. A snapshot leaves the engine whole: `gather`
joins every rank's heads (an all-gather over host memory), so every rank returns the single
process's snapshot; `local` cuts a whole snapshot down to this rank's heads on restore. A
snapshot is thus the same under either mode and at any world size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from checkpoint_store.snapshot import Snapshot
from engine.config import ModelConfig
from engine.parallel import ExpertParallel, ExpertParallelError


@dataclass(frozen=True)
class HeadShard:
    """This rank's heads of every attention and DeltaNet layer of a model of `config` (the whole
    model's). `group`: where snapshots are gathered (gloo: they are in host memory)."""

    rank: int
    world: int
    config: ModelConfig
    group: Any = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, parallel: ExpertParallel, config: ModelConfig) -> HeadShard:
        """`parallel`'s share of `config`'s heads; every rank calls it at once (a group may be made)."""
        counts = {"attention heads": config.num_attention_heads, "KV heads": config.num_key_value_heads,
                  "DeltaNet key heads": config.linear_num_key_heads,
                  "DeltaNet value heads": config.linear_num_value_heads}
        for what, count in counts.items():
            if count % parallel.world:
                raise ExpertParallelError(
                    f"{count} {what} do not split evenly over {parallel.world} ranks: run the attention and "
                    f"DeltaNet layers replicated, or choose a world size that divides {count}")
        group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        return cls(parallel.rank, parallel.world, config, group)

    @property
    def local_config(self) -> ModelConfig:
        """The model this rank runs: `config` with its head counts divided by the world's size."""
        c, w = self.config, self.world
        return dataclasses.replace(
            c, num_attention_heads=c.num_attention_heads // w, num_key_value_heads=c.num_key_value_heads // w,
            linear_num_key_heads=c.linear_num_key_heads // w, linear_num_value_heads=c.linear_num_value_heads // w)

    # -- weights

    def take(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """The whole model's state dict (HF names) → this rank's: each attention and DeltaNet weight
        cut to its heads (copies: the whole ones can go), the rest as it is."""
        cuts = self._weight_cuts()
        out = {}
        for name, w in state_dict.items():
            _, _, suffix = name.partition(".layers.")
            cut = cuts.get(suffix.partition(".")[2])
            if cut is not None:
                if not isinstance(w, torch.Tensor):
                    raise ExpertParallelError(f"{name}: head split cuts plain weights, not quantized ones")
                w = self._cut(w, *cut)
            out[name] = w
        return out

    def _weight_cuts(self) -> dict[str, tuple[int, list[int]]]:
        """Per layer-relative weight name: the dim cut and the sizes of its parts along it (each
        part cut to this rank's block)."""
        c = self.config
        hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        hv = c.linear_num_value_heads
        conv = [c.linear_key_dim, c.linear_key_dim, c.linear_value_dim]  # q ‖ k ‖ v channels
        cuts = {
            "self_attn.q_proj.weight": (0, [hq * 2 * d]),  # per head: its query and its gate rows
            "self_attn.k_proj.weight": (0, [hkv * d]),
            "self_attn.v_proj.weight": (0, [hkv * d]),
            "self_attn.o_proj.weight": (1, [hq * d]),
            "linear_attn.conv1d.weight": (0, conv),
            "linear_attn.dt_bias": (0, [hv]),
            "linear_attn.A_log": (0, [hv]),
            "linear_attn.out_proj.weight": (1, [c.linear_value_dim]),
        }
        if c.arch == "qwen3_next":  # rows grouped per key head: q, k, then its value heads' v, z (and b, a)
            group = hv // c.linear_num_key_heads
            per_key = 2 * c.linear_key_head_dim + 2 * group * c.linear_value_head_dim
            cuts["linear_attn.in_proj_qkvz.weight"] = (0, [c.linear_num_key_heads * per_key])
            cuts["linear_attn.in_proj_ba.weight"] = (0, [2 * hv])
        else:
            cuts["linear_attn.in_proj_qkv.weight"] = (0, conv)
            cuts["linear_attn.in_proj_z.weight"] = (0, [c.linear_value_dim])
            cuts["linear_attn.in_proj_b.weight"] = (0, [hv])
            cuts["linear_attn.in_proj_a.weight"] = (0, [hv])
        return cuts

    def _cut(self, t: torch.Tensor, dim: int, parts: Sequence[int]) -> torch.Tensor:
        """This rank's block of each part of `t` along `dim`, joined (a copy)."""
        blocks, at = [], 0
        for size in parts:
            n = size // self.world
            blocks.append(t.narrow(dim, at + self.rank * n, n))
            at += size
        return torch.cat(blocks, dim)

    def _join(self, pieces: Sequence[torch.Tensor], dim: int, parts: Sequence[int]) -> torch.Tensor:
        """Every rank's `_cut` of a tensor (by rank) → the whole tensor."""
        local = [size // self.world for size in parts]
        split = [p.split(local, dim) for p in pieces]
        return torch.cat([split[r][i] for i in range(len(parts)) for r in range(self.world)], dim)

    # -- the forward

    def combine(self, out: torch.Tensor) -> torch.Tensor:
        """An output projection's partial sums [T, H] over this rank's heads → the whole layer's (in place)."""
        dist.all_reduce(out)
        return out

    # -- states

    def _state_cut(self, name: str) -> tuple[int, list[int]]:
        """How a snapshot tensor is split by heads (`checkpoint_store.snapshot`'s names)."""
        c = self.config
        if name.startswith("kv."):
            return 1, [c.num_key_value_heads]  # [S, Hkv, D]
        if name.startswith("conv."):
            return 0, [c.linear_key_dim, c.linear_key_dim, c.linear_value_dim]  # [C, K-1]
        return 0, [c.linear_num_value_heads]  # rec: [Hv, Dk, Dv]

    def local(self, snapshot: Snapshot) -> Snapshot:
        """A whole snapshot → this rank's heads of it."""
        tensors = {name: self._cut(t, *self._state_cut(name)) for name, t in snapshot.tensors.items()}
        return Snapshot(snapshot.start, snapshot.end, tensors)

    def gather(self, snapshots: Sequence[Snapshot]) -> list[Snapshot]:
        """This rank's snapshots (host tensors) → the whole ones, every rank's heads joined; every
        rank calls it with snapshots of the same shapes. One all-gather per dtype."""
        names = [(i, name) for i, s in enumerate(snapshots) for name in sorted(s.tensors)]
        whole: list[dict[str, torch.Tensor]] = [{} for _ in snapshots]
        for dtype in sorted({snapshots[i].tensors[n].dtype for i, n in names}, key=str):
            mine = [(i, n) for i, n in names if snapshots[i].tensors[n].dtype == dtype]
            tensors = [snapshots[i].tensors[n] for i, n in mine]
            flat = torch.cat([t.reshape(-1) for t in tensors])
            if flat.numel() == 0:
                for (i, n), t in zip(mine, tensors, strict=True):
                    whole[i][n] = self._join([t] * self.world, *self._state_cut(n))
                continue
            ranks = [torch.empty_like(flat) for _ in range(self.world)]
            dist.all_gather(ranks, flat, group=self.group)
            pieces = [r.split([t.numel() for t in tensors]) for r in ranks]
            for k, ((i, n), t) in enumerate(zip(mine, tensors, strict=True)):
                whole[i][n] = self._join([p[k].view(t.shape) for p in pieces], *self._state_cut(n))
        return [Snapshot(s.start, s.end, w) for s, w in zip(snapshots, whole, strict=True)]
