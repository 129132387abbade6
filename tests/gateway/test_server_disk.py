"""A damaged, unusable or full disk cache never stops `ft serve` nor fails an answer: the
server starts with one warning and answers (the damaged file moved aside, or RAM only); on
a full disk every answer completes, the write errors are counted in /metrics and the log
names them once. Damaged files: the real app in this process on a shared engine (it opens
the cache as `ft serve` does); a read-only folder and a file-size limit need a process of
their own: `ft serve` in a subprocess."""

from __future__ import annotations

import json
import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from gateway.embedded import EmbeddedServer, serve_in_thread
from gateway.service import ServeConfig
from tests.conftest import free_port

SYSTEM = {"role": "system", "content": "You are terse. " * 60}
BODY = {
    "model": "tiny",
    "max_tokens": 4,
    "temperature": 0,
    "messages": [SYSTEM, {"role": "user", "content": "hi"}],
}
FORCED = {"reasoning": "Short.", "content": "Hello there."}  # a complete message: the memo keeps its ids


class Server:
    """`ft serve` in a subprocess on a loopback port; `stop()` returns everything it logged."""

    def __init__(self, cache: Path, wrap: tuple[str, ...] = (), preexec_fn=None) -> None:
        port = free_port()
        command = [
            sys.executable,
            "-m",
            "ft",
            "serve",
            "--port",
            str(port),
            "--disk-cache",
            str(cache),
            "--disk-cache-size",
            "1",
            "--log-level",
            "warning",
        ]
        self.proc = subprocess.Popen(
            [*wrap, *command],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            preexec_fn=preexec_fn,
        )
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 120
        while time.time() < deadline and self.proc.poll() is None:
            try:
                httpx.get(self.url + "/health")
                return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise RuntimeError("ft serve did not start: " + self.stop())

    def post(self, body: dict) -> httpx.Response:
        return httpx.post(self.url + "/v1/chat/completions", json=body, timeout=120)

    def metric(self, name: str) -> float:
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
        raise AssertionError(name)

    def wait_idle(self) -> None:
        """Until no request, checkpoint put or disk write is queued or running."""
        deadline = time.time() + 60
        while not httpx.get(self.url + "/health").json()["idle"] or self.metric("ft_store_write_queue_depth"):
            assert time.time() < deadline, "the server never became idle"
            time.sleep(0.05)

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.stdout.read()


def warnings_in(log: str) -> list[str]:
    return [line for line in log.splitlines() if " WARNING " in line]


@pytest.fixture(scope="module")
def engine():
    from engine import Engine

    return Engine.from_preset("tiny")  # shared by the in-process servers: each opens only its cache


@contextmanager
def embedded(cache: Path, engine) -> Iterator[EmbeddedServer]:
    """The real app in this process on `cache` (what `ft serve --disk-cache` opens), closed on exit."""
    server = serve_in_thread(ServeConfig(preset="tiny", disk_cache=cache, disk_cache_gib=1), engine)
    try:
        yield server
    finally:
        server.stop()


def cache_warnings(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and r.name.startswith(("checkpoint_store", "gateway"))
    ]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, engine) -> Path:
    """A cache folder as a server leaves it: checkpoints of BODY's prompt and a memo entry."""
    cache = tmp_path_factory.mktemp("disk") / "cache"
    with embedded(cache, engine) as server, server.client() as client:
        body = {**BODY, "max_tokens": 64, "ft_forced_output": FORCED}
        assert client.post("/v1/chat/completions", json=body).status_code == 200
        server.wait_idle()
        server.runtime.store.flush()  # idle: handed to the store; flushed: committed to disk
        assert server.runtime.store.stats().disk_records > 0 and len(server.runtime.memo) == 1
    return cache


@pytest.fixture
def cache(pristine: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(pristine, tmp_path / "cache"))


def truncate(cache: Path) -> None:
    os.truncate(cache / "data.mdb", (cache / "data.mdb").stat().st_size // 2)


def garbage(cache: Path) -> None:
    (cache / "data.mdb").write_bytes(os.urandom(64 << 10))


def folder(cache: Path) -> None:
    (cache / "data.mdb").unlink()
    (cache / "data.mdb").mkdir()


def memo(cache: Path) -> None:
    (memo_folder,) = cache.glob("memo-*")
    (memo_folder / "data.mdb").write_bytes(b"\xff" * 4096)


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        (truncate, "truncated"),
        (garbage, "not an LMDB file"),
        (folder, "a folder where the data file should be"),
        (memo, "token memo"),
    ],
)
def test_a_damaged_cache_is_one_warning_and_the_server_answers(
    cache: Path, engine, damage, why, caplog
) -> None:
    damage(cache)
    with caplog.at_level(logging.WARNING), embedded(cache, engine) as server, server.client() as client:
        first, again = (client.post("/v1/chat/completions", json=BODY) for _ in range(2))
        assert first.status_code == again.status_code == 200
        assert first.json()["choices"][0]["finish_reason"] == "length"
        cached = int(first.headers["x-cached-tokens"])
        assert cached > 0 if damage is memo else cached == 0  # the checkpoints survive a damaged memo
        assert int(again.headers["x-cached-tokens"]) > 0  # and the cache works again
    (warning,) = cache_warnings(caplog)
    assert why in warning and "moved it aside" in warning
    assert len(list(cache.glob("**/data.mdb.damaged-*"))) == 1


def read_only_wrapper(cache: Path) -> tuple[str, ...]:
    """A command prefix under which `cache` is read-only: a read-only bind mount in a private
    mount namespace (root ignores file modes), else the folder's mode (for other users)."""
    if os.geteuid() != 0:
        cache.chmod(0o500)
        return ()
    wrap = (
        "unshare",
        "--mount",
        "sh",
        "-c",
        'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"',
        str(cache),
    )
    if shutil.which("unshare") is None:
        pytest.skip("no unshare to make a read-only mount for root")
    probe = subprocess.run(
        [*wrap, "touch", str(cache / "probe")], capture_output=True, text=True, check=False
    )
    if "Read-only file system" not in probe.stderr:
        pytest.skip(f"cannot make a read-only mount here: {probe.stderr.strip()}")
    return wrap


def test_a_read_only_cache_folder_is_one_warning_and_ram_only(cache: Path) -> None:
    """The real condition (not a simulation): `ft serve` in a subprocess sees the folder read-only."""
    before = (cache / "data.mdb").read_bytes()
    server = Server(cache, wrap=read_only_wrapper(cache))
    try:
        first, again = server.post(BODY), server.post(BODY)
        assert first.status_code == again.status_code == 200
        assert int(again.headers["x-cached-tokens"]) > 0  # from RAM
        assert server.metric("ft_store_disk_records") == 0
    finally:
        log = server.stop()
        cache.chmod(0o700)
    (warning,) = warnings_in(log)
    assert "cannot use" in warning and "RAM only" in warning, log
    assert (cache / "data.mdb").read_bytes() == before


def chat_turns(server: Server, session: int, turns: int, stream: bool) -> list[str]:
    """A session of `turns` requests, each answer sent back; returns the problems seen."""
    messages, problems = [SYSTEM], []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"session {session}, turn {turn}: go on"})
        body = {**BODY, "messages": messages, "max_tokens": 8, "stream": stream}
        if turn % 2:  # a complete message the memo keeps (its ids: about 1 KiB on disk)
            body["ft_forced_output"] = {"content": f"Answer {session}.{turn}: " + "fine, " * 100}
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as r:
            text = r.read().decode()
        if r.status_code != 200:
            problems.append(f"{r.status_code}: {text}")
            continue
        if stream:
            events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
            chunks = [json.loads(e) for e in events[:-1]]
            if events[-1:] != ["[DONE]"] or any("error" in c for c in chunks):
                problems.append(text)
                continue
            content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        else:
            content = json.loads(text)["choices"][0]["message"]["content"]
        messages.append({"role": "assistant", "content": content})
    return problems


def test_a_full_disk_fails_no_answer_and_is_logged_once(tmp_path: Path) -> None:
    """A file-size limit (RLIMIT_FSIZE, as a quota or a full disk) that the cache's files reach
    within the first answers: writes past it fail (EIO, then EFBIG, not SIGXFSZ) for the store
    and the memo alike."""
    from engine.engine import ensure_preset

    ensure_preset("tiny")  # written now: the server cannot write files over the limit
    limit = 32 << 10  # above the lock file (16.1 KiB) and an empty data file (8 KiB)

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    server = Server(tmp_path / "cache", preexec_fn=limited)
    try:
        with ThreadPoolExecutor(4) as pool:
            jobs = [pool.submit(chat_turns, server, s, 4, stream=s % 2 == 0) for s in range(4)]
            problems = [p for job in jobs for p in job.result()]
        assert problems == []
        server.wait_idle()
        errors = server.metric("ft_store_write_errors")
        assert errors > 1
        assert server.proc.poll() is None
    finally:
        log = server.stop()
    written = [line for line in warnings_in(log) if "write failed" in line]
    assert len(written) == 1, log
    (memo_file,) = (tmp_path / "cache").glob("memo-*/data.mdb")
    assert (
        memo_file.stat().st_size == (tmp_path / "cache" / "data.mdb").stat().st_size == limit
    )  # both hit it


def test_an_answer_ends_once_its_memo_write_lands_and_other_sessions_do_not_wait_for_it(
    tmp_path: Path, engine
) -> None:
    """The memo's synced write (its disk held here, as a slow disk would) keeps its own answer from
    ending, so a `kill -9` after an answer still finds its ids, but not the engine worker: another
    session's request is answered meanwhile."""
    import threading

    with embedded(tmp_path / "cache", engine) as server, server.client() as client:
        file = server.runtime.memo.file
        release, write = threading.Event(), file.write

        def held_write(put, drop=()):
            release.wait(30)
            write(put, drop)

        file.write = held_write
        with ThreadPoolExecutor(1) as pool:
            body = {**BODY, "max_tokens": 64, "ft_forced_output": FORCED}
            complete = pool.submit(client.post, "/v1/chat/completions", json=body)
            time.sleep(1.0)
            assert not complete.done()  # generated, remembered, not yet on disk: not ended
            # another session's answer, truncated (no memo write of its own), within 10 s of the 30 held
            other = {**BODY, "messages": [SYSTEM, {"role": "user", "content": "another session"}]}
            truncated = client.post("/v1/chat/completions", json=other, timeout=10)
            assert truncated.status_code == 200 and not complete.done()
            release.set()
            assert complete.result(30).status_code == 200
        assert len(list(file.entries())) == 1
