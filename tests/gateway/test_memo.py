"""TokenMemo: lookup by handle and by content, safety checks, bounds."""

from __future__ import annotations

from gateway.conversation import Message, ToolCall
from gateway.memo import TokenMemo, content_hash

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
