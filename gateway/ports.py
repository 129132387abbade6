"""Ports on this machine: a free loopback one, and whether one can be bound before a server loads."""

from __future__ import annotations

import socket

LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    """A port the OS has free on `host` now (another process may take it before it is bound)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_problem(host: str, port: int) -> str | None:
    """Why `host:port` cannot be bound (in use, bad address), checked before the model loads."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as exc:
        return exc.strerror or str(exc)
    return None
