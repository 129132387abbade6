"""Restores checkpoints written by another process and checks logits against a full recompute.

Run by test_engine_restart.py: ``python engine_child.py JOB.json``; prints one JSON line.
"""

import json
import sys

import torch

from checkpoint_store import CheckpointStore, StoreConfig
from engine import Engine


def restored_logits(
    engine: Engine, store: CheckpointStore, chain: list[bytes], ids: list[int]
) -> tuple[int, int, torch.Tensor]:
    """Restore the longest stored prefix of ``chain``, prefill the rest of ``ids``: (anchors, tokens, logits)."""
    n, snapshot = store.load_longest(chain)
    assert snapshot is not None, "nothing restorable"
    state = engine.restore(snapshot)
    return n, snapshot.end, engine.prefill(state, ids[snapshot.end :]).logits


def main(job_path: str) -> None:
    job = json.loads(open(job_path).read())
    engine = Engine.load(job["model_dir"])
    ids = job["ids"]
    chain = [bytes.fromhex(a) for a in job["chain"]]
    full = engine.prefill(engine.new_state(), ids).logits
    config = StoreConfig(
        ram_bytes=0, disk_dir=job["disk_dir"], disk_bytes=64 << 20, fingerprint=engine.fingerprint
    )
    report = {}
    with CheckpointStore(config) as store:
        for name, prefix in [("whole", chain), ("earlier", chain[: job["earlier"]])]:
            n, tokens, logits = restored_logits(engine, store, prefix, ids)
            report[name] = {
                "anchors": n,
                "tokens": tokens,
                "max_abs_diff": (logits - full).abs().max().item(),
            }
        records = store.load_records(
            chain[: store.longest_restorable(chain)]
        )  # unjoined: the engine copies each delta into place
        logits = engine.prefill(engine.restore(records), ids[records[-1].end :]).logits
        report["records"] = {"tokens": records[-1].end, "max_abs_diff": (logits - full).abs().max().item()}
        report["stats"] = {
            "disk_hits": store.stats().disk_hits,
            "bytes_restored": store.stats().bytes_restored,
        }
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1])
