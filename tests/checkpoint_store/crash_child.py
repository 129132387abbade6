"""Writes a chain of checkpoints until killed; prints ``ack <i>`` once record ``i`` is durable.

Run by test_crash.py: ``python crash_child.py DIR FIRST``.
"""

import sys

from checkpoint_store import CheckpointStore, StoreConfig
from tests.checkpoint_store.synth import make_snapshot

STATE_NUMEL = 65536  # 256 KiB of fp32 state per record: kills land inside writes
CONFIG = {"ram_bytes": 8 << 20, "disk_bytes": 1 << 30, "fingerprint": "crash-test"}


def anchor(i: int) -> bytes:
    return b"c%d" % i


def record(i: int):
    return make_snapshot(i, 4 * i, 4 * i + 4, with_state=True, state_numel=STATE_NUMEL)


def main(disk_dir: str, first: int) -> None:
    store = CheckpointStore(StoreConfig(disk_dir=disk_dir, **CONFIG))
    print("ready", flush=True)
    i = first
    while True:
        burst = range(i, i + 1 + i % 3)  # 1 to 3 records per flush: group commits too
        for j in burst:
            store.put(anchor(j), anchor(j - 1) if j else None, record(j))
        store.flush()
        for j in burst:
            print(f"ack {j}", flush=True)
        i = burst[-1] + 1


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
