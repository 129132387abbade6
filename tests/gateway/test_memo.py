"""TokenMemo: lookup by handle and by content, safety checks, bounds, a damaged or full file."""

from __future__ import annotations

import logging
import subprocess
import sys

import lmdb
import msgspec

from checkpoint_store.error_log import ErrorLog
from gateway.conversation import Message, ToolCall
from gateway.memo import MemoEntry, MemoFile, TokenMemo, content_hash

CALL = ToolCall(id="c1", name="bash", arguments={"b": 1, "a": [1, 2]})
MSG = Message(role="assistant", reasoning="think", content="text", tool_calls=(CALL,))


def test_lookup_by_handle_with_omitted_reasoning():
    memo = TokenMemo()
    handle = memo.remember(MSG, [1, 2, 3])
    echoed = Message(role="assistant", content="text", tool_calls=(CALL,), memo_handle=handle)
    assert memo.lookup(echoed) == [1, 2, 3]


def test_lookup_by_content_ignores_call_ids_key_order_and_whitespace():
    memo = TokenMemo()
    memo.remember(MSG, [7])
    same = Message(
        role="assistant",
        reasoning=" think\n",
        content="text ",
        tool_calls=(ToolCall(id="other", name="bash", arguments={"a": [1, 2], "b": 1}),),
    )
    assert content_hash(same) == content_hash(MSG)
    assert memo.lookup(same) == [7]


def test_edited_message_misses_even_with_its_handle():
    memo = TokenMemo()
    handle = memo.remember(MSG, [1])
    edited = Message(
        role="assistant", reasoning="think", content="edited", tool_calls=(CALL,), memo_handle=handle
    )
    assert memo.lookup(edited) is None
    other_reasoning = Message(
        role="assistant", reasoning="else", content="text", tool_calls=(CALL,), memo_handle=handle
    )
    assert memo.lookup(other_reasoning) is None
    assert (
        memo.lookup(Message(role="assistant", content="text", tool_calls=(CALL,))) is None
    )  # no handle, no reasoning


def test_handle_issued_before_remembering():
    memo = TokenMemo()
    handle = memo.issue_handle()
    assert memo.lookup(Message(role="assistant", memo_handle=handle)) is None
    assert memo.remember(MSG, [5], handle=handle) == handle
    assert memo.lookup(Message(role="assistant", content="text", tool_calls=(CALL,), memo_handle=handle)) == [
        5
    ]


def test_custom_tool_input_is_part_of_the_content():
    a = Message(role="assistant", tool_calls=(ToolCall(id="x", name="apply_patch", input="A"),))
    b = Message(role="assistant", tool_calls=(ToolCall(id="x", name="apply_patch", input="B"),))
    assert content_hash(a) != content_hash(b)


def test_bounded_by_entries_and_tokens():
    memo = TokenMemo(max_entries=2, max_tokens=10)
    msgs = [Message(role="assistant", content=str(i)) for i in range(3)]
    for m in msgs:
        memo.remember(m, [0, 1, 2])
    assert len(memo) == 2 and memo.lookup(msgs[0]) is None and memo.lookup(msgs[2]) == [0, 1, 2]
    memo.remember(Message(role="assistant", content="big"), list(range(9)))
    assert len(memo) == 1


def test_file_keeps_entries_across_instances_and_follows_evictions(tmp_path):
    messages = [Message(role="assistant", content=f"m{i}") for i in range(4)]
    memo = TokenMemo(max_entries=3, file=MemoFile(tmp_path / "memo"))
    handles = [memo.remember(m, [i, i + 1]) for i, m in enumerate(messages)]  # the first is evicted
    memo.close()
    again = TokenMemo(max_entries=3, file=MemoFile(tmp_path / "memo"))
    assert len(again) == 3
    assert again.lookup(messages[0]) is None
    assert [again.lookup(m) for m in messages[1:]] == [[1, 2], [2, 3], [3, 4]]
    echoed = Message(role="assistant", content="m3", memo_handle=handles[3])
    assert again.lookup(echoed) == [3, 4]
    again.remember(Message(role="assistant", content="m4"), [9])  # evicts m1, oldest on disk too
    again.close()
    smaller = TokenMemo(max_entries=2, file=MemoFile(tmp_path / "memo"))  # a tighter bound on load
    assert len(smaller) == 2 and smaller.lookup(messages[2]) is None
    assert smaller.lookup(messages[3]) == [3, 4]
    smaller.close()
    assert len(list(MemoFile(tmp_path / "memo").entries())) == 2


def test_a_damaged_memo_file_is_moved_aside_and_the_memo_starts_empty(tmp_path, caplog):
    memo = TokenMemo(file=MemoFile(tmp_path / "memo"))
    memo.remember(Message(role="assistant", content="kept?"), [1, 2])
    memo.close()
    (tmp_path / "memo" / "data.mdb").write_bytes(b"\x00" * 8192)
    with caplog.at_level(logging.WARNING):
        again = TokenMemo(file=MemoFile(tmp_path / "memo"))
    assert len(again) == 0 and "token memo" in caplog.text and "moved it aside" in caplog.text
    again.remember(Message(role="assistant", content="new"), [3])
    again.close()
    assert [e.token_ids for _, e in MemoFile(tmp_path / "memo").entries()] == [(3,)]


def test_a_damaged_entry_is_a_miss_and_is_dropped(tmp_path, caplog):
    messages = [Message(role="assistant", content=f"m{i}") for i in range(3)]
    memo = TokenMemo(file=MemoFile(tmp_path / "memo"))
    handles = [memo.remember(m, [i, i + 1, 7]) for i, m in enumerate(messages)]
    memo.close()
    env = lmdb.open(str(tmp_path / "memo"))
    with env.begin(write=True) as txn:  # one token id changes (7 -> 6), as a flipped bit would
        value = bytearray(txn.get(handles[1].encode()))
        value[value.index(b"\x07")] = 6
        txn.put(handles[1].encode(), bytes(value))
        txn.put(handles[2].encode(), b"\xc1 not msgpack")
    env.close()
    with caplog.at_level(logging.WARNING):
        again = TokenMemo(file=MemoFile(tmp_path / "memo"))
    assert [again.lookup(m) for m in messages] == [[0, 1, 7], None, None]
    assert "2 damaged entries dropped" in caplog.text
    again.close()
    assert len(list(MemoFile(tmp_path / "memo").entries())) == 1


def test_a_failed_memo_write_is_counted_and_the_memo_keeps_the_ids(tmp_path, caplog):
    errors = ErrorLog(logging.getLogger("test"), "memo write", "kept in memory")
    memo = TokenMemo(file=MemoFile(tmp_path / "memo", map_bytes=64 << 10, errors=errors))  # 64 KiB map
    big = Message(role="assistant", content="big")
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            memo.remember(big, list(range(50_000)))  # about 150 KiB: does not fit
        memo.written().result()
    assert memo.lookup(big) == list(range(50_000))
    assert errors.count == 3 and caplog.text.count("memo write failed") == 1
    memo.close()


def test_an_unusable_memo_folder_keeps_the_memo_in_memory(tmp_path, caplog):
    (tmp_path / "memo").write_text("a file where the folder should be")
    with caplog.at_level(logging.WARNING):
        memo = TokenMemo(file=MemoFile(tmp_path / "memo"))
    message = Message(role="assistant", content="x")
    memo.remember(message, [5])
    assert memo.lookup(message) == [5] and "generated token ids are kept in memory only" in caplog.text
    memo.close()


def test_entries_written_before_checksums_are_still_read(tmp_path):
    from gateway.memo import MemoEntry

    message = Message(role="assistant", content="old")
    entry = MemoEntry((4, 5), content_hash(message), "")
    MemoFile(tmp_path / "memo").close()
    env = lmdb.open(str(tmp_path / "memo"))
    with env.begin(write=True) as txn:  # the earlier format: (sequence number, entry)
        txn.put(b"ft1.old", msgspec.msgpack.encode((0, entry)))
    env.close()
    memo = TokenMemo(file=MemoFile(tmp_path / "memo"))
    assert memo.lookup(message) == [4, 5]
    memo.close()


def test_disk_writes_run_on_their_own_thread_in_order_and_written_says_when(tmp_path):
    """`remember` returns before its synced write (the engine worker calls it; an answer's end
    waits for `written()` instead): held writes leave the ids in memory, not yet on disk, and
    `written()` not done; once they run they land in the order remembered."""
    import threading

    file = MemoFile(tmp_path / "memo")
    release, write = threading.Event(), file.write

    def slow_write(put, drop=()):
        release.wait(10)
        write(put, drop)

    file.write = slow_write
    memo = TokenMemo(max_entries=2, file=file)
    messages = [Message(role="assistant", content=f"m{i}") for i in range(3)]
    handles = [memo.remember(m, [i]) for i, m in enumerate(messages)]  # the third evicts the first
    done = memo.written()
    assert memo.lookup(messages[2]) == [2] and not done.done() and not list(file.entries())
    release.set()
    done.result(10)
    assert [h for h, _ in file.entries()] == handles[1:]
    memo.close()


def test_a_memo_file_reads_back_only_what_another_process_wrote(tmp_path):
    """A lookup miss asks the file for news only after a transaction not its own: a server's own
    writes leave nothing to scan; another process's entry (a replica sharing the folder) is news."""
    mine = MemoFile(tmp_path / "memo")
    entry = MemoEntry((1, 2, 3), "c", "b")
    mine.write(("h1", entry))
    mine.write(None, drop=["h1"])
    assert not mine.changed() and mine.news(frozenset()) == []
    other = (
        "import sys; from gateway.memo import MemoEntry, MemoFile; "
        "f = MemoFile(sys.argv[1]); f.write(('h2', MemoEntry((1, 2, 3), 'c', 'b'))); f.close()"
    )
    subprocess.run([sys.executable, "-c", other, str(tmp_path / "memo")], check=True)
    assert mine.changed()
    assert mine.news(frozenset()) == [("h2", entry)]
    assert not mine.changed()
    mine.close()
