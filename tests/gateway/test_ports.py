"""A port held from before a server loads (`gateway.ports.hold`) and the server that listens on it."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from gateway.http_server import make_server
from gateway.ports import LOOPBACK, hold, port_problem


def test_a_held_port_is_refused_to_a_plain_bind_and_reported_taken():
    with hold(LOOPBACK, 0) as held:
        port = held.getsockname()[1]
        with socket.socket() as other, pytest.raises(OSError, match="in use"):
            other.bind((LOOPBACK, port))
    assert port_problem(LOOPBACK, port) is None  # free again once closed


def test_connections_to_a_server_on_a_held_socket_send_without_delay():
    """uvicorn listening on a held socket: each accepted connection has TCP_NODELAY, as when uvicorn
    binds the port itself (a socket made with protocol 0 passes 0 on to its connections, and asyncio
    then leaves Nagle's algorithm on: every small write of a stream waits on the peer's delayed ACK)."""
    app = Starlette(routes=[Route("/", lambda request: PlainTextResponse("ok"))])
    sock = hold(LOOPBACK, 0)
    server = make_server(app, LOOPBACK, sock.getsockname()[1], log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.02)
        with httpx.Client(base_url=f"http://{LOOPBACK}:{sock.getsockname()[1]}") as client:
            assert client.get("/").text == "ok"  # the connection stays open (keep-alive)
            accepted = [c.transport.get_extra_info("socket") for c in server.server_state.connections]
            assert accepted and all(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for s in accepted)
    finally:
        server.should_exit = True
        thread.join(30)
