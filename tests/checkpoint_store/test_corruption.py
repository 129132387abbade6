"""Damaged bytes on disk are misses with a log line: never a crash, never wrong data."""

import logging
import shutil
import tempfile
from pathlib import Path

import lmdb
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpoint_store import CheckpointStore, StoreConfig
from checkpoint_store.record import PREFIX

from .synth import assert_same, expected_chain, linear_chain, put_chain

ANCHORS, SNAPS = linear_chain(4, seed=5, state_every=2)  # states at records 1 and 3
CONFIG = {"ram_bytes": 0, "disk_bytes": 16 << 20, "fingerprint": "fp"}


@pytest.fixture(scope="module")
def pristine() -> Path:
    path = Path(tempfile.mkdtemp(prefix="ckpt-corrupt-"))
    with CheckpointStore(StoreConfig(disk_dir=path / "db", **CONFIG)) as store:
        put_chain(store, ANCHORS, SNAPS)
    yield path / "db"
    shutil.rmtree(path)


@pytest.fixture
def db(pristine: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(pristine, tmp_path / "db"))


def mangle(db: Path, key: bytes, edit) -> None:
    """Rewrite one stored value through LMDB itself (as a bad disk or a bug would leave it)."""
    env = lmdb.open(str(db), map_size=CONFIG["disk_bytes"])
    with env.begin(write=True) as txn:
        txn.put(key, edit(bytearray(txn.get(key))))
    env.close()


def flip(offset: int, mask: int = 0x10):
    def edit(value: bytearray) -> bytes:
        value[offset % len(value)] ^= mask
        return bytes(value)

    return edit


def payload_start(value: bytearray) -> int:
    return -(-(PREFIX.size + PREFIX.unpack_from(value)[2]) // 64) * 64


def reopen_and_restore(db: Path) -> tuple[int, object]:
    with CheckpointStore(StoreConfig(disk_dir=db, **CONFIG)) as store:
        n, snap = store.load_longest(ANCHORS)
        if n:
            assert_same(snap, expected_chain(SNAPS[:n]))
        return n, store.stats()


def test_payload_flip_in_a_state_falls_back_to_an_earlier_state(db: Path, caplog) -> None:
    mangle(db, ANCHORS[3] + b"s", flip(-7))
    with caplog.at_level(logging.WARNING, logger="checkpoint_store"):
        n, stats = reopen_and_restore(db)
    assert n == 2 and stats.corrupt_records == 1 and stats.disk_misses >= 1
    assert "payload checksum mismatch" in caplog.text
    assert reopen_and_restore(db)[0] == 2  # the damaged state was deleted, its KV kept


def test_payload_flip_in_the_first_kv_delta_is_a_full_miss(db: Path, caplog) -> None:
    mangle(db, ANCHORS[0] + b"k", lambda v: flip(payload_start(v) + 3)(v))
    with caplog.at_level(logging.WARNING, logger="checkpoint_store"):
        n, stats = reopen_and_restore(db)
    assert n == 0 and stats.corrupt_records == 1
    assert "corrupt" in caplog.text


def test_header_flip_is_caught_when_the_store_opens(db: Path, caplog) -> None:
    mangle(db, ANCHORS[2] + b"k", flip(PREFIX.size + 5))
    with caplog.at_level(logging.WARNING, logger="checkpoint_store"):
        n, stats = reopen_and_restore(db)
    assert n == 2 and stats.corrupt_records == 1
    assert "header checksum mismatch" in caplog.text


def test_truncated_value_is_deleted(db: Path, caplog) -> None:
    mangle(db, ANCHORS[1] + b"s", lambda v: bytes(v[:-100]))
    with caplog.at_level(logging.WARNING, logger="checkpoint_store"):
        n, _ = reopen_and_restore(db)
    assert n == 4  # record 1 keeps its KV delta; record 3's state ends the chain
    assert "truncated payload" in caplog.text


def test_garbage_value_and_unknown_key(db: Path, caplog) -> None:
    mangle(db, ANCHORS[3] + b"s", lambda v: b"\x00" * 7)
    env = lmdb.open(str(db), map_size=CONFIG["disk_bytes"])
    with env.begin(write=True) as txn:
        txn.put(b"stray-key?", b"not a frame")
    env.close()
    with caplog.at_level(logging.WARNING, logger="checkpoint_store"):
        n, stats = reopen_and_restore(db)
    assert n == 2 and stats.corrupt_records == 2
    assert "truncated frame" in caplog.text and "unknown key" in caplog.text


def test_other_model_fingerprint_is_a_miss(db: Path, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="checkpoint_store"):
        with CheckpointStore(StoreConfig(disk_dir=db, **{**CONFIG, "fingerprint": "other"})) as store:
            assert store.longest_restorable(ANCHORS) == 0
    assert "fingerprint mismatch" in caplog.text


@settings(max_examples=40, deadline=None)
@given(which=st.integers(0, 5), offset=st.integers(0, 1 << 20), mask=st.integers(1, 255))
def test_any_single_byte_flip_is_a_miss_or_exact(pristine: Path, which: int, offset: int, mask: int) -> None:
    keys = [a + b"k" for a in ANCHORS] + [ANCHORS[1] + b"s", ANCHORS[3] + b"s"]
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(shutil.copytree(pristine, Path(tmp) / "db"))
        mangle(db, keys[which], flip(offset, mask))
        n, _ = reopen_and_restore(db)  # asserts exact bytes whenever something is restored
        assert n in (0, 2, 4)
