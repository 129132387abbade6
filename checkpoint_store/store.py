"""The checkpoint store: records by anchor in a RAM tier over an optional LMDB tier.

Acknowledgement: ``put`` returns once the record is visible to ``longest_restorable``
and ``load_chain`` (held in RAM, or in the write queue if RAM cannot hold it) and queued
for the disk. It is *durable* once the writer thread's LMDB transaction holding it has
committed (fsynced); ``flush()`` blocks until everything put before it is durable. A
durable record survives kill -9 and a restart.

Correct or miss: a part that fails its checks, or a chain whose records disagree about
parents or positions, is a miss; the offending record (or part) is deleted and logged on
the ``checkpoint_store`` logger. ``load_chain`` never returns a chain with a hole.

Disk failures never reach the caller: a cache folder that cannot be used leaves the store
RAM-only, a damaged data file is moved aside (``environment``); a failed write is counted
in ``stats().write_errors`` and logged once per cause (``error_log``), a failed read is a
miss counted in ``read_errors``.

Thread safety: every method may be called from any thread; one lock guards the indexes,
and is never held during disk I/O or large copies. ``longest_restorable`` answers for the
moment it is called: the writer thread may evict disk records to make room for queued
puts before a following ``load_chain``, which then misses (``load_longest`` retries with
what is left). Once ``load_chain`` has planned a chain, its disk records are pinned
against eviction until it returns.

Pins: ``pin`` spares records of the RAM tier from eviction (a session's continuation while its
tool runs) until ``unpin``, or until a ``put`` cannot make room otherwise: the put breaks the pin
(counted in ``pins_broken``). ``promote`` (a prefetch) brings a chain up from disk into RAM and
never breaks a pin.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import lmdb
import torch

from .chain import Located, first_mismatch, follows, fresh_copy, join
from .config import StoreConfig
from .disk import MAX_ANCHOR_BYTES, DiskTier, MissingRecord
from .error_log import ErrorLog
from .ram import RamTier
from .record import KV_PART, STATE_PART, CorruptRecord, Packed, RecordMeta, pack, split_parts
from .snapshot import Snapshot
from .stats import Counters, StoreStats
from .writer import DeleteOp, Op, PutOp, Writer

log = logging.getLogger("checkpoint_store")
WRITE_FAILED = "what it was writing is not cached on disk; answers are not affected"


@dataclass(frozen=True)
class Access:
    """One use of a record part, as the RAM tier sees it: ``put`` (offered to the RAM tier, whether it
    holds the part already or not), ``get`` (read by a restore from ``source``: ``ram``, ``queue``,
    the disk writer's, or ``disk``) or ``promote`` (brought up into the RAM tier by a prefetch from
    ``source``). ``nbytes``: the packed part's, 0 where a restore read it from disk. A put names its
    record's place (``parent``, ``start``, ``end``) and ``segment`` kind (``kinds``), so that an offline
    replay of the log rebuilds chains; ``pin`` and ``unpin`` (nbytes 0) tell the RAM tier's pins."""

    kind: str
    anchor: bytes
    part: str
    nbytes: int
    source: str = ""
    parent: bytes | None = None
    start: int = 0
    end: int = 0
    segment: str = ""


class PartMiss(Exception):
    """A part ``load_chain`` needed and could not use; ``kind`` is corrupt, missing or stale."""

    def __init__(self, anchor: bytes, part: str, reason: str, kind: str) -> None:
        super().__init__(reason)
        self.anchor, self.part, self.reason, self.kind = anchor, part, reason, kind


class CheckpointStore:
    """Checkpoint records keyed by anchor; see the module docstring for guarantees."""

    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self._lock = threading.RLock()
        self._clock = 0
        self._counters = Counters()
        self._ram = RamTier(config.ram_bytes, config.eviction)
        self._pending: dict[bytes, PutOp] = {}
        self.write_errors = ErrorLog(log, "checkpoint cache write", WRITE_FAILED)
        self.read_errors = ErrorLog(log, "checkpoint read", "the restore is a miss (prefilled instead)")
        self._disk: DiskTier | None = None
        self._writer: Writer | None = None
        # told of every Access in order (benchmarks log them); called under the store's lock, so quick
        # and never calling the store
        self.on_access: Callable[[Access], None] | None = None
        if config.disk_dir is not None:
            self._disk = DiskTier.open(
                config.disk_dir, config.disk_bytes, config.fingerprint, self._lock, self.write_errors
            )
        if self._disk is not None:
            self._writer = Writer(self._apply, config.max_batch_bytes, config.max_queue_bytes)

    @property
    def has_disk(self) -> bool:
        """True while a disk tier is open (False: RAM only, by configuration or because the
        disk cache could not be used)."""
        return self._disk is not None

    def __enter__(self) -> CheckpointStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- writing ---------------------------------------------------------------------------

    def put(self, anchor: bytes, parent: bytes | None, snapshot: Snapshot, kind: str = "") -> None:
        """Store ``snapshot`` (KV delta of ``[start, end)``, optional state at ``end``) at ``anchor``.
        ``kind``: what the record's segment is to its sessions (``kinds``; "" unknown), told to
        ``on_access`` (the benchmark's access log classes its regrets by it).

        The tensors are copied; the caller may reuse them at once. Raises ``ValueError``
        for a malformed snapshot (KV rows that do not match ``end - start``).
        """
        meta = RecordMeta(
            bytes(anchor), None if parent is None else bytes(parent), snapshot.start, snapshot.end
        )
        _check_put(meta, snapshot)
        parts = split_parts(snapshot.tensors)
        with_state = STATE_PART in parts
        with self._lock:
            in_ram, on_disk = self._ram_covers(meta, with_state), self._disk_covers(meta, with_state)
            if in_ram and on_disk:
                self._clock += 1
                self._ram.touch(meta.anchor, self._clock)
                held = self._ram.get(meta.anchor)
                self._tell_put(meta, held.kv, held.state if with_state else None, kind)
                return
        kv = pack(parts[KV_PART])
        state = pack(parts[STATE_PART]) if with_state else None
        with self._lock:
            self._clock += 1
            self._counters.puts += 1
            if not in_ram:
                self._ram.put(meta, kv, state, self._clock)
            self._tell_put(meta, kv, state, kind)
            op = None if on_disk else self._queue_put(meta, kv, state)
        if op is not None and self._writer is not None:
            self._writer.submit(op)

    def flush(self) -> None:
        """Block until every record put so far is durable on disk (no-op without a disk tier)."""
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Flush, stop the writer and close the database."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._disk is not None:
            self._disk.close()
            self._disk = None

    # -- pins and prefetch -------------------------------------------------------------------

    def pin(self, anchor: bytes) -> None:
        """Spare ``anchor``'s record in the RAM tier from eviction (held now or put later) until
        ``unpin``, or until a put can make room no other way (a broken pin, counted)."""
        with self._lock:
            self._ram.pinned.add(bytes(anchor))
            if self.on_access is not None:
                self.on_access(Access("pin", bytes(anchor), KV_PART, 0))

    def unpin(self, anchor: bytes) -> None:
        with self._lock:
            self._ram.pinned.discard(bytes(anchor))
            if self.on_access is not None:
                self.on_access(Access("unpin", bytes(anchor), KV_PART, 0))

    @property
    def pins_broken(self) -> int:
        """RAM pins a put broke to make room."""
        with self._lock:
            return self._ram.pins_broken

    def promote(self, chain: list[bytes], stop: Callable[[], bool] = lambda: False) -> int:
        """Bring the restorable prefix of ``chain`` up into the RAM tier (a prefetch): the KV part of
        each of its records and the state part of the last, read from disk (or taken from the disk
        writer's queue) where RAM lacks them, deepest first (a record whose child is held is never
        the next KV eviction). Each part is read outside the lock; ``stop`` is asked before each
        record. Never evicts a pinned record: it stops where the RAM tier cannot hold the next record
        otherwise, or at a part that fails its checks (a later restore's miss). Returns the parts
        brought up. Raises nothing."""
        depth = self.longest_restorable(chain)
        if self._disk is None or depth == 0:
            return 0
        with self._lock:
            self._clock += 1  # what is brought up counts as used now: its next request is due
        moved = 0
        for i in range(depth - 1, -1, -1):
            if stop():
                break
            parts = self._promote(chain[i], with_state=i == depth - 1)
            if parts is None:
                break
            moved += parts
        return moved

    def touch(self, chain: list[bytes]) -> None:
        """Count the records of ``chain`` the store holds as used now (as a restore of it would), in
        both tiers: e.g. a live sequence of the chain, continued without restoring it, is let go."""
        with self._lock:
            self._clock += 1
            for anchor in chain:
                self._ram.touch(anchor, self._clock)
                if self._disk is not None:
                    self._disk.index.touch(anchor, self._clock)

    def longest_in_ram(self, chain: list[bytes]) -> int:
        """How many leading anchors of ``chain`` the RAM tier alone restores (as ``longest_restorable``,
        reading nothing from disk or the writer's queue). Changes nothing."""
        with self._lock:
            best, prev = 0, None
            for i, anchor in enumerate(chain):
                held = self._ram.get(anchor)
                if held is None or not follows(held.meta, prev):
                    break
                prev = held.meta
                best = i + 1 if held.state is not None else best
            return best

    def _promote(self, anchor: bytes, with_state: bool) -> int | None:
        """One record's missing parts into the RAM tier: how many, or None where promoting stops."""
        with self._lock:
            loc = self._locate(anchor)
            if loc is None or self._disk is None:
                return None
            held = self._ram.get(anchor)
            held = held if held is not None and held.meta == loc.meta else None
            need = [] if held is not None else [KV_PART]
            if with_state and (held is None or held.state is None):
                need.append(STATE_PART)
            if not need:
                return 0
            self._disk.pin([anchor])
        try:
            read = self._read_parts(loc, need)
        finally:
            with self._lock:
                if self._disk is not None:
                    self._disk.unpin([anchor])
        if read is None:
            return None
        with self._lock:
            now = self._locate(anchor)
            if now is None or now.meta != loc.meta:
                return None
            kv = read.get(KV_PART, held.kv if held else None)
            state = read.get(STATE_PART, held.state if held and with_state else None)
            if kv is None or not self._ram.put(loc.meta, kv, state, self._clock, break_pins=False):
                return None
            if self.on_access is not None:
                queued = {KV_PART: loc.kv, STATE_PART: loc.state}
                for part, packed in read.items():
                    source = "disk" if queued[part] is None else "queue"
                    self.on_access(Access("promote", anchor, part, packed.nbytes, source))
            return len(read)

    def _read_parts(self, loc: Located, parts: list[str]) -> dict[str, Packed] | None:
        """Packed copies of ``loc``'s ``parts``: the writer queue's where it holds them, else read and
        checked from disk; None when one cannot be read (corrupt, gone, or replaced meanwhile)."""
        queued = {KV_PART: loc.kv, STATE_PART: loc.state}
        out = {p: packed for p in parts if (packed := queued[p]) is not None}
        missing = [p for p in parts if p not in out]
        if not missing:
            return out
        disk = self._disk
        if disk is None:
            return None
        try:
            with disk.read_txn() as txn:
                for part in missing:
                    header, views = disk.read(txn, loc.meta.anchor, part)
                    if header.meta != loc.meta:
                        return None
                    out[part] = pack(views)
        except (CorruptRecord, MissingRecord, lmdb.Error) as exc:
            log.info("checkpoint store: not promoting %s: %s", loc.meta.anchor.hex(), exc)
            return None
        return out

    # -- matching --------------------------------------------------------------------------

    def has_kv(self, anchor: bytes) -> bool:
        with self._lock:
            return self._locate(anchor) is not None

    def longest_restorable(self, chain: list[bytes]) -> int:
        """How many leading anchors of ``chain`` can be restored (0: none).

        The last of them holds a state; every record before it holds its KV delta, starts
        where its predecessor ends, and names it as parent; the first starts at 0. Records another
        process wrote to a shared disk folder count too (``DiskTier.adopt``).
        """
        self._adopt(chain)
        with self._lock:
            best, prev = 0, None
            for i, anchor in enumerate(chain):
                loc = self._locate(anchor)
                if loc is None or not follows(loc.meta, prev):
                    break
                prev = loc.meta
                best = i + 1 if loc.has_state else best
            return best

    def state_tier(self, anchor: bytes) -> str | None:
        """Where ``anchor``'s state part is read from on a restore: ``"ram"`` (in memory, RAM tier or
        the disk writer's queue), ``"disk"``, or None (no record, or a record without a state).
        Changes nothing."""
        with self._lock:
            loc = self._locate(anchor)
        if loc is None or not loc.has_state:
            return None
        return "ram" if loc.state is not None else "disk"

    def load_chain(self, chain: list[bytes]) -> Snapshot | None:
        """KV of the whole chain concatenated and the last record's state, or None (a miss).

        The result owns fresh memory (one copy of each byte restored).
        """
        snapshots = self._load(chain, joined=True)
        return None if snapshots is None else snapshots[0]

    def load_records(self, chain: list[bytes]) -> list[Snapshot] | None:
        """The chain's records as consecutive snapshots (for ``Engine.restore(list)``), or None.

        KV deltas and the last record's state, not concatenated: RAM-held parts are
        read-only views into the store (no copy; never write through them), disk parts are
        copied once out of the map. The same checks and misses as ``load_chain``.
        """
        return self._load(chain, joined=False)

    def load_longest(self, chain: list[bytes]) -> tuple[int, Snapshot | None]:
        """``longest_restorable`` then ``load_chain``, retrying shorter after a miss."""
        for _ in range(len(chain) + 1):
            n = self.longest_restorable(chain)
            if n == 0:
                return 0, None
            snapshot = self.load_chain(chain[:n])
            if snapshot is not None:
                return n, snapshot
        return 0, None

    def stats(self) -> StoreStats:
        with self._lock:
            c, ram, disk, writer = self._counters, self._ram, self._disk, self._writer
            return StoreStats(
                puts=c.puts,
                restores=c.restores,
                restore_misses=c.restore_misses,
                bytes_restored=c.bytes_restored,
                ram_hits=c.ram_hits,
                ram_misses=c.ram_misses,
                disk_hits=c.disk_hits,
                disk_misses=c.disk_misses,
                ram_bytes=ram.used_bytes,
                ram_records=len(ram.records),
                ram_evictions=ram.evictions,
                ram_states_dropped=ram.states_dropped,
                ram_rejected=ram.rejected,
                disk_bytes=disk.index.used_bytes if disk else 0,
                disk_records=len(disk.index) if disk else 0,
                disk_evictions=disk.evictions if disk else 0,
                disk_states_dropped=disk.states_dropped if disk else 0,
                corrupt_records=c.corrupt + (disk.corrupt if disk else 0),
                write_errors=self.write_errors.count,
                read_errors=self.read_errors.count,
                write_queue_depth=writer.depth if writer else 0,
                write_queue_bytes=writer.queued_bytes if writer else 0,
            )

    # -- internals ---------------------------------------------------------------------------

    def _adopt(self, chain: list[bytes]) -> None:
        disk = self._disk
        if disk is None:
            return
        try:
            disk.adopt(chain, self._clock)
        except lmdb.Error as exc:
            self.read_errors.record(exc, "looking up records another process wrote")

    def _ram_covers(self, meta: RecordMeta, with_state: bool) -> bool:
        ram = self._ram.get(meta.anchor)
        return ram is not None and ram.meta == meta and (ram.state is not None or not with_state)

    def _disk_covers(self, meta: RecordMeta, with_state: bool) -> bool:
        """True without a disk tier, or if the disk holds (or is about to) this record in full."""
        if self._disk is None:
            return True
        pending = self._pending.get(meta.anchor)
        if pending is not None and pending.meta == meta and (pending.state is not None or not with_state):
            return True
        index = self._disk.index
        return (
            pending is None
            and index.metas.get(meta.anchor) == meta
            and (index.has_state(meta.anchor) or not with_state)
        )

    def _queue_put(self, meta: RecordMeta, kv: Packed, state: Packed | None) -> PutOp:
        """Replace any queued put of this anchor (keeping its state if it is the same record)."""
        queued = self._pending.get(meta.anchor)
        if state is None and queued is not None and queued.meta == meta:
            state = queued.state
        op = PutOp(meta, kv, state, self._clock)
        self._pending[meta.anchor] = op
        return op

    def _locate(self, anchor: bytes) -> Located | None:
        """Where ``anchor``'s parts are, preferring RAM, then the write queue, then disk."""
        ram, pending = self._ram.get(anchor), self._pending.get(anchor)
        disk_meta = self._disk.index.metas.get(anchor) if self._disk else None
        metas = [r.meta for r in (ram, pending) if r is not None] + [disk_meta]
        meta = next((m for m in metas if m is not None), None)
        if meta is None:
            return None
        held = [r for r in (ram, pending) if r is not None and r.meta == meta]
        kv = held[0].kv if held else None
        state = next((r.state for r in held if r.state is not None), None)
        on_disk = disk_meta == meta
        if kv is None and not on_disk:
            return None
        state_on_disk = on_disk and self._disk is not None and self._disk.index.has_state(anchor)
        return Located(meta, kv, state, state_on_disk)

    def _plan(self, chain: list[bytes]) -> list[Located] | None:
        with self._lock:
            self._clock += 1
            self._counters.restores += 1
            plan: list[Located] = []
            for anchor in chain:
                loc = self._locate(anchor)
                prev = plan[-1].meta if plan else None
                if loc is None or not follows(loc.meta, prev):
                    self._broken(anchor, loc, prev)
                    return None
                plan.append(loc)
            if not plan or not plan[-1].has_state:
                self._counters.restore_misses += 1
                return None
            for loc in plan:  # the state read is the last record's
                self._ram.touch(loc.meta.anchor, self._clock, with_state=loc is plan[-1])
                if self._disk is not None:
                    self._disk.index.touch(loc.meta.anchor, self._clock, with_state=loc is plan[-1])
            if self._disk is not None:
                self._disk.pin(chain)
            self._tell_gets(plan)
            return plan

    def _tell_put(self, meta: RecordMeta, kv: Packed, state: Packed | None, kind: str) -> None:
        if self.on_access is not None:
            place = (meta.parent, meta.start, meta.end, kind)
            self.on_access(Access("put", meta.anchor, KV_PART, kv.nbytes, "", *place))
            if state is not None:
                self.on_access(Access("put", meta.anchor, STATE_PART, state.nbytes, "", *place))

    def _tell_gets(self, plan: list[Located]) -> None:
        """Each part a restore reads and where from (caller holds the lock)."""
        if self.on_access is None:
            return
        for i, loc in enumerate(plan):
            ram = self._ram.get(loc.meta.anchor)
            parts = [(KV_PART, loc.kv, ram.kv if ram else None)]
            if i == len(plan) - 1:
                parts.append((STATE_PART, loc.state, ram.state if ram else None))
            for part, held, in_ram in parts:
                source = "disk" if held is None else "ram" if held is in_ram else "queue"
                self.on_access(Access("get", loc.meta.anchor, part, held.nbytes if held else 0, source))

    def _unpin(self, plan: list[Located]) -> None:
        if self._disk is not None:
            with self._lock:
                self._disk.unpin([loc.meta.anchor for loc in plan])

    def _broken(self, anchor: bytes, loc: Located | None, prev: RecordMeta | None) -> None:
        """A chain that cannot be restored as asked; a record that contradicts its own parent goes."""
        self._counters.restore_misses += 1
        if loc is None:
            self._counters.disk_misses += 1
        elif prev is not None and loc.meta.parent == prev.anchor:
            log.warning(
                "checkpoint store: record %s starts at %d but its parent ends at %d; deleting it",
                anchor.hex(),
                loc.meta.start,
                prev.end,
            )
            self._forget(anchor, KV_PART)
        else:
            log.info("checkpoint store: record %s does not follow the chain asked for", anchor.hex())

    def _load(self, chain: list[bytes], joined: bool) -> list[Snapshot] | None:
        plan = self._plan(chain)
        if plan is None:
            return None
        try:
            snapshots = self._materialize(plan, joined)
        except PartMiss as miss:
            self._miss(miss)
            return None
        finally:
            self._unpin(plan)
        with self._lock:
            self._counters.bytes_restored += sum(s.nbytes for s in snapshots)
        return snapshots

    def _materialize(self, plan: list[Located], joined: bool) -> list[Snapshot]:
        on_disk = self._disk is not None and any(loc.kv is None or loc.state is None for loc in plan)
        try:
            txn = self._disk.read_txn() if on_disk and self._disk is not None else None
        except lmdb.Error as exc:
            self.read_errors.record(exc)
            raise PartMiss(plan[0].meta.anchor, KV_PART, str(exc), "stale") from exc
        try:
            last = len(plan) - 1
            snapshots = [
                self._snapshot(loc, txn, i == last, copy_disk=not joined) for i, loc in enumerate(plan)
            ]
            bad = first_mismatch(snapshots)
            if bad is not None:
                raise PartMiss(
                    plan[bad].meta.anchor, KV_PART, "KV tensors disagree with the chain", "corrupt"
                )
            return [join(snapshots)] if joined else snapshots
        finally:
            if txn is not None:
                txn.abort()

    def _snapshot(
        self, loc: Located, txn: lmdb.Transaction | None, with_state: bool, copy_disk: bool
    ) -> Snapshot:
        """One record's tensors: views into RAM buffers or the LMDB map (copied out if ``copy_disk``)."""
        tensors = self._part(loc, KV_PART, loc.kv, txn, copy_disk)
        if with_state:
            tensors.update(self._part(loc, STATE_PART, loc.state, txn, copy_disk))
        return Snapshot(loc.meta.start, loc.meta.end, tensors)

    def _part(
        self, loc: Located, part: str, held: Packed | None, txn: lmdb.Transaction | None, copy_disk: bool
    ) -> dict[str, torch.Tensor]:
        anchor = loc.meta.anchor
        if held is not None:
            self._count(ram_hits=1)
            return held.views()
        self._count(ram_misses=1)
        if txn is None or self._disk is None:
            raise PartMiss(anchor, part, "not held", "stale")
        try:
            header, views = self._disk.read(txn, anchor, part)
        except CorruptRecord as e:
            raise PartMiss(anchor, part, str(e), "corrupt") from e
        except MissingRecord as e:
            raise PartMiss(anchor, part, str(e), "missing") from e
        except lmdb.Error as e:  # a damaged page or a failed disk: unreadable, so as good as missing
            self.read_errors.record(e, f"{part} part of {anchor.hex()}")
            raise PartMiss(anchor, part, str(e), "missing") from e
        if header.meta != loc.meta:
            raise PartMiss(anchor, part, "replaced while reading", "stale")
        self._count(disk_hits=1)
        return {n: fresh_copy(t) for n, t in views.items()} if copy_disk else views

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self._counters, name, getattr(self._counters, name) + delta)

    def _miss(self, miss: PartMiss) -> None:
        log.info("checkpoint store: miss on the %s part of %s: %s", miss.part, miss.anchor.hex(), miss.reason)
        with self._lock:
            self._counters.restore_misses += 1
            self._counters.disk_misses += 1
            if miss.kind == "corrupt":
                self._counters.corrupt += 1
                log.warning(
                    "checkpoint store: %s part of %s is corrupt (%s); deleting it",
                    miss.part,
                    miss.anchor.hex(),
                    miss.reason,
                )
                self._forget(miss.anchor, miss.part)
            elif miss.kind == "missing" and self._disk is not None:
                self._disk.forget(miss.anchor, miss.part)  # the index was stale; nothing to delete

    def _forget(self, anchor: bytes, part: str) -> None:
        """Delete a part (KV: the whole record) from every tier; the disk copy via the writer."""
        if part == KV_PART:
            self._ram.remove(anchor)
            self._pending.pop(anchor, None)
        if self._disk is not None and self._writer is not None:
            self._disk.forget(anchor, part)
            if part == KV_PART:
                self._disk.deleting.add(anchor)
            self._writer.submit(DeleteOp(anchor, None if part == KV_PART else part, "corrupt"))

    def _apply(self, ops: list[Op]) -> None:
        """Writer thread: apply a batch to disk, then retire its puts from the queue map."""
        assert self._disk is not None
        try:
            self._disk.apply(ops)
        except Exception as exc:  # noqa: BLE001 (a bug: apply handles the disk's errors; still never a failed answer)
            self.write_errors.record(exc, f"{len(ops)} operations", trace=True)
        finally:
            with self._lock:
                for op in ops:
                    if isinstance(op, PutOp) and self._pending.get(op.meta.anchor) is op:
                        del self._pending[op.meta.anchor]


def _check_put(meta: RecordMeta, snapshot: Snapshot) -> None:
    if not 0 < len(meta.anchor) <= MAX_ANCHOR_BYTES:
        raise ValueError(f"an anchor has 1 to {MAX_ANCHOR_BYTES} bytes")
    if not 0 <= meta.start <= meta.end:
        raise ValueError(f"bad positions [{meta.start}, {meta.end})")
    for name, t in snapshot.tensors.items():
        if name.startswith("kv.") and (t.dim() == 0 or t.shape[0] != meta.end - meta.start):
            raise ValueError(f"{name} has {t.shape[0] if t.dim() else 0} rows for [{meta.start}, {meta.end})")
