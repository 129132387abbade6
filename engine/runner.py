"""Decode steps of several sequences at once, on slotted state buffers, graph-captured on a GPU.

The runner owns `SlotBuffers`: every sequence it decodes is bound to a slot, its KV caches and
DeltaNet states become views of that slot (`SequenceState` works unchanged: a later
prefill appends to the same KV view, snapshots read it), so consecutive steps copy nothing. A state
that comes without a slot takes a free one or the least recently used one of a sequence outside
the step, whose owner first gets private copies of what it still shares.

A step is the model's own forward over a `SlotBatch`. On a GPU it is captured once per batch-size
bucket (1, 2, 4, ...; a smaller batch is padded with rows that read and write a scratch slot), so
a step is one graph replay whatever the lengths: attention reads each row's valid length from the
device. When the slots or their capacity run out, the buffers grow (slots to the next power of two,
capacity doubling) and the graphs are captured again.

A short prefill of one sequence (up to PREFILL_BUCKETS[-1] tokens: a tool result or a user turn
after a restore) runs the same way on its slot: a `SlotPrefill` padded to a token bucket, one graph
per bucket, its slot, position and token count on the device. Eager, such a prefill's kernel
launches take several times its GPU work.

A step that also prefills a longer chunk runs eagerly: `slot_batch` binds the decode rows to their
slots and the engine's one forward takes them before the prefill's spans (`Mixed`), so the step
reads the weights once.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch

from engine.batch import SlotBatch, SlotBuffers, SlotPrefill
from engine.model import HybridForCausalLM
from engine.ops import Kernels
from engine.state import SequenceState

MIN_CAPACITY = {"cuda": 4096, "cpu": 256}  # tokens per slot at first; doubles as sequences grow
GRAPH_CAPACITY = 16384  # at first when graphs run and no budget counts it: a growth recaptures every graph
PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512)  # token counts of the captured prefills
HEADROOM_SHARE = 4  # growth ahead keeps a capacity's quarter (at least the largest bucket) past every sequence


def bucket(n: int) -> int:
    """The batch bucket (a power of two) that `n` rows run in."""
    return 1 << (n - 1).bit_length()


def prefill_bucket(n: int) -> int | None:
    """The token bucket a prefill of `n` tokens runs in on its slot; None above the largest."""
    return next((rows for rows in PREFILL_BUCKETS if rows >= n), None)


def initial_capacity(device: torch.device) -> int:
    return MIN_CAPACITY.get(device.type, 256)


def starting_capacity(device: torch.device) -> int:
    """Tokens per slot after `Runner.warmup`: room for the largest prefill bucket as well."""
    return max(initial_capacity(device), bucket(PREFILL_BUCKETS[-1]))


class Runner:
    def __init__(self, model: HybridForCausalLM, kernels: Kernels, use_graph: bool = False,
                 before_overwrite: Callable[[], None] | None = None,
                 before_allocate: Callable[[int, int], None] | None = None, capacity: int | None = None,
                 graph_rows: int | None = None, max_context: int | None = None):
        """`before_overwrite` runs before a slot's contents are replaced (on a GPU: wait for the
        host copies that may still read the previous owner's KV); `before_allocate(slots,
        capacity)` before buffers of that size replace the old ones (an expert cache shrinks there
        to keep a memory budget; the old buffers are freed before the new ones are made).
        `capacity`: tokens per slot at first (default `initial_capacity`); growing later
        recaptures every graph inside the request that grew them. `graph_rows`: the
        most decode rows a graph may hold (an offloaded model reads its experts in place, which a graph
        can hold, only up to so many assignments); wider decode steps run eagerly. `max_context`:
        the most tokens a sequence reaches (default the model's): no slot grows past it."""
        self.model, self.kernels = model, kernels
        self.c = model.config
        self.device = model.lm_head.weight.device
        self.dtype = model.lm_head.weight.dtype
        self.use_graph = use_graph
        self.graph_rows = graph_rows
        self.max_context = max_context or self.c.max_position_embeddings
        self.min_capacity = min(capacity or initial_capacity(self.device), self.max_context)
        self.before_overwrite = before_overwrite or (lambda: None)
        self.before_allocate = before_allocate or (lambda slots, capacity: None)
        self.slots = 0  # sequence slots; slot `self.slots` is the scratch slot padding rows use
        self.capacity = 0
        self.buffers: SlotBuffers | None = None
        self.views: list[dict[str, dict[int, torch.Tensor]]] = []
        self.owners: list[weakref.ref | None] = []
        self.used: list[int] = []  # step count of each slot's last use (least recently used is evicted)
        self.steps = 0
        self.graphs: dict[tuple[str, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.warmed: set[tuple[str, int]] = set()  # graphs captured before (their kernels are compiled)
        self.dropped: set[tuple[str, int]] = set()  # graphs a growth dropped: captured again ahead of use
        self.pool = None
        self.events = {"slot_growth": 0, "graph_capture": 0}  # buffers made and graphs captured so far

    @torch.no_grad()
    def decode(self, states: Sequence[SequenceState], tokens: Sequence[int]) -> torch.Tensor:
        """Feed tokens[b] to states[b] (distinct states); the next logits [B, V] fp32."""
        count = len(states)
        self._reserve(count, max(s.length for s in states) + 1)
        slots = self._assign(states)
        graphed = self._graphed(bucket(count))
        rows = bucket(count) if graphed else count
        pad = rows - count  # padding rows: token 0 at position 0 of the scratch slot
        host = torch.tensor([[*tokens, *[0] * pad], [s.length for s in states] + [0] * pad, slots + [self.slots] * pad])
        logits = self._run("decode", rows, host, self.inputs[:, :rows], graphed)[:count].clone()
        self.commit(states)
        return logits

    def slot_batch(self, states: Sequence[SequenceState], tokens: Sequence[int]) -> tuple[torch.Tensor, SlotBatch]:
        """The decode rows of a step that runs eagerly beside a prefill (`Mixed`): tokens[b] for
        states[b] on their slots, as (ids [B], the `SlotBatch`); `commit` them after the forward."""
        self._reserve(len(states), max(s.length for s in states) + 1)
        slots = self._assign(states)
        ids, pos, index = torch.tensor([list(tokens), [s.length for s in states], slots]).to(self.device)
        return ids, SlotBatch(self.buffers, index, pos)

    def commit(self, states: Sequence[SequenceState]) -> None:
        """The decode rows of a `slot_batch` ran: each state is one token longer."""
        for state in states:
            self._advance(state, 1)

    @torch.no_grad()
    def prefill(self, state: SequenceState, tokens: Sequence[int]) -> torch.Tensor:
        """Feed a few tokens (at most PREFILL_BUCKETS[-1]) to `state` on its slot, padded to their
        bucket; the logits [V] fp32 after the last one. The state keeps its slot (its next decode
        step copies nothing)."""
        count = len(tokens)
        rows = prefill_bucket(count)
        if rows is None:
            raise ValueError(f"{count} tokens exceed the largest prefill bucket ({PREFILL_BUCKETS[-1]})")
        self._reserve(1, state.length + rows)  # padding rows are written too: room for the whole bucket
        slot = self._assign([state])[0]
        host = torch.tensor([slot, state.length, count, *tokens, *[0] * (rows - count)])
        logits = self._run("prefill", rows, host, self.prefill_inputs[: 3 + rows], self.use_graph)[0].clone()
        self._advance(state, count)
        return logits

    def warmup(self, max_running: int, prefill: bool = True) -> None:
        """Slots for `max_running` sequences and the graphs of every batch bucket up to it and (with
        `prefill`) of every prefill bucket, now (each capture is a few forwards) rather than at first use."""
        self._reserve(max_running, PREFILL_BUCKETS[-1])
        if self.use_graph:
            for rows in sorted({bucket(n) for n in range(1, max_running + 1)}):
                if self._graphed(rows):
                    self._graph("decode", rows)
            for rows in PREFILL_BUCKETS if prefill else ():
                self._graph("prefill", rows)

    def drop_graphs(self) -> None:
        """Forget the captured graphs (they hold tensors that are gone): each is captured again at
        its next use, a decode graph ahead of it where the worker is idle first (`grow_ahead`)."""
        self.dropped = {key for key in self.graphs if key[0] == "decode"}
        self.graphs, self.pool = {}, None

    @property
    def headroom(self) -> int:
        """Tokens past a sequence's end that growth ahead keeps room for: the largest prefill
        bucket (a short prefill reserves its whole bucket), or a quarter of the capacity."""
        return max(PREFILL_BUCKETS[-1], self.capacity // HEADROOM_SHARE)

    def grow_ahead(self, lengths: Sequence[int]) -> bool:
        """One bounded piece of growth ahead of need, for sequences of `lengths` tokens that may
        come back (run while no step is due): the capacity for the longest plus `headroom` (up to
        the model's context; the slots' owners are bound again at once), else one graph a growth
        dropped. False when there was nothing to do."""
        if self.buffers is None:
            return False
        longest = min(max(lengths, default=0) + self.headroom, self.max_context)
        if longest > self.capacity:
            owners = [(slot, self._owner(slot), self.used[slot]) for slot in range(self.slots)]
            self._allocate(self.slots, self._capacity_for(longest))
            for slot, state, used in owners:
                if state is not None:
                    self._bind(slot, state)
                    self.used[slot] = used
            return True
        while self.dropped:
            kind, rows = self.dropped.pop()
            if self.use_graph and (kind, rows) not in self.graphs and (kind == "prefill" or self._graphed(rows)):
                self._graph(kind, rows)
                return True
        return False

    def bound(self, state: SequenceState) -> bool:
        """Whether `state` is its slot's owner (its KV lives in the slot buffers)."""
        return any(self._owner(slot) is state for slot in range(self.slots))

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` lives in the slot buffers (its memory is reused by the next sequence
        bound to its slot)."""
        return tensor.untyped_storage().data_ptr() in self.storages()

    def storages(self) -> set[int]:
        """The data pointers of the slot buffers' storages."""
        if self.buffers is None:
            return set()
        b = self.buffers
        return {t.untyped_storage().data_ptr() for part in (b.k, b.v, b.conv, b.rec) for t in part.values()}

    @property
    def nbytes(self) -> int:
        """Bytes of the slot buffers (KV, conv and recurrent state of every slot)."""
        if self.buffers is None:
            return 0
        b = self.buffers
        return sum(t.nbytes for part in (b.k, b.v, b.conv, b.rec) for t in part.values())

    # -- the step

    def _graphed(self, rows: int) -> bool:
        """Whether a decode step of `rows` (bucketed) rows runs as a graph."""
        return self.use_graph and (self.graph_rows is None or rows <= self.graph_rows)

    def _run(self, kind: str, rows: int, host: torch.Tensor, inputs: torch.Tensor, graphed: bool) -> torch.Tensor:
        """Copy a step's host inputs into the static inputs and run it: a graph replay (captured at
        first use) or the eager forward. A graph's logits are overwritten by its next replay: the
        caller copies the rows it keeps."""
        if not graphed:
            inputs.copy_(host.view_as(inputs))
            return self._forward(kind, rows)
        graph, out = self._graph(kind, rows)
        inputs.copy_(host.view_as(inputs))  # one small pageable copy: done before the host writes the next step's
        graph.replay()
        return out

    def _forward(self, kind: str, rows: int) -> torch.Tensor:
        """The model's forward over the static inputs of a `rows`-row step: a decode step's logits
        [rows, V], or a prefill's at its last real token [1, V]."""
        assert self.buffers is not None
        if kind == "decode":
            ids, pos, index = self.inputs[:, :rows]
            hidden, _ = self.model(ids, SlotBatch(self.buffers, index, pos), self.kernels)
            return self.model.logits(hidden)
        meta, ids = self.prefill_inputs[:3], self.prefill_inputs[3 : 3 + rows]
        batch = SlotPrefill(self.buffers, meta, self.arange[:rows])
        hidden, _ = self.model(ids, batch, self.kernels)
        return self.model.logits(hidden.index_select(0, batch.count - 1))

    def _graph(self, kind: str, rows: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        if (kind, rows) not in self.graphs:  # captured on the scratch slot
            self.inputs[:2, :rows] = 0
            self.inputs[2, :rows] = self.slots
            self.prefill_inputs.zero_()
            self.prefill_inputs[0], self.prefill_inputs[2] = self.slots, rows
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # warm-up: Triton compiles and autotunes outside the capture
                for _ in range(1 if (kind, rows) in self.warmed else 2):  # once more after the buffers grew
                    self._forward(kind, rows)
            self.warmed.add((kind, rows))
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: a capture while serving (the slots grew) must not be invalidated by the
            # store thread's event waits and pinned allocations, which touch no captured memory
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                logits = self._forward(kind, rows)
            self.pool = graph.pool()
            self.graphs[kind, rows] = (graph, logits)
            self.events["graph_capture"] += 1
        return self.graphs[kind, rows]

    @staticmethod
    def _advance(state: SequenceState, count: int) -> None:
        """Commit `count` tokens the slot step wrote (a replayed graph runs no Python)."""
        for cache in state.kv.values():
            cache.length += count
        state.length += count

    # -- slots

    def _reserve(self, sequences: int, length: int) -> None:
        """Room for `sequences` at once of up to `length` tokens each: the buffers grow (slots to
        the next bucket, capacity to the next power of two, at most `max_context`) when they are too small."""
        if sequences > self.slots or length > self.capacity:
            capacity = max(self.capacity, self.min_capacity, self._capacity_for(length), length)
            self._allocate(max(self.slots, bucket(sequences)), capacity)

    def _capacity_for(self, length: int) -> int:
        """Slot capacity for `length` tokens: the next power of two, at most `max_context`."""
        return min(bucket(length), self.max_context)

    def _allocate(self, slots: int, capacity: int) -> None:
        """Buffers for `slots` sequences (+ the scratch slot) of `capacity` tokens; every owner
        first gets private copies, and is bound again at its next step."""
        self.before_allocate(slots, capacity)
        for slot in range(self.slots):
            self._release(slot)
        self.dropped |= set(self.graphs)
        self.buffers, self.views, self.graphs, self.pool = None, [], {}, None  # freed before the new ones exist
        self.events["slot_growth"] += 1
        c, dev, n = self.c, self.device, slots + 1
        kv_shape = (n, capacity, c.num_key_value_heads, c.head_dim)
        self.buffers = SlotBuffers(
            k={i: torch.zeros(kv_shape, dtype=self.dtype, device=dev) for i in c.attention_layers},
            v={i: torch.zeros(kv_shape, dtype=self.dtype, device=dev) for i in c.attention_layers},
            conv={i: torch.zeros(n, c.conv_dim, c.linear_conv_kernel_dim - 1, dtype=self.dtype, device=dev) for i in c.deltanet_layers},
            rec={i: torch.zeros(n, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim,
                                dtype=torch.float32, device=dev) for i in c.deltanet_layers},
        )
        b = self.buffers
        self.views = [{name: {i: t[s] for i, t in getattr(b, name).items()} for name in ("k", "v", "conv", "rec")} for s in range(slots)]
        self.owners, self.used = [None] * slots, [0] * slots
        self.slots, self.capacity = slots, capacity
        self.inputs = torch.zeros(3, bucket(slots), dtype=torch.long, device=dev)  # token ids, positions, slots per row
        self.prefill_inputs = torch.zeros(3 + PREFILL_BUCKETS[-1], dtype=torch.long, device=dev)  # slot, start, count, ids
        self.arange = torch.arange(PREFILL_BUCKETS[-1], device=dev)

    def _owner(self, slot: int) -> SequenceState | None:
        ref = self.owners[slot]
        return ref() if ref is not None else None

    def _assign(self, states: Sequence[SequenceState]) -> list[int]:
        self.steps += 1
        owned = {id(owner): s for s in range(self.slots) if (owner := self._owner(s)) is not None}
        chosen = [owned.get(id(state)) for state in states]
        taken = {s for s in chosen if s is not None}
        for b, state in enumerate(states):
            if chosen[b] is None:  # a free slot, else the least recently used one outside this step
                free = [s for s in range(self.slots) if s not in taken]
                slot = min(free, key=lambda s: (self._owner(s) is not None, self.used[s]))
                self._release(slot)
                chosen[b] = slot
                taken.add(slot)
            self._bind(chosen[b], state)
            self.used[chosen[b]] = self.steps
        return chosen

    def _release(self, slot: int) -> None:
        """Give the slot's owner private copies of whatever it still shares with the slot."""
        prev = self._owner(slot)
        self.owners[slot] = None
        if prev is None:
            return
        views = self.views[slot]
        for i, cache in prev.kv.items():
            if cache.k is views["k"][i]:
                cache.k, cache.v = cache.k[: cache.length].clone(), cache.v[: cache.length].clone()
        for name, tensors in (("conv", prev.conv), ("rec", prev.rec)):
            for i, view in views[name].items():
                if tensors.get(i) is view:
                    tensors[i] = view.clone()

    def _bind(self, slot: int, state: SequenceState) -> None:
        """Make `state` use the slot's views, copying in whatever it does not already share."""
        views = self.views[slot]
        state.wait_all()
        if self._owner(slot) is not state:
            self.before_overwrite()
        for i, cache in state.kv.items():
            if cache.k is not views["k"][i]:
                n = cache.length
                views["k"][i][:n].copy_(cache.k[:n])
                views["v"][i][:n].copy_(cache.v[:n])
                cache.k, cache.v = views["k"][i], views["v"][i]
        for name, tensors in (("conv", state.conv), ("rec", state.rec)):
            for i, view in views[name].items():
                if tensors.get(i) is not view:
                    if i in tensors:
                        view.copy_(tensors[i])
                    else:
                        view.zero_()
                    tensors[i] = view
        self.owners[slot] = weakref.ref(state)
