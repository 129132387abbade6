"""`ft top`: a live terminal view of a running server: its sessions and queue, the last requests
with their TTFT and prompt tokens restored against prefilled, the checkpoint tiers' fill and hit
ratios (and the expert cache's under offload), and the engine's steps per second. Read from the
server's `/metrics` and `/v1/ft/recent` every interval."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import httpx
from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table

from ft import env, servers
from ft.ps import GiB, Samples, scrape, uptime

DEFAULT_SERVER = "http://127.0.0.1:1919"


@dataclass(frozen=True)
class Snapshot:
    """One read of the server: its metrics, last requests and when it was taken."""

    at: float
    samples: Samples
    requests: list[dict]
    started_at: float


def read(url: str, key: str | None) -> Snapshot:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    samples = scrape(url)
    recent = httpx.get(f"{url}/v1/ft/recent", headers=headers, timeout=5.0).json()
    return Snapshot(time.time(), samples, recent["requests"], recent["started_at"])


def ratio(hits: float, misses: float) -> str:
    return f"{hits / (hits + misses):.0%}" if hits + misses else "-"


def steps_per_s(now: Snapshot, before: Snapshot | None) -> float:
    """Engine steps a second since the previous read (since the start for the first)."""
    steps = now.samples.get("ft_scheduler_steps_total")
    if before is None:
        return steps / max(now.at - now.started_at, 1e-9)
    return (steps - before.samples.get("ft_scheduler_steps_total")) / max(now.at - before.at, 1e-9)


def header(url: str, now: Snapshot, before: Snapshot | None) -> Table:
    s = now.samples
    table = Table.grid(padding=(0, 3))
    hit = s.cache_hit_ratio
    table.add_row(
        f"[bold]{url}[/bold]  up {uptime(now.at - now.started_at)}",
        f"sessions [bold]{int(s.get('ft_live_sequences'))}[/bold]",
        f"running [bold]{int(s.get('ft_scheduler_running'))}[/bold]  queued [bold]{int(s.get('ft_scheduler_queue_depth'))}[/bold]",
        f"steps/s [bold]{steps_per_s(now, before):.1f}[/bold]",
        f"prompt tokens from cache [bold]{'-' if hit is None else f'{hit:.0%}'}[/bold]",
    )
    return table


def tiers(s: Samples) -> Table:
    table = Table("CACHE", "HOLDS", "FILL", "HIT RATIO", box=None, pad_edge=False)
    budget = s.by("ft_memory_bytes", "part").get("ram_cache_budget", 0)
    ram = s.get("ft_store_ram_bytes")
    table.add_row("checkpoints, RAM", f"{ram / GiB:.2f} GiB ({int(s.get('ft_store_ram_records'))} records)",
                  f"{ram / budget:.0%}" if budget else "-", ratio(s.get("ft_store_ram_hits"), s.get("ft_store_ram_misses")))
    table.add_row("checkpoints, disk", f"{s.get('ft_store_disk_bytes') / GiB:.2f} GiB "
                  f"({int(s.get('ft_store_disk_records'))} records)", "-",
                  ratio(s.get("ft_store_disk_hits"), s.get("ft_store_disk_misses")))
    if ("ft_expert_cache_hit_ratio", ()) in s.values:
        decode = s.by("ft_expert_cache_phase_hit_ratio", "phase").get("decode", 0.0)
        cache = s.by("ft_memory_bytes", "part").get("expert_cache", 0)
        table.add_row("experts, device", f"{cache / GiB:.2f} GiB", "-",
                      f"{s.get('ft_expert_cache_hit_ratio'):.0%} (decode {decode:.0%})")
    return table


def requests(snapshot: Snapshot) -> Table:
    table = Table("AT", "TTFT ms", "RESTORED", "PREFILLED", "QUEUE ms", "RESTORE ms", "PREFILL ms", box=None,
                  pad_edge=False)
    for r in reversed(snapshot.requests[-12:]):
        phases = r["phases"]
        table.add_row(time.strftime("%H:%M:%S", time.localtime(r["at"])), f"{1000 * r['ttft_s']:.0f}",
                      f"{r['restored']:,}", f"{r['prefilled']:,}",
                      *(f"{1000 * phases.get(p, 0.0):.0f}" for p in ("queue", "restore", "prefill")))
    return table


def frame(url: str, now: Snapshot, before: Snapshot | None = None) -> Group:
    """One screen of the view."""
    return Group(
        header(url, now, before),
        Panel(tiers(now.samples), title="caches", title_align="left"),
        Panel(requests(now), title="recent requests (newest first)", title_align="left"),
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server", default=None, help=f"server URL (default: the only one running, else {DEFAULT_SERVER})")
    parser.add_argument("--interval", type=float, default=1.0, metavar="SECONDS", help="refresh period (default 1)")
    parser.add_argument("--once", action="store_true", help="print one frame and exit")
    parser.add_argument("--api-key", default=None, help="the server's key (default: $FT_API_KEY)")


def server_url(given: str | None) -> str:
    if given:
        return given.rstrip("/")
    running = servers.running()
    return running[0].url if len(running) == 1 else DEFAULT_SERVER


def run(args: argparse.Namespace) -> int:
    url, key = server_url(args.server), args.api_key or env.api_key()
    console = Console()
    try:
        before, now = None, read(url, key)
        if args.once:
            console.print(frame(url, now))
            return 0
        with Live(frame(url, now), console=console, screen=False, auto_refresh=False) as live:
            while True:
                time.sleep(args.interval)
                before, now = now, read(url, key)
                live.update(frame(url, now, before), refresh=True)
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        print(f"ft top: cannot read {url}: {exc or type(exc).__name__}", file=sys.stderr)
        return 1
