"""The LMDB tier: record parts as frames in one LMDB environment with a size cap.

Keys are ``anchor + b"k"`` (KV part) and ``anchor + b"s"`` (state part). Writes come only
from the writer thread (``apply``), each batch in one transaction that LMDB fsyncs on
commit (``sync=True``): a committed record survives kill -9. Reads run in any thread,
each in its own read transaction over the memory map (``buffers=True``: no copy until
the caller copies into its destination).

The cap is LMDB's map size. Before a batch is written, records are evicted (``eviction``)
until the batch fits under ``capacity``; if LMDB still reports ``MapFullError`` (page
overhead, fragmentation of free pages), one more victim goes and the write is retried;
a part that cannot fit even in an empty map is dropped with a log line. Never a crash:
any other failed write (a full disk, a file-size limit, an I/O error) drops what it was
writing and is counted in ``write_errors`` (logged once per cause, see ``error_log``).

The environment is opened by ``environment.open_env`` (which checks it before mapping it).
Then every frame header is checked (not the payloads: those are checked on every read);
frames with a bad header, a wrong fingerprint, a wrong length, or a state part without its
KV part are deleted and logged.

Processes of one model may share the folder (replicas on one host). Each keeps its own index:
what it found when it opened the folder, what it wrote since, and what another process wrote
since, looked up by anchor when a chain asks for it (``adopt``). Each evicts from its own index,
so a record may go while another process still indexes it: that read is a miss
(``MissingRecord``), never a wrong restore. A map full of records this process does not index
(another filled the folder) has them indexed at once (``adopt_all``), as older than any of its
own, so its eviction makes room for its writes there too.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from pathlib import Path
from typing import NamedTuple

import lmdb
import torch

from .environment import open_env
from .error_log import ErrorLog
from .index import TierIndex
from .record import (
    KV_PART,
    STATE_PART,
    CorruptRecord,
    RecordHeader,
    RecordMeta,
    decode_frame,
    decode_header,
    encode_frame,
)
from .writer import DeleteOp, Op, PutOp

log = logging.getLogger("checkpoint_store")

SUFFIX = {KV_PART: b"k", STATE_PART: b"s"}
PART_OF = {v[0]: k for k, v in SUFFIX.items()}
CAPACITY_FRACTION = 0.75  # headroom: LMDB reuses freed pages only two transactions later
RESERVE_BYTES = 1 << 20  # B-tree, freelist and meta pages
MIN_MAP_BYTES = 4 << 20
MAX_ANCHOR_BYTES = 500


class Write(NamedTuple):
    key: bytes
    frame: bytes | None  # None: delete the key
    clock: int


class MissingRecord(Exception):
    """The index named a part that the database no longer holds."""


def key(anchor: bytes, part: str) -> bytes:
    return anchor + SUFFIX[part]


ENV_OPTIONS = {"sync": True, "metasync": True, "max_readers": 256}
RAM_ONLY = "checkpoints are kept in RAM only"


class DiskTier:
    """Record parts in the LMDB environment ``env`` (opened with ``ENV_OPTIONS``, ``map_bytes``);
    ``lock`` guards ``index`` (shared with the store); failed writes go to ``write_errors``."""

    def __init__(
        self,
        env: lmdb.Environment,
        map_bytes: int,
        fingerprint: str,
        lock: threading.RLock,
        write_errors: ErrorLog,
    ) -> None:
        self.env = env
        self.fingerprint = fingerprint
        self.page_bytes = self.env.stat()["psize"]
        self.capacity = int(map_bytes * CAPACITY_FRACTION) - RESERVE_BYTES
        self.lock = lock
        self.index = TierIndex()
        self.pinned: Counter[bytes] = Counter()
        self.deleting: set[bytes] = set()  # records out of the index whose delete is not committed yet
        self.evictions = 0
        self.states_dropped = 0
        self.write_errors = write_errors
        self.corrupt = 0
        self._scan()

    @classmethod
    def open(
        cls,
        folder: str | Path,
        map_bytes: int,
        fingerprint: str,
        lock: threading.RLock,
        write_errors: ErrorLog,
    ) -> DiskTier | None:
        """The tier in ``folder``, or None (logged) when the folder cannot be used."""
        if map_bytes < MIN_MAP_BYTES:
            raise ValueError(f"disk_bytes must be at least {MIN_MAP_BYTES}")
        env = open_env(folder, map_bytes, "checkpoint store", RAM_ONLY, **ENV_OPTIONS)
        if env is None:
            return None
        try:
            return cls(env, map_bytes, fingerprint, lock, write_errors)
        except lmdb.Error as exc:  # damage the check before opening did not see
            env.close()
            log.warning("checkpoint store: cannot read %s (%s); %s", folder, exc, RAM_ONLY)
            return None

    def close(self) -> None:
        self.env.close()

    def read_txn(self) -> lmdb.Transaction:
        return self.env.begin(buffers=True)

    def read(
        self, txn: lmdb.Transaction, anchor: bytes, part: str
    ) -> tuple[RecordHeader, dict[str, torch.Tensor]]:
        """Check and view one part; raises ``MissingRecord`` or ``CorruptRecord``."""
        value = txn.get(key(anchor, part))
        if value is None:
            raise MissingRecord(f"{anchor.hex()} {part} is gone")
        return decode_frame(value, anchor, part, self.fingerprint)

    def adopt(self, chain: list[bytes], clock: int) -> None:
        """Index the records of ``chain`` that another process sharing the folder wrote since this
        one opened it: the anchors not indexed here, in order, up to the first one without a KV
        part on disk. A part whose header fails its check is left to the read or the next open."""
        with self.lock:
            unknown = [a for a in chain if a not in self.index and a not in self.deleting]
        if not unknown:
            return
        found: list[list[tuple[RecordHeader, int]]] = []
        with self.env.begin(buffers=True) as txn:
            for anchor in unknown:
                kv, state = (self._peek(txn, anchor, part) for part in (KV_PART, STATE_PART))
                if kv is None:
                    break
                found.append([kv] if state is None else [kv, state])
        with self.lock:
            for parts in found:
                if parts[0][0].anchor not in self.index and parts[0][0].anchor not in self.deleting:
                    for header, nbytes in parts:
                        self._index_part(header, nbytes, clock)

    def _peek(self, txn: lmdb.Transaction, anchor: bytes, part: str) -> tuple[RecordHeader, int] | None:
        value = txn.get(key(anchor, part))
        return None if value is None else self._header(value, anchor, part)

    def _header(self, value, anchor: bytes, part: str) -> tuple[RecordHeader, int] | None:
        """A stored part's header and footprint; None where the header fails its check."""
        try:
            return decode_header(value, anchor, part, self.fingerprint), self.footprint(len(value))
        except CorruptRecord:
            return None

    def footprint(self, nbytes: int) -> int:
        """Bytes a value of ``nbytes`` occupies in the map (overflow pages)."""
        return -(-(nbytes + 16) // self.page_bytes) * self.page_bytes

    # -- writer thread only -------------------------------------------------------------

    def apply(self, ops: list[Op]) -> None:
        """Apply a batch in one transaction; if the map is full, op by op with eviction."""
        planned: dict[bytes, tuple[RecordMeta | None, bool]] = {}
        writes = [w for op in ops for w in self._writes(op, planned)]
        if not writes:
            return
        keep = tuple({op.meta.anchor for op in ops if isinstance(op, PutOp)})
        self._evict_until(sum(self.footprint(len(w.frame)) for w in writes if w.frame), keep)
        if self._commit(writes, keep, retry=len(ops) == 1) or len(ops) == 1:
            return
        for op in ops:
            op_keep = (op.meta.anchor,) if isinstance(op, PutOp) else ()
            self._commit(self._writes(op, {}), op_keep, retry=True)

    def _writes(self, op: Op, planned: dict[bytes, tuple[RecordMeta | None, bool]]) -> list[Write]:
        """What one operation writes (a frame) or deletes (None), skipping what is on disk.

        ``planned`` holds (meta, has_state) of anchors that earlier operations of the same
        batch write, so a batch reads as if applied one operation at a time.
        """
        if isinstance(op, DeleteOp):
            parts = [op.part] if op.part else [KV_PART, STATE_PART]
            meta = None if op.part in (None, KV_PART) else self._known(op.anchor, planned)[0]
            planned[op.anchor] = (meta, False)
            return [Write(key(op.anchor, p), None, 0) for p in parts]
        anchor = op.meta.anchor
        meta, has_state = self._known(anchor, planned)
        same = meta == op.meta
        writes = []
        if not same:
            writes.append(Write(key(anchor, KV_PART), self._frame(op, KV_PART), op.clock))
        if op.state is not None and not (same and has_state):
            writes.append(Write(key(anchor, STATE_PART), self._frame(op, STATE_PART), op.clock))
        elif op.state is None and not same:
            writes.append(Write(key(anchor, STATE_PART), None, op.clock))
        planned[anchor] = (op.meta, op.state is not None or (same and has_state))
        return writes

    def _known(self, anchor: bytes, planned: dict) -> tuple[RecordMeta | None, bool]:
        if anchor in planned:
            return planned[anchor]
        with self.lock:
            return self.index.metas.get(anchor), self.index.has_state(anchor)

    def _frame(self, op: PutOp, part: str) -> bytes:
        packed = op.kv if part == KV_PART else op.state
        assert packed is not None
        return encode_frame(op.meta, part, packed, self.fingerprint)

    def _commit(self, writes: list[Write], keep: tuple[bytes, ...], retry: bool) -> bool:
        """One transaction for ``writes``; with ``retry``, evict and retry while the map is full."""
        scanned = False  # the folder scanned for other processes' records (`_make_room`), once a write
        while writes:
            try:
                with self.env.begin(write=True) as txn:
                    for w in writes:
                        txn.put(w.key, w.frame) if w.frame is not None else txn.delete(w.key)
            except lmdb.MapFullError:
                if retry and self._make_room(keep, scan=not scanned):
                    scanned = True
                    continue
                if retry:
                    self.write_errors.record(
                        "parts that do not fit in the map even when it is empty", f"{len(writes)}"
                    )
                return False
            except lmdb.Error as exc:
                self.write_errors.record(exc, f"{len(writes)} parts dropped")
                return False
            self._index_writes(writes)
            return True
        return True

    def _index_writes(self, writes: list[Write]) -> None:
        with self.lock:
            for w in writes:
                anchor, part = w.key[:-1], PART_OF[w.key[-1]]
                if w.frame is None:
                    self.forget(anchor, part)
                    self.deleting.discard(anchor)
                    continue
                header = decode_header(memoryview(w.frame), anchor, part, self.fingerprint)
                self._index_part(header, self.footprint(len(w.frame)), w.clock)

    def _index_part(self, header: RecordHeader, nbytes: int, clock: int) -> None:
        if header.part == KV_PART:
            self.index.add(header.meta, nbytes, 0, clock)
        elif self.index.metas.get(header.anchor) == header.meta:
            self.index.set_state(header.anchor, nbytes, clock)

    def forget(self, anchor: bytes, part: str) -> None:
        """Drop a part from the index (the caller holds ``lock``; the key is deleted elsewhere)."""
        if part == KV_PART:
            self.index.remove(anchor)
        elif anchor in self.index:
            self.index.set_state(anchor, 0)

    def _evict_until(self, incoming: int, keep: tuple[bytes, ...]) -> None:
        while True:
            with self.lock:
                if self.index.used_bytes + incoming <= self.capacity:
                    return
            if not self._evict_one(keep):
                return

    def _make_room(self, keep: tuple[bytes, ...], scan: bool) -> bool:
        """After a full map, one victim out. A map full while this process's index holds less than
        ``capacity`` holds what other processes sharing the folder wrote: with ``scan``, those
        records are indexed first (``adopt_all``), to go before this process's own."""
        with self.lock:
            room = self.index.used_bytes <= self.capacity
        if scan and room:
            self.adopt_all()
        return self._evict_one(keep)

    def _evict_one(self, keep: tuple[bytes, ...]) -> bool:
        """Evict one victim: out of the index first (no new restore plans on it), then deleted."""
        with self.lock:
            victim = self.index.victim(keep + tuple(self.pinned))
            if victim is None:
                return False
            anchor, part = victim
            self.forget(anchor, part)
            self.deleting.add(anchor)
            self.evictions += part == KV_PART
            self.states_dropped += part == STATE_PART
        try:
            with self.env.begin(write=True) as txn:
                txn.delete(key(anchor, part))
        except lmdb.Error as exc:  # the key stays until the next open finds it unindexed... or reused
            self.write_errors.record(exc, f"evicting {anchor.hex()}")
            return False
        finally:
            with self.lock:
                self.deleting.discard(anchor)
        return True

    def adopt_all(self) -> bool:
        """Index every record on disk that this process does not: those other processes sharing the
        folder wrote and this one never read, the oldest first and all older than its own, so they
        are evicted first. Whether any was found. Headers only are read (a bad one is skipped, left
        to the read or the next open)."""
        found: dict[bytes, dict[str, tuple[RecordHeader, int]]] = {}
        with self.env.begin(buffers=True) as txn:
            for raw_key, value in txn.cursor():
                k = bytes(raw_key)
                anchor, part = k[:-1], PART_OF.get(k[-1]) if k else None
                if part is None:
                    continue
                with self.lock:
                    if anchor in self.deleting or (anchor in self.index and (
                            part == KV_PART or self.index.has_state(anchor))):
                        continue
                if (header := self._header(value, anchor, part)) is not None:
                    found.setdefault(anchor, {})[part] = header
        with self.lock:
            found = {a: parts for a, parts in found.items() if KV_PART in parts or a in self.index}
            oldest = min((e.last_used for e in self.index.entries.values()), default=self.index.clock)
            order = oldest_first(found)
            for rank, anchor in enumerate(order):
                clock = oldest - len(order) + rank
                for part in (KV_PART, STATE_PART):
                    if part in found[anchor] and anchor not in self.deleting:
                        self._index_part(*found[anchor][part], clock)
        return bool(found)

    def pin(self, anchors: list[bytes]) -> None:
        """Spare ``anchors`` from eviction while a restore reads them (caller holds ``lock``)."""
        self.pinned.update(anchors)

    def unpin(self, anchors: list[bytes]) -> None:
        self.pinned.subtract(anchors)
        self.pinned = +self.pinned  # drop zero counts

    # -- open ------------------------------------------------------------------------------

    def _scan(self) -> None:
        headers: dict[bytes, dict[str, tuple[RecordHeader, int]]] = {}
        bad: list[tuple[bytes, str]] = []
        with self.env.begin(buffers=True) as txn:
            for raw_key, v in txn.cursor():
                k = bytes(raw_key)
                try:
                    anchor, part = k[:-1], PART_OF.get(k[-1]) if k else None
                    if part is None:
                        raise CorruptRecord("unknown key")
                    header = decode_header(v, anchor, part, self.fingerprint)
                    headers.setdefault(anchor, {})[part] = (header, self.footprint(len(v)))
                except CorruptRecord as e:
                    bad.append((k, str(e)))
        self._build_index(headers, bad)
        self._delete_keys(bad)

    def _build_index(self, headers: dict, bad: list[tuple[bytes, str]]) -> None:
        order = oldest_first(headers)
        for rank, anchor in enumerate(order):
            parts = headers[anchor]
            if KV_PART not in parts:
                bad.append((key(anchor, STATE_PART), "state part without its KV part"))
                continue
            kv_header, kv_bytes = parts[KV_PART]
            self.index.add(kv_header.meta, kv_bytes, 0, rank - len(order))
            if STATE_PART in parts:
                state_header, state_bytes = parts[STATE_PART]
                if state_header.meta != kv_header.meta:
                    bad.append((key(anchor, STATE_PART), "state part disagrees with its KV part"))
                else:
                    self.index.set_state(anchor, state_bytes)

    def _delete_keys(self, bad: list[tuple[bytes, str]]) -> None:
        if not bad:
            return
        for k, why in bad:
            log.warning("checkpoint store: deleting record %s: %s", k.hex(), why)
        try:
            with self.env.begin(write=True) as txn:
                for k, _ in bad:
                    txn.delete(k)
        except lmdb.Error as exc:
            self.write_errors.record(exc, f"deleting {len(bad)} bad records")
        self.corrupt += len(bad)


def oldest_first(headers: dict[bytes, dict[str, tuple[RecordHeader, int]]]) -> list[bytes]:
    """The anchors of ``headers`` (anchor -> part -> (header, footprint)) by their first part's creation."""
    return sorted(headers, key=lambda a: min(h.created for h, _ in headers[a].values()))
