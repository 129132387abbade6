"""`ft ps`: the `ft serve` processes running on this machine (`ft.servers`), each with its model,
port, memory by part, requests running and queued, cache hit ratio and uptime (read from its
`/metrics`). A router (`ft serve --replicas`) is listed with its workers' ports, and each worker with
its router's port."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.table import Table

from adapters.server_start import answers
from ft import servers

GiB = 1 << 30
SHORT = {"weights": "weights", "decode_slots": "slots", "live_sequences": "live", "ram_cache_budget": "ram≤",
         "expert_cache": "experts", "expert_staging": "staging", "expert_stream": "stream", "experts_host": "host-experts",
         "device_reserved": "reserved", "device_peak_reserved": "peak", "workspace": "workspace"}


@dataclass(frozen=True)
class Samples:
    """A server's `/metrics`: every sample's value by (name, labels as sorted pairs)."""

    values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = field(default_factory=dict)

    def get(self, name: str, **labels: str) -> float:
        return self.values.get((name, tuple(sorted(labels.items()))), 0.0)

    def by(self, name: str, label: str) -> dict[str, float]:
        """The samples of `name` by the value of one label."""
        return {dict(k)[label]: v for (n, k), v in self.values.items() if n == name and label in dict(k)}

    @property
    def cache_hit_ratio(self) -> float | None:
        """Of the prompt tokens of every request, the share served from checkpoints or live sequences."""
        cached = self.get("ft_tokens_total", kind="reused") + self.get("ft_tokens_total", kind="continued")
        total = cached + self.get("ft_tokens_total", kind="prefilled")
        return cached / total if total else None


def scrape(url: str, timeout: float = 5.0) -> Samples:
    """`url`'s `/metrics`, parsed by prometheus-client's own parser."""
    text = httpx.get(f"{url}/metrics", timeout=timeout).text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return Samples(values)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="one JSON object per server instead of a table")


def row(record: servers.ServerRecord, now: float, router: int | None = None) -> dict:
    """What `ft ps` shows of one record; `router`: the port of the router this server works behind.
    A router has no `/metrics` of its own (its workers' are theirs)."""
    try:
        samples = None if record.is_router else scrape(record.url)
    except httpx.HTTPError:
        samples = None
    memory = samples.by("ft_memory_bytes", "part") if samples else {}
    ratio = samples.cache_hit_ratio if samples else None
    return {
        "port": record.port, "pid": record.pid, "model": record.model, "url": record.url,
        "memory_gib": {part: round(n / GiB, 3) for part, n in memory.items() if n},
        "sessions": int(samples.get("ft_live_sequences")) if samples else None,
        "running": int(samples.get("ft_scheduler_running")) if samples else None,
        "queued": int(samples.get("ft_scheduler_queue_depth")) if samples else None,
        "cache_hit_ratio": None if ratio is None else round(ratio, 4),
        "uptime_s": round(now - record.started),
        "answering": answers(record.url) if record.is_router else samples is not None,
        "kind": record.kind, "workers": list(record.workers), "router": router,
    }


def uptime(seconds: float) -> str:
    minutes, s = divmod(int(seconds), 60)
    hours, m = divmod(minutes, 60)
    return f"{hours}h{m:02d}m" if hours else f"{m}m{s:02d}s"


def run(args: argparse.Namespace) -> int:
    console = Console()
    running = servers.running()
    router_of = {port: r.port for r in running if r.is_router for port in r.workers}
    rows = [row(r, time.time(), router_of.get(r.port)) for r in running]
    if args.json:
        import json  # noqa: PLC0415

        for r in rows:
            console.print(json.dumps(r), highlight=False, markup=False, soft_wrap=True)
        return 0
    if not rows:
        console.print("no ft server running (start one with `ft serve` or `ft launch`)")
        return 0
    table = Table("PORT", "PID", "MODEL", "MEMORY (GiB)", "SESSIONS", "RUNNING/QUEUED", "CACHE HITS", "UPTIME",
                  box=None, pad_edge=False)
    for r in rows:
        memory = " ".join(f"{SHORT.get(part, part)} {gib:.2f}" for part, gib in r["memory_gib"].items()) or "-"
        busy = f"{r['running']}/{r['queued']}" if r["answering"] else "not answering"
        if r["kind"] == "router":
            memory = "router of " + ", ".join(map(str, r["workers"]))
            busy = "-" if r["answering"] else "not answering"
        elif r["router"] is not None:
            memory += f" (behind {r['router']})"
        hits = "-" if r["cache_hit_ratio"] is None else f"{r['cache_hit_ratio']:.0%}"
        sessions = "-" if r["kind"] == "router" else str(r["sessions"] or 0)
        table.add_row(str(r["port"]), str(r["pid"]), r["model"], memory, sessions, busy, hits,
                      uptime(r["uptime_s"]))
    console.print(table)
    return 0
