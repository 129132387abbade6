"""From a parsed request to what the engine must do: segments, anchors, boundaries,
sampling. Runs off the event loop (tokenizing a long prompt takes milliseconds)."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from engine import SamplingParams
from gateway.anchors import Namespace, boundaries
from gateway.conversation import Conversation, Message
from gateway.errors import ContextLengthExceeded
from gateway.memo import TokenMemo
from gateway.render import Renderer, Segment, segment_ids
from gateway.replay_outputs import ReplayOutputs
from gateway.volatile import VolatileRules, normalize


@dataclass
class RestorePlan:
    conv: Conversation
    segments: list[Segment]
    chain: list[bytes]
    ends: list[int]
    prompt_ids: list[int]
    sampling: SamplingParams
    forced_ids: list[int] | None
    memo_handle: str
    namespace: Namespace  # the tenant's: what the answer's checkpoints and the next turn's hang from

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


def forced_message(conv: Conversation) -> Message | None:
    return None if conv.forced_output is None else conv.forced_output.to_message("forced_")


class RestorePlanner:
    """Turns a parsed request into its `RestorePlan`. Built once per server from exactly what planning
    reads: the renderer and token memo (the segments), the root anchor (the chain), the rules for
    volatile fields, the recorded outputs a replay forces, the model's context and the
    `max_tokens` default and cap. Any thread (it runs off the event loop, before the worker)."""

    def __init__(self, renderer: Renderer, memo: TokenMemo, root: bytes, volatile_rules: VolatileRules,
                 replay: ReplayOutputs | None, max_context: int, default_max_tokens: int, max_tokens_cap: int | None):
        self.renderer, self.memo, self.root, self.volatile_rules = renderer, memo, root, volatile_rules
        self.replay, self.max_context = replay, max_context
        self.default_max_tokens, self.max_tokens_cap = default_max_tokens, max_tokens_cap

    def plan(self, conv: Conversation, namespace: Namespace | None = None, memo: TokenMemo | None = None) -> RestorePlan:
        """`namespace` and `memo`: the tenant's (gateway/tenants.py), by default the server's own."""
        namespace = Namespace(self.root) if namespace is None else namespace
        memo = self.memo if memo is None else memo  # (an empty memo is falsy)
        conv = normalize(conv, self.volatile_rules)
        if conv.forced_output is None and self.replay is not None and conv.tools:
            forced = self.replay.take()
            if forced is not None:
                conv = msgspec.structs.replace(conv, forced_output=forced)
        segments = self.renderer.render(conv, memo)
        prompt_ids = segment_ids(segments)
        max_context = self.max_context
        if len(prompt_ids) >= max_context:
            raise ContextLengthExceeded(len(prompt_ids), max_context)
        message = forced_message(conv)
        forced_ids = self.renderer.render_generation(conv, message) if message is not None else None
        p = conv.params
        limits = [p.max_tokens or self.default_max_tokens, max_context - len(prompt_ids), self.max_tokens_cap]
        sampling = SamplingParams(
            max_tokens=min(n for n in limits if n is not None),
            temperature=1.0 if p.temperature is None else p.temperature,
            top_p=1.0 if p.top_p is None else p.top_p,
            top_k=p.top_k or 0,
            seed=p.seed,
            stop_token_ids=frozenset(self.renderer.tokenizer.eos_ids),
            vocab_limit=self.renderer.tokenizer.vocab_size,
        )
        return RestorePlan(conv, segments, namespace.chain(segments), boundaries(segments), prompt_ids, sampling,
                    forced_ids, memo.issue_handle(), namespace)
