"""Failures of the cache's disk I/O, counted and logged without flooding the log.

A full disk fails every write after the first, and a broken disk every read: a log line
per failure would bury everything else. Each failure is counted; the first one is a
warning, later ones a summary line at most once per ``summary_seconds`` (how many, and
their causes: a write that crosses a file-size limit fails with EIO, the next one with
EFBIG, and the token memo's writes fail with the checkpoints').
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter


def cause(exc: BaseException | str) -> str:
    """What went wrong, without the call that noticed it (``mdb_txn_commit: Input/output
    error`` and ``mdb_put: Input/output error`` are one cause)."""
    if isinstance(exc, str):
        return exc
    return f"{type(exc).__name__}: {str(exc).rsplit(': ', 1)[-1]}"


class ErrorLog:
    """A thread-safe counter of failures of one kind (``what``: "checkpoint cache write") that
    logs on ``logger``; ``consequence`` says what happens instead (the answer is not affected)."""

    def __init__(
        self, logger: logging.Logger, what: str, consequence: str, summary_seconds: float = 300.0
    ) -> None:
        self.logger, self.what, self.consequence = logger, what, consequence
        self.summary_seconds = summary_seconds
        self.count = 0
        self._lock = threading.Lock()
        self._unlogged: Counter[str] = Counter()
        self._last_line = 0.0

    def record(self, exc: BaseException | str, where: str = "", trace: bool = False) -> None:
        """Count one failure (``where``: what was being written or read, for the log; ``trace``:
        log the first with its traceback, for failures that are not the disk's)."""
        with self._lock:
            self.count += 1
            now = time.monotonic()
            if self.count == 1:
                self._last_line = now
                self.logger.warning(
                    "%s failed%s: %s; %s (further failures are counted, and summarised at most every %.0f s)",
                    self.what,
                    f" ({where})" if where else "",
                    exc,
                    self.consequence,
                    self.summary_seconds,
                    exc_info=exc if trace and isinstance(exc, BaseException) else None,
                )
                return
            self._unlogged[cause(exc)] += 1
            if now - self._last_line >= self.summary_seconds:
                causes = ", ".join(f"{c} ×{n}" for c, n in self._unlogged.most_common())
                self.logger.warning(
                    "%d more %s failures in %.0f s (%d in all): %s",
                    self._unlogged.total(),
                    self.what,
                    now - self._last_line,
                    self.count,
                    causes,
                )
                self._unlogged.clear()
                self._last_line = now
