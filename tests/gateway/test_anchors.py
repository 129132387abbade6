"""Anchors: the hash chain over segments."""

from __future__ import annotations

import struct

import xxhash
from hypothesis import given
from hypothesis import strategies as st

from gateway.anchors import anchor_chain, boundaries, root_anchor
from gateway.render import Segment

segments = st.lists(
    st.builds(
        Segment,
        st.sampled_from(["system", "user", "tool_call"]),
        st.lists(st.integers(0, 2**31 - 1), max_size=6),
    ),
    max_size=6,
)


def test_definition():
    root = root_anchor("model-fp", "qwen3_6/x")
    assert (
        len(root) == 16
        and root != root_anchor("model-fp", "qwen3_6/y")
        and root != root_anchor("other", "qwen3_6/x")
    )
    seg = Segment("user", [1, 248045])
    expected = xxhash.xxh3_128_digest(root + b"user\x00" + struct.pack("<2i", 1, 248045))
    assert anchor_chain([seg], root) == [expected]


@given(segments, segments)
def test_shared_prefix_shares_anchors(a, b):
    root = root_anchor("fp", "t")
    chain_ab, chain_a = anchor_chain(a + b, root), anchor_chain(a, root)
    assert chain_ab[: len(a)] == chain_a
    assert boundaries(a + b)[: len(a)] == boundaries(a)
    if a:
        assert boundaries(a)[-1] == sum(len(s.token_ids) for s in a)


def test_kind_and_message_index():
    root = root_anchor("fp", "t")
    assert anchor_chain([Segment("user", [1])], root) != anchor_chain([Segment("system", [1])], root)
    assert anchor_chain([Segment("user", [1], 0)], root) == anchor_chain([Segment("user", [1], 5)], root)
    assert anchor_chain([Segment("user", [1, 2])], root) != anchor_chain(
        [Segment("user", [1]), Segment("user", [2])], root
    )
