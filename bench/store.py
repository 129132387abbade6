"""Restore bandwidth of the checkpoint store, beside raw copies of the same bytes.

Checkpoints of the Qwen3.6-35B-A3B shape (synthetic tensors of the real sizes): 10
attention layers with 2 KV heads x 256 head dim in bf16 (20 KiB of KV per token), and 30
DeltaNet layers each with a conv state [8192, 3] bf16 and a recurrent state
[32, 128, 128] fp32 (about 61 MiB of state). A checkpoint at P positions is a chain of
2048-token segment records (KV deltas) whose last record also holds the state.

Measured in one run, per size:
- raw copy: ``dst.copy_(src)`` / ``np.copyto`` into a preallocated buffer, and
  ``src.clone()`` / ``ndarray.copy()`` (allocate and copy, which is what a restore into
  fresh memory must do); the faster of torch and numpy is kept;
- RAM tier: ``load_chain`` from a RAM-only store (and ``load_records``: views, no copy);
- raw file read: ``readinto`` a fresh buffer from a file of the same bytes, cold (page
  cache dropped) and warm;
- LMDB tier: ``load_chain`` from a freshly reopened disk-only store, cold and warm.
Cold means ``echo 3 > /proc/sys/vm/drop_caches`` where permitted, else
``posix_fadvise(POSIX_FADV_DONTNEED)`` on the file (the LMDB data file, closed first);
the method used and the page-cache residency checked with ``fincore`` are reported.

    python bench/store.py [--positions 8192 32768] [--repeats 3] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from checkpoint_store import CheckpointStore, StoreConfig
from checkpoint_store.snapshot import Snapshot

KV_LAYERS, KV_HEADS, HEAD_DIM = 10, 2, 256
DN_LAYERS, CONV_SHAPE, REC_SHAPE = 30, (8192, 3), (32, 128, 128)
SEGMENT = 2048
GiB, MiB = 1 << 30, 1 << 20
OUT = Path(__file__).with_suffix(".json")


def checkpoint_chain(positions: int) -> tuple[list[bytes], list[Snapshot]]:
    """Segment records of 2048 tokens; the last one holds the DeltaNet state."""
    anchors, snapshots = [], []
    for start in range(0, positions, SEGMENT):
        end = min(start + SEGMENT, positions)
        tensors = {}
        for layer in range(KV_LAYERS):
            for kind in "kv":
                tensors[f"kv.{layer}.{kind}"] = _fill(
                    (end - start, KV_HEADS, HEAD_DIM), torch.bfloat16, start + layer
                )
        if end == positions:
            for layer in range(DN_LAYERS):
                tensors[f"conv.{layer}"] = _fill(CONV_SHAPE, torch.bfloat16, layer)
                tensors[f"rec.{layer}"] = _fill(REC_SHAPE, torch.float32, layer)
        anchors.append(b"bench-%d" % start)
        snapshots.append(Snapshot(start, end, tensors))
    return anchors, snapshots


def _fill(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    return (
        torch.empty(shape, dtype=dtype)
        .view(torch.uint8)
        .random_(generator=torch.Generator().manual_seed(seed))
        .view(dtype)
    )


def best_seconds(fn: Callable[[], object], repeats: int, before: Callable[[], None] = lambda: None) -> float:
    times = []
    for _ in range(repeats):
        before()
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
        del out
    return min(times)


def drop_cache(path: Path) -> str:
    """Evict ``path`` from the page cache (written back first); returns the method that worked."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages cannot be dropped
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            if resident_bytes(path) == 0:
                return "drop_caches"
        except OSError:
            pass
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return "posix_fadvise(DONTNEED)"
    finally:
        os.close(fd)


def resident_bytes(path: Path) -> int:
    """Bytes of ``path`` in the page cache as ``fincore`` reports them (-1: unknown)."""
    try:
        out = subprocess.run(
            ["fincore", "-nb", "-o", "RES", str(path)], capture_output=True, text=True, timeout=10
        )
        return int(out.stdout.split()[0])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return -1


def raw_file_read(path: Path, nbytes: int) -> torch.Tensor:
    buf = np.empty(nbytes, dtype=np.uint8)  # the allocator the store uses, for a like-for-like figure
    with open(path, "rb", buffering=0) as f:
        f.readinto(memoryview(buf))
    return torch.from_numpy(buf)


def bench_size(positions: int, repeats: int, workdir: Path) -> dict:
    anchors, snapshots = checkpoint_chain(positions)
    nbytes = sum(s.nbytes for s in snapshots)
    row: dict = {"positions": positions, "records": len(anchors), "bytes": nbytes}
    row.update(bench_memory(nbytes, repeats))
    with CheckpointStore(StoreConfig(ram_bytes=2 * nbytes, fingerprint="bench")) as store:
        for i, (anchor, snap) in enumerate(zip(anchors, snapshots, strict=True)):
            store.put(anchor, anchors[i - 1] if i else None, snap)
        assert store.longest_restorable(anchors) == len(anchors)
        row["ram_GBps"] = nbytes / best_seconds(lambda: store.load_chain(anchors), repeats) / 1e9
        row["ram_records_GBps"] = nbytes / best_seconds(lambda: store.load_records(anchors), repeats) / 1e9
        buffers = preallocated(snapshots)
        into_place = lambda: copy_into_place(store.load_records(anchors), buffers)  # noqa: E731
        row["ram_into_place_GBps"] = nbytes / best_seconds(into_place, repeats) / 1e9
        row["ram_into_place_vs_raw_copy"] = row["ram_into_place_GBps"] / row["raw_copy_GBps"]
    row.update(bench_file(nbytes, repeats, workdir / "raw.bin"))
    row.update(bench_lmdb(anchors, snapshots, nbytes, repeats, workdir / "db"))
    for key in ("ram", "lmdb_cold", "lmdb_warm"):
        base = {"ram": "raw_clone_GBps", "lmdb_cold": "file_cold_GBps", "lmdb_warm": "file_warm_GBps"}[key]
        row[f"{key}_vs_raw"] = row[f"{key}_GBps"] / row[base]
    row["ram_vs_raw_copy"] = row["ram_GBps"] / row["raw_copy_GBps"]
    return row


def _byte_view(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy()


def preallocated(snapshots: list[Snapshot]) -> dict[str, torch.Tensor]:
    """Destination buffers a restore copies into (what Engine.restore fills: a KV cache of the
    chain's length per layer, one state per DeltaNet layer), touched once."""
    total = snapshots[-1].end
    out = {}
    for name, t in snapshots[-1].tensors.items():
        shape = (total, *t.shape[1:]) if name.startswith("kv.") else t.shape
        out[name] = torch.zeros(shape, dtype=t.dtype)
    return out


def copy_into_place(records: list[Snapshot] | None, buffers: dict[str, torch.Tensor]) -> None:
    """The restore path the gateway uses: `load_records` (views) + one single-threaded memcpy per
    part into preallocated buffers."""
    assert records is not None
    for record in records:
        for name, t in record.tensors.items():
            dst = buffers[name][record.start : record.end] if name.startswith("kv.") else buffers[name]
            np.copyto(_byte_view(dst), _byte_view(t))


def bench_memory(nbytes: int, repeats: int) -> dict:
    """Raw copies of ``nbytes``: the best of torch's and numpy's (single-threaded memcpy)."""
    src = torch.empty(nbytes, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    src_np, dst_np = src.numpy(), dst.numpy()
    dst.copy_(src)  # touch every page first
    copy = min(
        best_seconds(lambda: dst.copy_(src), repeats),
        best_seconds(lambda: np.copyto(dst_np, src_np), repeats),
    )
    clone = min(best_seconds(src.clone, repeats), best_seconds(src_np.copy, repeats))
    return {"raw_copy_GBps": nbytes / copy / 1e9, "raw_clone_GBps": nbytes / clone / 1e9}


def bench_file(nbytes: int, repeats: int, raw: Path) -> dict:
    with open(raw, "wb") as f:
        f.write(memoryview(torch.empty(nbytes, dtype=torch.uint8).random_().numpy()))
    row = {"cache_drop": drop_cache(raw), "raw_file_resident_before_cold": resident_bytes(raw)}
    row["file_cold_GBps"] = (
        nbytes / best_seconds(lambda: raw_file_read(raw, nbytes), repeats, lambda: drop_cache(raw)) / 1e9
    )
    row["file_warm_GBps"] = nbytes / best_seconds(lambda: raw_file_read(raw, nbytes), repeats) / 1e9
    raw.unlink()
    return row


def bench_lmdb(anchors: list[bytes], snapshots: list[Snapshot], nbytes: int, repeats: int, db: Path) -> dict:
    config = StoreConfig(ram_bytes=0, disk_dir=db, disk_bytes=4 * nbytes + 64 * MiB, fingerprint="bench")
    row = {}
    with CheckpointStore(config) as store:
        t0 = time.perf_counter()
        for i, (anchor, snap) in enumerate(zip(anchors, snapshots, strict=True)):
            store.put(anchor, anchors[i - 1] if i else None, snap)
        store.flush()
        row["lmdb_write_GBps"] = nbytes / (time.perf_counter() - t0) / 1e9
    data = db / "data.mdb"

    def cold_load() -> Snapshot | None:
        with CheckpointStore(config) as store:  # a restart: nothing of it in RAM
            return store.load_chain(anchors)

    drop_cache(data)
    row["lmdb_resident_before_cold"] = resident_bytes(data)
    row["lmdb_cold_GBps"] = nbytes / best_seconds(cold_load, repeats, lambda: drop_cache(data)) / 1e9
    with CheckpointStore(config) as store:
        assert store.load_chain(anchors) is not None
        row["lmdb_warm_GBps"] = nbytes / best_seconds(lambda: store.load_chain(anchors), repeats) / 1e9
        row["lmdb_records_warm_GBps"] = (
            nbytes / best_seconds(lambda: store.load_records(anchors), repeats) / 1e9
        )
    shutil.rmtree(db)
    return row


COLUMNS = [  # (label, key, format); ratios compare like with like
    ("bytes (MiB)", "bytes", "{:.0f}"),
    ("raw memcpy into preallocated memory", "raw_copy_GBps", "{:.2f}"),
    ("raw clone (allocate + memcpy)", "raw_clone_GBps", "{:.2f}"),
    ("RAM tier load_chain", "ram_GBps", "{:.2f}"),
    ("  RAM tier / raw clone", "ram_vs_raw", "{:.0%}"),
    ("  RAM tier / raw copy", "ram_vs_raw_copy", "{:.0%}"),
    ("RAM tier load_records (views, no copy)", "ram_records_GBps", "{:.1f}"),
    ("RAM tier restore into place (records + memcpy)", "ram_into_place_GBps", "{:.2f}"),
    ("  into place / raw copy", "ram_into_place_vs_raw_copy", "{:.0%}"),
    ("raw file read, cold", "file_cold_GBps", "{:.2f}"),
    ("LMDB tier load_chain, cold (reopened)", "lmdb_cold_GBps", "{:.2f}"),
    ("  LMDB / file, cold", "lmdb_cold_vs_raw", "{:.0%}"),
    ("raw file read, warm", "file_warm_GBps", "{:.2f}"),
    ("LMDB tier load_chain, warm", "lmdb_warm_GBps", "{:.2f}"),
    ("  LMDB / file, warm", "lmdb_warm_vs_raw", "{:.0%}"),
    ("LMDB tier load_records, warm", "lmdb_records_warm_GBps", "{:.2f}"),
    ("LMDB put + flush (write)", "lmdb_write_GBps", "{:.2f}"),
]


def print_table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="checkpoint store restore bandwidth, GB/s (best of repeats)")
    table.add_column("measure")
    for row in rows:
        table.add_column(f"{row['positions']} positions ({row['records']} records)", justify="right")
    for label, key, fmt in COLUMNS:
        scale = MiB if key == "bytes" else 1
        table.add_row(label, *[fmt.format(row[key] / scale) for row in rows])
    Console(width=120).print(table)
    for row in rows:
        print(
            f"{row['positions']}: cold reads by {row['cache_drop']}; resident before: "
            f"file {row['raw_file_resident_before_cold']} B, LMDB {row['lmdb_resident_before_cold']} B"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--positions", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="scratch directory on the disk to measure")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="bench-store-", dir=args.dir))
    try:
        rows = [bench_size(p, args.repeats, workdir) for p in args.positions]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print_table(rows)
    result = {"torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(), "rows": rows}
    OUT.write_text(json.dumps(result, indent=2))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
