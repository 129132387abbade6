"""The server `ft launch` points an agent at: the one answering at the URL when it serves the model
asked for, else a new `ft serve` started in the background on this machine.

A started server runs in its own process group (the agent's Ctrl-C does not reach it), with its
output in the ft home (`ft.servers.log_path`); it registers itself there once it listens
(`ft ps`, `ft stop`). While it loads, the log's lines are shown; a server that exits first is an
error quoting the end of its log. Launchers started together for one port start one server: the
others wait for it, showing its log the same way (`ensure`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx
from rich.console import Console

from ft import env, servers

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1", "0.0.0.0")


class ServerStartError(Exception):
    """A user-facing failure of finding or starting the server (one message, no traceback)."""


@dataclass(frozen=True)
class Wanted:
    """The server asked for: its URL, the model (a path, hub spec or preset name; None: whichever
    a running server serves, else the default preset) and the `ft serve` options to start it with."""

    url: str
    model: str | None
    serve_argv: tuple[str, ...] = ()
    api_key: str | None = None

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or "127.0.0.1"

    @property
    def port(self) -> int:
        return urlsplit(self.url).port or 80

    @property
    def local(self) -> bool:
        return self.host in LOCAL_HOSTS

    def command(self) -> list[str]:
        model = ["--model", self.model] if self.model and "--preset" not in self.serve_argv else []
        return [sys.executable, "-m", "ft", "serve", "--host", self.host, "--port", str(self.port), *model,
                *self.serve_argv]


def answers(url: str) -> bool:
    """Whether an HTTP server answers at `url` (any status: a draining one answers 503)."""
    try:
        httpx.get(f"{url}/health", timeout=5.0)
    except httpx.HTTPError:
        return False
    return True


def served(wanted: Wanted) -> tuple[str | None, list[str]]:
    """What the server at the URL serves: the model it was asked for (its record, when it runs
    from this ft home) and the ids it lists."""
    record = servers.at_port(wanted.port) if wanted.local else None
    try:
        ids = [str(m.get("id")) for m in httpx.get(f"{wanted.url}/v1/models", timeout=5.0).json()["data"]]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        ids = []
    return (record.model if record else None), ids


def same_model(asked: str, spec: str | None, ids: list[str]) -> bool:
    if asked == spec or asked in ids:
        return True
    path = Path(asked).expanduser()
    if spec is not None and path.exists() and Path(spec).expanduser().exists():
        return path.resolve() == Path(spec).expanduser().resolve()
    return path.exists() and path.name in ids


def check_model(wanted: Wanted) -> None:
    """A running server that serves another model than the one asked for is an error naming
    the flags that replace it or start another beside it."""
    if wanted.model is None:
        return
    spec, ids = served(wanted)
    if same_model(wanted.model, spec, ids):
        return
    serving = spec or ", ".join(ids) or "an unknown model"
    raise ServerStartError(
        f"{wanted.url} serves {serving}, not {wanted.model}: pass --replace to stop it and start {wanted.model}, "
        f"or --server http://127.0.0.1:PORT to start another beside it"
    )


def stop_running(wanted: Wanted) -> None:
    record = servers.at_port(wanted.port) if wanted.local else None
    if record is None:
        raise ServerStartError(f"--replace: the server at {wanted.url} was not started from this machine's ft home")
    if not servers.stop(record):
        raise ServerStartError(f"--replace: the server at {wanted.url} (pid {record.pid}) did not stop")


def start(wanted: Wanted, console: Console, lock: int) -> subprocess.Popen:
    """`ft serve` in the background, in its own session; it inherits `lock`, the port's start lock,
    and holds it while it lives. Returns once it answers."""
    log = servers.log_path(wanted.port)
    child_env = dict(os.environ, PYTHONUNBUFFERED="1")
    if wanted.api_key is not None:
        child_env[env.API_KEY] = wanted.api_key  # not on the command line, where ps shows it
    with log.open("w", encoding="utf-8") as out:
        proc = subprocess.Popen(wanted.command(), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                env=child_env, start_new_session=True, pass_fds=(lock,))
    servers.mark_starting(lock, proc.pid)
    console.print(f"starting ft serve on {wanted.url} (pid {proc.pid}, log {log})", highlight=False)
    try:
        wait_ready(proc, wanted.url, log, console)
    except BaseException:
        proc.terminate()
        proc.wait(30)
        raise
    return proc


def wait_ready(proc: subprocess.Popen, url: str, log: Path, console: Console) -> None:
    """Show the server's log as it loads until `/health` answers; a server that exits first is an error."""

    def ready() -> bool:
        if proc.poll() is not None:
            raise ServerStartError(f"ft serve exited with code {proc.returncode} (log {log}):\n{servers.log_tail(log)}")
        return answers(url)

    show_log(log, console, ready)


def follow(wanted: Wanted, console: Console) -> None:
    """Wait for the server another launcher (or `ft serve` by hand) is starting on the port, its log shown as
    `wait_ready` shows it, until it answers; a server that exits first is an error. Returns
    without waiting when the start lock is let go before a server is named in it (that launcher
    stopped before starting one): the caller may then start it."""
    while (pid := servers.starting_pid(wanted.port)) is None:
        if not servers.start_held(wanted.port) or answers(wanted.url):
            return
        time.sleep(0.05)
    log = servers.log_path(wanted.port)
    console.print(f"waiting for ft serve on {wanted.url}, which another ft launch or a hand started (pid {pid}, "
                  f"log {log})", highlight=False)

    def ready() -> bool:
        if not servers.alive(pid):
            raise ServerStartError(f"ft serve (pid {pid}), started by another ft launch or a hand, exited before it "
                                   f"answered (log {log}):\n{servers.log_tail(log)}")
        return answers(wanted.url)

    show_log(log, console, ready)


def show_log(log: Path, console: Console, ready: Callable[[], bool]) -> None:
    """Show the log of a loading server (its own lines in full, progress bars and other output as
    a status line) until `ready()`."""
    seen, failing = 0, False
    with console.status("ft serve: starting") as status:
        while True:
            text = servers.read_log(log)
            for line in text[seen:].replace("\r", "\n").splitlines():
                failing = failing or line.startswith("Traceback")
                if line.startswith(("ft serve", "  ")) and not failing:
                    console.print(line, style="dim", highlight=False, markup=False, soft_wrap=True)
                elif line.strip():
                    status.update(f"ft serve: {line.strip()[:120]}")
            seen = len(text)
            if ready():
                return
            time.sleep(0.25)


def ensure(wanted: Wanted, console: Console, replace: bool = False) -> bool:
    """Make a server answer at the URL serving the model asked for; True when this call started one.

    Launchers of one port take turns through its start lock (`servers.start_lock`): one that finds
    another starting a server, or a server so started still loading, waits for that server and uses
    it as it would a running one; it never starts a second."""
    while True:
        if answers(wanted.url):
            if not replace:
                check_model(wanted)
                return False
            stop_running(wanted)
            replace = False
        if not wanted.local:
            raise ServerStartError(
                f"no server at {wanted.url}; ft launch starts one only on this machine (start `ft serve` there)"
            )
        with servers.start_lock(wanted.port) as lock:
            if lock is None:
                follow(wanted, console)
            elif not answers(wanted.url):
                start(wanted, console, lock)
                return True
