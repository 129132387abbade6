"""The uvicorn server `ft serve` runs, with what plain uvicorn leaves open:

- a request head must arrive within `head_timeout_s` of the connection (or of its first byte
  on a kept-alive one) and its body within `body_timeout_s` after the head: a client that sends
  a byte at a time (slowloris) is cut, as is one that connects and says nothing;
- a response the client stops reading for `write_timeout_s` is cut: the connection is aborted,
  the app sees a disconnect and the generation behind it stops at its next step, freeing its
  slot. "Stops reading" is seen as writes blocked: the socket's send buffer, fixed at
  `send_buffer_bytes` (the kernel's autotuning would let a non-reading client absorb megabytes,
  minutes of tokens, first), and asyncio's buffer above it, both full;
- at most `max_connections` open connections, kept below the open-file limit (whose soft value
  is raised to the hard one at start): one more is answered 503 and closed at once, so the
  accept loop never meets EMFILE in normal operation;
- if it does (other files use the descriptors), asyncio's per-failure traceback becomes one
  warning a minute;
- a request whose framing is ambiguous (both `Content-Length` and `Transfer-Encoding`, or
  `Transfer-Encoding` on HTTP/1.0) is answered 400 and its connection closed before anything
  after it is read (RFC 9112 section 6.1: behind a proxy, the bytes after it could be a smuggled
  request); h11 itself refuses the other invalid framings (bad or conflicting lengths, codings
  other than chunked) the same way;
- on SIGTERM or Ctrl-C the app's `Drain` (gateway/drain.py) begins before connections close,
  and answers still running get `shutdown_grace_s` seconds.

One warning a minute, with a count, for each kind of cut connection: a flood is never a flood
of log lines."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import socket
import time
from dataclasses import dataclass

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("gateway.http")

ACCEPT_FAILED = "socket.accept() out of system resource"  # asyncio's message (selector_events)
FD_RESERVE = 64  # descriptors kept free beyond those open at start (store, logs, model files)
# connections waiting to be accepted, and (asyncio) accepted per loop turn: also how often one failing
# turn retries accept() in vain (asyncio's loop goes on after EMFILE); uvicorn's default is 2048
ACCEPT_BACKLOG = 128
REJECT_503 = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nretry-after: 1\r\nconnection: close\r\n\r\n"
)
TIMEOUT_408 = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
INVALID_REQUEST = "Invalid HTTP request received."  # uvicorn's warning, once per request it answers 400


@dataclass(frozen=True)
class ServerLimits:
    head_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    keep_alive_s: int = 5
    write_timeout_s: float = 30.0
    send_buffer_bytes: int = 64 << 10
    max_connections: int = 1024
    shutdown_grace_s: float = 5.0


class RateLimitedLog:
    """`note()` counts an event; a warning goes out at the first one and then at most once per
    `interval_s`, with how many happened since the last warning."""

    def __init__(self, message: str, interval_s: float = 60.0):
        self.message, self.interval_s = message, interval_s
        self.count, self.total, self._last = 0, 0, -float("inf")

    def note(self) -> None:
        self.count += 1
        self.total += 1
        now = time.monotonic()
        if now - self._last >= self.interval_s:
            if self.total == 1:
                log.warning("%s", self.message)
            else:
                log.warning("%s (%d times since the last such warning)", self.message, self.count)
            self.count, self._last = 0, now


def raise_open_file_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit; returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


def open_files() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return FD_RESERVE


def connection_cap(wanted: int) -> int:
    """`wanted`, or fewer: what the open-file limit leaves after the files open now and a reserve."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(1, min(wanted, soft - open_files() - FD_RESERVE))


def framing_error(request: h11.Request) -> str | None:
    """Why the request's body length is ambiguous (RFC 9112 section 6.1), or None."""
    names = {name.lower() for name, _ in request.headers}
    if b"transfer-encoding" not in names:
        return None
    if b"content-length" in names:
        return "both Content-Length and Transfer-Encoding"
    if request.http_version == b"1.0":
        return "Transfer-Encoding in an HTTP/1.0 request"
    return None


class StrictFraming(h11.Connection):
    """h11's server connection that refuses a request with ambiguous framing as a protocol error
    (uvicorn then answers 400 and closes the connection, reading nothing after it)."""

    def next_event(self):  # type: ignore[override]
        event = super().next_event()
        if isinstance(event, h11.Request) and (why := framing_error(event)) is not None:
            raise h11.RemoteProtocolError(f"invalid request framing: {why}")
        return event


class ConnectionLogger:
    """uvicorn's logger as one connection uses it, with its per-request invalid-request warning
    counted in a `RateLimitedLog` instead (a flood of bad requests is not a flood of lines)."""

    def __init__(self, logger: logging.Logger, invalid: RateLimitedLog):
        self._logger, self._invalid = logger, invalid

    def warning(self, msg: object, *args, **kwargs) -> None:
        if msg == INVALID_REQUEST:
            self._invalid.note()
        else:
            self._logger.warning(msg, *args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._logger, name)


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with read deadlines, a connection cap (set by `guarded_protocol`) and
    strict request framing."""

    limits: ServerLimits = ServerLimits()
    max_connections: int = ServerLimits.max_connections
    logs: dict[str, RateLimitedLog] = {}

    rejected = False
    _deadline: asyncio.TimerHandle | None = None
    _reading: str | None = None  # "head" | "body" while a deadline runs
    _write_deadline: asyncio.TimerHandle | None = None  # while the transport's writing is paused

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.conn = StrictFraming(h11.SERVER, self.conn._max_incomplete_event_size)
        self.logger = ConnectionLogger(self.logger, self.logs["invalid"])  # type: ignore[assignment]

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.max_connections:
            self.rejected, self.transport = True, transport
            transport.write(REJECT_503)
            transport.close()
            self.logs["cap"].note()
            return
        super().connection_made(transport)
        self._limit_send_buffer(transport)
        self._watch("head", self.limits.head_timeout_s)

    def data_received(self, data: bytes) -> None:
        if self.rejected:
            return
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow()

    def _limit_send_buffer(self, transport: asyncio.Transport) -> None:
        size = self.limits.send_buffer_bytes
        transport.set_write_buffer_limits(high=size)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_deadline is None:
            self._write_deadline = self.loop.call_later(self.limits.write_timeout_s, self._write_expired)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._unwatch_write()

    def _unwatch_write(self) -> None:
        if self._write_deadline is not None:
            self._write_deadline.cancel()
        self._write_deadline = None

    def _write_expired(self) -> None:
        self._write_deadline = None
        if not self.transport.is_closing():
            self.logs["write"].note()
        self.transport.abort()  # connection_lost: the app's next receive is a disconnect

    def connection_lost(self, exc: Exception | None) -> None:
        self._unwatch()
        self._unwatch_write()
        if not self.rejected:
            super().connection_lost(exc)

    def _follow(self) -> None:
        """The deadline that applies to the request now being read, if any."""
        state = self.conn.their_state
        if state is h11.IDLE and self.conn.trailing_data[0]:  # part of a head has arrived
            self._watch("head", self.limits.head_timeout_s)
        elif state is h11.SEND_BODY:
            self._watch("body", self.limits.body_timeout_s)
        elif state is not h11.IDLE:
            self._unwatch()

    def _watch(self, reading: str, timeout_s: float) -> None:
        if self._reading != reading:
            self._unwatch()
            self._reading = reading
            self._deadline = self.loop.call_later(timeout_s, self._expired, reading)

    def _unwatch(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline, self._reading = None, None

    def _expired(self, reading: str) -> None:
        self._deadline, self._reading = None, None
        if self.transport.is_closing():
            return
        self.logs[reading].note()
        if reading == "head" and self.conn.our_state is h11.IDLE:
            self.transport.write(TIMEOUT_408)
        self.transport.close()  # a body cut short reaches the app as a disconnect


def guarded_protocol(limits: ServerLimits) -> type[GuardedH11]:
    """A `GuardedH11` class bound to `limits` (uvicorn builds protocols with a fixed signature)."""
    logs = {
        "cap": RateLimitedLog("connection refused: already at the connection limit"),
        "head": RateLimitedLog(
            f"connection closed: no complete request head within {limits.head_timeout_s:g} s"
        ),
        "body": RateLimitedLog(
            f"connection closed: request body not complete within {limits.body_timeout_s:g} s"
        ),
        "invalid": RateLimitedLog("connection closed: invalid request (bad framing or syntax), answered 400"),
        "write": RateLimitedLog(
            f"connection closed: the client read nothing of its answer for {limits.write_timeout_s:g} s"
        ),
    }
    cap = connection_cap(limits.max_connections)
    return type("GuardedH11", (GuardedH11,), {"limits": limits, "max_connections": cap, "logs": logs})


class GatewayServer(uvicorn.Server):
    """Begins the app's drain when shutdown begins; one warning a minute when accept fails."""

    def __init__(self, config: uvicorn.Config, limits: ServerLimits):
        super().__init__(config)
        self.limits = limits
        self.accept_failures = RateLimitedLog("cannot accept connections: out of file descriptors")

    async def startup(self, sockets=None) -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(self._loop_exception)
        await super().startup(sockets)

    def _loop_exception(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        if context.get("message") == ACCEPT_FAILED:
            self.accept_failures.note()
        elif self.should_exit and _is_stale_accept_retry(context):
            pass  # asyncio re-arms accept 1 s after EMFILE; once the socket closed at shutdown that is moot
        else:
            loop.default_exception_handler(context)

    def handle_exit(self, sig: int, frame) -> None:
        """A stop by signal that completes gracefully exits with status 0 (uvicorn would raise the
        signal again once shut down: status 130 for Ctrl-C, death by SIGTERM)."""
        super().handle_exit(sig, frame)
        self._captured_signals.clear()

    async def shutdown(self, sockets=None) -> None:
        drain = getattr(getattr(self.config.app, "state", None), "drain", None)
        if drain is not None:
            drain.begin(self.limits.shutdown_grace_s)
        await super().shutdown(sockets)


def _is_stale_accept_retry(context: dict) -> bool:
    """The accept retry asyncio scheduled after EMFILE, firing on a listening socket since closed."""
    handle, exc = context.get("handle"), context.get("exception")
    return isinstance(exc, ValueError) and "_start_serving" in repr(handle)


def make_server(
    app, host: str, port: int, limits: ServerLimits | None = None, log_level: str = "info"
) -> GatewayServer:
    """The server for `app` (the gateway's Starlette app; its `state.drain` begins at shutdown).
    Answers still running at the end of the grace period are ended by the drain; uvicorn's own
    graceful timeout, a little later, is the backstop."""
    limits = limits or ServerLimits()
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        http=guarded_protocol(limits),
        backlog=ACCEPT_BACKLOG,
        timeout_keep_alive=limits.keep_alive_s,
        timeout_graceful_shutdown=int(limits.shutdown_grace_s) + 3,
    )
    return GatewayServer(config, limits)
