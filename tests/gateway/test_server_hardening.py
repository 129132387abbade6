"""What operators and clients do to a running server: values that could crash it are
400s naming the field, a client that leaves frees the engine, the key is checked safely, slow and
too many connections are cut, and SIGTERM ends every answer in its protocol's shape."""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import socket
import stat
import subprocess
import sys
import threading
import time

import httpx
import pytest

from gateway import embedded
from gateway.embedded import serve_in_thread
from gateway.http_server import ServerLimits
from gateway.recorder import Recorder
from gateway.serve import api_key, limits_from_args
from gateway.service import ServeConfig
from tests.conftest import free_port, serve_args, start_server
from tests.gateway.test_server_errors import ENDPOINTS, _generated, assert_error_shape

CHAT = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


def post_raw(client: httpx.Client, path: str, payload: bytes, **headers: str) -> httpx.Response:
    return client.post(path, content=payload, headers={"content-type": "application/json", **headers})


def field_of(response: httpx.Response) -> str:
    """The field a 400 names: OpenAI's `param`, the start of Anthropic's message."""
    error = response.json()["error"]
    return error.get("param") or error["message"].split(":")[0]


@pytest.mark.parametrize("path", [*ENDPOINTS, "/v1/messages/count_tokens"])
@pytest.mark.parametrize("depth", [1000, 5000, 150])
def test_deeply_nested_json_is_a_400(live_server, path, depth):
    nested = b"[" * depth + b"]" * depth
    payload = (
        b'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "metadata": '
        + nested
        + b"}"
    )
    with live_server.client() as client:
        r = post_raw(client, path, payload)
        assert_error_shape(r, "anthropic" if path.startswith("/v1/messages") else "openai", 400)
        assert field_of(r) == "body" and "nested" in r.json()["error"]["message"]
        assert client.get("/health").json()["status"] == "ok"


@pytest.mark.parametrize(
    ("field", "raw"),
    [
        ("temperature", b"1e-300"),
        ("temperature", b"-1"),
        ("temperature", b"9" * 400),
        ("top_p", b"-0.5"),
        ("top_p", b"1" + b"0" * 400),
        ("max_tokens", b"1.5"),
    ],
)
@pytest.mark.parametrize("path", ENDPOINTS)
def test_numeric_extremes_are_400s_naming_the_field(live_server, path, field, raw):
    if path == "/v1/responses" and field == "max_tokens":
        field = "max_output_tokens"
    payload = (
        b'{"model": "tiny", "max_tokens": 2, "input": "hi", "messages": [{"role": "user", "content": "hi"}], "'
        + field.encode()
        + b'": '
        + raw
        + b"}"
    )
    with live_server.client() as client:
        r = post_raw(client, path, payload)
    assert_error_shape(r, ENDPOINTS[path], 400)
    assert field_of(r) == field


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 10**400])
def test_a_chat_seed_beyond_64_bits_is_a_400(live_server, seed):
    payload = b'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "seed": '
    with live_server.client() as client:
        r = post_raw(client, "/v1/chat/completions", payload + str(seed).encode() + b"}")
        assert_error_shape(r, "openai", 400)
        assert field_of(r) == "seed"
        ok = client.post("/v1/chat/completions", json={**CHAT, "seed": 2**64 - 1, "temperature": 0.7})
        assert ok.status_code == 200, ok.text


def test_the_smallest_temperature_still_samples(live_server):
    with live_server.client() as client:
        r = client.post("/v1/chat/completions", json={**CHAT, "temperature": 0.001, "top_p": 0})
    assert r.status_code == 200, r.text


def test_a_body_longer_than_the_context_can_hold_is_refused_unread(live_server):
    """The tiny preset's 65,536 tokens at 32 bytes a token: 2 MiB. A 3 MiB prompt is a 413
    before any of it is decoded or tokenized."""
    text = "word " * (600 << 10)
    with live_server.client() as client:
        r = client.post("/v1/messages", json={**CHAT, "messages": [{"role": "user", "content": text}]})
    assert_error_shape(r, "anthropic", 413)
    assert "2097152" in r.json()["error"]["message"]


def test_the_key_is_checked_safely():
    server = start_server(preset="tiny", api_key="sekret")
    try:
        with server.client() as client:
            bad = client.post("/v1/messages", json=CHAT, headers={"x-api-key": b"\xff\xfe sekret"})
            assert_error_shape(bad, "anthropic", 400)
            assert field_of(bad) == "headers.x-api-key"
            bad = client.post(
                "/v1/chat/completions", json=CHAT, headers={"authorization": b"Bearer \xc3\x28"}
            )
            assert_error_shape(bad, "openai", 400)
            assert field_of(bad) == "headers.authorization"
            other = client.post(
                "/v1/chat/completions",
                json=CHAT,
                headers={"authorization": "bearer sekret", "x-trace": b"\xff"},
            )
            assert other.status_code == 200, other.text
            assert_error_shape(
                client.post("/v1/messages", json=CHAT, headers={"x-api-key": "sekre"}), "anthropic", 401
            )
    finally:
        server.stop()


def test_a_non_streaming_client_that_leaves_frees_the_engine(live_server):
    """The client gives up after 1 s; its 5,000-token answer stops within a step or two."""
    body = {
        **CHAT,
        "max_tokens": 5000,
        "temperature": 0,
        "messages": [{"role": "user", "content": "write forever"}],
    }
    with live_server.client() as client:
        before = _generated(client)
        with (
            pytest.raises(httpx.ReadTimeout),
            httpx.Client(base_url=live_server.url, timeout=1.0) as impatient,
        ):
            impatient.post("/v1/chat/completions", json=body)
        live_server.wait_idle(timeout=120)
        assert _generated(client) - before < 1000
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200


def test_the_recording_is_private_and_never_follows_a_planted_link(tmp_path, monkeypatch):
    monkeypatch.setattr("gateway.recorder.time.strftime", lambda fmt: "20250101-000000")
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    folder = tmp_path / "rec"
    folder.mkdir()
    (folder / "session-20250101-000000.jsonl").symlink_to(victim)
    recorder = Recorder(folder)
    try:
        assert not recorder.path.is_symlink() and recorder.path.name != "session-20250101-000000.jsonl"
        assert stat.S_IMODE(os.stat(recorder.path).st_mode) == 0o600
        assert victim.read_text() == "precious\n"
    finally:
        recorder.close()


# -- connections: read deadlines and the connection cap (real sockets, short limits)

LIMITS = ServerLimits(head_timeout_s=1.0, body_timeout_s=2.0, max_connections=12)
GIVE_UP_S = 30  # a socket wait that long means the server never cut the connection


@pytest.fixture(scope="module")
def guarded_server():
    server = serve_in_thread(ServeConfig(preset="tiny", default_max_tokens=4), limits=LIMITS)
    yield server
    server.stop()


def connect(server) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=GIVE_UP_S)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(4096):
            data += chunk
    return data


def test_a_connection_that_says_nothing_gets_a_408_and_is_closed(guarded_server):
    with connect(guarded_server) as sock:
        assert read_until_closed(sock).startswith(b"HTTP/1.1 408 ")


def test_a_head_sent_a_byte_at_a_time_is_cut(guarded_server):
    """Slowloris: each byte comes well within any idle timeout, the head never completes."""
    sent = 0
    with connect(guarded_server) as sock, contextlib.suppress(BrokenPipeError, ConnectionResetError):
        sock.sendall(b"POST /v1/messages HTTP/1.1\r\nhost: x\r\n")
        while sent < 10 * GIVE_UP_S:
            sock.sendall(b"x")
            sent += 1
            time.sleep(0.1)
    assert sent < 10 * GIVE_UP_S  # the server closed the connection first


def test_a_body_that_never_completes_is_cut(guarded_server):
    with connect(guarded_server) as sock:
        sock.sendall(
            b"POST /v1/messages HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 100\r\n\r\n{"
        )
        assert read_until_closed(sock) == b""  # closed; the app saw a disconnect


def test_kept_alive_connections_serve_several_requests(guarded_server):
    with guarded_server.client() as client:
        for _ in range(3):
            assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
            time.sleep(0.5)  # idle between requests is the keep-alive timeout's, not the head's


def test_connections_beyond_the_cap_get_a_503_and_the_server_serves_on(guarded_server):
    held = [connect(guarded_server) for _ in range(LIMITS.max_connections)]
    try:
        with connect(guarded_server) as extra:
            assert read_until_closed(extra).startswith(b"HTTP/1.1 503 ")
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + GIVE_UP_S
    while True:  # the server notices the closed sockets on its next loop turns
        try:
            assert httpx.get(guarded_server.url + "/health").json()["status"] == "ok"
            break
        except httpx.HTTPError:
            assert time.monotonic() < deadline


# -- SIGTERM: a real `ft serve` process


def wait_for(condition) -> None:
    deadline = time.monotonic() + GIVE_UP_S
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.05)


def serve_process(*extra: str, preexec_fn=None) -> tuple[subprocess.Popen, str]:
    return embedded.serve_process(list(extra), preexec_fn)


LONG = {
    "model": "tiny",
    "max_tokens": 5000,
    "temperature": 0,
    "messages": [{"role": "user", "content": "write forever"}],
}


def test_sigterm_ends_every_answer_in_its_protocols_shape(tmp_path):
    """One request streams, two wait behind it (--max-running 1). On SIGTERM the waiting ones get
    the protocol's 503 JSON at once, the stream ends with the protocol's error event after the
    grace period, the process exits 0 and its checkpoints are on disk."""
    proc, url = serve_process(
        "--max-running",
        "1",
        "--shutdown-grace",
        "2",
        "--disk-cache",
        str(tmp_path / "ckpt"),
        "--disk-cache-size",
        "1",
    )
    results: dict[str, object] = {}

    def stream() -> None:
        with httpx.stream("POST", url + "/v1/messages", json={**LONG, "stream": True}, timeout=120) as r:
            results["stream"] = (r.status_code, list(r.iter_lines()))

    def waiting(path: str) -> None:
        body = (
            LONG
            if path != "/v1/responses"
            else {"model": "tiny", "max_output_tokens": 5000, "input": "write"}
        )
        results[path] = httpx.post(url + path, json=body, timeout=120)

    threads = [threading.Thread(target=stream)]
    threads += [
        threading.Thread(target=waiting, args=(p,)) for p in ("/v1/chat/completions", "/v1/responses")
    ]
    try:
        threads[0].start()
        wait_for(lambda: httpx.get(url + "/health").json()["running"] == 1)
        for t in threads[1:]:
            t.start()
        wait_for(lambda: httpx.get(url + "/health").json()["queue_depth"] == 2)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(120)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    output = proc.stdout.read()
    for path in ("/v1/chat/completions", "/v1/responses"):
        assert_error_shape(results[path], "openai", 503)
        assert results[path].json()["error"]["code"] == "server_shutting_down"
    status, lines = results["stream"]
    assert status == 200 and "event: error" in lines and "Traceback" not in output
    assert any(line.startswith("data: ") and '"overloaded_error"' in line for line in lines)
    assert any((tmp_path / "ckpt").iterdir())  # the store was opened and closed cleanly


def test_at_the_open_file_limit_the_server_logs_once_and_recovers():
    """1,500 connections at once against a 256-descriptor limit: the excess is refused or waits
    in the backlog, a handful of warning lines (no tracebacks), and the server answers after."""

    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))

    proc, url = serve_process(preexec_fn=low_limit)
    socks = []
    try:
        host, port = url.removeprefix("http://").split(":")
        for _ in range(1500):
            sock = socket.socket()
            sock.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                sock.connect((host, int(port)))
            socks.append(sock)
        time.sleep(3)
        for sock in socks:
            sock.close()
        deadline = time.monotonic() + GIVE_UP_S
        while True:
            try:
                assert httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=60).status_code == 200
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline
        proc.terminate()
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    output = proc.stdout.read()
    assert "Traceback" not in output and len(output.splitlines()) < 20, output[-3000:]


# -- the key's sources


def test_an_empty_api_key_is_refused_before_the_model_loads():
    done = subprocess.run(
        [sys.executable, "-m", "ft", "serve", "--api-key", "", "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "the API key is empty" in done.stderr


def test_the_key_comes_from_the_flag_a_file_or_the_environment(tmp_path, monkeypatch):
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    monkeypatch.setenv("FT_API_KEY", "from-env")
    assert api_key(serve_args("--api-key-file", str(key_file))) == "from-file"
    assert api_key(serve_args("--api-key", "flag")) == "flag"
    assert api_key(serve_args()) == "from-env"
    monkeypatch.setenv("FT_API_KEY", " ")
    with pytest.raises(ValueError, match="empty"):
        api_key(serve_args())
    key_file.write_text("")
    with pytest.raises(ValueError, match="empty"):
        api_key(serve_args("--api-key-file", str(key_file)))
    monkeypatch.delenv("FT_API_KEY")
    assert api_key(serve_args()) is None


def test_timeouts_are_flags():
    limits = limits_from_args(serve_args("--header-timeout", "2.5", "--body-timeout", "7", "--write-timeout", "9"))
    assert (limits.head_timeout_s, limits.body_timeout_s, limits.write_timeout_s) == (2.5, 7.0, 9.0)
    assert limits_from_args(serve_args()).write_timeout_s == ServerLimits.write_timeout_s
    for flag in ("--header-timeout", "--body-timeout", "--write-timeout"):
        with pytest.raises(ValueError, match=flag):
            limits_from_args(serve_args(flag, "0"))


def test_a_silent_connection_is_closed_at_the_header_timeout_flag():
    """`ft serve --header-timeout 1`: a connection that sends nothing is closed long before the
    default 10 s (a real process, a real socket)."""
    proc, url = serve_process("--header-timeout", "1")
    try:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as sock:
            sock.settimeout(6)  # well under the default 10 s: only the flag can close it by then
            data = sock.recv(4096)
            while data and not data.endswith(b"\r\n\r\n") and b"408" not in data:
                data += sock.recv(4096)
        assert data == b"" or b"408" in data
    finally:
        proc.terminate()
        proc.wait(60)
