"""Sampling parameters and the token sampler (greedy, temperature, top-k, top-p, seeded)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    vocab_limit: int | None = None  # ids >= this (the model's padding past the tokenizer) are never chosen


class Sampler:
    def __init__(self, params: SamplingParams, device: torch.device):
        self.params = params
        self.generator = None
        if params.temperature > 0:
            self.generator = torch.Generator(device=device)
            if params.seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(params.seed)

    def __call__(self, logits: torch.Tensor) -> int:
        """logits: [V] fp32 -> one token id."""
        p = self.params
        if p.vocab_limit is not None and p.vocab_limit < logits.shape[-1]:
            logits = logits[: p.vocab_limit]
        if p.temperature <= 0:
            return int(torch.argmax(logits))
        logits = logits / p.temperature
        if p.top_k > 0:
            kth = torch.topk(logits, min(p.top_k, logits.shape[-1])).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            drop = sorted_probs.cumsum(-1) - sorted_probs > p.top_p  # keep the smallest set reaching top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=self.generator))


@dataclass(frozen=True)
class TokenEvent:
    token_id: int
    index: int  # 0-based position in the generation
    finish_reason: str | None = None  # "stop" | "length" on the last token


class Decoding:
    """Chooses a generation's tokens one at a time: sampled, or the `forced` ones (teacher
    forcing). `next(logits)` gives the token after those logits; the last one carries its
    finish reason ("stop" at a stop token or the end of the forced tokens, else "length")."""

    def __init__(self, params: SamplingParams, device: torch.device, forced: Sequence[int] | None = None):
        self.params, self.forced = params, forced
        self.sampler = Sampler(params, device)
        self.limit = len(forced) if forced is not None else params.max_tokens
        self.index = 0

    def next(self, logits: torch.Tensor) -> TokenEvent:
        index, self.index = self.index, self.index + 1
        token = self.forced[index] if self.forced is not None else self.sampler(logits)
        stop = self.forced is None and token in self.params.stop_token_ids
        if stop or index + 1 == self.limit:
            return TokenEvent(token, index, "stop" if stop or self.forced is not None else "length")
        return TokenEvent(token, index)
