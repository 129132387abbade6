"""The server's metrics, exposed by prometheus-client for `/metrics`; the last requests' figures for
`ft top` (`recent`).

Counted as requests come: requests by endpoint and status, tokens by kind (prefilled, restored
from checkpoints as `reused`, `continued` in place from a live sequence, generated, precomputed),
prefilled tokens by why they were not restored (gateway/prefill_reasons.py), and histograms of the
time to first token and its phases (queue, restore, prefill). Read at each scrape from their
owners: the scheduler's queue and steps (and the engine's growth events), memory by part, the
checkpoint store's counters, the expert cache's (with offload), the live sequences held, and the pins
held and broken (`ft_pins_active`, `ft_pins_broken_total{tier}`: gateway/pins.py). Each `Metrics` has its own
registry: two servers in one process (tests) count apart.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import msgspec
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client import Histogram as PromHistogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.offload import hit_ratio
from gateway.prefill_reasons import REASONS

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
PHASES = ("queue", "restore", "prefill")
TOKEN_KINDS = ("prefilled", "reused", "continued", "generated", "precomputed")
TOOL_MARKUP_OUTCOMES = ("recovered", "kept_as_text")
RECENT = 32  # requests kept for `ft top`
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Histogram:
    """Counts per upper bound (the last past every bound), kept by one thread (the scheduler's
    engine steps a request waited); exposed through `Metrics.render`'s scheduler stats."""

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


@dataclass(frozen=True)
class RecentRequest:
    """One request's start, as `ft top` lists it."""

    at: float  # unix time of its first token
    endpoint: str
    ttft_s: float
    restored: int  # prompt tokens from checkpoints or a live sequence
    prefilled: int
    phases: dict[str, float]


@dataclass(frozen=True)
class PinCounts:
    """Pins held now, and pins broken so far for a live request's memory, by tier (`device`: a live
    sequence dropped; `ram`: a record the store's RAM tier evicted)."""

    active: int
    broken: dict[str, int]


@dataclass
class Gauges:
    """What the server reads from its parts at each scrape (`Metrics.render`'s arguments)."""

    store: msgspec.Struct | None = None
    scheduler: dict[str, int] | None = None
    memory: dict[str, int] | None = None
    expert_cache: dict[str, int] | None = None
    live_sequences: int | None = None
    pins: PinCounts | None = None


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("ft_requests", "Requests answered, by endpoint and status", ["endpoint", "status"],
                                registry=self.registry)
        self.tokens = Counter("ft_tokens", "Tokens by kind", ["kind"], registry=self.registry)
        for kind in TOKEN_KINDS:
            self.tokens.labels(kind)
        self.prefill_reasons = Counter("ft_prefill_tokens_by_reason", "Prompt tokens prefilled, by why they "
                                       "were not restored", ["reason"], registry=self.registry)
        for reason in REASONS:
            self.prefill_reasons.labels(reason)
        self.tool_markup = Counter("ft_tool_call_markup", "Tool-call markup the model wrote other than the "
                                   "template does: read as the call it meant, or passed on as text",
                                   ["outcome"], registry=self.registry)
        for outcome in TOOL_MARKUP_OUTCOMES:
            self.tool_markup.labels(outcome)
        self.ttft = PromHistogram("ft_ttft_seconds", "Time from request to first token", buckets=TTFT_BUCKETS,
                              registry=self.registry)
        self.phases = {
            p: PromHistogram(f"ft_{p}_seconds", f"Time of a request's {p} phase before its first token",
                         buckets=PHASE_BUCKETS, registry=self.registry)
            for p in PHASES
        }
        self._lock = threading.Lock()
        self._recent: deque[RecentRequest] = deque(maxlen=RECENT)
        self._gauges = Gauges()
        self.registry.register(_ScrapeCollector(self))

    def request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def add_tokens(self, **counts: int) -> None:
        for kind, n in counts.items():
            self.tokens.labels(kind).inc(n)

    def add_prefill_reasons(self, tokens: dict[str, int]) -> None:
        """One request's prefilled tokens by reason (`PrefillReasons.tokens`)."""
        for reason, n in tokens.items():
            self.prefill_reasons.labels(reason).inc(n)

    def count_tool_markup(self, recovered: int, kept_as_text: int) -> None:
        """One answer's tool-call markup outside the template's form (`QwenParser` counts it)."""
        self.tool_markup.labels("recovered").inc(recovered)
        self.tool_markup.labels("kept_as_text").inc(kept_as_text)

    def observe_ttft(self, seconds: float, phases: dict[str, float] | None = None, restored: int = 0,
                     prefilled: int = 0, endpoint: str = "") -> None:
        """A request's first token: its TTFT, the seconds of its phases, its tokens restored and prefilled."""
        self.ttft.observe(seconds)
        for name, value in (phases or {}).items():
            if name in self.phases:
                self.phases[name].observe(value)
        with self._lock:
            self._recent.append(RecentRequest(time.time(), endpoint, seconds, restored, prefilled, dict(phases or {})))

    def recent(self) -> list[dict]:
        """The last requests' starts, oldest first."""
        with self._lock:
            return [asdict(r) for r in self._recent]

    def render(self, store_stats: msgspec.Struct, scheduler_stats: dict[str, int], memory: dict[str, int],
               expert_cache: dict[str, int] | None = None, live_sequences: int | None = None,
               pins: PinCounts | None = None) -> str:
        """The exposition text. `expert_cache`: the engine's offload counters (`Engine.offload_stats`),
        None without offload."""
        with self._lock:
            self._gauges = Gauges(store_stats, scheduler_stats, memory, expert_cache, live_sequences, pins)
            return generate_latest(self.registry).decode()


class _ScrapeCollector(Collector):
    """The families read from the server's parts at scrape time (`Metrics.render` hands them over)."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        g = self.metrics._gauges
        if g.scheduler is not None:
            yield from scheduler_families(g.scheduler)
        if g.memory is not None:
            memory = GaugeMetricFamily("ft_memory_bytes", "Resident bytes by part", labels=["part"])
            for part, n in g.memory.items():
                memory.add_metric([part], n)
            yield memory
        if g.live_sequences is not None:
            yield GaugeMetricFamily("ft_live_sequences", "Sequences kept on the device between requests",
                                    value=g.live_sequences)
        if g.pins is not None:
            yield from pin_families(g.pins)
        if g.expert_cache is not None:
            yield from expert_cache_families(g.expert_cache)
        if g.store is not None:
            yield from store_families(g.store)


def scheduler_families(stats: dict[str, int]) -> Iterator[Metric]:
    """`ft_scheduler_*`: queue depth and running as gauges, step counts as counters, and the engine
    steps live requests waited (`queue_steps_bucket{le}`, cumulative); `ft_growth_events`: the
    engine's buffers grown and graphs captured by kind (`Engine.growth_events`)."""
    buckets = GaugeMetricFamily("ft_scheduler_queue_steps_bucket", "Live requests that waited at most le engine steps",
                                labels=["le"])
    growth = CounterMetricFamily("ft_growth_events", "Engine buffers grown and graphs captured, by kind", labels=["kind"])
    for name, value in stats.items():
        if name.startswith("queue_steps_bucket"):
            buckets.add_metric([name.split('"')[1]], value)
        elif name.startswith("growth_events"):
            growth.add_metric([name.split('"')[1]], value)
        elif name.endswith("_total"):
            yield CounterMetricFamily(f"ft_scheduler_{name.removesuffix('_total')}", f"Scheduler {name}", value=value)
        else:
            yield GaugeMetricFamily(f"ft_scheduler_{name}", f"Scheduler {name}", value=value)
    yield buckets
    yield growth


def pin_families(pins: PinCounts) -> Iterator[Metric]:
    yield GaugeMetricFamily("ft_pins_active", "Sessions whose state is pinned while their tool runs", value=pins.active)
    broken = CounterMetricFamily("ft_pins_broken", "Pins broken for a live request's memory, by tier", labels=["tier"])
    for tier, n in pins.broken.items():
        broken.add_metric([tier], n)
    yield broken


def expert_cache_families(counts: dict[str, int]) -> Iterator[Metric]:
    """Every expert a layer needed is counted once: a hit, fetched for it (copied or streamed), read
    in place from host memory (mapped) or computed there (on_host); misses count every copy into a
    slot or stream buffer (prefetches and refreshes too). Decode's hit ratio is apart: a streamed
    prefill hits every resident expert."""
    yield GaugeMetricFamily("ft_expert_cache_hit_ratio", "Share of needed experts found resident",
                            value=hit_ratio(counts) or 0.0)
    phase = GaugeMetricFamily("ft_expert_cache_phase_hit_ratio", "Hit ratio by phase", labels=["phase"])
    for p in ("prefill", "decode"):
        phase.add_metric([p], hit_ratio(counts, p) or 0.0)
    yield phase
    for name in ("hits", "fetched", "misses", "evictions", "on_host", "mapped"):
        yield CounterMetricFamily(f"ft_expert_cache_{name}", f"Expert cache {name}", value=counts[name])
    moved = CounterMetricFamily("ft_expert_cache_bytes_in", "Bytes moved host -> device", labels=["phase"])
    for p in ("prefill", "decode"):
        moved.add_metric([p], counts[f"bytes_in_{p}"])
    yield moved


def store_families(stats: msgspec.Struct) -> Iterator[Metric]:
    """`ft_store_*`: the checkpoint store's counters and gauges as it reports them, a dict by tier."""
    for name, value in msgspec.structs.asdict(stats).items():
        if isinstance(value, bool):
            continue
        if isinstance(value, int | float):
            yield GaugeMetricFamily(f"ft_store_{name}", f"Checkpoint store {name}", value=value)
        elif isinstance(value, dict):
            family = GaugeMetricFamily(f"ft_store_{name}", f"Checkpoint store {name}", labels=["tier"])
            for key, v in value.items():
                if isinstance(v, int | float):
                    family.add_metric([str(key)], v)
            yield family
