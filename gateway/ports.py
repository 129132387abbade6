"""Ports on this machine: a free loopback one, one held from before a server loads until it listens,
and whether one can be bound."""

from __future__ import annotations

import socket

LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    """A port the OS has free on `host` now (another process may take it before it is bound)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def hold(host: str, port: int) -> socket.socket:
    """A socket bound to `host:port` (0: a free port), not listening yet. While it is bound, neither an
    outgoing connection's source port nor a bind without SO_REUSEADDR can take the port, so a server
    binds it before its model loads and listens on it once ready (uvicorn's `sockets=`); connections
    meanwhile are refused. Raises OSError: in use, or a bad address.

    The protocol is named (IPPROTO_TCP, not 0): accepted connections inherit it, and asyncio sets
    TCP_NODELAY only on sockets that name it; without it small writes wait on delayed ACKs (~40 ms)."""
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
    except OSError:
        s.close()
        raise
    return s


def port_problem(host: str, port: int) -> str | None:
    """Why `host:port` cannot be bound (in use, bad address), for a port another program binds."""
    try:
        hold(host, port).close()
    except OSError as exc:
        return exc.strerror or str(exc)
    return None
