"""`ft serve`'s app in a thread of this process, on a free loopback port: what `ft replay
--preset` and the tests use to drive the real server without a subprocess; and `ft serve` as a
subprocess (`serve_process`) where a test or bench needs the real process (signals, limits)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import httpx
import uvicorn

from engine import Engine
from gateway.app import create_app
from gateway.http_server import ServerLimits, make_server
from gateway.ports import LOOPBACK, hold
from gateway.service import ServeConfig, Service, build_service


def serve_process(args: list[str], preexec_fn=None, timeout: float = 180,
                  env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """`ft serve ARGS` on a free port (in `env`, default this process's), once `/health` answers:
    the process (stdout and stderr together as text) and its URL."""
    with hold(LOOPBACK, 0) as sock:  # bound here, handed to the server: no other process takes the port meanwhile
        port = sock.getsockname()[1]
        command = [sys.executable, "-m", "ft", "serve", "--port", str(port), "--fd", str(sock.fileno()),
                   "--log-level", "warning", *args]
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                preexec_fn=preexec_fn, pass_fds=(sock.fileno(),), env=env)
    url = f"http://{LOOPBACK}:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            httpx.get(url + "/health")
            return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("ft serve did not start: " + (proc.stdout.read() if proc.stdout else ""))


@dataclass
class EmbeddedServer:
    url: str
    runtime: Service
    server: uvicorn.Server
    thread: threading.Thread

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=120, **kw)

    def wait_idle(self, timeout: float = 600) -> None:
        """Wait until the engine worker has no queued or running job (precompute included)."""
        deadline = time.monotonic() + timeout
        while not self.runtime.idle:
            if time.monotonic() > deadline:
                raise TimeoutError(f"server still busy after {timeout:.0f} s")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)

    def __enter__(self) -> EmbeddedServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve_in_thread(config: ServeConfig, engine: Engine | None = None, startup_timeout: float = 300,
                    limits: ServerLimits | None = None) -> EmbeddedServer:
    """Serve `config` (its host/port replaced by 127.0.0.1 and a free port) on a fresh store;
    `engine` reuses a loaded model. Returns once the server accepts connections."""
    sock = hold(LOOPBACK, 0)  # uvicorn listens on it and closes it at shutdown
    config = dataclasses.replace(config, host=LOOPBACK, port=sock.getsockname()[1])
    try:
        runtime = build_service(config, engine)
        server = make_server(create_app(runtime), config.host, config.port, limits, log_level="warning")
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="ft-embedded-server", daemon=True)
        thread.start()
        deadline = time.monotonic() + startup_timeout
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("the in-process server did not start")
            time.sleep(0.05)
    except BaseException:
        sock.close()
        raise
    return EmbeddedServer(f"http://{config.host}:{config.port}", runtime, server, thread)
