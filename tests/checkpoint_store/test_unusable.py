"""A disk cache that is damaged, unusable or full never stops the store: one warning, then an
empty disk tier (the damaged file moved aside) or RAM only; failed writes and reads are
counted, and a restore that cannot read the disk is a miss."""

import json
import logging
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from checkpoint_store import CheckpointStore, StoreConfig
from checkpoint_store.environment import damage
from checkpoint_store.error_log import ErrorLog

from .synth import assert_same, expected_chain, linear_chain, make_snapshot, put_chain

ROOT = Path(__file__).resolve().parents[2]
ANCHORS, SNAPS = linear_chain(4, seed=9)
BIG = make_snapshot(77, 0, 4, with_state=True, state_numel=16384)  # 64 KiB: overflow pages
CONFIG = {"ram_bytes": 64 << 20, "disk_bytes": 16 << 20, "fingerprint": "fp"}


@pytest.fixture(scope="module")
def pristine() -> Path:
    path = Path(tempfile.mkdtemp(prefix="ckpt-unusable-"))
    with CheckpointStore(StoreConfig(disk_dir=path / "db", **CONFIG)) as store:
        put_chain(store, ANCHORS, SNAPS)
        store.put(b"big", None, BIG)
    yield path / "db"
    shutil.rmtree(path)


@pytest.fixture
def db(pristine: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(pristine, tmp_path / "db"))


def node_offset(data_file: Path, key: bytes) -> int:
    """Where the leaf node of ``key`` starts in the file (LMDB 0.9: data size u16 lo, u16 hi,
    flags u16, key size u16, then the key)."""
    raw = data_file.read_bytes()
    at = raw.index(struct.pack("=H", len(key)) + key)
    return at - 6


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def opens_empty_and_works(db: Path, caplog, why: str) -> None:
    """The store opens with one warning naming ``why``, the damaged file moved aside, and
    stores and restores as a fresh one would (surviving a reopen)."""
    with caplog.at_level(logging.WARNING, logger="checkpoint_store"):
        with CheckpointStore(StoreConfig(disk_dir=db, **CONFIG)) as store:
            assert store.longest_restorable(ANCHORS) == 0
            put_chain(store, ANCHORS, SNAPS)
    (warning,) = warnings_of(caplog)
    assert why in warning and "moved it aside" in warning
    assert len(list(db.glob("data.mdb.damaged-*"))) == 1
    with CheckpointStore(StoreConfig(disk_dir=db, **{**CONFIG, "ram_bytes": 0})) as store:
        assert_same(store.load_chain(ANCHORS), expected_chain(SNAPS))


def test_truncated_data_file_is_moved_aside(db: Path, caplog) -> None:
    data = db / "data.mdb"
    os.truncate(data, data.stat().st_size // 2)  # mapped as it is, the first read past the end is a SIGBUS
    opens_empty_and_works(db, caplog, "truncated")


def test_garbage_data_file_is_moved_aside(db: Path, caplog) -> None:
    (db / "data.mdb").write_bytes(os.urandom(3 * 4096))
    opens_empty_and_works(db, caplog, "not an LMDB file")


def test_a_folder_in_place_of_the_data_file_is_moved_aside(tmp_path: Path, caplog) -> None:
    db = tmp_path / "db"
    (db / "data.mdb").mkdir(parents=True)
    opens_empty_and_works(db, caplog, "a folder where the data file should be")


def test_a_value_that_runs_past_the_end_of_the_file_is_found_before_mapping(db: Path, caplog) -> None:
    """The meta pages are fine, but a node claims more bytes than the file holds: reading that
    value would be a SIGBUS in the server; the check in a child process finds it."""
    data = db / "data.mdb"
    at = node_offset(data, b"bigs")
    with data.open("r+b") as f:
        f.seek(at)
        f.write(struct.pack("=HH", 0, 8 << 20 >> 16))  # 8 MiB: inside the map, past the file's end
    assert "crashed the checking process (SIGBUS)" in (damage(db) or "")
    opens_empty_and_works(db, caplog, "SIGBUS")


def test_an_unusable_folder_leaves_the_store_in_ram(tmp_path: Path, caplog) -> None:
    (tmp_path / "db").write_bytes(b"a file where the cache folder should be")
    with caplog.at_level(logging.WARNING, logger="checkpoint_store"):
        with CheckpointStore(StoreConfig(disk_dir=tmp_path / "db", **CONFIG)) as store:
            put_chain(store, ANCHORS, SNAPS)
            store.flush()
            assert_same(store.load_chain(ANCHORS), expected_chain(SNAPS))
            assert store.stats().disk_records == 0 and not store.has_disk
    (warning,) = warnings_of(caplog)
    assert "cannot use" in warning and "RAM only" in warning


def test_files_are_private(tmp_path: Path) -> None:
    with CheckpointStore(StoreConfig(disk_dir=tmp_path / "new" / "db", **CONFIG)) as store:
        put_chain(store, ANCHORS, SNAPS)
    assert (tmp_path / "new" / "db").stat().st_mode & 0o777 == 0o700
    for name in ("data.mdb", "lock.mdb"):
        assert (tmp_path / "new" / "db" / name).stat().st_mode & 0o777 == 0o600


def test_files_of_an_earlier_version_become_private(db: Path) -> None:
    (db / "data.mdb").chmod(0o644)
    CheckpointStore(StoreConfig(disk_dir=db, **CONFIG)).close()
    assert (db / "data.mdb").stat().st_mode & 0o777 == 0o600


def test_a_page_damaged_while_open_is_a_counted_miss(db: Path, caplog) -> None:
    with CheckpointStore(StoreConfig(disk_dir=db, **{**CONFIG, "ram_bytes": 0})) as store:
        assert store.longest_restorable([b"big"]) == 1
        data = db / "data.mdb"
        page = node_offset(data, b"bigs") // 4096 * 4096
        with data.open("r+b") as f:  # the leaf page that holds the node: its flags say nothing
            f.seek(page + 10)
            f.write(b"\x00\x00")
        with caplog.at_level(logging.WARNING, logger="checkpoint_store"):
            assert store.load_chain([b"big"]) is None
        stats = store.stats()
        assert stats.read_errors == 1 and stats.restore_misses == 1
        assert store.longest_restorable([b"big"]) == 0  # not asked for again
    assert "checkpoint read failed" in caplog.text


def test_a_full_disk_drops_writes_counts_them_and_logs_once(tmp_path: Path) -> None:
    """A file-size limit (as a quota or a full disk) makes LMDB's commits fail partway: the
    records stay restorable from RAM, the errors are counted, and the log has one line."""
    done = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("full_disk_child.py")), str(tmp_path / "db"), "300000"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    stats = json.loads(done.stdout)
    assert stats["write_errors"] > 1 and stats["disk_records"] < stats["puts"]
    assert done.stderr.count("WARNING") == 1 and "checkpoint cache write failed" in done.stderr
    assert damage(tmp_path / "db") is None  # what was committed is intact


def test_error_log_logs_the_first_failure_then_summaries(caplog) -> None:
    logger = logging.getLogger("checkpoint_store.test")
    quiet, chatty = (
        ErrorLog(logger, "disk write", "none"),
        ErrorLog(logger, "disk write", "none", summary_seconds=0),
    )
    with caplog.at_level(logging.WARNING, logger="checkpoint_store.test"):
        for exc in (
            OSError(5, "Input/output error"),
            OSError(27, "File too large"),
            OSError(27, "File too large"),
        ):
            quiet.record(exc)
        assert quiet.count == 3 and len(caplog.records) == 1
        for exc in ("map full", "disk gone", "disk gone"):
            chatty.record(exc)
    assert chatty.count == 3 and len(caplog.records) == 4
    assert caplog.records[-1].getMessage() == "1 more disk write failures in 0 s (3 in all): disk gone ×1"
