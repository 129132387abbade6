"""Hostile and departing clients against a real `ft serve` process (tiny preset, CPU):

- departed client: a non-streaming request for 1,500 tokens whose client leaves after 1 s; the
  tokens the engine generated for it, and the seconds until the server is idle;
- slowloris: N connections that send a request head a byte every second; seconds until the
  server has closed all of them;
- memory: the server's peak RSS over its start while 8 clients at once send a 30 MB prompt
  (refused by its length), then 8 a prompt just under the body limit (decoded, tokenized,
  refused as too long for the context);
- SIGTERM: with one answer streaming and two queued, seconds from the signal to the exit, the
  exit status and what each client got.

    python bench/hardening.py [--slowloris 800] [--json bench/results/hardening.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from load import rss_mib

from adapters.client import http_wait_idle
from gateway.embedded import serve_process

MiB = 1 << 20
LONG = {
    "model": "tiny",
    "max_tokens": 1500,
    "temperature": 0,
    "messages": [{"role": "user", "content": "write"}],
}


class Server:
    def __init__(self, *extra: str):
        self.proc, self.url = serve_process(list(extra), timeout=300)
        self.port = int(self.url.rsplit(":", 1)[1])
        self.peak_mib = 0.0

    def rss_mib(self) -> float:
        return rss_mib(self.proc.pid)

    def generated(self) -> int:
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line.startswith('ft_tokens_total{kind="generated"}'):
                return int(float(line.split()[-1]))
        return 0

    def wait_idle(self) -> float:
        started = time.monotonic()
        http_wait_idle(self.url)()
        return time.monotonic() - started

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(60)


def departed_client(server: Server) -> dict:
    before = server.generated()
    with contextlib.suppress(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", json=LONG, timeout=1.0)
    idle_s = server.wait_idle()
    return {
        "max_tokens": LONG["max_tokens"],
        "generated": server.generated() - before,
        "idle_after_s": round(idle_s, 2),
    }


def slowloris(server: Server, count: int) -> dict:
    socks = []
    for _ in range(count):
        s = socket.create_connection(("127.0.0.1", server.port))
        s.sendall(b"POST /v1/messages HTTP/1.1\r\nhost: x\r\n")
        socks.append(s)
    started = time.monotonic()
    open_socks = list(socks)
    while open_socks and time.monotonic() - started < 300:
        still = []
        for s in open_socks:
            try:
                s.sendall(b"x")
                still.append(s)
            except OSError:
                s.close()
        open_socks = still
        time.sleep(1)
    for s in open_socks:
        s.close()
    return {
        "connections": count,
        "all_closed_after_s": round(time.monotonic() - started, 1),
        "still_open": len(open_socks),
    }


def memory(server: Server, limit_bytes: int) -> dict:
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            server.peak_mib = max(server.peak_mib, server.rss_mib())
            time.sleep(0.05)

    def send(size: int) -> int:
        text = "word " * (size // 5)
        body = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": text}]}
        return httpx.post(server.url + "/v1/messages", json=body, timeout=300).status_code

    result = {"rss_before_mib": round(server.rss_mib(), 1)}
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    for name, size in (("30MB", 30 * MiB), ("under_limit", limit_bytes - 4096)):
        server.peak_mib = server.rss_mib()
        with ThreadPoolExecutor(8) as pool:
            statuses = list(pool.map(send, [size] * 8))
        result[name] = {"statuses": sorted(set(statuses)), "peak_rss_mib": round(server.peak_mib, 1)}
    stop.set()
    result["rss_after_mib"] = round(server.rss_mib(), 1)
    return result


def sigterm(server: Server) -> dict:
    got: dict[str, object] = {}

    def stream() -> None:
        with httpx.stream(
            "POST", server.url + "/v1/messages", json={**LONG, "stream": True}, timeout=120
        ) as r:
            lines = list(r.iter_lines())
        got["stream"] = (
            "error event"
            if "event: error" in lines
            else "cut"
            if "event: message_stop" not in lines
            else "finished"
        )

    def queued(i: int) -> None:
        got[f"queued_{i}"] = httpx.post(
            server.url + "/v1/chat/completions", json=LONG, timeout=120
        ).status_code

    threads = [
        threading.Thread(target=stream),
        threading.Thread(target=queued, args=(1,)),
        threading.Thread(target=queued, args=(2,)),
    ]
    threads[0].start()
    while httpx.get(server.url + "/health").json()["running"] < 1:
        time.sleep(0.05)
    for t in threads[1:]:
        t.start()
    while httpx.get(server.url + "/health").json()["queue_depth"] < 2:
        time.sleep(0.05)
    started = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    code = server.proc.wait(120)
    exit_s = time.monotonic() - started
    for t in threads:
        t.join(60)
    return {"exit_after_s": round(exit_s, 2), "exit_code": code, **got}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slowloris", type=int, default=800)
    parser.add_argument("--json", type=Path, default=Path(__file__).with_name("results") / "hardening.json")
    args = parser.parse_args(argv)
    server = Server()
    try:
        results = {
            "departed_client": departed_client(server),
            "slowloris": slowloris(server, args.slowloris),
            "memory": memory(server, 2 * MiB),
        }
    finally:
        server.stop()
    results["sigterm"] = sigterm(Server("--max-running", "1"))
    for name, values in results.items():
        print(f"{name:>16}: " + ", ".join(f"{k}={v}" for k, v in values.items()))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
