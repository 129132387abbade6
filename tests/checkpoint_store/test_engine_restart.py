"""End to end: the tiny engine's checkpoints, stored to disk, restored in a new process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import xxhash

from checkpoint_store import CheckpointStore, StoreConfig

engine_mod = pytest.importorskip("engine")
ROOT = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).with_name("engine_child.py")
BOUNDARIES = [7, 15, 22, 31, 40]  # segment ends; the last segment (40..52) is the new suffix
STATE_AT = {15, 31}  # the other boundaries keep only their KV delta


def anchor_chain(ids: list[int], fingerprint: str) -> list[bytes]:
    anchors, prev, start = [], xxhash.xxh3_128_digest(fingerprint.encode()), 0
    for end in BOUNDARIES:
        prev = xxhash.xxh3_128_digest(prev + torch.tensor(ids[start:end]).numpy().tobytes())
        anchors.append(prev)
        start = end
    return anchors


def test_restore_in_a_new_process_matches_full_recompute(tmp_path: Path) -> None:
    from engine.presets import write_preset

    model_dir = write_preset("tiny", tmp_path / "tiny")
    engine = engine_mod.Engine.load(model_dir)
    ids = torch.randint(
        0, engine.config.vocab_size, (52,), generator=torch.Generator().manual_seed(3)
    ).tolist()
    chain = anchor_chain(ids, engine.fingerprint)
    result = engine.prefill(
        engine.new_state(), ids[: BOUNDARIES[-1]], capture_at=BOUNDARIES[:-1], state_at=STATE_AT
    )
    config = StoreConfig(
        ram_bytes=1 << 20, disk_dir=tmp_path / "db", disk_bytes=64 << 20, fingerprint=engine.fingerprint
    )
    with CheckpointStore(config) as store:
        for i, snapshot in enumerate(result.snapshots):
            store.put(chain[i], chain[i - 1] if i else None, snapshot)
        store.flush()  # durable: the process below opens the store cold
        assert store.longest_restorable(chain) == 4

    job = tmp_path / "job.json"
    job.write_text(
        json.dumps(
            {
                "model_dir": str(model_dir),
                "disk_dir": str(tmp_path / "db"),
                "ids": ids,
                "chain": [a.hex() for a in chain],
                "earlier": 3,
            }
        )
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, str(CHILD), str(job)], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["whole"]["anchors"] == 4 and report["whole"]["tokens"] == 31
    assert report["earlier"]["anchors"] == 2 and report["earlier"]["tokens"] == 15
    assert report["whole"]["max_abs_diff"] <= 1e-4 and report["earlier"]["max_abs_diff"] <= 1e-4
    assert report["records"]["tokens"] == 31 and report["records"]["max_abs_diff"] <= 1e-4
    assert report["stats"]["disk_hits"] > 0
