"""`ft serve --replicas 2` (gateway/replicas.py) as a real process: two `tiny` workers sharing one disk
cache behind the real smg router. Sessions sent to the router's port are answered, each on one worker
and restoring its own history; `ft ps` lists the router and its workers; `ft launch` takes the router
as the server of its model; `ft stop PORT` stops all three, and a single `ft serve` on the same disk
cache afterwards restores the sessions from what the workers flushed. A worker killed outright is
logged while the router sends its sessions to the other; Ctrl-C stops the router and the rest."""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from adapters import server_start
from adapters.server_start import ServerStartError, Wanted
from ft import servers
from gateway import replicas, serve
from gateway.embedded import serve_process
from tests.adapters.test_server_start import console
from tests.conftest import group_port

README = Path(__file__).resolve().parents[2] / "README.md"
WAIT = 180
SYSTEM = "You are a careful coding agent. Keep answers short and exact. " * 8


def ft(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ft", *argv], capture_output=True, text=True, timeout=WAIT)


def turn(url: str, sid: str, history: list[dict], number: int) -> httpx.Response:
    """One chat request of session `sid`: its history and a new user message; the answer joins the history."""
    history.append({"role": "user", "content": f"Turn {number} of {sid}: list the files."})
    body = {"model": "tiny", "max_tokens": 6, "temperature": 0,
            "messages": [{"role": "system", "content": f"{sid}: {SYSTEM}"}, *history]}
    response = httpx.post(url + "/v1/chat/completions", json=body, headers={"x-session-id": sid}, timeout=WAIT)
    assert response.status_code == 200, response.text
    history.append({"role": "assistant", "content": response.json()["choices"][0]["message"]["content"]})
    return response


def started(home: Path, port: int, *argv: str) -> tuple[subprocess.Popen, servers.ServerRecord]:
    """`ft serve --replicas 2 --preset tiny --port PORT ARGV` with its output in home/group.log, once its
    router record is written (the workers answer and smg has registered them)."""
    with (home / "group.log").open("w") as out:
        group = subprocess.Popen([sys.executable, "-m", "ft", "serve", "--replicas", "2", "--preset", "tiny",
                                  "--port", str(port), "--log-level", "warning", *argv],
                                 stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + WAIT
    while (router := servers.at_port(port)) is None:
        if group.poll() is not None or time.monotonic() > deadline:
            group.kill()
            raise AssertionError((home / "group.log").read_text())
        time.sleep(0.2)
    return group, router


@pytest.fixture
def home(tmp_path, monkeypatch, ft_home) -> Path:
    """The ft home in the test's folder (the session's presets shared, written once)."""
    models = Path(ft_home) / "models"
    models.mkdir(exist_ok=True)
    (tmp_path / "models").symlink_to(models)
    monkeypatch.setenv("FT_HOME", str(tmp_path))
    return tmp_path


@pytest.mark.skipif(shutil.which("smg") is None, reason="smg (pip install smg) is not installed")
def test_replicas_serve_behind_the_router_and_stop_together(home) -> None:
    port, disk = group_port(2), home / "shared-ckpt"
    group, router = started(home, port, "--disk-cache", str(disk))
    single = None
    try:
        assert router.is_router and len(router.workers) == 2

        histories: dict[str, list[dict]] = {"s1": [], "s2": []}
        routed: dict[str, set[str]] = {sid: set() for sid in histories}
        cached: dict[str, list[int]] = {sid: [] for sid in histories}
        for number in (1, 2):
            for sid, history in histories.items():
                response = turn(router.url, sid, history, number)
                routed[sid].add(response.headers["x-smg-routed-worker-id"])
                cached[sid].append(int(response.headers["x-cached-tokens"]))
        worker_urls = {f"http://127.0.0.1:{p}" for p in router.workers}
        for sid in histories:
            assert len(routed[sid]) == 1 and routed[sid] <= worker_urls, routed  # one worker a session
            assert cached[sid][1] > cached[sid][0], cached  # the second turn restored the first

        rows = [json.loads(line) for line in ft("ps", "--json").stdout.splitlines() if line.strip()]
        by_port = {r["port"]: r for r in rows}
        assert set(by_port) == {port, *router.workers}
        assert by_port[port]["kind"] == "router" and by_port[port]["workers"] == list(router.workers)
        assert by_port[port]["answering"]
        for worker in router.workers:
            assert by_port[worker]["kind"] == "server" and by_port[worker]["router"] == port
            assert by_port[worker]["answering"]

        # ft launch takes the router as a server of its model, and refuses it for another model
        assert server_start.ensure(Wanted(router.url, "tiny"), console()) is False
        with pytest.raises(ServerStartError, match="serves tiny, not small"):
            server_start.ensure(Wanted(router.url, "small"), console())

        pids = [router.pid, *(r.pid for r in servers.running() if r.port in router.workers)]
        stopped = ft("stop", str(port))
        assert stopped.returncode == 0, stopped.stderr
        assert f"stopped the router and its workers (ports {router.workers[0]}, {router.workers[1]})" in stopped.stdout
        assert group.wait(WAIT) == 0
        assert not any(servers.alive(pid) for pid in pids) and servers.running() == []

        single, url = serve_process(["--disk-cache", str(disk), "--disk-cache-size", "1"], timeout=WAIT)
        for sid, history in histories.items():
            restored = turn(url, sid, history, 3)
            assert int(restored.headers["x-cached-tokens"]) > cached[sid][1], sid  # from the workers' disk
    finally:
        for proc in (group, single):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(60)


@pytest.mark.skipif(shutil.which("smg") is None, reason="smg (pip install smg) is not installed")
def test_a_dead_worker_is_logged_and_ctrl_c_stops_the_group(home) -> None:
    port = group_port(2)
    group, router = started(home, port)
    try:
        assert (home / "replicas" / f"disk-cache-{port}").is_dir()  # the default shared disk cache
        workers = {r.port: r for r in servers.running() if r.port in router.workers}
        victim, survivor = router.workers
        os.kill(workers[victim].pid, signal.SIGKILL)
        deadline = time.monotonic() + WAIT
        while f"worker on port {victim} exited" not in (home / "group.log").read_text():
            assert time.monotonic() < deadline and group.poll() is None, (home / "group.log").read_text()
            time.sleep(0.2)
        for sid in ("s1", "s2", "s3"):  # the router sends every session to the survivor
            assert turn(router.url, sid, [], 1).headers["x-smg-routed-worker-id"] == f"http://127.0.0.1:{survivor}"
        group.send_signal(signal.SIGINT)  # a terminal's Ctrl-C reaches the supervisor alone
        assert group.wait(WAIT) == 0
        assert not servers.alive(workers[survivor].pid) and servers.running() == []
        assert "stopping the router" in (home / "group.log").read_text()
    finally:
        if group.poll() is None:
            group.kill()
            group.wait(60)


def test_a_router_without_smg_names_the_package(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    with pytest.raises(FileNotFoundError, match="pip install smg"):
        replicas.smg_binary()


def test_workers_get_the_serve_flags_given_but_the_groups_own() -> None:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(["--replicas", "3", "--port", "9000", "--host", "0.0.0.0", "--preset", "small",
                              "--keep-volatile", "--max-queue", "5", "--disk-cache", "/tmp/x"])
    assert replicas.forwarded(args, serve.add_arguments) == ["--preset", "small", "--keep-volatile",
                                                              "--max-queue", "5"]


def test_the_router_is_started_as_readme_documents() -> None:
    (line,) = re.findall(r"^\s*(smg launch .*)$", README.read_text(), re.MULTILINE)
    argv = shlex.split(line)
    at = argv.index(replicas.ROUTING[0])
    assert tuple(argv[at:at + len(replicas.ROUTING)]) == replicas.ROUTING
