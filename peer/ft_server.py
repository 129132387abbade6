"""Our gateway (`ft serve`) as a subprocess on a loopback port, for the side-by-side replay."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from peer.llama_server import free_port


@dataclass
class FtServer:
    preset: str | None = None
    model: Path | None = None
    policy: str = "anchor"
    extra: Sequence[str] = ()
    port: int = field(default_factory=free_port)
    log_path: Path | None = None
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        source = ["--model", str(self.model)] if self.model else ["--preset", self.preset or "tiny"]
        return [
            sys.executable,
            "-m",
            "ft",
            "serve",
            *source,
            "--port",
            str(self.port),
            "--policy",
            self.policy,
            "--log-level",
            "warning",
            *self.extra,
        ]

    def start(self, timeout: float = 600.0) -> FtServer:
        log = open(self.log_path, "w") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ft serve exited with {self.proc.returncode} (log: {self.log_path})")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"ft serve not healthy after {timeout}s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> FtServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
