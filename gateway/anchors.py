"""Anchors: a hash chain over segments that names each exact token prefix.

    anchor_0 = root_anchor(model_fingerprint, template_id)
    anchor_i = xxh3_128(anchor_{i-1} ‖ kind_i ‖ 0x00 ‖ token_ids_i as little-endian int32)

Two requests that share a prefix of segments share its anchors, across sessions. The
kind is hashed (a NUL ends it, so kinds cannot run into ids); the message index is not,
so the same tokens at the same place name the same prefix wherever they came from.
"""

from __future__ import annotations

import sys
from array import array
from itertools import accumulate

import xxhash

from gateway.render import Segment

ROOT_DOMAIN = b"ft-anchor-v1\x00"


def root_anchor(model_fingerprint: str, template_id: str) -> bytes:
    """anchor_0: 16 bytes naming the model (weights + config) and the template + tokenizer."""
    return xxhash.xxh3_128_digest(ROOT_DOMAIN + model_fingerprint.encode() + b"\x00" + template_id.encode())


def _ids_bytes(token_ids: list[int]) -> bytes:
    ids = array("i", token_ids)  # C int: 4 bytes on every platform we run on
    if sys.byteorder == "big":
        ids.byteswap()
    return ids.tobytes()


def next_anchor(parent: bytes, segment: Segment) -> bytes:
    """The anchor after `segment`, given the anchor before it."""
    return xxhash.xxh3_128_digest(parent + segment.kind.encode() + b"\x00" + _ids_bytes(segment.token_ids))


def anchor_chain(segments: list[Segment], root: bytes) -> list[bytes]:
    """anchor_1..anchor_n: one per segment, each naming the prefix through that segment."""
    chain: list[bytes] = []
    parent = root
    for s in segments:
        parent = next_anchor(parent, s)
        chain.append(parent)
    return chain


def boundaries(segments: list[Segment]) -> list[int]:
    """Token position where each segment ends (cumulative lengths): `anchor_chain(...)[i]`
    names the first `boundaries(...)[i]` tokens."""
    return list(accumulate(len(s.token_ids) for s in segments))
