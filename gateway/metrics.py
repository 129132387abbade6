"""Server counters and the TTFT histogram, rendered as Prometheus text for `/metrics`."""

from __future__ import annotations

import threading
from collections import Counter

import msgspec

from engine.offload import hit_ratio

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Histogram:
    """Counts per upper bound (the last past every bound) and their sum; not locked: its owner's lock or thread."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds, self.counts, self.sum = bounds, [0] * (len(bounds) + 1), 0.0

    def observe(self, value: float) -> None:
        self.counts[next((i for i, b in enumerate(self.bounds) if value <= b), len(self.bounds))] += 1
        self.sum += value

    def cumulative(self) -> list[tuple[str, int]]:
        """(le, observations at or below it) per bound then "+Inf", as Prometheus buckets read."""
        out, total = [], 0
        for bound, count in zip([*self.bounds, "+Inf"], self.counts, strict=True):
            total += count
            out.append((str(bound), total))
        return out


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter[tuple[str, str]] = Counter()  # (endpoint, status)
        self.tokens = Counter({"prefilled": 0, "reused": 0, "continued": 0, "generated": 0, "precomputed": 0})
        self._ttft = Histogram(TTFT_BUCKETS)

    def request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[(endpoint, str(status))] += 1

    def add_tokens(self, **counts: int) -> None:
        with self._lock:
            self.tokens.update(counts)

    def observe_ttft(self, seconds: float) -> None:
        with self._lock:
            self._ttft.observe(seconds)

    def render(self, store_stats: msgspec.Struct, scheduler_stats: dict[str, int], memory: dict[str, int],
               expert_cache: dict[str, int] | None = None) -> str:
        """`expert_cache`: the engine's offload counters (`Engine.offload_stats`), None without offload."""
        with self._lock:
            lines = ["# TYPE ft_requests_total counter"]
            lines += [f'ft_requests_total{{endpoint="{e}",status="{s}"}} {n}' for (e, s), n in sorted(self.requests.items())]
            lines.append("# TYPE ft_tokens_total counter")
            lines += [f'ft_tokens_total{{kind="{k}"}} {n}' for k, n in sorted(self.tokens.items())]
            lines.append("# TYPE ft_ttft_seconds histogram")
            buckets = self._ttft.cumulative()
            lines += [f'ft_ttft_seconds_bucket{{le="{le}"}} {n}' for le, n in buckets]
            lines += [f"ft_ttft_seconds_sum {self._ttft.sum:.6f}", f"ft_ttft_seconds_count {buckets[-1][1]}"]
        lines += [f"ft_scheduler_{name} {value}" for name, value in scheduler_stats.items()]
        lines.append("# TYPE ft_memory_bytes gauge")
        lines += [f'ft_memory_bytes{{part="{part}"}} {n}' for part, n in memory.items()]
        if expert_cache is not None:
            # every expert a layer needed is counted once: a hit, fetched for it (copied or streamed), read in
            # place from host memory (mapped) or computed there (on_host); misses count every copy into a slot
            # or stream buffer (prefetches and refreshes too)
            lines += ["# TYPE ft_expert_cache_hit_ratio gauge",
                      f"ft_expert_cache_hit_ratio {hit_ratio(expert_cache) or 0.0:.6f}",
                      "# TYPE ft_expert_cache_phase_hit_ratio gauge"]  # decode's apart: a streamed prefill hits every resident expert
            lines += [f'ft_expert_cache_phase_hit_ratio{{phase="{p}"}} {hit_ratio(expert_cache, p) or 0.0:.6f}'
                      for p in ("prefill", "decode")]  # fmt: skip
            lines += ["# TYPE ft_expert_cache_hits_total counter", f"ft_expert_cache_hits_total {expert_cache['hits']}",
                      "# TYPE ft_expert_cache_fetched_total counter", f"ft_expert_cache_fetched_total {expert_cache['fetched']}",
                      "# TYPE ft_expert_cache_misses_total counter", f"ft_expert_cache_misses_total {expert_cache['misses']}",
                      "# TYPE ft_expert_cache_evictions_total counter",
                      f"ft_expert_cache_evictions_total {expert_cache['evictions']}",
                      "# TYPE ft_expert_cache_on_host_total counter",  # misses computed on the host instead
                      f"ft_expert_cache_on_host_total {expert_cache['on_host']}",
                      "# TYPE ft_expert_cache_mapped_total counter",  # misses read in place from host memory
                      f"ft_expert_cache_mapped_total {expert_cache['mapped']}",
                      "# TYPE ft_expert_cache_bytes_in_total counter"]
            lines += [f'ft_expert_cache_bytes_in_total{{phase="{p}"}} {expert_cache[f"bytes_in_{p}"]}' for p in ("prefill", "decode")]
        for name, value in msgspec.structs.asdict(store_stats).items():
            if isinstance(value, int | float):
                lines.append(f"ft_store_{name} {value}")
            elif isinstance(value, dict):
                lines += [f'ft_store_{name}{{tier="{k}"}} {v}' for k, v in value.items() if isinstance(v, int | float)]
        return "\n".join(lines) + "\n"
