"""The `ft serve` processes running on this machine: one record a server under the ft home.

`ft serve` writes `servers/serve-PORT.json` (its pid, address, the model as it was asked for, when
it started, its log file) once it listens, and removes it when it exits; `ft launch` starts
servers in the background with their output in `servers/serve-PORT.log`; `ft ps` and `ft stop` read
the records. `ft serve --replicas N` writes one more record for its router (kind "router", the
ports of its workers, the pid of the process that supervises them: stopping it stops the group). A
record whose process is gone (a server killed with SIGKILL) is stale and removed when read.
Launchers of one port take turns through `servers/serve-PORT.lock` (`start_lock`).
This module imports nothing of the project but `ft.env`, so any layer may use it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from ft import env


@dataclass(frozen=True)
class ServerRecord:
    """One running server: `model` is what it was asked to serve (a path, a hub spec or a preset
    name), `model_id` the id it reports; a router (`kind`) also names its `workers`' ports."""

    pid: int
    host: str
    port: int
    model: str
    model_id: str
    started: float
    kind: str = "server"
    workers: tuple[int, ...] = ()

    @property
    def is_router(self) -> bool:
        return self.kind == "router"

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"


def folder() -> Path:
    """Where the records and the logs of background servers live."""
    return env.home() / "servers"


def record_path(port: int) -> Path:
    return folder() / f"serve-{port}.json"


def log_path(port: int) -> Path:
    return folder() / f"serve-{port}.log"


def read_log(log: Path) -> str:
    """A server's log so far ("" before it exists)."""
    try:
        return log.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def log_tail(log: Path, lines: int = 5) -> str:
    """The last `lines` lines of a server's log: what an error about a server that stopped quotes."""
    return "\n".join(read_log(log).strip().splitlines()[-lines:])


def lock_path(port: int) -> Path:
    return folder() / f"serve-{port}.lock"


@contextlib.contextmanager
def start_lock(port: int) -> Iterator[int | None]:
    """The port's start lock, taken without waiting: an open descriptor that holds it, or None
    while another process holds it.

    `ft launch` holds it while it starts a server, and the server it starts inherits the
    descriptor and holds it for as long as it lives: a second launcher for the port finds it held
    and waits for that server instead of starting another. The lock is the open file's (flock),
    so the OS releases it once every process holding it is gone: a launcher or server that died
    never blocks a start. The file names the pid of the server being started (`starting_pid`)."""
    path = lock_path(port)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd: int | None = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        fd = None
    try:
        if fd is not None:
            os.ftruncate(fd, 0)  # the pid of a server that ended
        yield fd
    finally:
        if fd is not None:
            os.close(fd)


def claim_start(port: int) -> bool:
    """For `ft serve` itself: whether this process holds the port's start lock, for as long as it
    lives (the descriptor is never closed); False while another launcher or server holds it.

    A server that `ft launch` started inherited the launcher's descriptor. A server started by hand
    takes the lock and names itself in it, so a launcher arriving while it loads waits for it
    (`follow`) instead of starting a second one that could not bind; the log file a launcher shows
    says where its output goes instead. Without /proc an inherited descriptor cannot be told from
    another launcher's lock, and the start goes on."""
    path = lock_path(port)
    proc = Path("/proc/self/fd")
    if any(_names(fd, path) for fd in (proc.iterdir() if proc.is_dir() else ())):
        return True
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return not proc.is_dir()
    os.ftruncate(fd, 0)
    mark_starting(fd, os.getpid())
    log_path(port).write_text(f"ft serve (pid {os.getpid()}) was started by hand: its output goes to its own "
                              "terminal\n", encoding="utf-8")
    return True


def _names(fd: Path, path: Path) -> bool:
    """Whether the open descriptor `fd` (a /proc/self/fd entry) is the file at `path`."""
    try:
        return os.readlink(fd) == str(path.resolve())
    except OSError:  # the listing's own descriptor, closed since
        return False


def start_held(port: int) -> bool:
    """Whether a launcher or a server it started holds the port's start lock."""
    with start_lock(port) as fd:
        return fd is None


def mark_starting(lock: int, pid: int) -> None:
    """Name `pid` in the start lock held through `lock` as the server being started."""
    os.pwrite(lock, f"{pid}\n".encode(), 0)


def starting_pid(port: int) -> int | None:
    """The live server the port's start lock names (the one a launcher started), if any."""
    try:
        pid = int(lock_path(port).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return pid if alive(pid) else None


def alive(pid: int) -> bool:
    """Whether `pid` runs: a process that exited and waits for its parent to reap it (a zombie) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8").rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no /proc here: the signal's answer stands
    return state != "Z"


def write(record: ServerRecord) -> Path:
    """Write `record` atomically (a reader never sees half a file)."""
    path = record_path(record.port)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(asdict(record)), encoding="utf-8")
    tmp.replace(path)
    return path


def read(path: Path) -> ServerRecord | None:
    try:
        fields = json.loads(path.read_text(encoding="utf-8"))
        return ServerRecord(**{**fields, "workers": tuple(fields.get("workers", ()))})
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def running() -> list[ServerRecord]:
    """The records of live servers, by port; stale ones are removed."""
    out = []
    for path in sorted(folder().glob("serve-*.json")):
        record = read(path)
        if record is not None and alive(record.pid):
            out.append(record)
        elif record is not None:
            path.unlink(missing_ok=True)
    return sorted(out, key=lambda r: r.port)


def at_port(port: int) -> ServerRecord | None:
    return next((r for r in running() if r.port == port), None)


@contextlib.contextmanager
def registered(record: ServerRecord) -> Iterator[None]:
    """`record` is listed while the block runs (the server's lifetime)."""
    path = write(record)
    try:
        yield
    finally:
        current = read(path)
        if current is not None and current.pid == record.pid:
            path.unlink(missing_ok=True)


def stop(record: ServerRecord, timeout: float = 120.0) -> bool:
    """Ask the server to shut down (SIGTERM: answers in flight finish within its grace, the
    checkpoint store is flushed and closed) and wait for its process to end; True once it has.
    A server that does not end within `timeout` is left running (False)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(record.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(record.pid) or _reaped(record.pid):
            record_path(record.port).unlink(missing_ok=True)
            return True
        time.sleep(0.1)
    return False


def _reaped(pid: int) -> bool:
    """For a server that is this process's child: reap it once it exited (else it stays a zombie, alive)."""
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return False
    return done == pid
