"""Why a request's prefilled tokens were not restored: each prefilled token is counted under one
reason (the `x-prefill-reasons` header, `ft_prefill_tokens_by_reason_total`, `ft replay`'s table).

From the end of what was restored (checkpoints copied in, or a live sequence continued in place:
those tokens have no reason) to the end of the prompt, in this order:

- `evicted`: up to the deepest anchor of the prompt where a state checkpoint was taken once and no
  longer restores (its state, or a KV delta before it, gone from every tier; a write that failed);
- `no_anchor`: on to the end of the prefix this server has computed before, where no state
  checkpoint was taken (the capture policy did not capture there; the prompt's last segment, whose
  logits start the answer, is never restored);
- `edited`: from the first segment that differs from every chain computed before, where a chain
  computed before went on past the last shared anchor and the request re-sends history after the
  divergence (a later segment, not a generation prompt, has the content of one computed before: an
  earlier turn edited or rendered otherwise), to the end of the longer of that history and the
  longest chain computed through the last shared anchor;
- `new`: the rest, never computed here (a new turn, whatever its content; a session that only
  shares a system prompt).

Anchors and segment contents are remembered as they are computed (prompts prefilled, answers
checkpointed, histories precomputed), the newest SEEN_LIMIT of each; forgotten ones, and those of
before a restart, read as never computed (`new`). Each is remembered under its tenant's scope
(`gateway.anchors.Namespace.scope`): a request is explained by its own tenant's history only, so
no reason tells it what another tenant sent (the same contents, a public prefix computed further).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from gateway.anchors import next_anchor
from gateway.render import Segment

REASONS = ("new", "edited", "evicted", "no_anchor")
SEEN_LIMIT = 1 << 17  # anchors, and segment contents, remembered: some 15 MiB each when full


@dataclass(frozen=True)
class PrefillReasons:
    """Tokens per reason (every name of REASONS, summing to the tokens prefilled) and, where some are
    `edited`, the first segment of the prompt that differs: (index, kind)."""

    tokens: dict[str, int]
    edited_at: tuple[int, str] | None = None

    def header(self) -> str:
        """`new=120, edited=4096`: the reasons with tokens, in REASONS order."""
        return ", ".join(f"{reason}={n}" for reason, n in self.tokens.items() if n)


@dataclass(frozen=True)
class _Seen:
    reach: int  # token end of the longest chain computed through this anchor
    state: bool  # a state checkpoint was taken here


def content_digest(segment: Segment, scope: bytes = b"") -> bytes:
    """A segment's kind and tokens, wherever it stands in `scope`'s chains (an anchor hashed from `scope`)."""
    return next_anchor(scope, segment)


class SeenChains:
    """The anchors and segment contents this server computed, newest last, at most `limit` of each.
    Engine worker only."""

    def __init__(self, limit: int = SEEN_LIMIT):
        self.limit = limit
        self._anchors: OrderedDict[bytes, _Seen] = OrderedDict()
        self._contents: OrderedDict[bytes, None] = OrderedDict()

    def add(self, chain: Sequence[bytes], reach: int, states: Iterable[bytes] = (),
            contents: Sequence[Segment] = (), scope: bytes = b"") -> None:
        """Remember `chain`, computed through token `reach` by the tenant of `scope`, a state checkpoint
        taken at each anchor of `states`, and the `contents` of the segments computed."""
        with_state = set(states)
        for anchor in chain:
            old = self._anchors.pop(scope + anchor, None)
            self._anchors[scope + anchor] = _Seen(max(reach, old.reach if old else 0),
                                                  anchor in with_state or (old is not None and old.state))
        for segment in contents:
            digest = content_digest(segment, scope)
            self._contents.pop(digest, None)
            self._contents[digest] = None
        for kept in (self._anchors, self._contents):
            while len(kept) > self.limit:
                kept.popitem(last=False)

    def explain(self, segments: Sequence[Segment], chain: Sequence[bytes], ends: Sequence[int],
                restored: int, scope: bytes = b"") -> PrefillReasons:
        """Why the prompt of `segments` (anchors `chain`, token ends `ends`) was prefilled after its
        first `restored` tokens, from what the tenant of `scope` computed. Changes nothing."""
        n, total = len(chain), ends[-1] if ends else 0
        chain = [scope + anchor for anchor in chain]
        shared = next((i + 1 for i in range(n - 1, -1, -1) if chain[i] in self._anchors), 0)
        shared_end = ends[shared - 1] if shared else 0
        stateful = 0  # end of the deepest anchor that took a state (the last segment is never restored)
        for i in range(min(shared, n - 1) - 1, -1, -1):
            if ends[i] <= restored:
                break
            seen = self._anchors.get(chain[i])
            if seen is not None and seen.state:
                stateful = ends[i]
                break
        resent = max((ends[i] for i in range(shared, n) if segments[i].kind != "generation_prompt"
                      and content_digest(segments[i], scope) in self._contents), default=shared_end)
        reach = self._anchors[chain[shared - 1]].reach if shared else resent  # from the root: any chain went on
        edited_end = max(resent, min(reach, total)) if resent > shared_end and reach > shared_end else shared_end
        cuts = [restored]
        for end in (stateful, shared_end, edited_end, total):
            cuts.append(max(cuts[-1], end))
        evicted, no_anchor, edited, new = (b - a for a, b in zip(cuts, cuts[1:], strict=False))
        edited_at = (shared, segments[shared].kind) if edited else None
        return PrefillReasons({"new": new, "edited": edited, "evicted": evicted, "no_anchor": no_anchor}, edited_at)
