"""What a forward does with the host link, chosen by its token count (`ExpertCachePolicy`), and the
link's measured rates (`Link`)."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.config import ModelConfig
from engine.offload.cache import IN_PLACE_ROWS, ExpertCache, host_experts

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Link:
    """Measured at start: host -> device bytes/s (pinned), and the host's seconds for one expert
    on one row and for each further row (`host_experts`)."""

    h2d_bytes_per_s: float
    host_expert_s: float
    host_row_s: float


@dataclass(frozen=True)
class ExpertCachePolicy:
    """Per forward: chunks of at least `stream_tokens` tokens prefetch the next layer's experts
    before its routing is known. In shorter ones, misses routed to at most `cpu_rows` rows may be
    computed on the host: all of them without `costs`, else as many as balance the two sides
    (`ExpertCache.split`), from `costs` = (seconds to copy an expert, host seconds for an expert
    on one row, for each further row)."""

    stream_tokens: int
    cpu_rows: int = 0
    costs: tuple[float, float, float] | None = None

    @staticmethod
    def coverage_tokens(c: ModelConfig, share: float = 0.9) -> int:
        """Tokens after which a chunk routes to `share` of the experts (uniform routing:
        1 - (1 - k/E)^T of them)."""
        if c.num_experts_per_tok >= c.num_experts:
            return 1
        return math.ceil(math.log(1 - share) / math.log(1 - c.num_experts_per_tok / c.num_experts))

    @staticmethod
    def coverage(c: ModelConfig, tokens: int) -> float:
        """The share of a layer's experts a chunk of `tokens` tokens routes to (uniform routing)."""
        return 1 - (1 - min(c.num_experts_per_tok / c.num_experts, 1.0)) ** tokens

    def crossover(self, c: ModelConfig, tokens: int, fetched_s: float, streamed_s: float) -> ExpertCachePolicy:
        """This policy with `stream_tokens` where fetching a chunk's routed experts (`fetched_s`
        measured on `tokens` tokens, taken to grow with the share of experts routed to) costs as
        much as streaming them all (`streamed_s`, which the link bounds whatever the length);
        never below the chunks that read in place (`IN_PLACE_ROWS`), never above `coverage_tokens`."""
        low, high = IN_PLACE_ROWS // c.num_experts_per_tok + 1, self.coverage_tokens(c)
        share = self.coverage(c, tokens) * streamed_s / max(fetched_s, 1e-9)  # where the two meet
        at = high if share >= self.coverage(c, high) else self.coverage_tokens(c, share) if share > 0 else low
        return dataclasses.replace(self, stream_tokens=min(max(at, low), high))

    @classmethod
    def measured(cls, c: ModelConfig, link: Link, expert_bytes: int) -> ExpertCachePolicy:
        """The costs of `link` for experts of `expert_bytes`; any miss may go to the host, the
        balance decides (myopic: a copied expert may also hit in later steps)."""
        costs = (expert_bytes / link.h2d_bytes_per_s, link.host_expert_s, link.host_row_s)
        return cls(cls.coverage_tokens(c), cpu_rows=1 << 16, costs=costs)


def measure_link(cache: ExpertCache, repeat: int = 5) -> Link:
    """Time one expert's host -> device copy and its host compute on 1 and 16 rows (medians)."""

    def median(fn) -> float:
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]

    scratch = tuple(torch.empty_like(p[0]) for p in cache.parts)
    sync = torch.cuda.synchronize if cache.device.type == "cuda" else (lambda: None)

    def copy() -> None:
        for dst, src in zip(scratch, cache.host, strict=True):
            dst.copy_(src[0], non_blocking=True)
        sync()

    x = torch.randn(16, cache.host_weights(0)[0].shape[1], dtype=torch.float32)
    ones = torch.ones(16)
    # as the host path runs an expert: its weights fetched (a packed expert dequantized) every time
    one = median(lambda: host_experts(x[:1], ones[:1], *cache.host_weights(0)))
    sixteen = median(lambda: host_experts(x, ones, *cache.host_weights(0)))
    seconds = median(copy)
    return Link(cache.expert_bytes / max(seconds, 1e-9), one, max(sixteen - one, 0.0) / 15)
