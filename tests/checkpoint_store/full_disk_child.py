"""Puts records into a store whose disk fills up: ``python full_disk_child.py DIR LIMIT_BYTES``.

The file-size limit (RLIMIT_FSIZE, as a quota or a full disk would) makes LMDB's writes fail
partway; every record must still restore (from RAM). Prints the store's stats as JSON; the
log goes to stderr.
"""

import json
import logging
import resource
import sys

import msgspec

from checkpoint_store import CheckpointStore, StoreConfig
from tests.checkpoint_store.synth import assert_same, make_snapshot

RECORDS = 24


def main(disk_dir: str, limit: int) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    config = StoreConfig(ram_bytes=64 << 20, disk_dir=disk_dir, disk_bytes=64 << 20, fingerprint="fp")
    with CheckpointStore(config) as store:
        for i in range(RECORDS):
            store.put(b"r%d" % i, None, make_snapshot(i, 0, 4, with_state=True, state_numel=8192))
            store.flush()
        for i in range(RECORDS):
            assert_same(
                store.load_chain([b"r%d" % i]), make_snapshot(i, 0, 4, with_state=True, state_numel=8192)
            )
        print(json.dumps(msgspec.structs.asdict(store.stats())), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
