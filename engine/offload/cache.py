"""One MoE layer's routed experts: all in host memory, a few resident in device slots.

An expert is a tuple of tensors (`parts`), each stacked on a leading expert dim: the bf16 stacks
(gate_up [E, 2I, H], down [E, H, I]) or the field arrays of quantized stacks (`QuantWeight.parts`).
The host keeps every expert ([E, ...] per part, pinned on CUDA), the device `slots` of them
([S, ...] per part); `assemble(parts)` turns stacks of parts back into what `moe_experts` takes
(default: the bf16 pair itself; for quantized stacks, `QuantWeight`s over the same parts). What it
returns must be views of the parts, not copies: the slots' weights are assembled once, when the
slots are made, and every later copy into a slot shows through them.

A forward's experts run in groups (`run`): those resident first (a hit is never evicted before
its use), then the misses. When they all fit the slots they are one group and one call; otherwise
groups of half the slots alternate between two halves, so that the copy of group j+1 (on the copy
stream) overlaps the compute of group j. Events order each copy after the last compute that read
its slot and each compute after the copies into its slots; nothing waits on the host except the
one read of the routing that choosing experts needs. Some misses may instead be computed on the
host from the host copy while the others are copied (`split`), and `prefetch` fills half the
slots before the routing is known (`ExpertOffload` decides when: engine/offload/). Copies of
experts that sit side by side on both ends (a prefill streaming a layer) go as one copy per part.

With `mapped` host parts (the device reads pinned host memory in place), a forward of a few
assignments (decode) chooses and copies nothing: the resident experts run from their slots and the
others are read where they lie, by the same kernels (`run_mapped`), so no host sync and a CUDA
graph may hold the step. With `staging` (device rows, shared by the layers), the experts a step
reads from host memory are first gathered there, each read once in long runs of wide loads (the
link's rate; engine/ops/gpu/gather.py), and run from those rows; without, their kernels read them
where they lie. The device counts each expert's uses; between steps `refresh` swaps the
hottest experts into the slots, on the copy stream, behind the steps already queued.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from engine.offload.stats import OffloadStats
from engine.weights import dense

Parts = tuple[torch.Tensor, ...]
# token x expert assignments up to which a forward reads the experts it does not hold where they lie
# (a decode step of up to 4 sequences, graph-captured): each assignment reads its expert over the link
# (~21 GB/s on the H200), so beyond a few tokens fetching or streaming them costs less
IN_PLACE_ROWS = 32
HEAT_DECAY = 0.9  # per decode step: an expert's heat is its uses, the older ones worth less
# uses by which a newcomer must be hotter than the expert it displaces: under routing without
# locality (random weights) a swap is a copy no later step repays, so a newcomer needs ~3 recent uses
SWAP_MARGIN = 2.0


class Streaming(Protocol):
    """What a layer's cache hands a streamed forward to (`engine.offload.stream.ExpertStream`)."""

    active: bool

    def run(
        self, cache: ExpertCache, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, moe_experts: Callable
    ) -> torch.Tensor: ...


class Lane:
    """Host -> device copies on a side stream, ordered with the compute stream by events. On the
    CPU (the split simulated) copies are synchronous and events are None."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], after: list[Any]) -> Any:
        """Copy each (device, host) pair once every event of `after` (compute that read the
        destinations) has completed; an event that completes with the copies."""

        def copies() -> None:
            for dst, src in pairs:
                dst.copy_(src, non_blocking=self.stream is not None)

        return self.run(copies, after)

    def run(self, work: Callable[[], None], after: list[Any], holds: tuple[torch.Tensor, ...] = ()) -> Any:
        """`work` (kernels that fill device buffers, e.g. a gather from host memory) on the copy
        stream once every event of `after` has completed; an event that completes with it. `holds`:
        tensors of the compute stream it reads, kept from the allocator until it ran."""
        if self.stream is None:
            work()
            return None
        for event in {id(e): e for e in after if e is not None}.values():
            self.stream.wait_event(event)
        with torch.cuda.stream(self.stream):
            work()
            for t in holds:
                t.record_stream(self.stream)
            done = torch.cuda.Event()
            done.record(self.stream)
        return done

    def record(self) -> Any:
        """An event of the compute stream's work so far."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def done(self, event: Any) -> bool:
        """Whether the copies behind `event` have landed (None: nothing pending)."""
        return event is None or event.query()

    def wait(self, events: list[Any]) -> None:
        """The compute stream waits for `events` (copies into slots it is about to read)."""
        if self.stream is None:
            return
        compute = torch.cuda.current_stream(self.device)
        for event in {id(e): e for e in events if e is not None}.values():  # a group's copies share one
            compute.wait_event(event)


def gather_rows(staging: Parts, source: Parts, ids: torch.Tensor) -> None:
    """staging[p][r] = source[p][ids[r]] for every part p and row r with ids[r] >= 0: the CPU's
    version of engine/ops/gpu/gather.py's kernel."""
    ids = ids.flatten()
    rows = (ids >= 0).nonzero()[:, 0]
    for dst, src in zip(staging, source, strict=True):
        dst[rows] = src[ids[rows]]


def host_experts(
    x: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """One expert on host rows: x [n, H], weights [n] -> [n, H] in fp32, computed in the weights'
    dtype (bf16 GEMMs accumulate in fp32), so within that dtype's rounding of the device path."""
    x = x.to(gate_up.dtype)
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down).float() * weights.float()[:, None]


class ExpertCache:
    """Eviction takes the least recently used slot, the least used expert among equals, and
    never one the group being loaded or the group being computed needs."""

    def __init__(
        self,
        host: Parts,
        slots: int,
        device: torch.device,
        stats: OffloadStats,
        lane: Lane,
        assemble: Callable[[Parts], tuple[Any, ...]] = tuple,
        mapped: Parts | None = None,
        staging: Parts | None = None,
        partial: bool = False,
    ):
        """`mapped`: the host parts as the device reads them in place (`ExpertOffload`'s
        `in_place`), or None: every expert a forward runs is copied into a slot first. `staging`:
        with `mapped`, device rows of the parts that the experts a step reads from host memory
        are gathered into before they run, one per assignment (None, or a step of more
        assignments than rows: they run where they lie). `partial`: the ids a forward passes may
        hold -1, no expert (another rank's, `engine.parallel`): nothing runs, is fetched or is
        counted for it."""
        self.host, self.assemble, self.stats, self.lane = host, assemble, stats, lane
        self.device = device
        self.num_experts = host[0].shape[0]
        # each expert's and each slot's views of the parts, made once: a quantized expert has 4 to 8
        # parts, and a view made for every copy of every miss was most of a decode step's host time
        self.host_views = [tuple(p[e] for p in host) for e in range(self.num_experts)]
        self.expert_bytes = sum(p[0].nbytes for p in host)
        self.parts: Parts = ()  # [S, ...] each, `slot_views` their slots' views, and `weights`:
        self.weights: tuple[Any, ...] = ()  # what they assemble to
        self._allocate(slots)
        self.cpu_rows = 0  # misses routed to at most this many rows may be computed on the host
        self.costs: tuple[float, float, float] | None = None  # see `split`
        self.expert_in = [-1] * slots  # the expert each slot holds
        self.slot_of = [-1] * self.num_experts  # the slot holding each expert
        # the same, to copy in, and on the device; one more entry, -1 for good: an id of -1 (no
        # expert) indexes it, so the table maps it to no slot
        self.slot_of_host = np.full(self.num_experts + 1, -1, dtype=np.int64)
        self.slot_table = torch.full((self.num_experts + 1,), -1, dtype=torch.long, device=device)
        self.partial = partial
        self.last_used = [0] * slots
        self.uses = [0] * self.num_experts  # forwards that routed to each expert
        self.copied = [None] * slots  # event: the copy into each slot
        self.read = [None] * slots  # event: the last compute that read each slot
        self.clock = 0
        self.holds_all = False  # every expert resident for good (`hold_all`)
        self.mapped = mapped
        self.mapped_weights = None if mapped is None else assemble(mapped)
        self.staging = staging
        self.staged_weights = None if staging is None else assemble(staging)
        self.stage_reads = staging is not None  # off: the staging kept, reads where they lie (a baseline)
        self.rows = torch.arange(0 if staging is None else staging[0].shape[0], device=device)
        self.gather = gather_rows
        if staging is not None and device.type == "cuda":
            from engine.ops.gpu.gather import gather_experts  # noqa: PLC0415 (Triton)

            self.gather = gather_experts
        # [2, E] on the device (rows of ExpertOffload's counters): each expert's assignments in
        # mapped forwards, and those of them that found it resident
        self.counters = torch.zeros((2, self.num_experts), dtype=torch.long, device=device)
        self.heat = np.zeros(self.num_experts)  # decayed uses per decode step (`refresh`)
        self.pending: Any = None  # event: the last refresh's copies and table published
        self.next: ExpertCache | None = None  # the following layer's cache
        self.stream: Streaming | None = None  # while it streams a forward, the layers run there
        self.prefetch_next = 0  # slots of the following layer to fill when this layer starts

    @property
    def slots(self) -> int:
        return len(self.expert_in)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def host_bytes(self) -> int:
        return sum(p.nbytes for p in self.host)

    def run(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, moe_experts: Callable
    ) -> torch.Tensor:
        """`moe_experts(x [T, H], weights [T, k], slot ids [T, k], *assemble(slot parts))` -> [T, H].
        Groups after the first (and host-computed experts) run on their own assignments as rows
        (k = 1), summed in fp32. With every expert resident (`hold_all`) nothing is chosen or
        copied: no host sync, so a CUDA graph may hold the call."""
        if self.holds_all:
            return moe_experts(x, weights, self.slot_table[ids], *self.weights)
        if self.stream is not None and self.stream.active:
            return self.stream.run(self, x, weights, ids, moe_experts)
        if self.mapped_weights is not None and ids.numel() <= IN_PLACE_ROWS:
            return self.run_mapped(x, weights, ids, moe_experts)
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "offloaded experts cannot run inside a CUDA graph: the slots change between replays"
            )
        if self.mapped_weights is not None:  # mapped steps may have read any slot: copies wait for them
            self.wait_for_table()
            self.read = [self.lane.record()] * self.slots
        if self.next is not None and self.prefetch_next:
            self.next.prefetch(self.prefetch_next)  # before this layer's routing is read: overlaps it
        counts = self._counts(ids)  # the one host sync
        groups, on_host = self.prepare(counts)
        if not on_host and len(groups) == 1:
            self._load(groups[0], busy=[])
            self.lane.wait([self.copied[self.slot_of[e]] for e in groups[0]])
            out = moe_experts(x, weights, self.slot_table[ids], *self.weights)
            self._read(groups[0])
            return out
        # assignments sorted by (group, expert): each group's rows are one range of `order`
        ordered = [e for g in [*groups, on_host] for e in g]
        rank = torch.empty(self.num_experts + 1, dtype=torch.long)  # the last: no expert (-1), after every group
        rank[ordered] = torch.arange(len(ordered))
        rank[-1] = len(ordered)
        order = torch.argsort(
            self._staged(rank).to(ids.device, non_blocking=True)[ids.flatten()], stable=True
        )
        bounds, lo = [], 0
        for group in [*groups, on_host]:
            bounds.append((lo, lo + sum(counts[e] for e in group)))
            lo = bounds[-1][1]
        top_k, flat_w, flat_ids = ids.shape[1], weights.flatten(), ids.flatten()
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        if on_host:  # rows to the host first: the device groups below then overlap the host's work
            picked = order[bounds[-1][0] : bounds[-1][1]]
            host_rows = (
                picked // top_k,
                x[picked // top_k].cpu(),
                flat_w[picked].cpu(),
                flat_ids[picked].cpu(),
            )
        if groups:
            self._load(groups[0], busy=[])
        for j, group in enumerate(groups):
            if j + 1 < len(groups):
                self._load(groups[j + 1], busy=group)  # overlaps this group's compute
            self.lane.wait([self.copied[self.slot_of[e]] for e in group])
            picked = order[bounds[j][0] : bounds[j][1]]
            y = moe_experts(
                x[picked // top_k],
                flat_w[picked, None],
                self.slot_table[flat_ids[picked, None]],
                *self.weights,
            )
            self._read(group)
            out.index_add_(0, picked // top_k, y.float())
        if on_host:
            out.index_add_(0, host_rows[0], self._host_compute(*host_rows[1:]).to(x.device))
        return out.to(x.dtype)

    def run_mapped(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, moe_experts: Callable
    ) -> torch.Tensor:
        """A few assignments: the resident experts from their slots and the others read from host
        memory (gathered into the staging rows first, or where they lie), two calls over the same
        assignments (each with the other's ids at -1: nothing read for them); each expert's uses
        counted on the device. Nothing waits on the host: the table lists only slots whose copies
        are done (`refresh`)."""
        assert self.mapped is not None and self.mapped_weights is not None
        slot = self.slot_table[ids]
        resident = slot >= 0
        flat = ids.flatten()
        uses = torch.ones_like(flat)
        if self.partial:  # no expert (-1): counted as none on expert 0
            flat, uses = flat.clamp(min=0), (flat >= 0).long()
        self.counters[0].index_add_(0, flat, uses)
        self.counters[1].index_add_(0, flat, resident.flatten().long())
        far_ids = torch.where(resident, -1, ids)
        far_weights = self.mapped_weights
        if self.stage_reads and ids.numel() <= len(self.rows):  # row j holds assignment j's expert
            assert self.staging is not None and self.staged_weights is not None
            self.gather(self.staging, self.mapped, far_ids)
            near_or_none = far_ids < 0 if self.partial else resident  # no row gathered for either
            far_ids = torch.where(near_or_none, -1, self.rows[: ids.numel()].view(ids.shape))
            far_weights = self.staged_weights
        near = moe_experts(x, weights, slot, *self.weights)
        far = moe_experts(x, weights, far_ids, *far_weights)
        return near + far  # added in fp32 and rounded to x's dtype once, as by hand, in one kernel

    def refresh(self, uses: np.ndarray, limit: int) -> int:
        """Between decode steps (mapped): each expert's heat decays and gains its `uses` since the
        last call; then up to `limit` of the hottest experts not resident replace the coldest
        resident ones (empty slots first) where hotter by more than `SWAP_MARGIN` (no churn among
        equals). The slots leave the table on the compute stream (the steps queued before are the
        last to read them), are filled on the copy stream after those steps, and join the table
        there once filled: a step reads an expert from its slot or from host memory, never a
        half-copied slot. Nothing while the last refresh's copies are in flight (its table would
        land after this one's evictions). Returns the experts copied in."""
        self.heat *= HEAT_DECAY
        self.heat += uses
        if not limit or not self.lane.done(self.pending):
            return 0
        hot = [
            int(e) for e in np.argsort(-self.heat, kind="stable")[: self.slots + limit] if self.slot_of[e] < 0
        ]
        cold = sorted(
            range(self.slots), key=lambda s: -1.0 if self.expert_in[s] < 0 else self.heat[self.expert_in[s]]
        )
        swaps = []
        for expert, slot in zip(hot[:limit], cold, strict=False):
            old = self.expert_in[slot]
            if self.heat[expert] <= (0.0 if old < 0 else self.heat[old] + SWAP_MARGIN):
                break
            swaps.append((expert, slot))
        if not swaps:
            return 0
        for _, slot in swaps:
            self._evict(slot)
        self._write_table()  # the steps queued so far are the last to read these slots
        after = [self.lane.record()]
        for expert, slot in swaps:
            self._place(expert, slot)
            self.last_used[slot] = self.clock
        self.pending = self._fill(swaps, after, publish=True)
        return len(swaps)

    def adopt(self, piece: Parts, start: int, lo: int, hi: int) -> None:
        """Fill empty slots with experts lo .. hi - 1 not resident, from `piece` (the device copy
        of the experts from `start` on, in a stream buffer: engine/offload/stream.py), on the
        compute stream."""
        empty = [s for s in range(self.slots) if self.expert_in[s] < 0]
        wanted = [e for e in range(lo, hi) if self.slot_of[e] < 0]
        placed = list(zip(wanted, empty, strict=False))
        if not placed:
            return
        self.wait_for_table()
        for expert, slot in placed:
            for dst, src in zip(self.slot_views[slot], piece, strict=True):
                dst.copy_(src[expert - start])
            self._place(expert, slot)
            self.copied[slot] = None
        self._write_table()

    def _copies(self, assigned: list[tuple[int, int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(device, host) copy pairs that fill slots with experts, from (expert, slot) pairs:
        one per part for each run of experts side by side in consecutive slots."""
        pairs = []
        assigned = sorted(assigned)
        i = 0
        while i < len(assigned):
            expert, slot = assigned[i]
            n = 1
            while i + n < len(assigned) and assigned[i + n] == (expert + n, slot + n):
                n += 1
            if n == 1:  # the views made once: most decode misses are single experts
                pairs += zip(self.slot_views[slot], self.host_views[expert], strict=True)
            else:
                pairs += [
                    (d[slot : slot + n], h[expert : expert + n])
                    for d, h in zip(self.parts, self.host, strict=True)
                ]
            i += n
        return pairs

    def _counts(self, ids: torch.Tensor) -> list[int]:
        """The assignments routed to each expert, those to no expert (-1, `partial`) left out."""
        if self.partial:
            return torch.bincount(ids.flatten() + 1, minlength=self.num_experts + 1).tolist()[1:]
        return torch.bincount(ids.flatten(), minlength=self.num_experts).tolist()

    def prepare(self, counts: list[int]) -> tuple[list[list[int]], list[int]]:
        """From the rows routed to each expert: device groups of the experts needed (resident
        first; all in one group when they fit the slots, else groups of half the slots) and the
        misses computed on the host (`split`). Counts hits and host experts;
        `run` loads each group as it comes."""
        needed = [e for e, n in enumerate(counts) if n]
        self.clock += 1
        for expert in needed:
            self.uses[expert] += 1
        resident = [e for e in needed if self.slot_of[e] >= 0]
        misses = [e for e in needed if self.slot_of[e] < 0]
        on_host = self.split(misses, counts)
        self.stats.count(len(resident), fetched=len(misses) - len(on_host), on_host=len(on_host))
        ordered = resident + [e for e in misses if e not in on_host]
        size = self.slots if len(ordered) <= self.slots else max(1, self.slots // 2)
        return [ordered[i : i + size] for i in range(0, len(ordered), size)], on_host

    def split(self, misses: list[int], counts: list[int]) -> list[int]:
        """The misses to compute on the host: those of at most `cpu_rows` rows; with `costs`
        (copy seconds per expert, host seconds per expert on one row and per further row) only as
        many, fewest rows first, as keep the host's total within the time of the copies left (the
        two run at once: the device groups are queued before the host starts)."""
        candidates = sorted((e for e in misses if counts[e] <= self.cpu_rows), key=lambda e: counts[e])
        if self.costs is None:
            return candidates
        copy_s, first_s, row_s = self.costs
        on_host, host_s, copies = [], 0.0, len(misses)
        for expert in candidates:
            cost = first_s + (counts[expert] - 1) * row_s
            if host_s + cost > (copies - 1) * copy_s:
                break
            on_host.append(expert)
            host_s, copies = host_s + cost, copies - 1
        return on_host

    def prefetch(self, count: int) -> None:
        """Before this layer's routing is known (a chunk that routes to nearly every expert):
        fill `count` least recently used slots with the most used experts not resident."""
        wanted = sorted(
            (e for e in range(self.num_experts) if self.slot_of[e] < 0), key=lambda e: -self.uses[e]
        )
        self._load(wanted[:count], busy=[])

    # -- slots

    def _load(self, group: list[int], busy: list[int]) -> None:
        """Make every expert of `group` resident, evicting only experts outside `group` and
        `busy`; each copy waits for the last compute that read its slot."""
        missing = sorted(e for e in group if self.slot_of[e] < 0)
        slots = sorted(self._victims({*group, *busy}, len(missing)))  # both ascending: runs copy as one
        assigned = list(zip(missing, slots, strict=True))
        for expert, slot in assigned:
            self._evict(slot)
            self._place(expert, slot)
        for expert in group:
            self.last_used[self.slot_of[expert]] = self.clock
        if assigned:
            self._write_table()  # with copies only: each compute waits for the copies into its slots
            self._fill(assigned, [self.read[slot] for slot in slots])

    def wait_for_table(self) -> None:
        """The compute stream waits for the last refresh's (or copied resize's) copies: the table
        they publish lands before the one this forward writes or reads."""
        if self.pending is not None:
            self.lane.wait([self.pending])
            self.pending = None

    def _evict(self, slot: int) -> None:
        if (old := self.expert_in[slot]) >= 0:
            self.expert_in[slot] = self.slot_of[old] = self.slot_of_host[old] = -1
            self.stats.evictions += 1

    def _place(self, expert: int, slot: int) -> None:
        self.expert_in[slot], self.slot_of[expert], self.slot_of_host[expert] = expert, slot, slot

    def _table(self) -> torch.Tensor:
        """The slot table as it stands on the host, staged for a copy to the device."""
        return self._staged(torch.from_numpy(self.slot_of_host.copy()))

    def _write_table(self) -> None:
        """The device's slot table as the host's, in compute-stream order."""
        self.slot_table.copy_(self._table(), non_blocking=True)

    def _fill(self, assigned: list[tuple[int, int]], after: list[Any], publish: bool = False) -> Any:
        """Copy (expert, slot) pairs in on the copy stream once `after` completed (and with
        `publish`, the slot table behind them there); counts them; the copies' event."""
        pairs = self._copies(assigned) + ([(self.slot_table, self._table())] if publish else [])
        done = self.lane.copy(pairs, after)
        for _, slot in assigned:
            self.copied[slot] = done
        self.stats.misses += len(assigned)
        self.stats.bytes_in[self.stats.phase] += len(assigned) * self.expert_bytes
        return done

    def _staged(self, t: torch.Tensor) -> torch.Tensor:
        """A small host tensor to copy in without a host sync: pinned on CUDA (the pinned
        allocator keeps it until the copy ran), where a pageable source may wait for the stream."""
        return t.pin_memory() if self.device.type == "cuda" else t

    def _read(self, group: list[int]) -> None:
        event = self.lane.record()
        for expert in group:
            self.read[self.slot_of[expert]] = event

    def _victims(self, keep: set[int], count: int) -> list[int]:
        """`count` slots to fill, outside those holding `keep`: empty ones first, then the least
        recently used (the least used expert among equals), chosen together in one pass."""
        if not count:
            return []
        expert_in, last_used, uses = self.expert_in, self.last_used, self.uses
        free = [s for s in range(self.slots) if expert_in[s] not in keep]
        return heapq.nsmallest(
            count, free, key=lambda s: (expert_in[s] >= 0, last_used[s], uses[expert_in[s]])
        )

    def _host_compute(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The host path: host rows x [n, H], weights [n], expert ids [n] -> [n, H] fp32."""
        out = torch.zeros(x.shape, dtype=torch.float32)
        for expert in ids.unique().tolist():
            rows = (ids == expert).nonzero()[:, 0]
            out[rows] = host_experts(x[rows], weights[rows], *self.host_weights(expert))
        return out

    def host_weights(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One expert's (gate_up [2I, H], down [H, I]) from its host copy, quantized ones dequantized."""
        gate_up, down = self.assemble(tuple(p[expert : expert + 1] for p in self.host))
        return dense(gate_up, torch.float32)[0], dense(down, torch.float32)[0]

    def hold_all(self) -> None:
        """Copy every expert in once, for good (there are as many slots as experts)."""
        assert self.slots >= self.num_experts
        self._load(list(range(self.num_experts)), busy=[])
        self.lane.wait(self.copied)  # now: no event from outside a graph capture is waited on later
        self.copied = [None] * self.slots
        self.holds_all = True

    def _allocate(self, slots: int) -> None:
        """`slots` empty slots, and the weights over them (assembled once: a quantized store's
        `QuantWeight`s are modules, too costly to build in every layer's every step)."""
        self.parts = tuple(
            torch.zeros((slots, *p.shape[1:]), dtype=p.dtype, device=self.device) for p in self.host
        )
        self.slot_views = [tuple(p[s] for p in self.parts) for s in range(slots)]
        self.weights = self.assemble(self.parts)

    def resize(self, slots: int) -> None:
        """`slots` slots instead of the current ones; the old slots' memory is freed first
        (after every copy into them), so the two never coexist. The hottest resident experts that
        fit stay resident, brought in again from the host: gathered by one kernel where the device
        reads host memory in place, else copied on the copy stream (a shrink emptied every slot
        before; decode's refresh then took a step per expert to fill them again)."""
        self.holds_all = False
        self.lane.wait(self.copied)
        resident = [e for e in self.expert_in if e >= 0]
        kept = sorted(sorted(resident, key=lambda e: (-self.heat[e], -self.uses[e]))[:slots])
        self.parts, self.slot_views, self.weights = (), [], ()  # the old slots freed first
        self._allocate(slots)
        self.expert_in, self.slot_of = [-1] * slots, [-1] * self.num_experts
        self.slot_of_host.fill(-1)
        self.slot_table.fill_(-1)
        self.last_used, self.copied, self.read = [0] * slots, [None] * slots, [None] * slots
        self.pending = None
        if not kept:
            return
        assigned = list(zip(kept, range(len(kept)), strict=True))  # both ascending: runs copy as one
        for expert, slot in assigned:
            self._place(expert, slot)
        if self.mapped is None:
            self.pending = self._fill(assigned, [self.lane.record()], publish=True)
            return
        # read in place: one gather per layer on the compute stream (not a copy per expert and
        # part: ~15,000 of them at 8 GiB), the table behind it
        self.gather(self.parts, self.mapped, self._staged(torch.tensor(kept)).to(self.device, non_blocking=True))
        self._write_table()
        self.stats.misses += len(kept)
        self.stats.bytes_in[self.stats.phase] += len(kept) * self.expert_bytes
