"""Load: N concurrent agent-like sessions against a real `ft serve` process for a while, and what
the server looks like at the end: errors, resident memory growth, client-side TTFT percentiles.

Each session is a growing multi-turn conversation over one protocol (sessions rotate through
Anthropic Messages streamed, Chat Completions non-streamed, Responses streamed), with a new user
turn after each answer, starting over past `--turns`. Every `--abandon-every`-th request of a
session is abandoned after its first streamed line (a client that leaves mid-answer), so the
cancel paths run under load too. The server's RSS is sampled every 5 s from /proc; growth is
counted from the end of the first minute (warm-up: checkpoints filling the RAM tier) to the end.

    python bench/load.py [--sessions 16] [--minutes 10] [--json bench/results/load.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from adapters.replay_report import percentile
from gateway.embedded import serve_process

MiB = 1 << 20
WARMUP_S = 60.0
PROTOCOLS = ("anthropic", "chat", "responses")


@dataclass
class Report:
    sessions: int
    seconds: float
    requests: int = 0
    abandoned: int = 0
    errors: Counter = field(default_factory=Counter)  # "status 500", "ReadTimeout", ...
    ttft_ms: list[float] = field(default_factory=list)  # streamed requests, client side
    rss_mib: list[tuple[float, float]] = field(default_factory=list)  # (seconds since start, MiB)
    exit_code: int | None = None

    def summary(self) -> dict:
        ttft = self.ttft_ms
        after_warmup = [m for t, m in self.rss_mib if t >= min(WARMUP_S, self.seconds / 2)] or [0.0]
        return {
            "sessions": self.sessions,
            "seconds": round(self.seconds, 1),
            "requests": self.requests,
            "abandoned": self.abandoned,
            "errors": sum(self.errors.values()),
            "error_kinds": dict(self.errors),
            "ttft_ms": {f"p{p}": round(percentile(ttft, p), 1) for p in (50, 90, 99)}
            | {"max": round(max(ttft, default=0), 1)},
            "rss_mib": {
                "start": round(self.rss_mib[0][1], 1) if self.rss_mib else 0,
                "after_warmup": round(after_warmup[0], 1),
                "end": round(after_warmup[-1], 1),
                "max": round(max(m for _, m in self.rss_mib), 1) if self.rss_mib else 0,
                "growth_after_warmup": round(after_warmup[-1] - after_warmup[0], 1),
            },
            "exit_code": self.exit_code,
        }


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def request_of(protocol: str, history: list[tuple[str, str]], max_tokens: int) -> tuple[str, dict]:
    messages = [{"role": role, "content": text} for role, text in history]
    if protocol == "anthropic":
        return "/v1/messages", {
            "model": "tiny",
            "max_tokens": max_tokens,
            "stream": True,
            "messages": messages,
            "system": "You are a terse coding agent.",
        }
    if protocol == "chat":
        return "/v1/chat/completions", {
            "model": "tiny",
            "max_tokens": max_tokens,
            "messages": [{"role": "system", "content": "You are terse."}, *messages],
        }
    return "/v1/responses", {
        "model": "tiny",
        "max_output_tokens": max_tokens,
        "stream": True,
        "input": messages,
        "instructions": "You are a terse coding agent.",
    }


class Session(threading.Thread):
    def __init__(self, index: int, url: str, until: float, report: Report, lock: threading.Lock, args):
        super().__init__(name=f"session-{index}", daemon=True)
        self.index, self.url, self.until = index, url, until
        self.report, self.lock, self.args = report, lock, args
        self.protocol = PROTOCOLS[index % len(PROTOCOLS)]

    def run(self) -> None:
        history: list[tuple[str, str]] = []
        n = 0
        with httpx.Client(base_url=self.url, timeout=self.args.timeout) as client:
            while time.monotonic() < self.until:
                n += 1
                if len(history) >= 2 * self.args.turns:
                    history = []
                history.append(("user", f"session {self.index} step {n}: fix the bug in module_{n % 7}.py"))
                path, body = request_of(self.protocol, history, self.args.max_tokens)
                abandon = self.args.abandon_every > 0 and n % self.args.abandon_every == 0
                try:
                    answer = self.one(client, path, body, abandon)
                except httpx.HTTPError as exc:
                    self.count(error=type(exc).__name__)
                    history.pop()
                    continue
                history.append(("assistant", answer or "ok"))

    def one(self, client: httpx.Client, path: str, body: dict, abandon: bool) -> str:
        started = time.perf_counter()
        if not body.get("stream"):
            r = client.post(path, json=body)
            self.count(error=None if r.status_code == 200 else f"status {r.status_code}")
            return r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else ""
        with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                r.read()
                self.count(error=f"status {r.status_code}")
                return ""
            ttft = None
            for line in r.iter_lines():
                if line.startswith("data: ") and ttft is None:
                    ttft = 1000 * (time.perf_counter() - started)
                    if abandon:
                        self.count(ttft=ttft, abandoned=True)
                        return ""
                if line in ("event: error", "event: response.failed") or line.startswith('data: {"error"'):
                    self.count(error="in-stream error")
                    return ""
        self.count(ttft=ttft)
        return "done"

    def count(self, error: str | None = None, ttft: float | None = None, abandoned: bool = False) -> None:
        with self.lock:
            self.report.requests += 1
            self.report.abandoned += abandoned
            if error is not None:
                self.report.errors[error] += 1
            if ttft is not None:
                self.report.ttft_ms.append(ttft)


def start_server(args) -> tuple[subprocess.Popen, str]:
    return serve_process(
        ["--preset", args.preset, "--ram-cache", str(args.ram_cache), "--max-running", str(args.max_running)],
        timeout=300,
    )


def run(args) -> dict:
    proc, url = start_server(args)
    report, lock = Report(args.sessions, args.minutes * 60), threading.Lock()
    began = time.monotonic()
    until = began + args.minutes * 60
    sessions = [Session(i, url, until, report, lock, args) for i in range(args.sessions)]
    try:
        for s in sessions:
            s.start()
        while any(s.is_alive() for s in sessions):
            report.rss_mib.append((time.monotonic() - began, rss_mib(proc.pid)))
            time.sleep(5)
        report.seconds = time.monotonic() - began
        proc.terminate()
        report.exit_code = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    return report.summary()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--turns", type=int, default=12, help="user turns before a session starts over")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument(
        "--abandon-every", type=int, default=10, help="abandon every Nth streamed request (0: never)"
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="client timeout per request, seconds")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--ram-cache", type=float, default=0.5, metavar="GiB")
    parser.add_argument("--max-running", type=int, default=4)
    parser.add_argument("--json", type=Path, default=Path(__file__).with_name("results") / "load.json")
    args = parser.parse_args(argv)
    summary = run(args)
    print(
        f"{'sessions':>8} {'seconds':>8} {'requests':>8} {'errors':>6} {'ttft p50':>9} {'p90':>8} {'p99':>8} "
        f"{'rss start':>9} {'warm':>8} {'end':>8} {'growth':>7}  (ms, MiB)"
    )
    t, m = summary["ttft_ms"], summary["rss_mib"]
    print(
        f"{summary['sessions']:>8} {summary['seconds']:>8} {summary['requests']:>8} {summary['errors']:>6} "
        f"{t['p50']:>9} {t['p90']:>8} {t['p99']:>8} {m['start']:>9} {m['after_warmup']:>8} {m['end']:>8} "
        f"{m['growth_after_warmup']:>7}"
    )
    if summary["error_kinds"]:
        print("errors:", summary["error_kinds"])
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, **summary}, indent=2) + "\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
