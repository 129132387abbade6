"""`--record DIR`: every generation request and its answer as one JSONL line
(`gateway.record.RecordLine`), the format `ft replay` reads.

Recordings hold whole prompts, so the folder is made private (0700, an existing one tightened) and
the file is created private (0600) and new: never through a
link someone planted at its predictable name (O_NOFOLLOW | O_EXCL), never appended to another's."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import msgspec

from gateway.record import RecordLine

CREATE_FLAGS = (
    os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
)
MAX_NAME_TRIES = 100


def create_private(folder: Path, stem: str) -> tuple[Path, int]:
    """A new 0600 file `stem.jsonl` in `folder` (`stem-2.jsonl`, ... when taken) and its fd."""
    for n in range(1, MAX_NAME_TRIES + 1):
        path = folder / (f"{stem}.jsonl" if n == 1 else f"{stem}-{n}.jsonl")
        try:
            return path, os.open(path, CREATE_FLAGS, 0o600)
        except FileExistsError:
            continue
    raise FileExistsError(f"{folder}: no free name for {stem}.jsonl after {MAX_NAME_TRIES} tries")


class Recorder:
    def __init__(self, folder: Path):
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(folder, 0o700)  # an existing folder too: the recordings' names and count are private as well
        self.path, fd = create_private(folder, f"session-{time.strftime('%Y%m%d-%H%M%S')}")
        self._file = os.fdopen(fd, "ab")
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
