"""Our gateway (`ft serve`) as a subprocess on a loopback port, for the side-by-side replay."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from peer.process import HealthyProcess, free_port


@dataclass
class FtServer(HealthyProcess):
    name = "ft serve"
    preset: str | None = None
    model: Path | None = None
    policy: str = "anchor"
    extra: Sequence[str] = ()
    port: int = field(default_factory=free_port)
    log_path: Path | None = None
    proc: subprocess.Popen | None = None

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
