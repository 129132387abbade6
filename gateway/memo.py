"""The token memo: the exact ids the engine generated for an assistant message.

When a client sends a generated message back, re-rendering it from text can tokenize
differently from what the model produced (BPE drift, reformatted tool calls, thinking the
client never saw), which breaks every anchor after it. The memo remembers the generated
ids (everything after the generation prompt, through `<|im_end|>`) under two keys:

- an opaque **handle** the gateway issues before the generation streams: the output side
  puts it into Anthropic's thinking `signature` or the Responses reasoning item's
  `encrypted_content`; clients echo it back verbatim (Claude Code with
  `display: "omitted"` echoes the signature with empty thinking text);
- the **content hash** of the message: reasoning, text and tool calls (name + arguments
  as canonical JSON, or raw input for custom tools), whitespace-trimmed; tool-call ids
  are not part of it. This serves clients that echo content but no handle (OpenCode).

A handle hit is used only if the message's text and tool calls still match what was
generated, and its reasoning either matches or was omitted by the client (empty).

Interaction with Qwen's reasoning rule: the memo'd ids include the reasoning, so the
renderer uses them only for assistant messages whose reasoning the template keeps (after
the last real user query, or all with `preserve_thinking`). Once a later user query
makes the rule drop that reasoning, the message is rendered from its text (the form the
template produces without reasoning), never from the memo.

Memo only generations that ended with the end-of-turn id (`<|im_end|>`); a truncated
generation is not a message the model would continue from.

With a disk cache the memo is also kept on disk (`MemoFile`, an LMDB folder beside the
checkpoints, one per model and template), written before the answer's end is sent, so a
restart, even after `kill -9`, renders surviving sessions with the ids their checkpoints hold.
The synced write runs on a thread of its own (`TokenMemo.written`): the answer's end waits for
it, the engine worker, and so every other session's next step, does not.
The disk copy never fails an answer: a folder that cannot be used or a damaged file (moved
aside, see `checkpoint_store.environment`) leaves a memo in memory only, an entry that fails
its checksum is dropped (a miss), and a failed write (a full disk) is counted with the
checkpoint store's write errors and logged once.

Processes serving one model may share the file (replicas on one host, one disk cache): a lookup
that misses in memory asks the file for the entries the others wrote since it last looked
(`MemoFile.news`), so a session that moves to another replica keeps its generated ids.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import lmdb
import msgspec
import xxhash

from checkpoint_store.environment import open_env
from checkpoint_store.error_log import ErrorLog
from gateway.conversation import Message, ToolCall

log = logging.getLogger("gateway.memo")
HANDLE_PREFIX = "ft1."


def _call_key(call: ToolCall) -> list:
    if call.input is not None:
        return [call.name, "input", call.input]
    args = json.dumps(call.arguments or {}, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return [call.name, "args", args]


def _digest(value: list) -> str:
    return xxhash.xxh3_128_hexdigest(json.dumps(value, ensure_ascii=False).encode())


def body_hash(message: Message) -> str:
    """Hash of the message's text and tool calls (not its reasoning)."""
    return _digest([message.content.strip(), [_call_key(c) for c in message.tool_calls]])


def content_hash(message: Message) -> str:
    """Hash of the message's canonical content: reasoning, text, tool calls."""
    return _digest([message.reasoning.strip(), body_hash(message)])


class MemoEntry(msgspec.Struct, frozen=True):
    token_ids: tuple[int, ...]
    content_hash: str
    body_hash: str


class StoredEntry(msgspec.Struct, array_like=True, frozen=True):
    """An entry as the memo file holds it; ``digest`` (absent in files of earlier versions)
    checks the rest."""

    seq: int
    entry: MemoEntry
    digest: int | None = None


def _digest_of(seq: int, entry: MemoEntry) -> int:
    return xxhash.xxh3_64_intdigest(msgspec.msgpack.encode((seq, entry)))


class MemoFile:
    """Memo entries on disk: handle -> (sequence number, entry), each write one synced LMDB
    transaction; `entries()` yields them oldest first. Without a usable folder it holds
    nothing (logged once when opened); failed writes go to `errors`."""

    def __init__(self, path: str | Path, map_bytes: int = 1 << 30, errors: ErrorLog | None = None):
        self.errors = errors or ErrorLog(log, "token memo write", "the ids stay in memory only")
        self.env = open_env(path, map_bytes, "token memo", "generated token ids are kept in memory only",
                            sync=True, metasync=True)
        self._looked_at = self._last_txn()
        self._seq = max((stored.seq for _, stored in self._rows()), default=-1) + 1

    def _rows(self, skip: frozenset[str] = frozenset()) -> list[tuple[str, StoredEntry]]:
        """Every sound entry but those of `skip`; damaged ones are dropped from the file with one
        warning."""
        if self.env is None:
            return []
        rows, damaged = [], []
        with self.env.begin() as txn:
            for key in txn.cursor().iternext(values=False):
                try:
                    handle = key.decode()
                    if handle in skip:
                        continue
                    stored = msgspec.msgpack.decode(txn.get(key), type=StoredEntry)
                    if stored.digest not in (None, _digest_of(stored.seq, stored.entry)):
                        raise ValueError("checksum mismatch")
                    rows.append((handle, stored))
                except (msgspec.DecodeError, ValueError):  # UnicodeDecodeError is a ValueError
                    damaged.append(key)
        if damaged:
            log.warning("token memo: %d damaged entries dropped (their messages are re-tokenized)", len(damaged))
            self._delete(damaged)
        return rows

    def entries(self) -> Iterator[tuple[str, MemoEntry]]:
        for handle, stored in sorted(self._rows(), key=lambda row: row[1].seq):
            yield handle, stored.entry

    def changed(self) -> bool:
        """Whether another process sharing the file may have written since `news` last looked (a
        transaction committed that was not this process's own)."""
        return self._last_txn() != self._looked_at

    def news(self, known: frozenset[str]) -> list[tuple[str, MemoEntry]]:
        """The entries not in `known` (written by another process sharing the file), oldest first;
        [] at once if nothing changed since the last call."""
        last = self._last_txn()
        if last == self._looked_at:
            return []
        self._looked_at = last
        return [(handle, stored.entry) for handle, stored in sorted(self._rows(known), key=lambda row: row[1].seq)]

    def _last_txn(self) -> int:
        return -1 if self.env is None else self.env.info()["last_txnid"]

    def _own(self, txn_id: int) -> None:
        """This process committed transaction `txn_id`: with nothing else committed since `news`
        looked, there is still nothing new to read (a single server never scans its own writes)."""
        if self._looked_at == txn_id - 1:
            self._looked_at = txn_id

    def write(self, put: tuple[str, MemoEntry] | None, drop: Sequence[str] = ()) -> None:
        if self.env is None:
            return
        try:
            with self.env.begin(write=True) as txn:
                for handle in drop:
                    txn.delete(handle.encode())
                if put is not None:
                    stored = StoredEntry(self._seq, put[1], _digest_of(self._seq, put[1]))
                    txn.put(put[0].encode(), msgspec.msgpack.encode(stored))
                    self._seq += 1
                mine = txn.id()
            self._own(mine)
        except lmdb.Error as exc:
            self.errors.record(exc, "token memo")

    def _delete(self, keys: list[bytes]) -> None:
        try:
            with self.env.begin(write=True) as txn:
                for key in keys:
                    txn.delete(key)
                mine = txn.id()
            self._own(mine)
        except lmdb.Error as exc:
            self.errors.record(exc, "token memo")

    def close(self) -> None:
        if self.env is not None:
            self.env.close()


class TokenMemo:
    """A bounded LRU of generated ids, by handle and by content hash. Thread-safe. With a
    `file`, entries are loaded from it and every change is written to it."""

    def __init__(self, max_entries: int = 4096, max_tokens: int = 16 << 20, file: MemoFile | None = None):
        self.max_entries, self.max_tokens = max_entries, max_tokens
        self._by_handle: OrderedDict[str, MemoEntry] = OrderedDict()
        self._by_content: dict[str, str] = {}
        self._tokens = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0
        self.file = file
        self._writer: ThreadPoolExecutor | None = None  # one thread: the file's writes in the order remembered
        if file is not None:
            dropped = [h for handle, entry in file.entries() for h in self._insert(handle, entry)]
            if dropped:
                file.write(None, dropped)
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="memo-writer")

    def close(self) -> None:
        if self._writer is not None:
            self._writer.shutdown(wait=True)  # what was remembered reaches the file first
        if self.file is not None:
            self.file.close()

    def written(self) -> Future | None:
        """Done once every entry remembered so far is on disk (its synced write may take
        milliseconds to tens of them); None without a file."""
        return None if self._writer is None else self._writer.submit(lambda: None)

    def issue_handle(self) -> str:
        """A fresh opaque handle, to send to the client before the message is complete."""
        return HANDLE_PREFIX + secrets.token_hex(16)

    def remember(self, message: Message, token_ids: Sequence[int], handle: str | None = None) -> str:
        """Remember `token_ids` as the generation of `message`; returns its handle
        (`handle` if given, else a new one). Lookups find it at once; it is on disk once
        `written()` says so."""
        handle = handle or self.issue_handle()
        entry = MemoEntry(tuple(token_ids), content_hash(message), body_hash(message))
        with self._lock:
            dropped = self._insert(handle, entry)
        if self._writer is not None and self.file is not None:
            self._writer.submit(self.file.write, (handle, entry), dropped)
        return handle

    def _insert(self, handle: str, entry: MemoEntry) -> list[str]:
        """Add an entry (the lock held, or during construction); returns the handles evicted."""
        self._drop(handle)
        self._by_handle[handle] = entry
        self._by_content[entry.content_hash] = handle
        self._tokens += len(entry.token_ids)
        dropped = []
        while self._by_handle and (len(self._by_handle) > self.max_entries or self._tokens > self.max_tokens):
            dropped.append(next(iter(self._by_handle)))
            self._drop(dropped[-1])
        return dropped

    def lookup(self, message: Message) -> list[int] | None:
        """The generated ids of `message`, if known (see the module doc for the rules); a miss in
        memory asks the file for what other processes sharing it wrote since."""
        with self._lock:
            entry = self._find(message)
            changed = entry is None and self.file is not None and self.file.changed()
            known = frozenset(self._by_handle) if changed else None  # a copy only when the file moved on
        if known is not None and (news := self.file.news(known)):
            with self._lock:
                dropped = [h for handle, new in news for h in self._insert(handle, new)]
                entry = self._find(message)
            if dropped and self._writer is not None:
                self._writer.submit(self.file.write, None, dropped)
        with self._lock:
            self.hits += entry is not None
            self.misses += entry is None
        return None if entry is None else list(entry.token_ids)

    def __len__(self) -> int:
        return len(self._by_handle)

    def _find(self, message: Message) -> MemoEntry | None:
        handle = message.memo_handle
        entry = self._by_handle.get(handle) if handle else None
        if entry is not None and entry.body_hash == body_hash(message):
            if not message.reasoning.strip() or entry.content_hash == content_hash(message):
                self._by_handle.move_to_end(handle)  # type: ignore[arg-type]
                return entry
        handle = self._by_content.get(content_hash(message))
        if handle is None:
            return None
        self._by_handle.move_to_end(handle)
        return self._by_handle[handle]

    def _drop(self, handle: str) -> None:
        entry = self._by_handle.pop(handle, None)
        if entry is None:
            return
        self._tokens -= len(entry.token_ids)
        if self._by_content.get(entry.content_hash) == handle:
            del self._by_content[entry.content_hash]
