"""A store on a folder that other processes have open too, driven line by line on stdin.

Run by test_shared_folder.py: ``python shared_child.py DIR DISK_BYTES``. Commands:
``put NAME FIRST COUNT`` writes records FIRST..FIRST+COUNT-1 of chain NAME and flushes them;
``load NAME COUNT`` restores the longest prefix of the chain's first COUNT records it can;
``stats`` tells the disk tier's evictions. Each answers one line: ``ok``, ``loaded N same|differs``
or ``evictions N states_dropped M``; ``exit`` closes the store.
"""

import sys

from checkpoint_store import CheckpointStore, StoreConfig
from tests.checkpoint_store.synth import assert_same, expected_chain, make_snapshot

STATE_NUMEL = 65536  # 256 KiB of fp32 state a record


def anchor(name: str, i: int) -> bytes:
    return f"{name}{i}".encode()


def record(name: str, i: int):
    return make_snapshot(ord(name[0]) * 1000 + i, 4 * i, 4 * i + 4, with_state=True, state_numel=STATE_NUMEL)


def load(store: CheckpointStore, name: str, count: int) -> str:
    n, snapshot = store.load_longest([anchor(name, i) for i in range(count)])
    if n == 0:
        return "loaded 0 same"
    try:
        assert_same(snapshot, expected_chain([record(name, i) for i in range(n)]))
    except AssertionError:
        return f"loaded {n} differs"
    return f"loaded {n} same"


def main(disk_dir: str, disk_bytes: int) -> None:
    config = StoreConfig(ram_bytes=0, disk_dir=disk_dir, disk_bytes=disk_bytes, fingerprint="shared-test")
    with CheckpointStore(config) as store:
        print("ready", flush=True)
        for line in sys.stdin:
            command, *args = line.split()
            if command == "put":
                name, first, count = args[0], int(args[1]), int(args[2])
                for i in range(first, first + count):
                    store.put(anchor(name, i), anchor(name, i - 1) if i else None, record(name, i))
                store.flush()
                print("ok", flush=True)
            elif command == "load":
                print(load(store, args[0], int(args[1])), flush=True)
            elif command == "stats":
                stats = store.stats()
                print(f"evictions {stats.disk_evictions} states_dropped {stats.disk_states_dropped}", flush=True)
            else:
                break


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
