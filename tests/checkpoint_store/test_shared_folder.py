"""Processes of one model sharing one disk folder (replicas on one host): each reads what the
others wrote after it opened the folder, writes from several processes at once all land, an
eviction by one is a miss for another (never a wrong restore), a folder filled by one makes room
for another's writes, and a process opening a folder
that another has open never checks it, so never moves a live data file aside."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from checkpoint_store import CheckpointStore, StoreConfig
from checkpoint_store.environment import in_use

from .shared_child import anchor, record
from .synth import assert_same, expected_chain

ROOT = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).with_name("shared_child.py")
DISK_BYTES = 1 << 30


class Child:
    """One real process with the store open on ``folder``, answering one line a command."""

    def __init__(self, folder: Path, disk_bytes: int = DISK_BYTES) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(CHILD), str(folder), str(disk_bytes)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert self.ask_nothing() == "ready"

    def ask_nothing(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def ask(self, line: str) -> str:
        self.send(line)
        return self.ask_nothing()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.send("exit")
            assert self.proc.wait(60) == 0


@pytest.fixture
def children(tmp_path: Path):
    started: list[Child] = []

    def start(disk_bytes: int = DISK_BYTES) -> Child:
        started.append(Child(tmp_path / "db", disk_bytes))
        return started[-1]

    yield start
    for child in started:
        if child.proc.poll() is None:
            child.proc.kill()
            child.proc.wait()


def test_each_process_restores_what_the_other_wrote_after_it_opened(tmp_path: Path, children) -> None:
    a, b = children(), children()
    a.send("put a 0 6")
    b.send("put b 0 6")  # both write at once: LMDB takes their transactions in turn
    assert (a.ask_nothing(), b.ask_nothing()) == ("ok", "ok")
    assert a.ask("load b 6") == "loaded 6 same"
    assert b.ask("load a 6") == "loaded 6 same"
    # a session that moved from a to b goes on there, then comes back to a
    assert b.ask("put a 6 3") == "ok"
    assert a.ask("load a 9") == "loaded 9 same"
    # a third process opens the folder while both have it open: nothing is moved aside
    with CheckpointStore(StoreConfig(disk_dir=tmp_path / "db", ram_bytes=0, fingerprint="shared-test")) as store:
        for name, count in (("a", 9), ("b", 6)):
            chain = [anchor(name, i) for i in range(count)]
            assert store.longest_restorable(chain) == count
            assert_same(store.load_chain(chain), expected_chain([record(name, i) for i in range(count)]))
        assert store.stats().corrupt_records == 0
    a.close()
    b.close()
    assert not list((tmp_path / "db").glob("*.damaged-*"))


def test_an_eviction_by_one_process_is_a_miss_for_the_other(children) -> None:
    small = 4 << 20  # room for about 8 records of 256 KiB
    a, b = children(small), children(small)
    assert a.ask("put a 0 4") == "ok"
    assert b.ask("load a 4") == "loaded 4 same"  # b indexes a's records now
    # a makes room in its own order, which keeps a chain's tip state (a3) longer than an inner
    # record's: 40 more tips of 256 KiB each (one-record chains; the 4 MiB map holds about 8) are
    # as likely to be read as a3 and newer, so a3's state goes, and chain a no longer restores whole
    for i in range(40):
        assert a.ask(f"put t{i}_ 0 1") == "ok"
    assert int(a.ask("stats").split()[3]) > 0  # states dropped
    loaded, n, verdict = b.ask("load a 4").split()
    assert int(n) < 4 and verdict == "same"
    # a holds up to 2 MiB of the 4 MiB map in records b never read: b's seven (1.9 MiB, within b's own
    # capacity of 2 MiB) find the map full, index a's records as older than its own, and evict them to
    # land. (How full a left the map varies with its writer's batches; an order that evicted only what
    # b indexes would leave b's writes without room whenever a left it full.)
    assert b.ask("put b 0 7") == "ok"
    assert b.ask("load b 7") == "loaded 7 same"
    _, _, verdict = a.ask("load c 180").split()  # a's own, some gone under it: misses, never wrong
    assert verdict == "same"


def test_a_folder_is_in_use_while_a_process_has_it_open(tmp_path: Path, children) -> None:
    a = children()
    assert in_use(tmp_path / "db")
    a.close()
    assert not in_use(tmp_path / "db")
