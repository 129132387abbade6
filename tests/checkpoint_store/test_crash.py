"""kill -9 at random moments: every acknowledged checkpoint survives, none is served torn."""

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from checkpoint_store import CheckpointStore, StoreConfig

from .crash_child import CONFIG, anchor, record
from .synth import assert_same, expected_chain

ROOT = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).with_name("crash_child.py")


def run_and_kill(disk_dir: Path, first: int, rng: random.Random) -> list[int]:
    """Start a writer, SIGKILL it after a random delay; the records it acknowledged."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, str(CHILD), str(disk_dir), str(first)], stdout=subprocess.PIPE, text=True, env=env
    )
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line.strip())
            ready.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert ready.wait(60), "the writer never started"
    time.sleep(rng.uniform(0.0, 0.5))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    reader.join()
    assert lines[0] == "ready"
    return [int(line.split()[1]) for line in lines[1:]]


def verify(disk_dir: Path, last_acked: int) -> None:
    with CheckpointStore(StoreConfig(disk_dir=disk_dir, **CONFIG)) as store:
        chain = [anchor(i) for i in range(last_acked + 1)]
        assert store.longest_restorable(chain) == len(chain)
        assert_same(store.load_chain(chain), expected_chain([record(i) for i in range(len(chain))]))
        beyond = chain + [anchor(i) for i in range(last_acked + 1, last_acked + 8)]
        n = store.longest_restorable(beyond)  # committed but unacknowledged records may be there too
        assert_same(store.load_chain(beyond[:n]), expected_chain([record(i) for i in range(n)]))
        assert store.stats().corrupt_records == 0


def test_acknowledged_checkpoints_survive_sigkill(tmp_path: Path) -> None:
    rng = random.Random(1234)
    last_acked, kills = -1, 0
    deadline = time.monotonic() + 22
    while kills < 10 and time.monotonic() < deadline:
        acks = run_and_kill(tmp_path, last_acked + 1, rng)
        assert acks == list(range(last_acked + 1, last_acked + 1 + len(acks)))
        last_acked = max([last_acked, *acks])
        kills += 1
        if last_acked >= 0:
            verify(tmp_path, last_acked)
    assert kills >= 5 and last_acked > 10
