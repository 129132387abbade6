"""`--replay-outputs FILE`: outputs the engine teacher-forces for successive requests.

FILE is JSONL, one `ft_forced_output` object per line (`{"reasoning", "content",
"tool_calls": [{"name", "arguments"}]}`). Each request that carries tools and has no forced
output of its own takes the next line (side requests without tools, such as title
generation, sample normally); once the file is used up, requests sample normally. The
engine still computes every step, so checkpoints and timings are those of real use.
"""

from __future__ import annotations

import threading
from pathlib import Path

import msgspec

from gateway.conversation import AssistantOutput


class ReplayOutputs:
    def __init__(self, outputs: list[AssistantOutput]):
        self._outputs = list(outputs)
        self._next = 0
        self._lock = threading.Lock()

    @classmethod
    def load(cls, path: Path) -> ReplayOutputs:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        try:
            return cls([msgspec.json.decode(line, type=AssistantOutput) for line in lines])
        except msgspec.ValidationError as exc:
            raise ValueError(f"{path}: not a list of forced outputs ({exc})") from None

    def take(self) -> AssistantOutput | None:
        with self._lock:
            if self._next >= len(self._outputs):
                return None
            self._next += 1
            return self._outputs[self._next - 1]
