"""Anchors: a hash chain over segments that names each exact token prefix.

    anchor_0 = root_anchor(model_fingerprint, template_id)
    anchor_i = xxh3_128(anchor_{i-1} ‖ kind_i ‖ 0x00 ‖ token_ids_i as little-endian int32)

Two requests that share a prefix of segments share its anchors, across sessions. The
kind is hashed (a NUL ends it, so kinds cannot run into ids); the message index is not,
so the same tokens at the same place name the same prefix wherever they came from.

Tenants (gateway/tenants.py) are kept apart by their `Namespace`: a server-side salt folded into
the root, so every anchor of a tenant differs from every other tenant's. What is keyed by anchor is
therefore namespaced with no more work: the store's RAM and disk records (LMDB keys are anchor +
part), the store queue, the live sequences. A tenant that shares the public prefix hangs its leading
system and tools segments from a root common to such tenants and folds its salt in after them.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import xxhash

from gateway.render import Segment

ROOT_DOMAIN = b"ft-anchor-v1\x00"
SALT_DOMAIN = b"ft-salt-v1\x00"
PUBLIC_SALT = b"public"  # the public prefix's root: never the server's own (keyless) root
PUBLIC_KINDS = ("system", "tools")


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


def anchor_chain(segments: Sequence[Segment], root: bytes) -> list[bytes]:
    """anchor_1..anchor_n: one per segment, each naming the prefix through that segment."""
    chain: list[bytes] = []
    parent = root
    for s in segments:
        parent = next_anchor(parent, s)
        chain.append(parent)
    return chain


def boundaries(segments: Sequence[Segment]) -> list[int]:
    """Token position where each segment ends (cumulative lengths): `anchor_chain(...)[i]`
    names the first `boundaries(...)[i]` tokens."""
    return list(accumulate(len(s.token_ids) for s in segments))


def fold(anchor: bytes, salt: bytes) -> bytes:
    """`anchor` moved into the namespace of `salt`: a chain hung from it shares no anchor with one
    hung from `anchor` or from any other salt's fold."""
    return xxhash.xxh3_128_digest(SALT_DOMAIN + anchor + salt)


def public_prefix(segments: Sequence[Segment]) -> int:
    """How many leading segments are the request's system prompt and tools (no message of its own)."""
    n = 0
    while n < len(segments) and segments[n].kind in PUBLIC_KINDS and segments[n].message_index is None:
        n += 1
    return n


@dataclass(frozen=True)
class Namespace:
    """Where one tenant's chains hang from. Without `salt`, every anchor from `root`. With it (a
    tenant sharing the public prefix), the leading system and tools segments hang from `root`, common
    to every tenant that shares, and `salt` is folded in before the first segment after them."""

    root: bytes
    salt: bytes | None = None

    @classmethod
    def private(cls, root: bytes, salt: bytes) -> Namespace:
        return cls(fold(root, salt))

    @classmethod
    def public(cls, root: bytes, salt: bytes) -> Namespace:
        return cls(fold(root, PUBLIC_SALT), salt)

    def chain(self, segments: Sequence[Segment]) -> list[bytes]:
        """anchor_1..anchor_n of `segments` in this namespace."""
        if self.salt is None:
            return anchor_chain(segments, self.root)
        shared = public_prefix(segments)
        head = anchor_chain(segments[:shared], self.root)
        return head + anchor_chain(segments[shared:], fold(head[-1] if head else self.root, self.salt))

    @property
    def scope(self) -> bytes:
        """Names the tenant, the same for every chain: what it computed is remembered apart
        (gateway/prefill_reasons.py), a shared public prefix included."""
        return self.root if self.salt is None else fold(self.root, self.salt)
