"""Request smuggling: a request whose framing is ambiguous or invalid gets one 400
and its connection is closed before anything after it is read (RFC 9112 section 6.1). Raw sockets
against the real server."""

from __future__ import annotations

import logging

import pytest

from tests.gateway.test_server_hardening import connect, guarded_server, read_until_closed

__all__ = ["guarded_server"]

BODY = b'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}'
HIDDEN = b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n"
CHUNKED = b"%x\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY)


def head(*lines: bytes, version: bytes = b"1.1") -> bytes:
    start = (
        b"POST /v1/chat/completions HTTP/" + version + b"\r\nhost: x\r\ncontent-type: application/json\r\n"
    )
    return start + b"".join(line + b"\r\n" for line in lines) + b"\r\n"


SMUGGLED = {
    # the front proxy frames by Content-Length and forwards HIDDEN as this body; chunked framing ends earlier
    "length-and-chunked": head(
        b"content-length: %d" % (len(CHUNKED) + len(HIDDEN)), b"transfer-encoding: chunked"
    )
    + CHUNKED
    + HIDDEN,
    "chunked-and-length": head(b"transfer-encoding: chunked", b"content-length: 4") + CHUNKED + HIDDEN,
    "chunked-on-http-1.0": head(b"transfer-encoding: chunked", version=b"1.0") + CHUNKED + HIDDEN,
    "two-lengths": head(b"content-length: %d" % len(BODY), b"content-length: 3") + BODY + HIDDEN,
    "unknown-coding": head(b"transfer-encoding: gzip, chunked") + CHUNKED + HIDDEN,
    "two-codings": head(b"transfer-encoding: chunked", b"transfer-encoding: chunked") + CHUNKED + HIDDEN,
    "bad-length": head(b"content-length: +5") + BODY + HIDDEN,
    "space-before-colon": head(b"content-length : %d" % len(BODY)) + BODY + HIDDEN,
    "bad-chunk-size": head(b"transfer-encoding: chunked") + b"zz\r\n" + BODY + b"\r\n0\r\n\r\n" + HIDDEN,
}


@pytest.mark.parametrize("raw", SMUGGLED.values(), ids=SMUGGLED.keys())
def test_ambiguous_framing_gets_one_400_and_a_closed_connection(guarded_server, raw):
    with connect(guarded_server) as sock:
        sock.sendall(raw)
        answer = read_until_closed(sock)  # returns only once the server closed the connection
    assert answer.startswith(b"HTTP/1.1 400 "), answer[:200]
    assert answer.count(b"HTTP/1.1 ") == 1  # the hidden request was never answered
    assert b'"object"' not in answer


def test_well_framed_requests_on_one_connection_are_all_answered(guarded_server):
    """The same bytes, framed once each, pipelined on one connection: both answered."""
    with connect(guarded_server) as sock:
        sock.sendall(
            head(b"transfer-encoding: chunked")
            + CHUNKED
            + HIDDEN.replace(b"\r\n\r\n", b"\r\nconnection: close\r\n\r\n")
        )
        answer = read_until_closed(sock)
    assert answer.count(b"HTTP/1.1 200 ") == 2, answer[:500]


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_a_flood_of_bad_requests_is_not_a_flood_of_log_lines(guarded_server):
    records = Records()
    loggers = [logging.getLogger("uvicorn.error"), logging.getLogger("gateway.http")]
    for logger in loggers:
        logger.addHandler(records)
    try:
        for _ in range(20):
            with connect(guarded_server) as sock:
                sock.sendall(SMUGGLED["length-and-chunked"])
                assert read_until_closed(sock).startswith(b"HTTP/1.1 400 ")
    finally:
        for logger in loggers:
            logger.removeHandler(records)
    invalid = [m for m in records.messages if "invalid" in m.lower()]
    assert len(invalid) <= 1, invalid
