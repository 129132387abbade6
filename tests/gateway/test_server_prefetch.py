"""Prefetch during tool calls on the real server (tiny preset, loopback port, the real LMDB): a session
whose restore chain is on disk only (a restarted server) has it in RAM once its answer ends in a tool
call, before its next request arrives, which then reads nothing from disk; and a request that runs
while a prefetch is held in the middle of its disk read waits for it not one engine step: its steps
are the same with prefetch on and off (counted, never timed)."""

from __future__ import annotations

import shutil
import threading

import pytest

from gateway.embedded import serve_in_thread
from gateway.pins import PinConfig
from gateway.protocols import chat
from gateway.service import ServeConfig
from tests.gateway.test_server_pins import Session


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A disk cache holding session a's first request and answer, and the engine that wrote it."""
    folder = tmp_path_factory.mktemp("cache") / "written"
    server = serve_in_thread(ServeConfig(preset="tiny", disk_cache=folder, live_sequences=0))
    try:
        Session(server, "a").step()
        server.runtime.store.flush()
        engine = server.runtime.engine
    finally:
        server.stop()
    return folder, engine


def restarted(written, tmp_path, prefetch: bool):
    """A server on a copy of the written cache: its RAM tier empty, no live sequence."""
    folder, engine = written
    shutil.copytree(folder, tmp_path / "cache")
    config = ServeConfig(preset="tiny", disk_cache=tmp_path / "cache", live_sequences=0,
                         pins=PinConfig(prefetch=prefetch))
    return serve_in_thread(config, engine)


def next_chain(server, session: Session) -> list[bytes]:
    return server.runtime.planner.plan(chat.parse_request(session.body())).chain


@pytest.mark.parametrize("prefetch", [True, False])
def test_a_disk_only_chain_is_in_ram_before_the_next_request(written, tmp_path, prefetch):
    server = restarted(written, tmp_path, prefetch)
    try:
        store, a = server.runtime.store, Session(server, "a")
        assert store.longest_restorable(next_chain(server, a)) > 0 == store.longest_in_ram(next_chain(server, a))
        a.step()  # its prompt restored from disk; its answer ends in a tool call
        assert server.runtime.retention.wait_prefetched(60)
        chain = next_chain(server, a)
        depth = store.longest_restorable(chain)
        assert depth > 0
        assert (store.longest_in_ram(chain) == depth) is prefetch
        disk_hits = store.stats().disk_hits
        restored, reasons = a.step()
        assert restored > 0 and reasons.startswith("new=") and "," not in reasons
        assert (store.stats().disk_hits == disk_hits) is prefetch  # warm: nothing read from disk
    finally:
        server.stop()


def steps_of_a_request_during_a_prefetch(written, tmp_path, prefetch: bool, monkeypatch) -> tuple[int, int]:
    """Session a's answer ends in a tool call (its chain then prefetched, its disk read held until the end);
    meanwhile session c's request runs: the engine steps it waited before it started, and the steps it
    ran to its end."""
    server = restarted(written, tmp_path, prefetch)
    rt = server.runtime
    reading, release = threading.Event(), threading.Event()
    disk = rt.store._disk
    read = disk.read

    def held(*args):
        if threading.current_thread().name == "retention":
            reading.set()
            assert release.wait(120)
        return read(*args)

    monkeypatch.setattr(disk, "read", held)
    try:
        Session(server, "a").step()
        assert not prefetch or reading.wait(60)  # the prefetch is in the middle of its disk read
        waited, started = rt.scheduler.queue_steps.sum, rt.scheduler.steps_total
        Session(server, "c").step()
        assert not prefetch or not rt.retention.wait_prefetched(0)  # still held: c ran meanwhile
        return int(rt.scheduler.queue_steps.sum - waited), rt.scheduler.steps_total - started
    finally:
        release.set()
        server.stop()


def test_a_prefetch_never_delays_a_running_requests_steps(written, tmp_path, monkeypatch):
    with_prefetch = steps_of_a_request_during_a_prefetch(written, tmp_path / "on", True, monkeypatch)
    without = steps_of_a_request_during_a_prefetch(written, tmp_path / "off", False, monkeypatch)
    assert with_prefetch == without
    assert with_prefetch[1] > 0
