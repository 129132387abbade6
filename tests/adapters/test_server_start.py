"""How `ft launch` finds or starts its server (adapters/server_start.py), with the real `ft serve`
of the `tiny` preset on a loopback port and the ft home in the test's folder: launchers started
together for one port start one server and share it, a launcher waits for an `ft serve` started by
hand, and what a dead launcher or server left behind (its record, its start lock) does not block a start."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from rich.console import Console

from adapters import server_start
from adapters.server_start import ServerStartError, Wanted
from ft import servers
from tests.conftest import free_port

SERVE = ("--log-level", "warning")


@pytest.fixture
def port(tmp_path, monkeypatch, ft_home):
    """A free port, with the ft home in the test's folder (its presets shared with the session's
    home, written once); whatever server is left on it at the end, loaded or still loading, is stopped."""
    models = Path(ft_home) / "models"
    models.mkdir(exist_ok=True)
    (tmp_path / "models").symlink_to(models)
    monkeypatch.setenv("FT_HOME", str(tmp_path))
    port = free_port()
    yield port
    if (record := servers.at_port(port)) is not None:
        servers.stop(record, timeout=60)
    if (pid := servers.starting_pid(port)) is not None:
        os.kill(pid, signal.SIGKILL)


def console() -> Console:
    return Console(file=io.StringIO(), width=200)


def serve_children(port: int) -> list[int]:
    """The live `ft serve` processes on `port` that this process started."""
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            stat = (proc / "stat").read_text()
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == os.getpid() and state != "Z" and b"serve" in argv and str(port).encode() in argv:
            pids.append(int(proc.name))
    return pids


def test_launchers_started_together_start_one_server_and_share_it(port):
    url = f"http://127.0.0.1:{port}"
    models = ["tiny", "tiny", "tiny-next"]
    wanted = [Wanted(url, m, ("--preset", m, *SERVE)) for m in models]
    consoles = [console() for _ in wanted]
    together = threading.Barrier(len(wanted))

    def launch(i: int) -> bool | ServerStartError:
        together.wait()
        try:
            return server_start.ensure(wanted[i], consoles[i])
        except ServerStartError as exc:
            return exc

    with ThreadPoolExecutor(len(wanted)) as pool:
        results = list(pool.map(launch, range(len(wanted))))

    outputs = [c.file.getvalue() for c in consoles]
    assert sum(o.count("starting ft serve") for o in outputs) == 1, outputs
    assert sum(o.count("waiting for ft serve") for o in outputs) == 2, outputs  # the others came while it loaded
    [starter] = [i for i, r in enumerate(results) if r is True]
    record = servers.at_port(port)
    assert record is not None and record.model == models[starter]
    for model, result in zip(models, results, strict=True):
        if model == record.model:
            assert result in (True, False)  # the one that started it, or one that uses it
        else:
            assert isinstance(result, ServerStartError)
            assert f"serves {record.model}, not {model}" in str(result) and "--replace" in str(result)
    assert serve_children(port) == [record.pid]
    assert server_start.answers(url) and server_start.ensure(wanted[starter], console()) is False


def test_what_a_dead_launcher_and_server_left_does_not_block_a_start(port):
    lock = servers.lock_path(port)
    lock.parent.mkdir(parents=True)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys\n"
         f"fd = os.open({str(lock)!r}, os.O_RDWR | os.O_CREAT)\n"
         "fcntl.flock(fd, fcntl.LOCK_EX)\nos.write(fd, b'%d' % os.getpid())\nprint('held', flush=True)\n"
         "sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    assert servers.start_held(port)
    holder.kill()
    holder.wait()
    servers.write(servers.ServerRecord(holder.pid, "127.0.0.1", port, "tiny", "tiny", time.time()))
    assert servers.record_path(port).exists() and lock.read_text() == str(holder.pid)

    out = console()
    assert server_start.ensure(Wanted(f"http://127.0.0.1:{port}", "tiny", ("--preset", "tiny", *SERVE)), out) is True
    assert "waiting for" not in out.file.getvalue()
    record = servers.at_port(port)
    assert record is not None and record.pid != holder.pid and serve_children(port) == [record.pid]


def test_a_launcher_waits_for_a_server_started_by_hand_and_a_hand_start_for_a_launcher(port):
    url = f"http://127.0.0.1:{port}"
    serve = [sys.executable, "-m", "ft", "serve", "--preset", "tiny", "--port", str(port), *SERVE]
    by_hand = subprocess.Popen(serve, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while servers.starting_pid(port) != by_hand.pid:  # it holds the port's start lock while it loads
            assert by_hand.poll() is None and time.monotonic() < deadline, by_hand.stderr.read()
            time.sleep(0.05)
        out = console()
        assert server_start.ensure(Wanted(url, "tiny", ("--preset", "tiny", *SERVE)), out) is False
        assert "waiting for ft serve" in out.file.getvalue() and "started by hand" in out.file.getvalue()
        assert serve_children(port) == [by_hand.pid]

    finally:
        by_hand.terminate()
        by_hand.wait(60)

    with servers.start_lock(port) as lock:  # a launcher holds the lock: a start by hand is refused
        assert lock is not None
        refused = subprocess.run(serve, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and f"starting a server on port {port}" in refused.stderr
