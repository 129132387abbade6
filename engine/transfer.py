"""Host <-> device copies for snapshots, on a side stream so they stay off the compute stream.

Device -> host: each captured tensor is copied into pinned host memory on the copy stream after
an event on the compute stream; `sync()` waits for all copies issued so far (the engine calls it
once, at the end of a prefill, so a snapshot's tensors are complete when the snapshot is handed
out). The pinned memory comes in slabs of `SLAB` bytes from a `SlabPool`, each call's tensors cut
from the current one: pinning fresh host memory (cudaHostAlloc) maps and locks every page, far slower
than a copy of the same bytes. The pool keeps every slab it pinned and cuts one again once no tensor
cut from it is alive (the store keeps its own copies); `reserve` pins slabs ahead (at warm-up), so
that a request's step rarely calls cudaHostAlloc.

Host -> device: a restore copies each layer's tensors on the copy stream and leaves one event per
layer in `SequenceState.pending`; the model waits for a layer's event just before it runs that
layer, so the copies overlap the first prefill chunk. The checkpoint store's records are in pageable
memory, which the driver stages through its own pinned buffers (the call returns once the staging is
done); a source that is pinned (a snapshot still in its slab) is copied truly asynchronously, so a
restore holds its sources until its copies have landed, whoever drops them meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from checkpoint_store.snapshot import Snapshot
from engine.config import ModelConfig
from engine.state import SequenceState

ALIGN = 64  # bytes between the buffers cut from one slab
SLAB = 64 << 20  # bytes of pinned memory cut into snapshot tensors; a power of two (torch's pinned cache rounds up)
RUN = SLAB // 8  # bytes of one copy of neighbouring tensors at most: a slab's unused tail stays under it
KV_HEADROOM = 4096  # tokens of KV capacity beyond a restored prefix, so the next prefill need not regrow


class SlabPool:
    """Host slabs of `size` bytes (from `make`, e.g. pinned) cut into tensors (`take`); a slab is
    cut again once no tensor cut from it is alive, else a new one is made and kept. Writes into a
    slab must be ordered after the earlier writes into it (the copies share one stream), since a
    slab is reused as soon as the host holds no tensor of it."""

    def __init__(self, size: int, make: Callable[[int], torch.Tensor]):
        self.size, self.make = size, make
        self.slabs: list[torch.Tensor] = []
        self._bare = 0  # a slab's storage use count with no tensor cut from it
        self._current: torch.Tensor | None = None
        self._used = 0  # bytes of the current slab taken

    def take(self, nbytes: int) -> torch.Tensor:
        """`nbytes` (at most `size`) cut from the current slab, or from the next free one."""
        if self._current is None or self._used + nbytes > self.size:
            free = self._free()
            self._current, self._used = (self._grow() if free is None else free), 0
        out = self._current[self._used : self._used + nbytes]
        self._used += -(-nbytes // ALIGN) * ALIGN
        return out

    def reserve(self, count: int) -> None:
        """At least `count` slabs made now."""
        while len(self.slabs) < count:
            self._grow()

    def _cut(self, slab: torch.Tensor) -> bool:
        return torch._C._storage_Use_Count(slab.untyped_storage()._cdata) > self._bare

    def _free(self) -> torch.Tensor | None:
        return next((slab for slab in self.slabs if slab is not self._current and not self._cut(slab)), None)

    def _grow(self) -> torch.Tensor:
        slab = self.make(self.size)
        self._bare = torch._C._storage_Use_Count(slab.untyped_storage()._cdata)
        self.slabs.append(slab)
        return slab


def _first_byte(t: torch.Tensor) -> int:
    """Where `t` starts in its storage, in bytes."""
    return t.storage_offset() * t.element_size()


def _runs(items: list[tuple[int, str, torch.Tensor]]):
    """Contiguous tensors (with their group and name) as runs to copy whole: (storage, first byte,
    end byte, the run's items). A run holds tensors of one storage in order, each starting at most
    its own size past the run's end (a gap is copied too), up to RUN bytes (the tail of a slab that
    the next run does not fit goes unused: up to a quarter of every slab with quarter-slab runs)."""
    runs: list[tuple[torch.UntypedStorage, int, int, list]] = []
    for item in sorted(items, key=lambda item: (item[2].untyped_storage().data_ptr(), _first_byte(item[2]))):
        t = item[2]
        lo = _first_byte(t)
        hi = lo + t.nbytes
        if runs:
            storage, first, end, run = runs[-1]
            same = storage.data_ptr() == t.untyped_storage().data_ptr()
            if same and lo - end <= t.nbytes and max(hi, end) - first <= RUN:
                runs[-1] = (storage, first, max(hi, end), [*run, item])
                continue
        runs.append((t.untyped_storage(), lo, hi, [item]))
    return runs


class Transfers:
    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.pending: list[torch.cuda.Event] = []
        self.slabs = SlabPool(SLAB, lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=True))
        self._reading: list[tuple[torch.cuda.Event, list[torch.Tensor]]] = []  # restores' sources in flight
        self.restored_bytes = 0  # copied host -> device by restores (sources already on the device excluded)

    def to_host(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Pinned host copies of device `tensors`, complete after `sync()`."""
        return self.to_host_many([tensors])[0]

    def to_host_many(self, groups: Sequence[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
        """`to_host` of each of `groups` (e.g. a layer's captures of every sequence in a forward)
        behind one wait on the compute stream. Tensors that lie near each other in one device
        buffer (a layer's captures) go over in one copy (`_runs`), each a view of its run's pinned
        buffer."""
        ready = torch.cuda.Event()
        ready.record()
        self.stream.wait_event(ready)
        out: list[dict[str, torch.Tensor]] = [{} for _ in groups]
        with torch.cuda.stream(self.stream):
            items = []
            for g, tensors in enumerate(groups):
                for name, t in tensors.items():
                    if not t.is_contiguous():  # made contiguous here, on this stream
                        t.record_stream(self.stream)
                        t = t.contiguous()
                    items.append((g, name, t))
            for storage, lo, hi, run in _runs(items):
                source = torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage, lo, (hi - lo,), (1,))
                host = self._pinned(hi - lo)
                host.copy_(source, non_blocking=True)
                source.record_stream(self.stream)  # the allocator must not reuse the memory before the copy ran
                for g, name, t in run:
                    start = _first_byte(t) - lo
                    out[g][name] = host[start : start + t.nbytes].view(t.dtype).view(t.shape)
        done = torch.cuda.Event()
        done.record(self.stream)
        self.pending.append(done)
        return out

    def _pinned(self, nbytes: int) -> torch.Tensor:
        """`nbytes` of pinned host memory: cut from the slabs (a request of over a quarter slab gets
        its own block from torch's pinned cache)."""
        if nbytes > SLAB // 4:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return self.slabs.take(nbytes)

    def reserve(self, nbytes: int) -> None:
        """Pin slabs for `nbytes` of captures now."""
        self.slabs.reserve(-(-nbytes // SLAB))

    def fence(self) -> torch.cuda.Event:
        """An event that completes with every copy issued so far (they share one stream)."""
        event = torch.cuda.Event()
        event.record(self.stream)
        self.pending.clear()
        return event

    def sync(self) -> None:
        for event in self.pending:
            event.synchronize()
        self.pending.clear()

    def restore(self, state: SequenceState, chain: Sequence[Snapshot], config: ModelConfig, dtype: torch.dtype) -> None:
        """Fill the empty `state` from `chain` (KV deltas from 0, the last one holding a state); or
        put a `state` whose KV already holds the chain's back at its end: `chain` is then the
        last state alone, a snapshot of no tokens (`Engine.rewind`)."""
        self._reading = [(event, held) for event, held in self._reading if not event.query()]
        end = chain[-1].end
        last = chain[-1].tensors
        sources = []
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)  # freshly allocated blocks may still be read by earlier kernels
        for layer in range(config.num_hidden_layers):
            copies = []  # (device destination allocated on the compute stream, host source)
            if layer in state.kv:
                cache = state.kv[layer]
                cache.reserve(end + KV_HEADROOM)
                for snap in (s for s in chain if s.end > s.start):
                    copies.append((cache.k[snap.start : snap.end], snap.tensors[f"kv.{layer}.k"]))
                    copies.append((cache.v[snap.start : snap.end], snap.tensors[f"kv.{layer}.v"]))
                cache.length = end
            else:
                conv, rec = last[f"conv.{layer}"], last[f"rec.{layer}"]
                state.conv[layer] = torch.empty(conv.shape, dtype=dtype, device=self.device)
                state.rec[layer] = torch.empty(rec.shape, dtype=torch.float32, device=self.device)
                copies += [(state.conv[layer], conv), (state.rec[layer], rec)]
            with torch.cuda.stream(self.stream):
                for dst, src in copies:
                    dst.copy_(src if src.dtype == dst.dtype else src.to(dst.dtype), non_blocking=True)
                    dst.record_stream(self.stream)
                event = torch.cuda.Event()
                event.record(self.stream)
            state.pending[layer] = event
            sources += [src for _, src in copies]
        self.restored_bytes += sum(src.nbytes for src in sources if not src.is_cuda)
        self._reading.append((event, sources))  # the copies read them until the last event
        state.length = end
