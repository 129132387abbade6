"""`ft serve --replicas N`: N `ft serve` workers of one model sharing one disk cache behind the smg
router (README, Replicas), started and supervised by one process in the foreground.

The workers listen on 127.0.0.1, on the ports after --port (a free port for one that is taken),
each bound here and handed to its worker (`--fd`) so that nothing takes it while the worker loads, with
the other serve flags as given and one `--disk-cache` (default: a folder under the ft home named by
the port); each writes its log beside the server records (`servers.log_path`). Once every worker
answers, `smg launch` starts on --host:--port with the routing flags README documents, and once smg
has registered them all the group is listed as a router record (`ft ps` shows it beside its workers;
`ft stop PORT` sends this process SIGTERM).

Stopping (Ctrl-C, SIGTERM): the router first, so no new request reaches a worker, then every worker
by SIGTERM (each finishes its answers within its grace and flushes its store). The children run in
a session of their own, so a terminal's Ctrl-C reaches only this process, which stops them in that
order; they get SIGTERM too if this process dies (PR_SET_PDEATHSIG). A worker that dies is logged
(smg retries its requests on the others); the group stops when the router or the last worker dies.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from ft import env, servers
from gateway.ports import free_port, hold, port_problem

# README's routing: a session's header onto the ring of workers, else the request's first characters
ROUTING = ("--policy", "prefix_hash", "--routing-key-headers", "x-claude-code-session-id", "session-id", "x-session-id")
NOT_FORWARDED = {"help", "replicas", "host", "port", "fd", "disk_cache", "plan"}
WORKER_HOST = "127.0.0.1"
START_TIMEOUT_S = 600.0
ROUTER_STOP_S = 30.0
PR_SET_PDEATHSIG = 1


@dataclass
class Worker:
    port: int
    proc: subprocess.Popen
    log: Path
    reported: bool = False  # its exit was logged

    @property
    def url(self) -> str:
        return f"http://{WORKER_HOST}:{self.port}"


def smg_binary() -> str:
    """The `smg` command: on PATH, or beside this Python (a virtual environment not activated)."""
    beside = Path(sys.executable).with_name("smg")
    found = shutil.which("smg") or (str(beside) if beside.is_file() and os.access(beside, os.X_OK) else None)
    if found is None:
        raise FileNotFoundError("--replicas needs the smg router, which is not installed: pip install smg")
    return found


def forwarded(args: argparse.Namespace, add_arguments: Callable[[argparse.ArgumentParser], None]) -> list[str]:
    """The serve flags given other than their defaults, as a worker's command line (less the group's own)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    argv: list[str] = []
    for action in parser._actions:
        value = getattr(args, action.dest, action.default)
        if action.dest in NOT_FORWARDED or not action.option_strings or value == action.default:
            continue
        flag = action.option_strings[-1]
        argv += [flag] if action.nargs == 0 else [flag, str(value)]  # nargs 0: a switch
    return argv


def worker_sockets(port: int, n: int) -> list[socket.socket]:
    """Sockets bound on the workers' host to `port`+1 .. `port`+n, to a free port in place of each taken."""
    held = []
    for p in range(port + 1, port + n + 1):
        try:
            held.append(hold(WORKER_HOST, p if p < 65536 else 0))
        except OSError:
            held.append(hold(WORKER_HOST, 0))
    return held


def die_with_parent() -> None:
    """In a child before exec: SIGTERM when the supervising process dies (Linux), so a supervisor
    killed outright leaves no worker behind."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def spawn(command: list[str], log: Path, pass_fds: tuple[int, ...] = ()) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w", encoding="utf-8") as out:
        return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True,
                                preexec_fn=die_with_parent, pass_fds=pass_fds)


def wait_for(ready: Callable[[], bool], procs: list[tuple[str, subprocess.Popen, Path]], stop: threading.Event) -> None:
    """Until `ready()`; a process of `procs` that exits first is an error quoting its log, a stop asked
    meanwhile an InterruptedError."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while not ready():
        for name, proc, log in procs:
            if proc.poll() is not None:
                raise ChildProcessError(f"{name} exited with code {proc.returncode} before it answered (log {log}):\n"
                                   f"{servers.log_tail(log, 8)}")
        if stop.wait(0.25):
            raise InterruptedError("stopped while starting")
        if time.monotonic() > deadline:
            raise TimeoutError(f"not ready within {START_TIMEOUT_S:g} s: {', '.join(n for n, _, _ in procs)}")


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5.0).status_code == 200
    except httpx.HTTPError:
        return False


def registered_all(url: str, n: int) -> bool:
    """Whether smg at `url` lists `n` workers ready and healthy."""
    try:
        listed = httpx.get(f"{url}/workers", timeout=5.0).json()["workers"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return False
    return sum(w.get("status") == "ready" and bool(w.get("is_healthy")) for w in listed) == n


def model_id(url: str) -> str:
    try:
        return str(httpx.get(f"{url}/v1/models", timeout=5.0).json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return ""


def end(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM, then SIGKILL after `timeout` seconds."""
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def stop_group(router: subprocess.Popen | None, workers: list[Worker], grace_s: float) -> None:
    """The router first, then every worker at once, each given its shutdown grace and a margin to
    flush its store."""
    if router is not None:
        print("ft serve: stopping the router", flush=True)
        end(router, ROUTER_STOP_S)
    print(f"ft serve: stopping {len(workers)} workers (answers in flight finish, stores flushed)", flush=True)
    for w in workers:
        if w.proc.poll() is None:
            w.proc.terminate()
    for w in workers:
        end(w.proc, grace_s + 120.0)


def supervise(router: subprocess.Popen, workers: list[Worker], stop: threading.Event) -> int:
    """Until a stop is asked (0), the router dies or the last worker does (1); each worker that dies is logged."""
    while not stop.wait(0.5):
        for w in workers:
            if not w.reported and w.proc.poll() is not None:
                w.reported = True
                print(f"ft serve: worker on port {w.port} exited with code {w.proc.returncode} (log {w.log}); "
                      "the router sends its sessions to the others", file=sys.stderr, flush=True)
        if router.poll() is not None:
            print(f"ft serve: the router exited with code {router.returncode}", file=sys.stderr, flush=True)
            return 1
        if all(w.reported for w in workers):
            print("ft serve: no worker left", file=sys.stderr, flush=True)
            return 1
    return 0


def run(args: argparse.Namespace, add_arguments: Callable[[argparse.ArgumentParser], None]) -> int:
    """`ft serve --replicas N`: start, supervise and stop the group; the exit code."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    workers: list[Worker] = []
    router: subprocess.Popen | None = None
    try:
        if args.plan:
            raise ValueError("--plan plans one server: leave out --replicas")
        smg = smg_binary()
        if (problem := port_problem(args.host, args.port)) is not None:
            raise OSError(f"cannot listen on {args.host}:{args.port}: {problem}")
        disk = args.disk_cache or env.home() / "replicas" / f"disk-cache-{args.port}"
        flags = forwarded(args, add_arguments)
        for sock in worker_sockets(args.port, args.replicas):
            with sock:  # the worker's copy stays bound
                port = sock.getsockname()[1]
                command = [sys.executable, "-m", "ft", "serve", "--host", WORKER_HOST, "--port", str(port),
                           "--fd", str(sock.fileno()), "--disk-cache", str(disk), *flags]
                log = servers.log_path(port)
                workers.append(Worker(port, spawn(command, log, (sock.fileno(),)), log))
        print(f"ft serve: starting {args.replicas} workers on ports {', '.join(str(w.port) for w in workers)} "
              f"sharing the disk cache {disk} (logs {servers.folder()})", flush=True)
        named = [(f"the worker on port {w.port}", w.proc, w.log) for w in workers]
        wait_for(lambda: all(healthy(w.url) for w in workers), named, stop)
        metrics_port, router_log = free_port(), servers.folder() / f"smg-{args.port}.log"
        router = spawn([smg, "launch", "--host", args.host, "--port", str(args.port),
                        "--worker-urls", *(w.url for w in workers), *ROUTING,
                        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)], router_log)
        record = servers.ServerRecord(os.getpid(), args.host, args.port, str(args.model or args.preset or "tiny"),
                                      model_id(workers[0].url), time.time(), "router", tuple(w.port for w in workers))
        wait_for(lambda: registered_all(record.url, len(workers)), [("smg", router, router_log), *named], stop)
    except (ValueError, OSError) as exc:  # each a message for the user: smg missing, a port taken, a worker failed
        print(f"ft serve: {exc}", file=sys.stderr)
        stop_group(router, workers, args.shutdown_grace)
        return 2
    print(f"ft serve: router (smg, log {router_log}) on {record.url} over {len(workers)} workers of "
          f"{record.model_id!r}\n  Claude Code:  ft launch claude --server {record.url}\n"
          f"  Codex:        ft launch codex --server http://{WORKER_HOST}:{workers[0].port} (smg refuses some of "
          f"Codex's Responses fields)\n  OpenCode:     ft launch opencode --server {record.url}", flush=True)
    with servers.registered(record):
        code = supervise(router, workers, stop)
        stop_group(router, workers, args.shutdown_grace)
    return code
