"""Shared fixtures: a private FT_HOME (presets written once per run) and a live `ft serve`
app on a loopback port (the real app, engine and store, served by uvicorn in a thread)."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest


@pytest.fixture(scope="session", autouse=True)
def ft_home(tmp_path_factory) -> str:
    home = os.environ.get("FT_TEST_HOME") or str(tmp_path_factory.mktemp("ft_home"))
    os.environ["FT_HOME"] = home
    return home


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LiveServer:
    url: str
    runtime: object
    server: object
    thread: threading.Thread

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=120, **kw)

    def wait_idle(self, timeout: float = 120) -> None:
        """Wait until background work (precompute) has drained."""
        deadline = time.time() + timeout
        while not self.runtime.scheduler.idle:
            if time.time() > deadline:
                raise TimeoutError("scheduler still busy")
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def start_server(**config) -> LiveServer:
    import uvicorn

    from gateway.app import create_app
    from gateway.runtime import ServeConfig, build_runtime

    port = free_port()
    runtime = build_runtime(ServeConfig(port=port, **config))
    server = uvicorn.Server(uvicorn.Config(create_app(runtime), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not server.started:
        if time.time() > deadline or not thread.is_alive():
            raise RuntimeError("server did not start")
        time.sleep(0.05)
    return LiveServer(f"http://127.0.0.1:{port}", runtime, server, thread)


@pytest.fixture(scope="module")
def live_server() -> Iterator[LiveServer]:
    server = start_server(preset="tiny", policy="anchor", default_max_tokens=16)
    yield server
    server.stop()
