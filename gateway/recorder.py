"""`--record DIR`: every generation request and its answer as one JSONL line
(`gateway.record.RecordLine`), the format `ft replay` reads."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import msgspec

from gateway.record import RecordLine


class Recorder:
    def __init__(self, folder: Path):
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"session-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
        self._file = self.path.open("ab")
        self._lock = threading.Lock()
        self._encoder = msgspec.json.Encoder()

    def write(self, line: RecordLine) -> None:
        data = self._encoder.encode(line) + b"\n"
        with self._lock:
            self._file.write(data)
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()
